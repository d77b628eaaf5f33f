"""Memory reporting: Megatron's memory line (CPU: RSS / peak RSS; only data-parallel rank 0 prints) and the
theoretical memory estimate of megatron/theoretical_memory_usage.py against hand calculations."""
from __future__ import annotations

import argparse
import re

import pytest

from megatron.logging_utils import memory_stats_mb, report_memory
from megatron.theoretical_memory_usage import (
    bytes_per_parameter,
    compute_activation_memory,
    count_parameters,
    report_theoretical_memory,
)

MEMORY_LINE = re.compile(r"^\[Rank 0\] \(after 3 iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                         r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)$")


def _args(**overrides) -> argparse.Namespace:
    """The tiny GPT of the training tests (2 layers, hidden 64, 4 heads, seq 64, vocab 5120, micro-batch 4)."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=16,
                seq_length=64, max_position_embeddings=64, micro_batch_size=4, padded_vocab_size=5120,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                data_parallel_size=1, sequence_parallel=False, fp16=False, bf16=False,
                accumulate_allreduce_grads_in_fp32=False, use_distributed_optimizer=False, optimizer="adam",
                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                distribute_saved_activations=False, untie_embeddings_and_output_weights=False, swiglu=False)
    base.update(overrides)
    return argparse.Namespace(**base)


def test_memory_line_on_cpu(capsys) -> None:
    line = report_memory("(after 3 iterations)", data_parallel_rank=0)
    out = capsys.readouterr().out.strip()
    assert out == line
    m = MEMORY_LINE.match(line)
    assert m, line
    allocated, max_allocated, reserved, max_reserved = map(float, m.groups())
    assert 0 < allocated <= max_allocated and reserved == allocated and max_reserved == max_allocated
    assert report_memory("(after 3 iterations)", data_parallel_rank=1) is None  # only DP rank 0 prints
    assert capsys.readouterr().out == ""


def test_memory_stats_follow_allocations() -> None:
    import torch

    before = memory_stats_mb()
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MB, touched
    after = memory_stats_mb()
    assert after["allocated"] - before["allocated"] > 50 and after["max allocated"] >= after["allocated"]
    del big


def test_parameter_count_equals_the_model() -> None:
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import GPTModel

    for untie in (False, True):
        args = _args(untie_embeddings_and_output_weights=untie)
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                   padded_vocab_size=5120, share_embeddings_and_output_weights=not untie)
        model = GPTModel(config)
        n = sum(p.numel() for p in model.parameters())
        counts = count_parameters(args)
        assert counts.total == n == counts.most_loaded_shard
    # by hand: per layer qkv 64*192+192, dense 64*64+64, fc1 64*256+256, fc2 256*64+64, two LayerNorms 2*128
    layer = 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64 + 2 * 128
    counts = count_parameters(_args())
    assert layer == 49984
    assert counts.transformer_layers == 2 * layer + 128
    assert counts.embedding_layers == 5120 * 64 + 64 * 64
    assert counts.total == 431872


def test_bytes_per_parameter_table() -> None:
    """Megatron-LM README: fp16 20 vs 4+16/d, bf16 18 vs 6+12/d, fp32 16 vs 8+8/d."""
    for dtype, plain, fixed, sharded in (({}, 16, 8, 8), ({"bf16": True}, 18, 6, 12),
                                         ({"fp16": True}, 20, 4, 16),
                                         ({"fp16": True, "accumulate_allreduce_grads_in_fp32": True}, 18, 6, 12)):
        assert bytes_per_parameter(_args(**dtype)) == plain
        for d in (1, 2, 4, 8):
            args = _args(**dtype, use_distributed_optimizer=True, data_parallel_size=d)
            assert bytes_per_parameter(args) == pytest.approx(fixed + sharded / d)
    assert bytes_per_parameter(_args(optimizer="sgd")) == 12  # momentum only


def test_estimate_config_a_serial_fp32(capsys) -> None:
    """Tiny GPT, serial fp32: weights+optimizer 16 B/param; activations with e = 4 bytes per element."""
    args = _args()
    s, b, h, f, a, v = 64, 4, 64, 256, 4, 5120
    sbh = s * b * h
    layer = sbh * (18 + 16) + 8 * s * b * f + 9 * a * s * s * b  # (4e+2)+4e, 2e*sbf, (2e+1)*as^2b with e = 4
    assert layer == 1671168
    embedding = 8 * s * b * 2 + sbh  # int64 ids + positions, dropout mask
    output = 4 * sbh + 4 * s * b * v  # final LN output, fp32 logits
    assert compute_activation_memory(args, 1) == 2 * layer + embedding + output == 8671232
    # full uniform, one layer per unit: the two layer inputs + one layer recomputed at a time
    full = _args(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert compute_activation_memory(full, 1) == 2 * 4 * sbh + layer + embedding + output
    # full block, one layer: layer 1 keeps its input only, layer 2 everything
    block = _args(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert compute_activation_memory(block, 1) == 4 * sbh + layer + embedding + output
    text = report_theoretical_memory(args, 1)
    assert capsys.readouterr().out.strip() == text
    w = 431872 * 16 / 2**20
    act = 8671232 / 2**20
    assert text.splitlines()[-1] == (f"Theoretical memory footprints: weight and optimizer={w:.2f} MB, "
                                     f"activation={act:.2f} MB, total={w + act:.2f} MB")
    assert "Number of parameters in most loaded shard in billions: 0.0004 (431872)" in text


def test_estimate_config_b_tp_pp_sp_selective_bf16_distopt() -> None:
    """TP=2, PP=2, SP, selective recompute, bf16, distributed optimizer over DP=4: Megatron's 34·sbh/t per layer."""
    args = _args(num_layers=4, micro_batch_size=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                 sequence_parallel=True, recompute_granularity="selective", bf16=True, use_distributed_optimizer=True,
                 data_parallel_size=4)
    # first stage: 2 layers (split 49600 / 2 + replicated 384 each) + word embeddings / 2 + position embeddings
    assert count_parameters(args).most_loaded_shard == (2 * 49600 + 5120 * 64) // 2 + 2 * 384 + 64 * 64 == 218304
    assert bytes_per_parameter(args) == 6 + 12 / 4
    sbh = 64 * 2 * 64
    layer = sbh * 34 // 2
    per_microbatch = 2 * layer + 8 * 64 * 2 * 2 + sbh // 2
    assert compute_activation_memory(args, num_microbatches=4) == 2 * per_microbatch == 569344
    assert compute_activation_memory(args, num_microbatches=1) == per_microbatch  # 1F1B: one micro-batch in flight
    args.virtual_pipeline_model_parallel_size = 2  # interleaving penalty 1 + (p - 1) / (p v) = 1.25
    assert compute_activation_memory(args, num_microbatches=4) == pytest.approx(2 * 1.25 * per_microbatch)
    assert compute_activation_memory(_args(distribute_saved_activations=True)) is None
    assert "activation=n/a" in report_theoretical_memory(_args(distribute_saved_activations=True), verbose=False)
