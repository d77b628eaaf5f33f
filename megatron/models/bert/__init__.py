"""The BERT family: BertModel (model.py), the finetuning heads (classification.py, multiple_choice.py), the
MegatronBert mapping (hf.py) and its Hugging Face adapter (hf_folder.py)."""
