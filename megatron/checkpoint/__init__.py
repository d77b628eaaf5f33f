"""Checkpoint code in one place: save/load in Megatron-LM's layout (checkpointing.py), the architecture stored in a
checkpoint (args.py), the layouts `--load` reads (formats.py), manifests and fallback (integrity.py), safe unpickling
(safe_load.py) and atomic writes (atomic_io.py). Conversion between layouts is megatron/checkpoint/conversion/.

Megatron's old paths (``megatron.checkpointing``, ``megatron.checkpoint_args``, ...) give these very modules
(megatron/moved.py). Importing this package imports none of its modules (no torch here).
"""
