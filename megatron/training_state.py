"""The run state of a training loop (`TrainingState`) and its adapter to Megatron's ``args`` names.

The loop in megatron/training.py owns one `TrainingState` and passes it explicitly: the iteration, the consumed
samples and tokens, whether there is data to train/validate/test, the padded vocabulary size and the run's totals of
skipped and non-finite iterations. Nothing of it is written onto the parsed flags while training.

Checkpoints keep Megatron's format: the state is saved as Megatron's top-level keys (``iteration``,
``consumed_train_samples``, ...) and inside the saved ``args`` namespace, which `megatron_args` derives from the flags
and the state in the key order Megatron-LM's loop leaves behind (so Megatron's tools, and our older checkpoints, read
the same bytes). `restore_counters` fills the state from a checkpoint's keys, or from its ``args`` for old ones.
The run's skipped and non-finite totals are saved as two top-level keys of our own (``skipped_iterations``,
``nan_iterations``) only when non-zero (`checkpoint_totals`): a healthy run's checkpoint keeps exactly Megatron's
keys and bytes, and a missing key reads as 0, so exact resume continues the totals.

Callers that still keep run state on ``args`` (the finetuning loop, tools, tests) use `from_args`/`write_counters`:
this module is the one place that maps between the two.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Mapping, Optional

import torch

# Megatron's names, in the order its loop adds them to ``args`` after model set-up (see `megatron_args`).
COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens", "consumed_valid_tokens")
TOTALS = ("skipped_iterations", "nan_iterations")  # our top-level checkpoint keys (written when non-zero)
RERUN_KEY = "rerun_state_machine"  # Megatron's key, written only by the save that asks for a step to be re-run
_ADDED_AFTER_MODEL = ("consumed_valid_tokens", "iteration", "do_train", "do_valid", "do_test", "curr_iteration")


@dataclasses.dataclass
class TrainingState:
    """What the training loop changes as it runs (the flags stay what was parsed)."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_tokens: Optional[int] = None  # None until a checkpoint provides it (Megatron never counts it)
    padded_vocab_size: Optional[int] = None
    curr_iteration: Optional[int] = None  # the iteration being trained (None before the first step)
    do_train: Optional[bool] = None  # None until the data iterators are built
    do_valid: Optional[bool] = None
    do_test: Optional[bool] = None
    skipped_iterations: int = 0  # run totals (the log line prints per-interval counts)
    nan_iterations: int = 0
    # the rerun state machine's checkpoint entry (Megatron's key ``rerun_state_machine``): set for the save that asks
    # for a step to be re-run from the checkpoint, and filled by loading one that holds it (megatron/training.py)
    rerun_state: Optional[dict] = None
    skipped_train_samples: int = 0  # samples of --iterations-to-skip (Megatron's ``args.skipped_train_samples``)

    # ------------------------------------------------------------------------------------------- adapters
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingState:
        """The state a caller kept on ``args`` under Megatron's names (absent names: the defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        for name in ("iteration", "consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens"):
            values[name] = int(values.get(name) or 0)
        return cls(**values)

    def write_counters(self, args: argparse.Namespace, names: tuple[str, ...] = COUNTERS) -> None:
        """Megatron's consumed-sample names on ``args`` (for callers that keep their run state there)."""
        for name in names:
            if getattr(self, name) is not None:
                setattr(args, name, getattr(self, name))

    def restore_counters(self, saved: Mapping[str, Any], ckpt_args: Optional[argparse.Namespace],
                         names: tuple[str, ...] = COUNTERS) -> None:
        """The consumed samples/tokens `names` from a checkpoint: its top-level keys, else its saved ``args`` (old
        checkpoints); the skipped/non-finite totals from its top-level keys (absent: 0)."""
        src = saved if "consumed_train_samples" in saved else vars(ckpt_args or argparse.Namespace())
        for name in names:
            setattr(self, name, int(src.get(name, 0)))
        for name in TOTALS:
            setattr(self, name, int(saved.get(name, 0)))
        self.rerun_state = saved.get(RERUN_KEY)
        self.skipped_train_samples = int(getattr(ckpt_args, "skipped_train_samples", 0) or 0)

    def checkpoint_counters(self) -> dict[str, int]:
        """Megatron's top-level checkpoint keys for the consumed samples and tokens."""
        return {"consumed_train_samples": int(self.consumed_train_samples),
                "consumed_valid_samples": int(self.consumed_valid_samples),
                "consumed_train_tokens": int(self.consumed_train_tokens),
                "consumed_valid_tokens": int(self.consumed_valid_tokens or 0)}

    def checkpoint_totals(self) -> dict[str, Any]:
        """The run's skipped/non-finite totals as top-level checkpoint keys: only the non-zero ones (see above); and
        the rerun state machine's entry when a step is to be re-run from this checkpoint."""
        out: dict[str, Any] = {name: int(getattr(self, name)) for name in TOTALS if getattr(self, name)}
        if self.rerun_state is not None:
            out[RERUN_KEY] = self.rerun_state
        return out

    def megatron_args(self, args: argparse.Namespace) -> argparse.Namespace:
        """The ``args`` a checkpoint stores: the flags (without callables) with this state under Megatron's names,
        in the order Megatron's loop adds them (consumed tokens before ``model_type``, then the names it adds after
        the model is built)."""
        out: dict[str, Any] = {}
        for key, value in vars(args).items():
            if (callable(value) and not isinstance(value, torch.dtype)) or key in _ADDED_AFTER_MODEL \
                    or key == "consumed_train_tokens":
                continue
            if key == "model_type":
                out["consumed_train_tokens"] = self.consumed_train_tokens
            out[key] = value
        out["consumed_train_samples"] = self.consumed_train_samples
        out["consumed_valid_samples"] = self.consumed_valid_samples
        if self.padded_vocab_size is not None:
            out["padded_vocab_size"] = self.padded_vocab_size
        out.setdefault("consumed_train_tokens", self.consumed_train_tokens)
        if self.consumed_valid_tokens is not None:
            out["consumed_valid_tokens"] = self.consumed_valid_tokens
        if self.skipped_train_samples:  # (Megatron always has it; written when non-zero: other bytes stay)
            out["skipped_train_samples"] = self.skipped_train_samples
        out["iteration"] = self.iteration
        for key in ("do_train", "do_valid", "do_test", "curr_iteration"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return argparse.Namespace(**out)
