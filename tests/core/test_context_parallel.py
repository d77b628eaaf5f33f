"""Context-parallel attention (megatron/core/context_parallel.py) equals full attention, forward and backward.

One 4-process gloo launch runs every case at N = 4 and N = 2 (p2p ring, all_gather, a2a; causal, padding and
causal+padding masks, a fully masked query row; RoPE at each chunk's true positions; GQA; head dims 8 and 12; query
tiles smaller than a chunk): each rank computes the full attention of the whole sequence on its own and compares its
slice of the output and of the gradients of q, k, v (before RoPE) with what context parallelism returns (fp32, 1e-6
of each tensor's scale; bf16 inputs, whose softmax runs in fp32 inside: 3e-2).
"""
from __future__ import annotations

import pytest
import torch

from megatron.core import context_parallel as cpa
from tests.dist_utils import run_distributed

CASES = [  # reported as (N, comm type, causal, padding mask, heads, K/V groups, head dim, rope)
    ("p2p", True, False, 4, 4, 8, True),
    ("p2p", True, True, 4, 2, 12, True),
    ("p2p", False, True, 4, 1, 8, False),
    ("all_gather", True, False, 4, 2, 12, True),
    ("all_gather", False, True, 4, 4, 8, False),
    ("a2a", True, False, 4, 2, 8, True),
    ("a2a", True, True, 4, 1, 12, False),
]
BF16 = [("p2p", True, False, 4, 2, 8, True), ("a2a", True, False, 4, 2, 8, True)]  # bf16 in, fp32 softmax inside


