"""Checkpoint code in one place, the run-time layer: it takes records (megatron/run_configs/: CheckpointSettings, the
architecture record) and state (models, optimizer, TrainingState), never the flags. Megatron-LM's layout and names
(paths.py), the RNG states (rng.py), saving (saving.py), which iteration a load reads and whether it fits this run
(selection.py), loading (loading.py), the architecture stored in a checkpoint (args.py), the layouts `--load` reads
(formats.py), manifests and fallback (integrity.py), whole experts under expert-TP (expert_shards.py), safe
unpickling (safe_load.py) and atomic writes (atomic_io.py). Conversion between layouts is
megatron/checkpoint/conversion/.

Megatron's args-taking functions (``save_checkpoint``, ``load_checkpoint``, ``load_args_from_checkpoint``, ...) are
megatron/compat.py, above the driver; Megatron's path ``megatron.checkpointing`` is that module, the other old paths
(``megatron.checkpoint_args``, ...) give these very modules (megatron/moved.py). Importing this package imports none
of its modules (no torch here).
"""
