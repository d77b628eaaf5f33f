"""The log line's FLOPs and the start-up memory estimate follow the model config (GQA, SwiGLU, untied output layer,
no biases, RMSNorm, rope): hand calculations, torch's FLOP counter on the real model, and the model's numel."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.core.transformer_config import TransformerConfig
from megatron.flops import num_floating_point_operations
from megatron.theoretical_memory_usage import compute_activation_memory, count_parameters

# Llama-style tiny model: h 64, 4 heads of 16, 2 KV groups, SwiGLU ffn 96, vocab 128, untied, no bias, RMSNorm, rope.
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, group_query_attention=True,
             num_query_groups=2, ffn_hidden_size=96, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", share_embeddings_and_output_weights=False, padded_vocab_size=128,
             max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--kv-channels", "16",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu",
               "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--untie-embeddings-and-output-weights", "--seq-length", "32", "--micro-batch-size", "2",
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _hand_flops(b: int, s: int, layers: int, h: int, n: int, d: int, g: int, f: int, v: int, gated: bool) -> int:
    """Forward matmul FLOPs (2 per multiply-add) counted one by one, times 3 for forward + backward."""
    q, kv = n * d, g * d
    per_layer = (2 * b * s * h * q          # query projection
                 + 2 * 2 * b * s * h * kv   # key and value projections
                 + 2 * b * s * s * q        # scores
                 + 2 * b * s * s * q        # attention over values
                 + 2 * b * s * q * h        # output projection
                 + 2 * b * s * h * f * (2 if gated else 1)  # first MLP linear (gate and up for SwiGLU)
                 + 2 * b * s * f * h)       # second MLP linear
    return 3 * (layers * per_layer + 2 * b * s * h * v)  # + logits


def test_flops_plain_gpt_is_megatrons_72_formula_and_96_with_full_recompute() -> None:
    b, s, layers, h, v = 8, 1024, 24, 1024, 50304
    config = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=16, padded_vocab_size=v,
                               max_position_embeddings=s)
    assert math.isclose(num_floating_point_operations(config, b, s),
                        72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h)))
    assert num_floating_point_operations(config, b, s) == _hand_flops(b, s, layers, h, 16, 64, 16, 4 * h, v, False)
    full = TransformerConfig(num_layers=layers, hidden_size=h, num_attention_heads=16, padded_vocab_size=v,
                             max_position_embeddings=s, recompute_granularity="full", recompute_method="uniform")
    assert math.isclose(num_floating_point_operations(full, b, s),
                        96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))


def test_flops_llama_config_by_hand_and_from_the_flags() -> None:
    config = TransformerConfig(**LLAMA)
    expected = _hand_flops(4, 32, 2, 64, 4, 16, 2, 96, 128, True)
    assert num_floating_point_operations(config, 4, 32) == expected == 59768832
    args = parse_args(args=LLAMA_FLAGS)
    args.rank = 1
    validate_args(args, {})
    args.padded_vocab_size = 128
    assert num_floating_point_operations(core_transformer_config_from_args(args), 4, 32) == expected


def test_flops_equal_torch_flop_counter_on_the_model() -> None:
    """torch's FlopCounterMode over one forward + backward of the real GPTModel (matmuls only, like the formula)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    model_parallel_manual_seed(1234, 0)

    b, s = 2, 16
    for overrides in ({}, dict(group_query_attention=False, num_query_groups=None, swiglu=False, ffn_hidden_size=256,
                               add_bias_linear=True, normalization="LayerNorm",
                               position_embedding_type="learned_absolute")):
        # attention dropout > 0 takes the explicit softmax path (bmm's the counter sees; CPU SDPA is not counted)
        config = TransformerConfig(**{**LLAMA, "attention_dropout": 0.1, **overrides})
        model = GPTModel(config, parallel_output=False)
        ids = torch.randint(0, 128, (b, s))
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        with FlopCounterMode(display=False) as counter:
            model(ids, pos, mask, labels=ids).sum().backward()
        assert counter.get_total_flops() == num_floating_point_operations(config, b, s), overrides


