"""megatron/utils.py: GPT masks vs Megatron's loop, loss averaging, parameter norms, unwrapping, TFLOPs formula."""
from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch

from megatron.progress import print_on_first_rank
from megatron.timers import Timers
from megatron.utils import (
    average_losses_across_data_parallel_group,
    calc_params_l2_norm,
    get_ltor_masks_and_position_ids,
    get_model_flops_per_iteration,
    is_last_rank,
    print_rank_0,
    print_rank_last,
    report_memory,
    throughput_calculator,
    unwrap_model,
)
from tests.dist_utils import run_distributed


def _reference_masks(data, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's per-document loop, written out plainly."""
    b, s = data.shape
    att_b = b if reset_attention_mask else 1
    mask = torch.tril(torch.ones(att_b, s, s)).view(att_b, 1, s, s)
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[data == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).clone()
    if reset_position_ids or reset_attention_mask:
        for i in range(b):
            eod_index = [j for j in range(s) if data[i, j] == eod]
            prev = 0
            for j in eod_index:
                if reset_attention_mask:
                    mask[i, 0, j + 1:, : j + 1] = 0
                if reset_position_ids:
                    position_ids[i, j + 1:] -= j + 1 - prev
                    prev = j + 1
    return mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, False), (False, True, False),
                                   (False, False, True), (True, True, True)])
def test_masks_match_reference_loop(flags):
    gen = torch.Generator().manual_seed(0)
    eod = 0
    data = torch.randint(0, 5, (4, 23), generator=gen)  # ~20% EOD, including at the ends
    data[0, 0] = eod
    data[1, -1] = eod
    data[2] = 3  # no EOD at all
    data[3, :3] = eod  # consecutive EODs
    got = get_ltor_masks_and_position_ids(data, eod, *flags)
    want = _reference_masks(data, eod, *flags)
    assert got[0].dtype == torch.bool and got[0].shape == want[0].shape
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2]) and got[2].dtype == torch.long


def test_masks_simple_example():
    data = torch.tensor([[5, 6, 0, 7, 8, 0, 9]])
    attn, loss, pos = get_ltor_masks_and_position_ids(data, 0, True, True, True)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert loss.tolist() == [[1, 1, 0, 1, 1, 0, 1]]
    allowed = (~attn[0, 0]).int()
    assert allowed[3].tolist() == [0, 0, 0, 1, 0, 0, 0]  # first token of doc 2 sees only itself
    assert allowed[2].tolist() == [1, 1, 1, 0, 0, 0, 0]  # the EOD belongs to the document it ends


def test_masks_reject_wrong_rank():
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        get_ltor_masks_and_position_ids(torch.zeros(5, dtype=torch.long), 0, False, False, False)


