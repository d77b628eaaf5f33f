"""--lr-decay-style WSD (warmup-stable-decay): learning rates equal megatron-core 0.16.1's OptimizerParamScheduler at
every iteration for each anneal style, with iteration- and sample-based runs, across a resume (state dict round trip).

The oracle runs once (one subprocess for every case); ours is built from parsed flags as a training run builds it.
"""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from megatron.arguments import parse_args, validate_args
from megatron.errors import MegatronUserError
from megatron.learning_rates import OptimizerParamScheduler
from megatron.model_setup import get_optimizer_param_scheduler, scheduler_steps, wsd_decay_steps
from megatron.run_configs.schedule import ScheduleSettings
from tests.mcore_oracle import run_oracle

GBS = 4
STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
# (run-length flags, iterations to step, iteration to resume at)
LENGTHS = (
    (("--train-iters", "24", "--lr-warmup-iters", "3", "--lr-wsd-decay-iters", "8"), 26, 13),
    (("--train-samples", "96", "--lr-warmup-samples", "10", "--lr-decay-samples", "88",
      "--lr-wsd-decay-samples", "30"), 26, 17),
)


def _args(*extra: str) -> argparse.Namespace:
    args = validate_args(parse_args(None, False, [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", str(GBS),
        "--lr", "1e-3", "--min-lr", "1e-5", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--lr-decay-style", "WSD", *extra]), {})
    args.padded_vocab_size = 128
    return args


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "wd_mult": 1.0, "lr_mult": 1.0}],
                           lr=0.0)


def _ours(args: argparse.Namespace, iters: int, resume_at: int) -> list[float]:
    """lr after every iteration; at `resume_at` a fresh scheduler loads the state dict and continues."""
    sched = get_optimizer_param_scheduler(_opt(), argparse.Namespace(**vars(args)))
    lrs = [sched.optimizer.param_groups[0]["lr"]]
    for it in range(1, iters + 1):
        if it == resume_at:
            state = sched.state_dict()
            sched = get_optimizer_param_scheduler(_opt(), argparse.Namespace(**vars(args)))
            sched.load_state_dict(state)
        sched.step(GBS)
        lrs.append(sched.optimizer.param_groups[0]["lr"])
    return lrs


_ORACLE = '''
import json, torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
cases = json.load(open("cases.json"))
out = []
def build(c):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.0)
    return OptimizerParamScheduler(opt, 0.0, 1e-3, 1e-5, c["warmup"], c["decay"], "WSD", 0.01, 0.01, c["wd_incr"],
                                   "constant", False, False, wsd_decay_steps=c["wsd"], lr_wsd_decay_style=c["style"])
for c in cases:
    s = build(c)
    lrs = [s.optimizer.param_groups[0]["lr"]]
    for it in range(1, c["iters"] + 1):
        if it == c["resume_at"]:
            sd = s.state_dict()
            s = build(c)
            s.load_state_dict(sd)
        s.step(c["gbs"])
        lrs.append(s.optimizer.param_groups[0]["lr"])
    out.append(lrs)
json.dump(out, open("out.json", "w"))
'''


def test_wsd_matches_megatron_core_at_every_iteration(tmp_path) -> None:
    cases, ours = [], []
    for style in STYLES:
        for flags, iters, resume_at in LENGTHS:
            args = _args(*flags, "--lr-wsd-decay-style", style)
            schedule = ScheduleSettings.from_args(args)
            warmup, decay, wd_incr = scheduler_steps(schedule)
            cases.append({"style": style, "warmup": warmup, "decay": decay, "wd_incr": wd_incr,
                          "wsd": wsd_decay_steps(schedule), "iters": iters, "resume_at": resume_at, "gbs": GBS})
            ours.append(_ours(args, iters, resume_at))
    assert cases[0]["wsd"] == 8 * GBS and cases[1]["wsd"] == 30
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    run_oracle(_ORACLE, tmp_path)
    theirs = json.loads((tmp_path / "out.json").read_text())
    for case, mine, ref in zip(cases, ours, theirs):
        assert mine == pytest.approx(ref, rel=1e-12, abs=0), case
    # the three phases are all there: warmup, a stable max_lr plateau, then the anneal down to min_lr
    lrs = ours[0]
    assert lrs[0] == 0.0 and lrs[3] == 1e-3 and lrs[16] == 1e-3 and lrs[17] < 1e-3 and lrs[24] == pytest.approx(1e-5)


@pytest.mark.parametrize("extra, match", [
    (("--train-iters", "10"), "needs --lr-wsd-decay-iters"),
    (("--train-samples", "40"), "needs --lr-wsd-decay-samples"),
    (("--train-iters", "10", "--lr-wsd-decay-samples", "8"), "--lr-wsd-decay-samples needs --train-samples"),
    (("--train-samples", "40", "--lr-wsd-decay-iters", "2"), "--lr-wsd-decay-iters needs --train-iters"),
])
def test_wsd_flags_refused_in_one_line(extra, match) -> None:
    with pytest.raises(MegatronUserError, match=match):
        _args(*extra)


def test_wsd_flags_need_the_wsd_style() -> None:
    with pytest.raises(MegatronUserError, match="need --lr-decay-style WSD"):
        validate_args(parse_args(None, False, [
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--lr-wsd-decay-iters", "3"]), {})
    with pytest.raises(ValueError, match="needs the length of its decay phase"):
        OptimizerParamScheduler(_opt(), 0.0, 1e-3, 0.0, 0, 10, "WSD", 0.0, 0.0, 10, "constant")
