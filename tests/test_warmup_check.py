"""A warmup that does not end before the LR decay is refused at argument validation, in the flags' own units
(iterations with --train-iters, samples with --train-samples), before anything is built."""
from __future__ import annotations

import pytest

from megatron.arguments import ArgumentError, build_parser, validate_args
from megatron.settings.required_flags import TRAINING_RUN

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --data-path x --vocab-file v --merge-file m").split()


def _validate(extra: str) -> None:
    args = build_parser().parse_args(BASE + extra.split())
    args.rank, args.world_size = 0, 1
    validate_args(args, {TRAINING_RUN: True, "tokenizer_type": "GPT2BPETokenizer"})


@pytest.mark.parametrize("extra,message", [
    ("--train-iters 20 --lr-warmup-iters 20",
     "--lr-warmup-iters 20 must be smaller than --train-iters (the decay length by default) 20"),
    ("--train-iters 100 --lr-decay-iters 10 --lr-warmup-iters 10", "--lr-warmup-iters 10 must be smaller than "
     "--lr-decay-iters 10"),
    ("--train-samples 320 --lr-warmup-samples 320", "--lr-warmup-samples 320 must be smaller than --train-samples"),
])
def test_warmup_not_before_decay_is_one_line_in_the_users_units(extra: str, message: str) -> None:
    with pytest.raises(ArgumentError) as exc:
        _validate(extra)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_warmup_shorter_than_decay_passes() -> None:
    _validate("--train-iters 20 --lr-warmup-iters 2")
    _validate("--train-iters 20 --lr-warmup-fraction 0.1")
