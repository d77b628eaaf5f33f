"""Multi-token prediction in-process (megatron/layers/mtp.py): the flags reach the config and bad combinations are
one line; evaluation and generation ignore the block (logits and eval losses equal the same model without MTP, no loss
recorded); training attaches the MTP loss to backward and records it per depth; Megatron Core's `mtp.layers.N.*`
names round-trip. The equality to megatron-core's block is tests/model/test_mtp_mcore_oracle.py, training layouts
tests/training/test_mtp_training.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args
from megatron.core import aux_losses
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.mcore_names import core_to_ours, ours_to_core
from megatron.models.gpt.model import GPTModel

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --position-embedding-type rope")
SEQ, VOCAB = 16, 64


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def _config_of(cmd: str) -> TransformerConfig:
    args = parse_args(args=cmd.split())
    args.world_size = 1
    return core_transformer_config_from_args(validate_args(args, {}))


def test_flags_reach_the_config():
    config = _config_of(BASE + " --mtp-num-layers 2 --mtp-loss-scaling-factor 0.25")
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (2, 0.25)
    plain = _config_of(BASE)
    assert (plain.mtp_num_layers, plain.mtp_loss_scaling_factor) == (None, 0.1)


@pytest.mark.parametrize("extra, named", [
    (" --mtp-num-layers 0", "--mtp-num-layers must be >= 1"),
    (" --mtp-num-layers 1 --position-embedding-type learned_absolute", "--position-embedding-type rope or none"),
])
def test_bad_combinations_are_one_line(extra, named):
    with pytest.raises(ArgumentError) as info:
        _config_of(BASE + extra)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_context_parallel_is_refused():
    with pytest.raises(ValueError, match="--context-parallel-size"):
        TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                          mtp_num_layers=1, context_parallel_size=2)


def _models(depths: int = 2):
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB, hidden_dropout=0.0,
              attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
    torch.manual_seed(0)
    with_mtp = GPTModel(TransformerConfig(**kw, mtp_num_layers=depths))
    plain = GPTModel(TransformerConfig(**kw))
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    return with_mtp, plain


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.arange(SEQ).expand(2, SEQ),
            torch.ones(1, 1, SEQ, SEQ).triu(1).bool(), torch.randint(0, VOCAB, (2, SEQ), generator=g))


def test_evaluation_and_generation_ignore_the_block():
    with_mtp, plain = _models()
    tokens, positions, mask, labels = _batch()
    aux_losses.clear()
    with_mtp.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(with_mtp(tokens, positions, mask), plain(tokens, positions, mask), rtol=0, atol=0)
        torch.testing.assert_close(with_mtp(tokens, positions, mask, labels=labels),
                                   plain(tokens, positions, mask, labels=labels), rtol=0, atol=0)
    assert aux_losses.tracked() == {}


def test_training_attaches_and_records_the_losses():
    with_mtp, plain = _models()
    tokens, positions, mask, labels = _batch()
    aux_losses.clear()
    losses = with_mtp(tokens, positions, mask, labels=labels)
    torch.testing.assert_close(losses, plain(tokens, positions, mask, labels=labels), rtol=0, atol=0)  # forward: LM
    losses.mean().backward()
    tracked = aux_losses.tracked()
    assert sorted(tracked) == ["mtp_1 loss", "mtp_2 loss"] and all(v.item() > 0 for v in tracked.values())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in with_mtp.named_parameters()
               if n.startswith("mtp.layers.1."))
    assert [loss.name for loss in aux_losses.declared_by([with_mtp])] == ["mtp_1 loss", "mtp_2 loss"]
    aux_losses.clear()


def test_megatron_core_names_round_trip():
    with_mtp, _ = _models(depths=1)
    ours = with_mtp.state_dict()
    core = ours_to_core(ours)
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
            "mtp.layers.0.transformer_layer.mlp.linear_fc1.weight"} <= set(core)
    back = core_to_ours(core)
    assert set(back) == set(ours) and all(torch.equal(back[k], ours[k]) for k in ours)


def test_router_losses_count_the_mtp_depths():
    """A router in an MTP layer records after the decoder's layers; the logged value divides by the MoE layers plus
    the MTP depths, as Megatron-LM's track_moe_metrics does."""
    from megatron.layers.moe import router_losses

    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                               add_bias_linear=False, num_moe_experts=4, moe_layer_freq=[0, 1, 1],
                               moe_aux_loss_coeff=0.01, mtp_num_layers=2)
    (lbl,) = router_losses(config, None)
    assert (lbl.name, lbl.num_layers, lbl.num_recording_layers) == ("load_balancing_loss", 5, 4)


LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, group_query_attention=True,
             num_query_groups=2, ffn_hidden_size=96, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", share_embeddings_and_output_weights=False, padded_vocab_size=128,
             max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.1, mtp_num_layers=2)


