"""Enumerations shared by the model code (Megatron's model/enums.py names, pickled under that path)."""
import enum


class ModelType(enum.Enum):
    """Whether a model is a single stack (GPT, BERT) or an encoder-decoder (T5)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


class LayerType(enum.Enum):
    """Transformer layer flavour: encoder (self-attention only) or decoder (self + cross attention)."""

    encoder = 1
    decoder = 2
    retro_encoder = 3
    retro_decoder = 4
    retro_decoder_with_retriever = 5


class AttnType(enum.Enum):
    """Self-attention (q, k, v from the same input) or cross-attention (k, v from the encoder)."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Mask given by the caller (padding) or implied causal (upper triangle masked)."""

    padding = 1
    causal = 2


# Checkpoints pickle `args.model_type` (and any other member) by its class's module: Megatron's path, so that files
# written here keep the bytes and names they had before the shared parts moved to megatron/layers/, and every
# checkpoint's allow-listed name (checkpoint/safe_load.py) stays "megatron.model.enums:<class>"
# (megatron/moved.py resolves it to this module).
for _cls in (ModelType, LayerType, AttnType, AttnMaskType):
    _cls.__module__ = "megatron.model.enums"
del _cls
