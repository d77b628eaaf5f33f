"""The finetuning loop's run state (`FinetuneState`): a `TrainingState` plus the epoch, saved as Megatron's ``args``.

tasks/finetune_utils.py owns one and passes it to the training machinery (set-up and --load, the log line, the
validation counts, checkpoint saves); nothing of it is written onto the parsed flags. Its checkpoints store the
``args`` namespace Megatron's finetuning loop leaves behind, names and key order included (`megatron_args`): the
finetuning loop adds its counters after the model is built, in another order than pretraining's loop
(megatron/training_state.py), so finetuned checkpoints keep the bytes they had when the loop wrote onto ``args``.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from megatron.training_state import TrainingState


@dataclasses.dataclass
class FinetuneState(TrainingState):
    """What the finetuning loop changes as it runs: the iteration, consumed samples/tokens, and the epoch."""

    epoch: int = 0  # the epoch being trained (derived from the iteration on resume; not saved)

    def step(self, global_batch_size: int, seq_length: int) -> int:
        """One trained iteration: the counters move on; returns the new iteration."""
        self.iteration += 1
        self.curr_iteration = self.iteration
        self.consumed_train_samples += global_batch_size
        self.consumed_train_tokens += global_batch_size * seq_length
        return self.iteration

    def megatron_args(self, args: argparse.Namespace) -> argparse.Namespace:
        """The ``args`` a finetuning checkpoint stores: the flags (without callables), then the state in the order
        Megatron's finetuning loop adds it: the restored token counters (a resumed run), ``iteration``, ``do_valid``,
        ``curr_iteration``, and ``consumed_train_tokens`` (first counted by the loop in a fresh run)."""
        out: dict[str, Any] = {k: v for k, v in vars(args).items()
                               if not (callable(v) and not isinstance(v, torch.dtype))}
        out["consumed_train_samples"] = self.consumed_train_samples
        out["consumed_valid_samples"] = self.consumed_valid_samples
        if self.consumed_valid_tokens is not None:  # restored by --load: written back in Megatron's counter order
            out["consumed_train_tokens"] = self.consumed_train_tokens
            out["consumed_valid_tokens"] = self.consumed_valid_tokens
        out["iteration"] = self.iteration
        for key in ("do_valid", "curr_iteration"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["consumed_train_tokens"] = self.consumed_train_tokens
        return argparse.Namespace(**out)