def test_flops_count_the_mtp_depths_as_megatron():
    """torch's FLOP counter over one training forward + backward of a GPTModel with two MTP depths equals the log
    line's formula less Megatron-LM's norm term 6·B·s·D·3h (not a matmul)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.flops import num_floating_point_operations

    model_parallel_manual_seed(1234, 0)
    config = TransformerConfig(**LLAMA)
    model = GPTModel(config)
    b, s = 2, 16
    ids = torch.randint(0, 128, (b, s))
    with FlopCounterMode(display=False) as counter:
        model(ids, torch.arange(s).expand(b, s), torch.ones(1, 1, s, s).triu(1).bool(), labels=ids).sum().backward()
    aux_losses.clear()
    flops = num_floating_point_operations(config, b, s)
    assert counter.get_total_flops() + 6 * b * s * 2 * 3 * 64 == flops
    plain = TransformerConfig(**{**LLAMA, "mtp_num_layers": None})
    assert flops > num_floating_point_operations(plain, b, s)


MEMORY_ARGS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16, group_query_attention=True,
                   num_query_groups=2, ffn_hidden_size=96, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                   normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                   seq_length=32, max_position_embeddings=32, micro_batch_size=2, padded_vocab_size=128,
                   tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                   virtual_pipeline_model_parallel_size=None, data_parallel_size=1, sequence_parallel=False,
                   fp16=False, bf16=False, accumulate_allreduce_grads_in_fp32=False, use_distributed_optimizer=False,
                   optimizer="adam", recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                   distribute_saved_activations=False, mtp_num_layers=2)


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_report_counts_the_mtp_block(moe):
    """The start-up parameter count equals the model's numel with MTP (dense, or MoE as the last decoder layer);
    `mtp` is the block's share; under PP=2 the last stage holds the block and, untied, an embedding copy."""
    import argparse

    from megatron.theoretical_memory_usage import count_parameters

    extra = dict(num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=48) if moe else {}
    args = argparse.Namespace(**MEMORY_ARGS, **extra)
    counts = count_parameters(args)
    config = TransformerConfig(**{**LLAMA, **({"num_moe_experts": 4, "moe_layer_freq": [0, 1],
                                               "moe_ffn_hidden_size": 48} if moe else {})})
    model = GPTModel(config)
    numel = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert counts.total == numel == counts.most_loaded_shard and counts.mtp == mtp > 0
    pp2 = count_parameters(argparse.Namespace(**{**vars(args), "pipeline_model_parallel_size": 2}))
    last = numel - sum(p.numel() for n, p in model.named_parameters()
                       if n.startswith(("language_model.embedding.", "language_model.encoder.layers.0.")))
    assert pp2.most_loaded_shard == last + 128 * 64  # the last stage: layer 1, final norm, output, MTP, emb copy


def test_checkpoint_architecture_holds_and_restores_the_mtp_depths():
    """The checkpoint's architecture records --mtp-num-layers (its weights hold the block); --use-checkpoint-args
    restores it (so generation from an MTP checkpoint builds the block it then skips); a run without it is stopped
    with one line naming the flag."""
    from megatron.checkpoint.args import ArchitectureMismatchError, architecture_from_args, flag_defaults
    from megatron.compat import check_architecture, restore_architecture

    def validated(cmd: str):
        args = parse_args(args=cmd.split())
        args.world_size = 1
        return validate_args(args, {})

    saved = architecture_from_args(validated(BASE + " --mtp-num-layers 2"))
    assert saved["mtp_num_layers"] == 2 and architecture_from_args(validated(BASE))["mtp_num_layers"] is None
    plain = parse_args(args=BASE.split())
    restore_architecture(plain, saved, None, flag_defaults())
    assert plain.mtp_num_layers == 2
    with pytest.raises(ArchitectureMismatchError, match="pass --mtp-num-layers 2") as info:
        check_architecture(saved, validated(BASE), "ckpt")
    assert "\n" not in str(info.value)


def _train_grads(config: TransformerConfig, state: dict) -> tuple:
    model = GPTModel(config)
    model.load_state_dict(state)
    tokens, positions, mask, labels = _batch()
    aux_losses.clear()
    losses = model(tokens, positions, mask, labels=labels)
    losses.mean().backward()
    tracked = aux_losses.tracked()
    aux_losses.clear()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}, tracked


def test_full_recompute_gives_the_same_losses_and_grads():
    """--recompute-granularity full --recompute-method uniform recomputes each MTP depth (Megatron-LM needs
    --recompute-num-layers 1 there: other values are one line); block leaves the MTP layers alone, as Megatron."""
    with_mtp, _ = _models()
    state = with_mtp.state_dict()
    base = with_mtp.config
    ref = _train_grads(base, state)
    for method in ("uniform", "block"):
        config = dataclasses.replace(base, recompute_granularity="full", recompute_method=method,
                                     recompute_num_layers=1)
        got = _train_grads(config, state)
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
        assert got[2].keys() == ref[2].keys() and all(torch.equal(got[2][k], ref[2][k]) for k in ref[2])
        for name, grad in ref[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=0, atol=1e-7, msg=f"{method}: {name}")
    with pytest.raises(ValueError, match="--recompute-num-layers 1"):
        GPTModel(dataclasses.replace(base, recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=2))


def test_mtp_layers_take_the_decoders_attention_and_mlp_kinds():
    """With multi-latent attention and a first-k-dense MoE decoder, each MTP layer is an MLA layer with the MoE MLP
    of the decoder's last layer, and training reaches its parameters."""
    from megatron.layers.moe import MoELayer
    from megatron.models.deepseek.mla import MLASelfAttention

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB,
                               hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope",
                               normalization="RMSNorm", add_bias_linear=False, swiglu=True,
                               multi_latent_attention=True, qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16,
                               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, max_position_embeddings=SEQ,
                               num_moe_experts=4, moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.01, mtp_num_layers=1)
    model = GPTModel(config)
    layer = model.mtp.layers[0].transformer_layer
    assert isinstance(layer.self_attention, MLASelfAttention) and isinstance(layer.mlp, MoELayer)
    assert layer.layer_number == 3
    tokens, positions, mask, labels = _batch()
    aux_losses.clear()
    model(tokens, positions, mask, labels=labels).mean().backward()
    tracked = aux_losses.tracked()
    aux_losses.clear()
    assert tracked["mtp_1 loss"].item() > 0 and tracked["load_balancing_loss"][2] > 0  # the MTP layer's router
    assert layer.self_attention.linear_kv_down_proj.weight.grad.abs().sum() > 0