def _model(tp_rank: int, tp_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    full = torch.nn.Linear(4, 6)  # "column parallel" weight, sharded on rows
    shard = torch.nn.Linear(4, 6 // tp_size)
    with torch.no_grad():
        shard.weight.copy_(full.weight.chunk(tp_size)[tp_rank])
        shard.bias.copy_(full.bias.chunk(tp_size)[tp_rank])
    for p in shard.parameters():
        p.tensor_model_parallel = True
    norm = torch.nn.LayerNorm(4)  # replicated on TP ranks
    with torch.no_grad():
        norm.weight.fill_(2.0)
    tied = torch.nn.Linear(2, 2, bias=False)
    tied.weight.shared = True  # e.g. the last stage's copy of the word embeddings: not counted
    return torch.nn.ModuleList([shard, norm, tied]), full, norm


def _expected_norm(full, norm) -> float:
    return math.sqrt(sum(p.detach().pow(2).sum().item() for p in [*full.parameters(), *norm.parameters()]))


def _reductions_body(rank, world_size):
    losses = [torch.tensor(float(rank)), torch.tensor(10.0 * (rank + 1))]
    averaged = average_losses_across_data_parallel_group(losses, torch.distributed.group.WORLD).tolist()
    model, full, norm = _model(rank, world_size)
    got = calc_params_l2_norm(model, torch.distributed.group.WORLD, tp_rank=rank)
    return averaged, got, _expected_norm(full, norm)


def test_reductions_across_two_ranks():
    """Loss averaging over the DP group; parameter norm with TP shards counted once (one 2-process launch)."""
    results = run_distributed(_reductions_body, world_size=2)
    for averaged, got, want in results:
        assert averaged == pytest.approx([0.5, 15.0])
        assert got == pytest.approx(want, rel=1e-6)


def test_reductions_without_group():
    local = average_losses_across_data_parallel_group([torch.tensor(2.0), torch.tensor(4.0)], None)
    assert local.tolist() == [2.0, 4.0]
    model, full, norm = _model(0, 1)
    assert calc_params_l2_norm(model, None, tp_rank=0) == pytest.approx(_expected_norm(full, norm), rel=1e-6)


def test_unwrap_model():
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    inner = torch.nn.Linear(2, 2)
    assert unwrap_model(Wrapper(Wrapper(inner)), (Wrapper,)) is inner
    assert unwrap_model([Wrapper(inner)], (Wrapper,)) == [inner]
    assert unwrap_model(inner) is inner


def _flops_args(**kw):
    base = dict(micro_batch_size=4, data_parallel_size=2, global_batch_size=64, seq_length=1024, hidden_size=1024,
                num_layers=24, padded_vocab_size=50304, world_size=8, recompute_granularity=None,
                checkpoint_activations=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_model_flops_formula_numbers():
    b, s, layers, h, v = 64, 1024, 24, 1024, 50304
    expected = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    assert get_model_flops_per_iteration(_flops_args()) == pytest.approx(expected)
    # Worked by hand for GPT-345M, batch 64: 72*64*1024*24*1024^2 = 1.18747e14; x (1 + 1/6 + 50304/393216) = 1.29460
    assert expected == pytest.approx(1.53730e14, rel=1e-5)
    full = get_model_flops_per_iteration(_flops_args(recompute_granularity="full"))
    assert full == pytest.approx(expected * 96 / 72)
    assert get_model_flops_per_iteration(_flops_args(checkpoint_activations=True)) == pytest.approx(full)
    assert get_model_flops_per_iteration(_flops_args(), batch_size=1) == pytest.approx(expected / 64)


def test_throughput_calculator():
    model = torch.nn.Linear(100, 10)  # 1010 parameters
    samples, tflops, params = throughput_calculator(model, _flops_args(), iteration_time=20.0, total_iterations=10,
                                                    batch_size=64)
    assert samples == pytest.approx(32.0)
    assert tflops == pytest.approx(get_model_flops_per_iteration(_flops_args()) / (2.0 * 8 * 1e12))
    assert params == pytest.approx(1010 / 1e9)
    with pytest.raises(ValueError):
        throughput_calculator(None, _flops_args(), 0.0, 1)


def test_printing_and_memory(capsys):
    print_rank_0("hello zero")
    print_rank_last("hello last")
    text = report_memory("after step")
    out = capsys.readouterr().out
    assert is_last_rank()
    assert "hello zero" in out and "hello last" in out
    assert "after step memory (MB)" in text and "[Rank 0]" in out


def test_a_printed_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PYTHONUNBUFFERED=1 `print` writes the text and the newline in two calls; ranks sharing one stdout (srun's
    tasks on a node, torchrun's workers) then glued one rank's memory line before another's iteration line (the
    multi-host test's flake). Each line now reaches the stream in one write."""
    writes = []

    class Unbuffered:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Unbuffered())
    print_rank_0("zero")
    print_rank_last(" iteration        4/      10 |")
    line = report_memory("(after 4 iterations)")
    assert writes == ["zero\n", " iteration        4/      10 |\n", line + "\n"]
    # The timers' block (several lines) and the heartbeat's line (printed from its own thread) likewise.
    writes.clear()
    timers = Timers(log_level=2)
    timers("forward-compute", log_level=0).start()
    timers("forward-compute").stop()
    timers.log(["forward-compute"])
    print_on_first_rank(" > working: x")
    assert len(writes) == 2 and writes[0].startswith("(min, max) time across ranks") and writes[0].endswith("\n")
    assert writes[1] == " > working: x\n"
