"""The T5 family: T5Model (model.py; encoder-decoder, its pipeline stage roles and FLOPs). Its Megatron checkpoint
stream is megatron/checkpoint/conversion/t5_format.py (the encoder-decoder stream), its layout in every checkpoint
format checkpoint_layout.py; it has no Hugging Face adapter."""
