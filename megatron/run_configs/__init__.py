"""Typed, read-only run configs built once from the parsed flags (part of the settings adapter).

Each module holds one concern's record and its ``from_args``: checkpointing (`checkpoint.CheckpointSettings`),
DeepSpeed (`deepspeed.DeepSpeedSettings`), the tokenizer (`tokenizer.TokenizerSettings`), ... Library code takes these
records instead of ``args``; together with megatron/run_configs/run_settings.py they are the one place that reads
optional flags (a namespace from another entry script or an older checkpoint may lack them). A record's fields named
like a setting are filled by `declared.fill_from_args` with the declared defaults (megatron/settings/); its
``from_args`` writes only the derived fields by hand. Import only the standard library at load time: every part of
megatron may import these modules (declared.py imports the settings when a record is first built).
"""
