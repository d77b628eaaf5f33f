"""Typed, read-only run configs built once from the parsed flags (part of the settings adapter).

Each module holds one concern's record and its ``from_args``: checkpointing (`checkpoint.CheckpointSettings`),
DeepSpeed (`deepspeed.DeepSpeedSettings`), the tokenizer (`tokenizer.TokenizerSettings`), ... Library code takes these
records instead of ``args``; together with megatron/run_configs/run_settings.py they are the one place that reads optional flags
with their defaults (``getattr(args, name, default)``: a namespace from another entry script or an older checkpoint
may lack them). Import only the standard library here: every part of megatron may import these modules.
"""