def _memory_args(**overrides) -> argparse.Namespace:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, group_query_attention=True,
                num_query_groups=2, ffn_hidden_size=96, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                seq_length=32, max_position_embeddings=32, micro_batch_size=2, padded_vocab_size=128,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                data_parallel_size=1, sequence_parallel=False, fp16=False, bf16=False,
                accumulate_allreduce_grads_in_fp32=False, use_distributed_optimizer=False, optimizer="adam",
                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                distribute_saved_activations=False)
    base.update(overrides)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("overrides", [
    {},
    dict(add_qkv_bias=True),
    dict(add_bias_linear=True, normalization="LayerNorm", position_embedding_type="learned_absolute",
         untie_embeddings_and_output_weights=False),
    dict(group_query_attention=True, num_query_groups=1, swiglu=False),
])
def test_parameter_count_equals_the_model(overrides) -> None:
    from megatron.models.gpt.model import GPTModel

    args = _memory_args(**overrides)
    counts = count_parameters(args)
    config = TransformerConfig(**{**LLAMA, "add_qkv_bias": args.add_qkv_bias, "add_bias_linear": args.add_bias_linear,
                                  "normalization": args.normalization,
                                  "position_embedding_type": args.position_embedding_type,
                                  "share_embeddings_and_output_weights": not args.untie_embeddings_and_output_weights,
                                  "num_query_groups": args.num_query_groups, "swiglu": args.swiglu})
    n = sum(p.numel() for p in GPTModel(config).parameters())
    assert counts.total == n == counts.most_loaded_shard, overrides


def test_parameter_count_llama_by_hand() -> None:
    # per layer: qkv 64 x (64 + 2*32), dense 64x64, fc1 64 x 2*96, fc2 96x64, two RMSNorms of 64; no biases
    layer = 64 * 128 + 64 * 64 + 64 * 192 + 96 * 64 + 2 * 64
    counts = count_parameters(_memory_args())
    assert layer == 30848
    assert counts.transformer_layers == 2 * layer + 64  # + final RMSNorm
    assert counts.embedding_layers == 2 * 128 * 64  # word embeddings + untied output layer, no position table
    assert counts.total == 78144


def test_activation_estimate_with_query_groups_by_hand() -> None:
    """fp32 (e = 4): per layer sbh(4e+2) + e·sb(2q + 2k) + 2e·sb·2f + (2e+1)·a·s²b with q = 64, k = 32, f = 96."""
    s, b, h, a = 32, 2, 64, 4
    layer = s * b * h * 18 + 4 * s * b * (2 * 64 + 2 * 32) + 8 * s * b * 192 + 9 * a * s * s * b
    embedding = 8 * s * b * 2 + s * b * h
    output = 4 * s * b * h + 4 * s * b * 128
    assert compute_activation_memory(_memory_args(), 1) == 2 * layer + embedding + output
    mha = _memory_args(group_query_attention=False, num_query_groups=None)
    assert compute_activation_memory(mha, 1) - compute_activation_memory(_memory_args(), 1) == 2 * 4 * s * b * 64


BERT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=64, max_position_embeddings=16,
            hidden_dropout=0.0, attention_dropout=0.1, bias_gelu_fusion=False)


