"""Megatron Core's ``megatron.core.enums.ModelType`` under its own import path, for checkpoint interop.

Megatron-LM records ``args.model_type`` as this enum in every checkpoint it writes (``common.pt`` of a torch_dist
folder, each rank's ``model_optim_rng.pt``), and megatron-core's loader unpickles ``common.pt`` weights-only with
this class on its allow-list. Our torch_dist writer stores ``args.model_type`` as a member of this class
(`CORE_MODEL_TYPE`) so that Megatron-LM loads our folders, and the safe loader (megatron/checkpoint/safe_load.py)
accepts it in Megatron-LM's checkpoints. Same name and values as Megatron Core's enum (0.16 keeps only
``encoder_or_decoder``; the older members stay here so that older Megatron-LM checkpoints, T5's included, load).
The model code's own enum is megatron/layers/enums.py.
"""
import enum


class ModelType(enum.Enum):
    """Megatron Core's model type: every model of Megatron Core 0.16 is ``encoder_or_decoder``."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2  # older Megatron Core's T5; megatron-core 0.16 cannot unpickle it
    retro_encoder = 3
    retro_decoder = 4


# what Megatron-LM 0.16 stores for every model (GPT, BERT and T5 alike): the only member megatron-core 0.16 has
CORE_MODEL_TYPE = ModelType.encoder_or_decoder
