"""The start-up parameter report with experts (megatron/theoretical_memory_usage.py): totals, active parameters and
the per-rank count under expert parallelism, against the model and against Megatron-LM's estimate; the EP layout
line (megatron/core/expert_parallel.py)."""
from __future__ import annotations

import argparse

from megatron.arguments import parse_args, validate_args
from megatron.core.expert_parallel import describe_ep_layout
from megatron.presets import get_preset
from megatron.run_configs.declared import with_settings
from megatron.run_configs.memory import MemorySettings
from megatron.theoretical_memory_usage import count_parameters, memory_report, model_config, parameter_counts
from tests.dist_utils import run_distributed
from tests.model._param_count_workers import ep_parameter_worker


def _preset_args(name: str, vocab: int, seq_length: int = 0, **overrides) -> argparse.Namespace:
    extra = ["--vocab-size", str(vocab), "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
             "--make-vocab-size-divisible-by", "1"]
    args = parse_args(args=get_preset(name).argv(seq_length or None) + extra)
    args.world_size = 1
    args = validate_args(args)
    args.padded_vocab_size = vocab
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _megatron_lm_estimate(a: argparse.Namespace) -> tuple[float, float]:
    """Megatron-LM's megatron/training/theoretical_memory_usage.py (total, active) for a model whose every layer is
    MoE, without shared experts (its formula, restated)."""
    h, e, k, f = a.hidden_size, a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size or a.ffn_hidden_size
    q = a.kv_channels * a.num_attention_heads
    glu = 3 / 2 if a.swiglu else 1
    norm = 1 if a.normalization == "RMSNorm" else 2
    attention = 2 * h * h * ((1 + a.num_query_groups / a.num_attention_heads) * q / h)
    layer = attention + 2 * h * norm + h * e  # + layernorms + router
    routed, active = 2 * h * f * e * glu, 2 * h * f * k * glu
    embedding = (2 if a.untie_embeddings_and_output_weights else 1) * h * a.padded_vocab_size
    return (a.num_layers * (layer + routed) + norm * h + embedding,
            a.num_layers * (layer + active) + norm * h + embedding)


def test_mixtral_8x7b_counts_are_the_published_ones_and_megatron_lms() -> None:
    args = _preset_args("mixtral_8x7b", 32000)
    counts = count_parameters(args)
    total, active = _megatron_lm_estimate(args)
    assert (counts.total, counts.active) == (total, active)
    assert (round(counts.total / 1e9, 1), round(counts.active / 1e9, 1)) == (46.7, 12.9)
    ep8 = count_parameters(_preset_args("mixtral_8x7b", 32000, expert_model_parallel_size=8))
    assert ep8.most_loaded_shard == counts.total - counts.experts + counts.experts // 8


def test_mixtral_tiny_under_ep2_equals_the_model_on_each_rank() -> None:
    """The total is the sum over ranks of their unique parameters (non-expert ones once, experts on every rank); the
    most loaded shard is what rank 0 holds."""
    args = _preset_args("mixtral_tiny", 512, expert_model_parallel_size=2)
    ranks = run_distributed(ep_parameter_worker, 2, args=(args,))
    shared = {n: c for n, (c, expert) in ranks[0].items() if not expert}
    assert all({n: c for n, (c, expert) in r.items() if not expert} == shared for r in ranks)
    experts = sum(c for r in ranks for c, expert in r.values() if expert)
    counts = count_parameters(args)
    assert counts.total == sum(shared.values()) + experts
    assert counts.experts == experts
    assert counts.most_loaded_shard == sum(c for c, _ in ranks[0].values())
    text = memory_report(MemorySettings.from_args(args), model_config(args), verbose=True)
    assert f"Total number of parameters in billions: {counts.total / 1e9:.4f} ({counts.total})" in text
    assert f"({counts.active}), top-2 of 8 experts per token" in text
    assert "per rank over expert-parallel size 2 x expert-tensor-parallel size 1" in text


def test_dense_layers_between_moe_layers_and_shared_experts() -> None:
    """--moe-layer-freq 2 (layers 0 and 2 are MoE) with a gated shared expert: dense layers count a dense MLP."""
    args = _preset_args("mixtral_tiny", 512, moe_layer_freq=2, moe_shared_expert_intermediate_size=64,
                        moe_shared_expert_gate=True)
    opts, config = MemorySettings.from_args(args), model_config(args)
    from megatron.models.gpt.model import GPTModel

    n = sum(p.numel() for p in GPTModel(config).parameters())
    counts = parameter_counts(opts, config)
    assert counts.total == n == counts.most_loaded_shard
    h, f = 128, 256
    assert counts.total - counts.active == 2 * (8 - 2) * (3 * h * f)  # two MoE layers, 6 idle experts each
    assert parameter_counts(with_settings(opts, expert_model_parallel_size=4), config).most_loaded_shard == \
        n - counts.experts + counts.experts // 4


def test_ep_layout_line() -> None:
    assert describe_ep_layout(8, 2, 1, 3) == (
        "> expert parallel: size 2, expert-tensor-parallel size 1, expert-data-parallel size 3; 8 experts per MoE "
        "layer, 4 per rank (rank 0: experts 0-3; rank 1: experts 4-7); the rest of the model is replicated over the "
        "expert-parallel ranks")


def test_qwen3_counts_are_the_published_ones_and_the_tiny_models() -> None:
    """qwen3_8b: 8,190,735,360 (HF Qwen3-8B's count, "8.2B"); qwen3_30b_a3b: 30.5B total, 3.35B active (published
    "3.3B"); the tiny presets' counts (q/k norms included) equal their models'."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.models.gpt.model import GPTModel

    assert count_parameters(_preset_args("qwen3_8b", 151936)).total == 8_190_735_360
    moe = count_parameters(_preset_args("qwen3_30b_a3b", 151936))
    assert (round(moe.total / 1e9, 1), int(moe.active / 1e8) / 10) == (30.5, 3.3)
    for name in ("qwen3_tiny", "qwen3_moe_tiny"):
        args = _preset_args(name, 512)
        model = GPTModel(core_transformer_config_from_args(args))
        assert count_parameters(args).total == sum(p.numel() for p in model.parameters()), name
