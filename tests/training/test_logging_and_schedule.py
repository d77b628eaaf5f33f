"""Log-line formats (BigScience Megatron-DeepSpeed), TFLOPs formula and the no-pipelining schedule."""
from __future__ import annotations

import math

import torch

from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining, get_forward_backward_func
from megatron.logging_utils import (
    ADVANCED,
    NAN,
    SKIPPED,
    accumulate_losses,
    format_training_log_line,
    format_validation_line,
)


def test_training_line_format() -> None:
    line = format_training_log_line(
        iteration=10, train_iters=200, consumed_samples=80, consumed_tokens=5120, elapsed_per_iter=0.1234,
        learning_rate=1e-4, batch_size=8, losses={"lm loss": 8.25}, loss_scale=65536.0, grad_norm=1.23456,
        num_zeros_in_grad=None, params_norm=None, skipped=0, nans=0, samples_per_sec=64.8, tflops=0.0123)
    assert line == (
        " iteration       10/     200 | consumed samples:           80 | consumed tokens:         5120 |"
        " elapsed time per iteration (s): 0.12 | learning rate: 1.000E-04 | global batch size:     8 |"
        " lm loss: 8.250000E+00 | loss scale: 65536.0 | grad norm: 1.235 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 | samples per second: 64.800 | TFLOPs: 0.01 |")


def test_validation_line_format() -> None:
    line, ppl = format_validation_line("iteration 100", {"lm loss": 2.0})
    assert line == " validation loss at iteration 100 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert math.isclose(ppl["lm loss"], math.exp(2.0))
    _, clamped = format_validation_line("x", {"lm loss": 50.0})
    assert clamped["lm loss"] == math.exp(20.0)  # Megatron clamps the PPL exponent at 20


def test_loss_accumulation_counts_skips_and_nans() -> None:
    total: dict = {}
    accumulate_losses({"lm loss": 2.0}, total, 0)
    accumulate_losses({"lm loss": 4.0}, total, 0)
    accumulate_losses({"lm loss": float("nan")}, total, 1)
    assert total["lm loss"] == 6.0 and total[ADVANCED] == 2 and total[SKIPPED] == 1 and total[NAN] == 1


class _Counter:
    def __init__(self) -> None:
        self.data = iter([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])])


def _forward_step(data_iterator, model):
    x = next(data_iterator)
    out = model(x.unsqueeze(0)).sum()

    def loss_func(output):
        return output, {"loss": output.detach()}

    return out, loss_func


def test_no_pipelining_accumulates_the_mean_gradient() -> None:
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    data = _Counter().data
    store = forward_backward_no_pipelining(_forward_step, data, [model], num_microbatches=2,
                                           grad_scale_func=lambda loss: loss * 4.0)
    assert [float(d["loss"]) for d in store] == [3.0, 8.0]
    # d/dw of mean over micro-batches of w·x, times the loss scale 4: 4 * ([1,2] + [3,5]) / 2
    assert torch.allclose(model.weight.grad, torch.tensor([[8.0, 14.0]]))
    model.weight.grad = None
    store = forward_backward_no_pipelining(_forward_step, _Counter().data, model, 2, forward_only=True)
    assert len(store) == 2 and model.weight.grad is None
    assert get_forward_backward_func(1) is forward_backward_no_pipelining


def test_train_samples_with_rampup_to_iterations(monkeypatch) -> None:
    """--train-samples 96 --rampup-batch-size 4 4 32 --global-batch-size 8: 9 ramp-up iterations, then 7 of 8."""
    import argparse

    from megatron import global_vars, training
    from megatron.microbatches import build_num_microbatches_calculator

    calc = build_num_microbatches_calculator(1, ["4", "4", "32"], 8, 4, 1)
    monkeypatch.setattr(global_vars, "update_num_microbatches", lambda c, consistency_check=True: calc.update(
        c, consistency_check))
    monkeypatch.setattr(global_vars, "get_current_global_batch_size", calc.get_current_global_batch_size)
    args = argparse.Namespace(train_samples=96, rampup_batch_size=["4", "4", "32"], global_batch_size=8)
    training.update_train_iters(args)
    assert args.train_iters == 16
    args = argparse.Namespace(train_samples=100, rampup_batch_size=None, global_batch_size=8)
    training.update_train_iters(args)
    assert args.train_iters == 12
