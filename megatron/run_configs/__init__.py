"""Typed, read-only run configs built once from the parsed flags (part of the settings adapter).

Each module holds one concern's record and its ``from_args``: checkpointing (`checkpoint.CheckpointSettings`),
DeepSpeed (`deepspeed.DeepSpeedSettings`), the tokenizer (`tokenizer.TokenizerSettings`), ... Library code takes these
records instead of ``args``; together with megatron/run_configs/run_settings.py they are the one place that reads
optional flags (a namespace from another entry script or an older checkpoint may lack them). A record holds the
run's `Settings` (the settings groups of megatron/settings/ instantiated from the flags, absent ones at their declared
defaults) and reads each setting from it (`declared.SettingValue`); its dataclass fields are derived values only,
which its ``from_args`` passes by hand. These modules import only the standard library and megatron/settings/ (which
imports no other part of megatron but enums and errors), so every part of megatron may import them.
"""
