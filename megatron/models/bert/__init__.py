"""The BERT family: BertModel (model.py), the finetuning heads (classification.py, multiple_choice.py) and the
MegatronBert mapping with its Hugging Face adapter (hf.py)."""
