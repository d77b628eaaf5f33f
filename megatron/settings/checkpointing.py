"""Checkpoint settings: where to save and load, what to keep, the format, how far to trust a file."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from megatron.settings.declare import setting


@dataclasses.dataclass
class CheckpointingSettings:
    """--help group "checkpointing"."""

    TITLE: ClassVar[str] = "checkpointing"
    save: Optional[str] = setting("--save", help="Directory to save checkpoints to.", read_by="megatron/training.py")
    save_interval: Optional[int] = setting("--save-interval", help="Iterations between checkpoint saves.",
        read_by="megatron/training.py")
    no_save_optim: Optional[bool] = setting("--no-save-optim", action="store_true", help="Do not save optimizer state.",
        read_by="megatron/checkpoint/saving.py")
    no_save_rng: Optional[bool] = setting("--no-save-rng", action="store_true", help="Do not save RNG state.",
        read_by="megatron/checkpoint/saving.py")
    load: Optional[str] = setting("--load", help="Directory containing a checkpoint to load.",
        read_by="megatron/checkpoint/loading.py")
    no_load_optim: Optional[bool] = setting("--no-load-optim", action="store_true", help="Do not load optimizer state.",
        read_by="megatron/checkpoint/loading.py")
    no_load_rng: Optional[bool] = setting("--no-load-rng", action="store_true", help="Do not load RNG state.",
        read_by="megatron/checkpoint/loading.py")
    finetune: bool = setting("--finetune", default=False,
        help="Load model weights only; reset iteration count, optimizer and RNG.", read_by="megatron/checkpoint/loading.py")
    perform_initialization: bool = setting("--no-initialization", default=True,
        help="Skip weight initialisation (weights come from a checkpoint).", config=True)
    use_checkpoint_args: bool = setting("--use-checkpoint-args", default=False,
        help="Take model arguments from the checkpoint in --load.", read_by="megatron/startup.py")
    exit_on_missing_checkpoint: bool = setting("--exit-on-missing-checkpoint", default=False,
        help="Exit if --load is set but no checkpoint is found there.", read_by="megatron/checkpoint/loading.py")
    trust_checkpoint: bool = setting("--trust-checkpoint", default=False,
        help="Load checkpoint files with full unpickling (can run code in them); default: weights-only with an "
             "allow-list (also MEGATRON_TRUST_CHECKPOINT=1).", read_by="megatron/checkpoint/loading.py")
    no_checkpoint_fallback: bool = setting("--no-checkpoint-fallback", default=False,
        help="A damaged latest checkpoint is an error (default: load the newest iteration that verifies).",
        read_by="megatron/checkpoint/loading.py")
    keep_last_n_checkpoints: Optional[int] = setting("--keep-last-n-checkpoints",
        help="After a save verifies, delete all but the N newest checkpoint iterations.",
        read_by="megatron/checkpoint/saving.py")
    ckpt_format: str = setting("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
        help="Checkpoint format to save (and expect on load): torch = per-rank model_optim_rng.pt files (ours, the "
             "default; Megatron-LM's default is torch_dist), torch_dist = one torch.distributed.checkpoint folder "
             "with Megatron Core names, any layout can load it.", read_by="megatron/checkpoint/formats.py")
    auto_detect_ckpt_format: bool = setting("--auto-detect-ckpt-format", default=False,
        help="Load whichever format the checkpoint folder holds (torch, Megatron Core torch, torch_dist).",
        read_by="megatron/checkpoint/formats.py")
    async_save: bool = setting("--async-save", default=False,
        help="Write checkpoints in the background: the state is copied, training continues, and the tracker and "
             "manifest are published once every rank's files are complete (torch_dist needs "
             "--use-persistent-ckpt-worker, as in Megatron-LM; the legacy torch layout too, which Megatron-LM refuses).",
        read_by="megatron/checkpoint/saving.py")
    use_persistent_ckpt_worker: bool = setting("--use-persistent-ckpt-worker", default=False,
        help="One long-lived background writer for --async-save (default: a writer per save); same files.",
        read_by="megatron/checkpoint/saving.py")
    ckpt_fully_parallel_save: bool = setting("--no-ckpt-fully-parallel-save", default=True,
        help="Do not split the torch_dist save across data-parallel ranks.",
        variant="Megatron-LM splits the torch_dist write across data-parallel ranks; here rank 0 writes the folder "
                "from the per-rank files, which hold the same tensors either way (and stay fully reshardable)")
    ckpt_fully_parallel_save_deprecated: bool = setting("--ckpt-fully-parallel-save", default=False,
        help="Deprecated: see --no-ckpt-fully-parallel-save.",
        variant="deprecated in Megatron-LM, where it has no effect")
    ckpt_fully_parallel_load: bool = setting("--ckpt-fully-parallel-load", default=False,
        help="Split the torch_dist load across data-parallel ranks.",
        variant="Megatron-LM reads each shard once per data-parallel group and exchanges it; here every rank reads "
                "(and verifies) the folder itself: the same values")
    ckpt_assume_constant_structure: bool = setting("--ckpt-assume-constant-structure", default=False,
        help="Assume the checkpoint structure is constant across saves (Megatron-LM caches its save plans).",
        variant="Megatron-LM reuses its torch_dist save plan from the previous save; the files are the same")
