"""megatron-lite: Megatron-LM / Megatron-DeepSpeed compatible large-model training that also runs on CPU.

Importing this package is cheap on purpose (no torch import here): `tools/preprocess_data.py` imports
`megatron.tokenizer` and `megatron.data.indexed_dataset` only.
"""

__version__ = "0.1.0"
