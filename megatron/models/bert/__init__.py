"""The BERT family: BertModel (model.py), the finetuning heads (classification.py, multiple_choice.py), the
MegatronBert mapping (hf.py), its Hugging Face adapter (hf_folder.py) and its checkpoint layout (checkpoint_layout.py:
the pooler and heads after the final norm in every format)."""
