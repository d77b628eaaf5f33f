"""Checkpoint conversion library behind tools/checkpoint/convert.py and tools/merge_mp_partitions.py.

A *loader* turns a checkpoint (Megatron at any TP/PP/virtual-PP, Hugging Face, DeepSpeed) into one in-memory
interchange form: a `ModelMeta` plus a stream of `Message`s holding full (TP=1) tensors under Megatron's TP=1
parameter names, one part of the model at a time (embeddings, each transformer layer, final norm, output layer). A
*saver* consumes that stream and writes another format/layout. Loaders and savers are plugins
(`plugins.resolve_plugin`); the interchange form is the only thing they share, so a new family (BERT, T5) adds its
messages and adapters without touching the others.
"""
from megatron.checkpoint.conversion.interchange import ConversionError, Message, ModelMeta  # noqa: F401
