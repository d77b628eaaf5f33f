"""FinetuneState (tasks/finetune_state.py): the finetuning loop's run state, saved as the ``args`` Megatron's loop left.

The ``args`` a finetuning checkpoint stores has the names, values and key order the loop used to leave on the parsed
flags when it wrote its counters there: a fresh run (iteration, do_valid, curr_iteration, then consumed_train_tokens
first counted by the loop) and a run resumed with --load (the restored token counters first). Callables are dropped;
the flags themselves are never written.
"""
from __future__ import annotations

import argparse

import torch

from tasks.finetune_state import FinetuneState


def _parsed() -> argparse.Namespace:
    return argparse.Namespace(lr=1e-3, consumed_train_samples=0, consumed_valid_samples=0, padded_vocab_size=128,
                              params_dtype=torch.float32, hook=lambda: None, model_type="encoder_or_decoder")


def test_fresh_run_args_match_the_old_loop() -> None:
    old = _parsed()  # what the loop wrote: set-up, do_valid, then per step (2 steps of 8 samples x 64 tokens)
    old.iteration = 0
    old.do_valid = True
    for step in (1, 2):
        old.iteration = old.curr_iteration = step
        old.consumed_train_samples += 8
        old.consumed_train_tokens = getattr(old, "consumed_train_tokens", 0) + 8 * 64
    old.consumed_valid_samples += 4  # one evaluation
    expected = [(k, v) for k, v in vars(old).items() if k != "hook"]

    args = _parsed()
    run = FinetuneState(padded_vocab_size=128)
    run.do_valid = True
    for _ in range(2):
        run.step(8, 64)
    run.consumed_valid_samples += 4
    assert list(vars(run.megatron_args(args)).items()) == expected
    assert not hasattr(args, "iteration") and args.consumed_train_samples == 0  # the flags are not written


def test_resumed_run_args_match_the_old_loop() -> None:
    saved = {"consumed_train_samples": 16, "consumed_valid_samples": 4, "consumed_train_tokens": 1024,
             "consumed_valid_tokens": 0}
    old = _parsed()  # --load wrote the four counters, set-up the iteration, then do_valid and one step
    for key, value in saved.items():
        setattr(old, key, value)
    old.iteration = 2
    old.do_valid = False
    old.iteration = old.curr_iteration = 3
    old.consumed_train_samples += 8
    old.consumed_train_tokens += 8 * 64
    expected = [(k, v) for k, v in vars(old).items() if k != "hook"]

    run = FinetuneState(padded_vocab_size=128)
    run.restore_counters(saved, None)
    run.iteration = 2
    run.do_valid = False
    run.curr_iteration = None
    assert run.step(8, 64) == 3 and run.curr_iteration == 3
    assert list(vars(run.megatron_args(_parsed())).items()) == expected