@pytest.mark.parametrize("binary", [True, False])
def test_bert_flops_and_parameter_count_equal_the_model(binary: bool) -> None:
    """BERT's TFLOPs formula / 3 equals torch's count of one forward of the real BertModel (encoder layers, LM head
    dense + tied logits, pooler + binary head), and the start-up parameter count equals the model's numel."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.flops import bert_num_floating_point_operations
    from megatron.models.bert.model import BertModel

    model_parallel_manual_seed(1234, 0)
    config = TransformerConfig(**BERT)  # attention dropout > 0: the explicit softmax path the counter sees
    model = BertModel(config, num_tokentypes=2 if binary else 0, add_binary_head=binary)
    b, s = 2, 12
    tokens = torch.randint(0, 64, (b, s))
    pad = torch.ones(b, s, dtype=torch.long)
    pad[1, 8:] = 0
    types = torch.zeros(b, s, dtype=torch.long) if binary else None
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, pad, types)
    flops = bert_num_floating_point_operations(config, b, s, binary)
    assert counter.get_total_flops() == flops / 3 == (1405184 if binary else 1400832)
    assert flops > num_floating_point_operations(config, b, s)  # GPT's formula missed the heads

    args = _memory_args(model_family="bert", bert_binary_head=binary, num_layers=2, hidden_size=32,
                        num_attention_heads=4, kv_channels=8, group_query_attention=False, num_query_groups=None,
                        ffn_hidden_size=128, swiglu=False, add_bias_linear=True, normalization="LayerNorm",
                        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
                        seq_length=12, max_position_embeddings=16, padded_vocab_size=64)
    counts = count_parameters(args)
    n = sum(p.numel() for p in model.parameters())
    assert counts.total == n == counts.most_loaded_shard == (30402 if binary else 29216)
    pp2 = count_parameters(_memory_args(**{**vars(args), "pipeline_model_parallel_size": 2}))
    assert pp2.total == n and pp2.most_loaded_shard < n


def _bert_memory_args(binary: bool) -> argparse.Namespace:
    """fp32 BERT, 2 layers, s = 12, b = 2, h = 32, a = 4, f = 128, V = 64."""
    return _memory_args(model_family="bert", bert_binary_head=binary, num_layers=2, hidden_size=32,
                        num_attention_heads=4, kv_channels=8, group_query_attention=False, num_query_groups=None,
                        ffn_hidden_size=128, swiglu=False, add_bias_linear=True, normalization="LayerNorm",
                        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
                        seq_length=12, max_position_embeddings=16, padded_vocab_size=64, micro_batch_size=2)


@pytest.mark.parametrize("binary", [True, False])
def test_bert_activation_estimate_by_hand(binary: bool) -> None:
    """fp32 BERT, 2 layers, s = 12, b = 2, h = 32, a = 4, f = 128, V = 64: GPT's per-layer, embedding and output terms
    plus the padding mask (int64 [b, s] and bool [b, 1, s, s]), token types (binary head), the LM head's dense, GeLU
    and LayerNorm inputs and the pooler (dense input, tanh output, fp32 sentence-order logits)."""
    s, b, h, a, f, v = 12, 2, 32, 4, 128, 64
    args = _bert_memory_args(binary)
    layer = s * b * h * 18 + 4 * s * b * (2 * h + 2 * h) + 8 * s * b * f + 9 * a * s * s * b
    embedding = 8 * s * b * 2 + s * b * h
    masks = 8 * s * b + s * s * b + (8 * s * b if binary else 0)
    gpt_output = 4 * s * b * h + 4 * s * b * v
    head = 3 * 4 * s * b * h + ((2 * 4 * b * h + 4 * 2 * b) if binary else 0)
    assert compute_activation_memory(args, 1) == 2 * layer + embedding + masks + gpt_output + head
    gpt = _memory_args(**{**vars(args), "model_family": "gpt"})
    assert compute_activation_memory(args, 1) - compute_activation_memory(gpt, 1) == masks + head
    # TP2 + SP: the head's dense, GeLU and LayerNorm run on the sequence shard; PP2: the head is on the last stage
    sp = _memory_args(**{**vars(args), "tensor_model_parallel_size": 2, "sequence_parallel": True})
    sp_gpt = _memory_args(**{**vars(sp), "model_family": "gpt"})
    assert compute_activation_memory(sp, 1) - compute_activation_memory(sp_gpt, 1) == masks + head - 3 * 2 * s * b * h
    pp = _memory_args(**{**vars(args), "pipeline_model_parallel_size": 2})
    pp_gpt = _memory_args(**{**vars(pp), "model_family": "gpt"})
    assert compute_activation_memory(pp, 4) - compute_activation_memory(pp_gpt, 4) == 2 * masks


def test_bert_head_activation_terms_equal_what_autograd_saves() -> None:
    """The estimate's LM head (logits input + dense, GeLU and LayerNorm inputs: 4·e·s·b·h) and pooler + binary head
    (2·e·b·h) terms equal the non-parameter [.., h] tensors autograd saves in the real BertModel's heads (fp32)."""
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.bert.model import BertModel

    model_parallel_manual_seed(1234, 0)
    model = BertModel(TransformerConfig(**{**BERT, "attention_dropout": 0.0}), num_tokentypes=2, add_binary_head=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict = {}
    current = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current and t.data_ptr() not in params and t.shape[-1] == BERT["hidden_size"]:
            saved.setdefault(current[-1], {})[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    def enter(name: str):
        def hook(module, inputs) -> None:
            current.append(name)
        return hook

    def leave(module, inputs, output) -> None:
        current.pop()

    for name, module in (("lm", model.lm_head), ("pooler", model.language_model.pooler), ("pooler", model.binary_head)):
        module.register_forward_pre_hook(enter(name))
        module.register_forward_hook(leave)
    b, s, h, e = 2, 12, BERT["hidden_size"], 4
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 64, (b, s)), torch.ones(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long))
    assert sum(saved["lm"].values()) == 4 * e * s * b * h  # GPT's output-layer input + the 3 BERT head terms
    assert sum(saved["pooler"].values()) == 2 * e * b * h
    # the estimate's BERT-only terms: masks and token types (inputs), the heads' saved tensors, fp32 SOP logits
    args = _bert_memory_args(True)
    gpt = _memory_args(**{**vars(args), "model_family": "gpt"})
    masks = 8 * s * b + s * s * b + 8 * s * b
    head = compute_activation_memory(args, 1) - compute_activation_memory(gpt, 1) - masks
    assert head == sum(saved["lm"].values()) - e * s * b * h + sum(saved["pooler"].values()) + 4 * 2 * b