def _rope(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb

    cos, sin = RotaryEmbedding(t.size(-1)).cos_sin(int(positions.max()) + 1, 0, t.device, t.dtype)
    return apply_rotary_pos_emb(t, cos[positions], sin[positions])


def _reference(q, k, v, causal, mask):
    """Megatron's explicit softmax attention over the whole sequence (masked scores -10000)."""
    s, b, h, d = q.shape
    g = k.size(2)
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(h // g, dim=1), vv.repeat_interleave(h // g, dim=1)
    scores = qq @ kk.transpose(-1, -2) / d ** 0.5
    full = torch.zeros(1, 1, s, s, dtype=torch.bool)
    if causal:
        full = full | torch.ones(s, s, dtype=torch.bool).triu(1)
    if mask is not None:
        full = full | mask
    out = torch.softmax(scores.masked_fill(full, -10000.0), dim=-1) @ vv
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _body(rank: int, world_size: int) -> list:
    """Every case at N = 4 (the world) and at N = 2 (ranks {0, 1} and {2, 3}): one launch for both sizes."""
    halves = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    cpa._TILE_ROWS = 3  # chunks of 4 queries: tiles of 3 and 1 rows (partial diagonal blocks) in the ring
    out = _cases(rank, world_size, torch.distributed.group.WORLD)
    return out + _cases(rank % 2, 2, halves[rank // 2])


def _cases(rank: int, world: int, group) -> list:
    seq, b = 8 * world, 2
    errors = []
    for case, dtype in [(c, torch.float32) for c in CASES] + [(c, torch.bfloat16) for c in BF16]:
        comm, causal, padded, heads, groups, hn, rope = case
        gen = torch.Generator().manual_seed(1234)
        q = torch.randn(seq, b, heads, hn, generator=gen, dtype=torch.float64).float().requires_grad_()
        k = torch.randn(seq, b, groups, hn, generator=gen).requires_grad_()
        v = torch.randn(seq, b, groups, hn, generator=gen).requires_grad_()
        dout = torch.randn(seq, b, heads * hn, generator=gen)
        mask = None
        if padded:  # key padding per sample, plus one query row with every key masked (Megatron: uniform row)
            pad = torch.rand(b, seq, generator=gen) < 0.3
            pad[:, 0] = False
            mask = pad[:, None, None, :].expand(b, 1, seq, seq).clone()
            if not causal:  # (under a causal mask Megatron's GPT never has one: the diagonal stays visible)
                mask[1, 0, seq // 2 + 1, :] = True
        pos = torch.arange(seq)
        ref = _reference(_rope(q, pos) if rope else q, _rope(k, pos) if rope else k, v, causal, mask)
        ref.backward(dout)
        ref_grads = [t.grad.clone() for t in (q, k, v)]
        mine = cpa.cp_positions(seq, world, rank)
        ql, kl, vl = (cpa.slice_for_cp(t.detach(), 0, world, rank).to(dtype).requires_grad_() for t in (q, k, v))
        qr, kr = (_rope(ql, mine), _rope(kl, mine)) if rope else (ql, kl)
        local_mask = None if mask is None else cpa.slice_for_cp(mask, 2, world, rank)
        out = cpa.context_parallel_attention(qr, kr, vl, group, comm_type=comm, causal=causal,
                                             attention_mask=local_mask)
        out.backward(cpa.slice_for_cp(dout, 0, world, rank).to(dtype))
        pairs = [(out, ref)] + list(zip((ql.grad, kl.grad, vl.grad), ref_grads))
        errs = []
        for a, r in pairs:  # max error relative to the tensor's scale (an fp32 ulp of a gradient near 10 is 1e-6)
            r = cpa.slice_for_cp(r.detach(), 0, world, rank)
            errs.append(float((a.detach().float() - r).abs().max()) / max(1.0, float(r.abs().max())))
        tol = 1e-6 if dtype == torch.float32 else 3e-2  # bf16: its rounding of q, k, v, the output and gradients
        errors.append(((world, comm, causal, padded, heads, groups, hn, rope, str(dtype)), errs, tol))
    return errors


@pytest.mark.slow
def test_context_parallel_attention_equals_full_attention() -> None:
    for rank_errors in run_distributed(_body, world_size=4):
        for case, errs, tol in rank_errors:
            assert max(errs) <= tol, f"{case}: out/dq/dk/dv max errors {errs}"


def test_layout_positions_and_errors() -> None:
    assert cpa.cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cpa.cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    t = torch.arange(16)
    together = torch.cat([cpa.slice_for_cp(t, 0, 4, r) for r in range(4)])
    assert sorted(together.tolist()) == list(range(16))
    assert cpa.slice_for_cp(t, 0, 4, 3).tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"divisible by 8 \(2 x --context-parallel-size 4\)"):
        cpa.check_cp_layout(10, 4)
    assert "chunks 0 and 3" in cpa.describe_cp_layout(16, 2, "p2p")
    q = torch.randn(8, 1, 2, 4)
    # One process (no group): plain full attention.
    out = cpa.context_parallel_attention(q, q, q, None, causal=True)
    assert torch.allclose(out, _reference(q, q, q, True, None), atol=1e-6)


def test_rank_layout_is_megatrons_tp_cp_dp_pp_order() -> None:
    from megatron.core.parallel_state import _build_rank_groups, rank_coordinates

    layout = _build_rank_groups(16, tp=2, pp=2, cp=2)  # DP 2
    assert layout["tp"][:2] == [[0, 1], [2, 3]]
    assert layout["cp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["dp"][:2] == [[0, 4], [1, 5]]
    assert layout["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients: same TP and PP coordinates
    assert layout["pp"][0] == [0, 8]
    assert layout["mp"][0] == [0, 1, 8, 9]  # TP x PP of one (DP, CP) coordinate
    assert rank_coordinates(7, 16, 2, 2, 2) == {"tp_rank": 1, "cp_rank": 1, "dp_rank": 1, "pp_rank": 0}
    assert _build_rank_groups(4, 1, 1)["dp"] == [[0, 1, 2, 3]]  # without CP: unchanged
    with pytest.raises(ValueError, match="context-parallel size"):
        _build_rank_groups(6, tp=1, pp=1, cp=4)


def _validate(extra: str, world_size: int = 2, training: bool = True):
    from megatron.arguments import parse_args, validate_args
    from megatron.settings.required_flags import TRAINING_RUN

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --attention-dropout 0 --data-path p "
            "--tokenizer-type GPT2BPETokenizer --vocab-file v --merge-file m ")
    args = parse_args(args=(base + extra).split())
    args.world_size = world_size
    return validate_args(args, {TRAINING_RUN: True} if training else {})


@pytest.mark.parametrize("extra, world, message", [
    ("--context-parallel-size 2 --seq-length 30", 2, r"--seq-length \(30\) must be divisible by 4 \(2 x "
     r"--context-parallel-size 2\): each context-parallel rank holds 2 of 4 equal chunks"),
    ("--context-parallel-size 2", 3, r"world size \(3\) is not divisible .* --context-parallel-size \(2\)"),
    ("--context-parallel-size 4 --cp-comm-type a2a --group-query-attention --num-query-groups 2 "
     "--num-attention-heads 2", 4, "a2a needs the attention heads per tensor-parallel rank"),
    ("--context-parallel-size 2 --attention-dropout 0.1", 2, "needs --attention-dropout 0"),
    ("--context-parallel-size 2 --position-embedding-type alibi", 2, "does not support ALiBi"),
    ("--context-parallel-size 2 --num-experts 2 --disable-bias-linear", 2, "with --num-experts"),
])
def test_impossible_layouts_are_one_line_errors(extra: str, world: int, message: str) -> None:
    from megatron.arguments import ArgumentError

    with pytest.raises(ArgumentError, match=message) as info:
        _validate(extra, world)
    assert "\n" not in str(info.value)


def test_cp_sets_data_parallel_size_and_refuses_outside_training() -> None:
    from megatron.arguments import ArgumentError

    args = _validate("--context-parallel-size 2 --tensor-model-parallel-size 2", world_size=8)
    assert args.data_parallel_size == 2
    with pytest.raises(ArgumentError, match="evaluation and text generation run at --context-parallel-size 1"):
        _validate("--context-parallel-size 2", training=False)  # tasks/main.py, generation, the eval harness


def test_memory_estimate_knows_context_parallelism() -> None:
    from megatron.theoretical_memory_usage import compute_activation_memory

    def estimate(extra: str, world: int) -> float:
        args = _validate("--seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 " + extra, world)
        args.padded_vocab_size = 512
        return compute_activation_memory(args)

    one, two, four = estimate("", 1), estimate("--context-parallel-size 2", 2), estimate("--context-parallel-size 4", 4)
    assert four < two < 0.55 * one
