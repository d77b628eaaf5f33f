"""megatron-lite: Megatron-LM / Megatron-DeepSpeed compatible large-model training that also runs on CPU.

Importing this package is cheap on purpose (no torch import here): `tools/preprocess_data.py` imports
`megatron.tokenizer` and `megatron.data.indexed_dataset` only.
"""

from megatron import moved

__version__ = "0.1.0"

moved.install()  # Megatron's import paths of moved modules (megatron.checkpointing, megatron.model.bert_model, ...)
