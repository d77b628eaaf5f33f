"""Run by tests/tools/test_checkpoint_mcore.py under megatron-core 0.16.1 (never imported by this repository's code).

On 2 gloo processes, for a tiny GPT (LayerNorm, GeLU, learned positions, tied embeddings), a tiny Llama (RMSNorm,
SwiGLU, RoPE, GQA, no biases, untied) and a tiny Qwen3 (the Llama with --qk-layernorm, --kv-channels 12, a sliding
window on layer 1): builds Megatron Core's GPTModel (local layer spec) at TP1 with random weights,
writes its logits on fixed tokens, saves it as `torch` (per-rank files with Core names, as Megatron-LM's
`--ckpt-format torch`) and `torch_dist` (dist_checkpointing.save) at TP1, then rebuilds it at TP2 and PP2 (weights
loaded by dist_checkpointing from the TP1 folder) and saves both formats there too. When `ours/<family>` holds a
torch_dist checkpoint written by our code, it is loaded with dist_checkpointing.load into Core models at TP1 and TP2
and their logits are written (also `moe_mixed`: the MoE family with MoE and dense layers mixed, at TP1; and
`deepseek`: multi-latent attention, a first dense layer, group-limited sigmoid routing with the expert bias, a shared
expert and one MTP layer, at TP1; `mtp_moe`: the MoE family with a dense first layer and one MTP layer). A tiny BERT (Core's BertModel, local spec, tied head, binary head; `bert`) is saved
the same way at TP1 and TP2, and ours loaded into it; so is a tiny T5 (Core's T5Model, local specs, tied
head; `t5`; ours also as saved by our PP2 run); at TP2 both also load our save's optimizer state into Megatron Core's
DDP and distributed optimizer and save it again in both its layouts (`ours_optim_tp2_<layout>`). Then training (`train`): the GPT wrapped in Megatron Core's DistributedDataParallel
with its distributed optimizer (Adam, DP2) takes 6 steps on the batches of `batches.pt`, saving torch_dist
checkpoints with the optimizer state (fully_reshardable in `train`, Megatron-LM's default dp_reshardable in
`train_dp`) and Megatron-LM's RNG state after step 3; its per-step losses are the run that never stopped. One
optimizer state (random Adam moments) of the GPT at TP2 and PP2 and of the Llama at TP2 is saved in both layouts
(`layouts/`). When `ours_train` names our torch_dist save (with optimizer state) of a run on the same batches, it is
loaded into that model and optimizer (and its RNG state restored as Megatron-LM's load_checkpoint does) and steps
4-6 are taken again. Inputs and outputs: the folder it runs in (see
job.json). The test prepends tests/mcore_oracle.py's ORACLE_CPU_PRELUDE (the CPU stand-ins).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, ITER = 2, 32, 4, 128, 16, 10
FAMILIES = {
    "gpt": dict(config={}, model=dict(share_embeddings_and_output_weights=True,
                                      position_embedding_type="learned_absolute"),
                args=dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True, group_query_attention=False,
                          num_query_groups=None, position_embedding_type="learned_absolute",
                          untie_embeddings_and_output_weights=False, ffn_hidden_size=4 * HIDDEN)),
    "llama": dict(config=dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                              add_bias_linear=False, num_query_groups=2, ffn_hidden_size=64),
                  model=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope"),
                  args=dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, group_query_attention=True,
                            num_query_groups=2, position_embedding_type="rope", rotary_base=10000,
                            untie_embeddings_and_output_weights=True, ffn_hidden_size=64)),
}
# a Qwen3-like model with sliding windows: per-head q/k norms, 12-channel heads (not 32 / 4), a window of 3 on layer 1
FAMILIES["qwen3"] = dict(config={**FAMILIES["llama"]["config"], "qk_layernorm": True, "kv_channels": 12,
                                 "window_size": (3, 0), "window_attn_skip_freq": 2},
                         model=FAMILIES["llama"]["model"], spec=dict(qk_layernorm=True),
                         args={**FAMILIES["llama"]["args"], "qk_layernorm": True, "kv_channels": 12,
                               "window_size": (3, 0), "window_attn_skip_freq": 2})
_ones = torch.ones  # Core builds its sliding-window mask on "cuda": the CPU stand-in
torch.ones = lambda *a, device=None, **k: _ones(*a, device="cpu" if device == "cuda" else device, **k)
# a Mixtral-like MoE (the Llama family's layers with 4 experts, top-2, a gated shared expert), local spec's
# SequentialMLP; saved at TP1, PP2 and EP2 (Megatron Core's MoE with TP needs sequence parallelism)
_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40,
            moe_shared_expert_gate=True, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
FAMILIES["moe"] = dict(config={**FAMILIES["llama"]["config"], **_MOE}, model=FAMILIES["llama"]["model"],
                       args={**FAMILIES["llama"]["args"], "num_experts": 4, "moe_router_topk": 2,
                             "moe_ffn_hidden_size": 48, "moe_shared_expert_intermediate_size": 40,
                             "moe_shared_expert_gate": True},
                       spec=dict(num_experts=4, moe_grouped_gemm=False),
                       layouts=(("pp2", (1, 2)), ("ep2", (1, 1, 2))))  # (TP, PP[, EP])


def megatron_lm_args(family: str, tp: int, pp: int) -> argparse.Namespace:
    """The fields of Megatron-LM's args namespace that describe the model (what its checkpoints hold)."""
    fields = {"kv_channels": None, **FAMILIES[family]["args"]}
    return argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              max_position_embeddings=SEQ, seq_length=SEQ, padded_vocab_size=VOCAB,
                              make_vocab_size_divisible_by=128, norm_epsilon=1e-5, bias_activation_fusion=False,
                              openai_gelu=False, squared_relu=False, add_qkv_bias=False, rotary_percent=1.0,
                              transformer_impl="local",
                              apply_layernorm_1p=False, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, iteration=ITER, consumed_train_samples=80,
                              consumed_valid_samples=0, tokenizer_type="NullTokenizer", **fields)


def build(family: str, parallel_output: bool = False) -> GPTModel:
    spec = FAMILIES[family]
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32, tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size(),
                            pipeline_model_parallel_size=mps.get_pipeline_model_parallel_world_size(),
                            expert_model_parallel_size=mps.get_expert_model_parallel_world_size(),
                            **spec["config"])
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(**spec.get("spec", {})), vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=mps.is_pipeline_first_stage(),
                    post_process=mps.is_pipeline_last_stage(), parallel_output=parallel_output, **spec["model"])


def tokens():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def randomize(model: GPTModel) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "layernorm" in name or "final_layernorm" in name
            p.copy_(1 + 0.2 * torch.randn_like(p) if norm and name.endswith("weight") else 0.2 * torch.randn_like(p))


def mixed_run(ours: str) -> None:
    """Our torch_dist save of the MoE family with MoE and dense layers mixed (moe_layer_freq [1, 0]: Megatron Core's
    non-homogeneous layers, each under its own names) loaded into Core's model at TP1 (per-layer specs of
    get_gpt_decoder_block_spec, local); its logits written to out/moe_mixed/ours_logits_tp1.pt."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    mps.initialize_model_parallel(1, 1)
    spec = FAMILIES["moe"]
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32, moe_layer_freq=[1, 0], **spec["config"])
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ, parallel_output=False, **spec["model"])
    load_dist(model, ours)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join("out", "moe_mixed"), exist_ok=True)
        torch.save(logits_of(model), os.path.join("out", "moe_mixed", "ours_logits_tp1.pt"))
    dist.barrier()
    mps.destroy_model_parallel()


# the DeepSeek-V3 family (ours only, at TP1): multi-latent attention with q-lora (plain RoPE), a first dense layer
# then an MoE layer (4 experts in 2 groups, sigmoid router with expert bias and scaling, an ungated shared expert),
# one MTP layer; Core's MLA on the local spec takes a stand-in core attention (as tests/model/test_mla_mcore_oracle.py)
DEEPSEEK = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                v_head_dim=8, rope_type="rope", rotary_base=10000, normalization="RMSNorm", qk_layernorm=True,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, ffn_hidden_size=64,
                apply_rope_fusion=False, num_moe_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=32,
                moe_shared_expert_intermediate_size=32, moe_router_topk=2, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                moe_router_topk_scaling_factor=2.5, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                mtp_num_layers=1, mtp_loss_scaling_factor=0.3)


class StandInCoreAttention(torch.nn.Module):
    """causal softmax(q k^T * softmax_scale) v: Core's local DotProductAttention takes no separate k / v head dims."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, packed_seq_params=None, **kw):
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.scale
        causal = torch.ones(q.size(0), k.size(0), dtype=torch.bool).triu(1)
        ctx = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1), v)
        return ctx.reshape(ctx.size(0), ctx.size(1), -1)


# the MoE family with a dense first layer and one MTP layer (plain attention: norms under Transformer Engine's names)
MTP_MOE = {**FAMILIES["moe"]["config"], "moe_layer_freq": [0, 1], "mtp_num_layers": 1}


def mtp_family_run(family: str, ours: str) -> None:
    """Our torch_dist save of `family` ("deepseek" or "mtp_moe") loaded (strictly, MTP layer and expert biases
    included) into Core's GPTModel at TP1 (local specs of get_gpt_decoder_block_spec, get_gpt_mtp_block_spec); its
    logits, the MTP depth's logits (the output layer's first call when labels are given) and its expert biases
    written to out/<family>/ours_in_core.pt."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    multi_latent_attention.HAVE_TE = False  # its TE stand-ins are not types without Transformer Engine
    mps.initialize_model_parallel(1, 1)
    config_class, extra = (MLATransformerConfig, DEEPSEEK) if family == "deepseek" else (TransformerConfig, MTP_MOE)
    cfg = config_class(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
                       hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.float32, **extra)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs if family == "deepseek" else ():
        layer.submodules.self_attention.submodules.core_attention = StandInCoreAttention
    model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=SEQ,
                     parallel_output=False, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, block, use_transformer_engine=False))
    model.eval()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ours)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    calls = []
    # copies: Core's cross entropy then turns the logits into probabilities in place
    model.output_layer.register_forward_hook(lambda module, args, out: calls.append(out[0].detach().clone()))
    ids, pos, mask = tokens()
    with torch.no_grad():
        model(ids, pos, mask, labels=ids)  # the MTP block runs only with labels: its depth's logits come first
    if dist.get_rank() == 0:
        os.makedirs(os.path.join("out", family), exist_ok=True)
        torch.save({"logits": calls[1].transpose(0, 1), "mtp_logits": calls[0].transpose(0, 1),
                    "expert_bias": [b for name, b in model.named_buffers() if name.endswith("router.expert_bias")]},
                   os.path.join("out", family, "ours_in_core.pt"))
    dist.barrier()
    mps.destroy_model_parallel()


def save_torch(model: GPTModel, root: str, family: str) -> None:
    """Megatron-LM's --ckpt-format torch: mp_rank_TT[_PPP][_EEE] (the expert rank under expert parallelism), written
    by (expert-)data-parallel rank 0."""
    tp, pp = mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size()
    ep = mps.get_expert_model_parallel_world_size()
    if (mps.get_expert_data_parallel_rank() if ep > 1 else mps.get_data_parallel_rank()) == 0:
        t, p = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
        sub = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (
            f"_{mps.get_expert_model_parallel_rank():03d}" if ep > 1 else "")
        path = os.path.join(root, f"iter_{ITER:07d}", sub, "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        args = megatron_lm_args(family, tp, pp)
        args.expert_model_parallel_size = ep
        torch.save({"model": model.state_dict_for_save_checkpoint(), "args": args, "checkpoint_version": 3.0,
                    "iteration": ITER}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITER))


def save_dist(model: GPTModel, root: str, family: str) -> None:
    tp, pp = mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size()
    iter_dir = os.path.join(root, f"iter_{ITER:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": megatron_lm_args(family, tp, pp),
                             "checkpoint_version": 3.0, "iteration": ITER}, iter_dir)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITER))
    dist.barrier()


def load_dist(model: GPTModel, iter_dir: str) -> None:
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(loaded["model"])


def logits_of(model: GPTModel):
    with torch.no_grad():
        return model(*tokens()).detach()


def build_bert():
    """Megatron Core's BertModel (local layer spec; tied LM head, 2 token types, binary head and pooler)."""
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size())
    return BertModel(config=cfg, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, add_binary_head=True, parallel_output=False,
                     share_embeddings_and_output_weights=True)


def bert_inputs():
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 11:] = 0  # padding
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    return ids, mask, types


def bert_logits(model):
    ids, mask, types = bert_inputs()
    with torch.no_grad():
        return model(ids, mask, tokentype_ids=types)


def bert_run(ours) -> None:
    """BERT: logits (LM and binary head) of random weights at TP1; `torch` and `torch_dist` saved at TP1 and TP2;
    our torch_dist save (`ours`, when given) loaded at TP1 and TP2, its logits written."""
    out = os.path.join("out", "bert")
    args = {**vars(megatron_lm_args("gpt", 1, 1)), "bert_binary_head": True, "num_tokentypes": 2}
    mps.initialize_model_parallel(1, 1)
    model = build_bert()
    randomize(model)
    logits = bert_logits(model)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(logits, os.path.join(out, "logits.pt"))
    for tp in (1, 2):
        if tp == 2:
            mps.initialize_model_parallel(2, 1)
            model = build_bert()
            load_dist(model, os.path.join(out, "dist_tp1", f"iter_{ITER:07d}"))
        ns = argparse.Namespace(**{**args, "tensor_model_parallel_size": tp})
        if mps.get_data_parallel_rank() == 0:
            path = os.path.join(out, f"torch_tp{tp}", f"iter_{ITER:07d}",
                                f"mp_rank_{mps.get_tensor_model_parallel_rank():02d}", "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.state_dict_for_save_checkpoint(), "args": ns, "checkpoint_version": 3.0,
                        "iteration": ITER}, path)
        iter_dir = os.path.join(out, f"dist_tp{tp}", f"iter_{ITER:07d}")
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": ns, "checkpoint_version": 3.0,
                                 "iteration": ITER}, iter_dir)
        if dist.get_rank() == 0:
            for name in (f"torch_tp{tp}", f"dist_tp{tp}"):
                with open(os.path.join(out, name, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(ITER))
        if ours:
            fresh = build_bert()
            load_dist(fresh, ours)
            logits = bert_logits(fresh)
            if dist.get_rank() == 0:
                torch.save(logits, os.path.join(out, f"ours_logits_tp{tp}.pt"))
            if tp == 2:
                resave_optimizer(build_bert(), ours, os.path.join(out, "ours_optim_tp2"), ns)
        dist.barrier()
        mps.destroy_model_parallel()


DSEQ = 12  # T5's decoder tokens


def build_t5():
    """Megatron Core's T5Model (local layer specs; the blocks' final norms LayerNorm, as LNImpl without Transformer
    Engine; tied head with its bias)."""
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size())
    enc = TransformerBlockSubmodules([t5_spec.encoder_model_with_local_spec()] * LAYERS, layer_norm=t5_spec.LNImpl)
    dec = TransformerBlockSubmodules([t5_spec.decoder_model_with_local_spec()] * LAYERS, layer_norm=t5_spec.LNImpl)
    return T5Model(config=cfg, encoder_config=cfg, transformer_encoder_layer_spec=enc,
                   transformer_decoder_layer_spec=dec, vocab_size=VOCAB, max_sequence_length=SEQ,
                   share_embeddings_and_output_weights=True, parallel_output=False)


def t5_inputs():
    """Encoder and decoder tokens and the [b, s_q, s_k] masks (1 = attend; sample 1's encoder padded after 11)."""
    g = torch.Generator().manual_seed(13)
    enc, dec = torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, DSEQ), generator=g)
    keys = torch.ones(2, SEQ)
    keys[1, 11:] = 0
    enc_mask = keys[:, None, :].expand(2, SEQ, SEQ).clone()
    dec_mask = torch.tril(torch.ones(DSEQ, DSEQ)).expand(2, DSEQ, DSEQ).clone()
    return enc, dec, enc_mask, dec_mask, keys[:, None, :].expand(2, DSEQ, SEQ).clone()


def t5_logits(model):
    enc, dec, *masks = t5_inputs()
    with torch.no_grad():  # Megatron Core's masks: bool [b, 1, s_q, s_k], True = masked
        return model(enc, dec, *[m.unsqueeze(1) < 0.5 for m in masks])


def t5_run(ours, ours_pp2=None) -> None:
    """T5: logits of random weights at TP1; `torch` and `torch_dist` saved at TP1 and TP2; our torch_dist save
    (`ours`, when given) loaded at TP1 and TP2, its logits written; so is our save at PP2 (`ours_pp2`) at TP1."""
    out = os.path.join("out", "t5")
    args = {**vars(megatron_lm_args("gpt", 1, 1)), "encoder_num_layers": LAYERS, "decoder_num_layers": LAYERS,
            "encoder_seq_length": SEQ, "decoder_seq_length": DSEQ}
    mps.initialize_model_parallel(1, 1)
    model = build_t5()
    randomize(model)
    logits = t5_logits(model)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        torch.save(logits, os.path.join(out, "logits.pt"))
    for tp in (1, 2):
        if tp == 2:
            mps.initialize_model_parallel(2, 1)
            model = build_t5()
            load_dist(model, os.path.join(out, "dist_tp1", f"iter_{ITER:07d}"))
        ns = argparse.Namespace(**{**args, "tensor_model_parallel_size": tp})
        if mps.get_data_parallel_rank() == 0:
            path = os.path.join(out, f"torch_tp{tp}", f"iter_{ITER:07d}",
                                f"mp_rank_{mps.get_tensor_model_parallel_rank():02d}", "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": model.state_dict_for_save_checkpoint(), "args": ns, "checkpoint_version": 3.0,
                        "iteration": ITER}, path)
        iter_dir = os.path.join(out, f"dist_tp{tp}", f"iter_{ITER:07d}")
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": ns, "checkpoint_version": 3.0,
                                 "iteration": ITER}, iter_dir)
        if dist.get_rank() == 0:
            for name in (f"torch_tp{tp}", f"dist_tp{tp}"):
                with open(os.path.join(out, name, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(ITER))
        if ours:
            fresh = build_t5()
            load_dist(fresh, ours)
            logits = t5_logits(fresh)
            if dist.get_rank() == 0:
                torch.save(logits, os.path.join(out, f"ours_logits_tp{tp}.pt"))
            if tp == 2:
                resave_optimizer(build_t5(), ours, os.path.join(out, "ours_optim_tp2"), ns)
        if ours_pp2 and tp == 1:
            fresh = build_t5()
            load_dist(fresh, ours_pp2)
            logits = t5_logits(fresh)
            if dist.get_rank() == 0:
                torch.save(logits, os.path.join(out, "ours_pp2_logits_tp1.pt"))
        dist.barrier()
        mps.destroy_model_parallel()


SAVE_AT, LR = 3, 1e-3
OPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}  # Megatron-LM's --dist-ckpt-optim-fully-reshardable


_STAND_INS = []


def training_cpu_stand_ins() -> None:
    """Megatron Core's DDP and distributed optimizer allocate on 'cuda' and accept only `torch.cuda.*Tensor` types:
    both pointed at the CPU (applied once, before the first use of either)."""
    import functools

    if _STAND_INS:
        return
    _STAND_INS.append(True)

    def on_cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if k.get("device") is not None and "cuda" in str(k["device"]):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like", "ones_like"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.is_available = lambda: False
    original = torch.Tensor.type

    def tensor_type(self, *a, **k):
        if a or k:
            return original(self, *a, **k)
        name = original(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = tensor_type

    # Without apex / Transformer Engine Megatron Core steps torch's AdamW, which keeps a per-parameter "step" tensor.
    # Its fully_reshardable reader (written for FusedAdam) restores the step from the param groups as one tensor
    # shared by every parameter (AdamW would then count it once per parameter per step) and also tries to copy a
    # "step" entry the format does not store: each parameter gets its own copy, and that copy is the value.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def own_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].detach().clone()
            tensors = {**tensors, "step": state["step"]}
        return set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = own_step


def resave_optimizer(model, ours: str, root: str, args: argparse.Namespace) -> None:
    """Our torch_dist save with its optimizer state (`ours`) loaded into `model` (this TP; the other ranks data
    parallel) inside Megatron Core's DDP and distributed optimizer, then saved by Megatron Core in both its layouts
    (`root`_fully_reshardable, `root`_dp_reshardable)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    training_cpu_stand_ins()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.01, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp])
    for inner in opt.chained_optimizers:  # torch's AdamW has no state before a step (Megatron Core's own helper)
        inner._init_optimizer_states_with_dummy_values()
    msd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": msd, "optimizer": opt.sharded_state_dict(
        msd, is_loading=True, metadata=OPT_META)}, ours)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    for kind in ("dp_reshardable", "fully_reshardable"):
        iter_dir = os.path.join(f"{root}_{kind}", f"iter_{SAVE_AT:07d}")
        if dist.get_rank() == 0:
            os.makedirs(iter_dir, exist_ok=True)
        dist.barrier()
        msd = model.sharded_state_dict()
        dist_checkpointing.save({"model": msd, "optimizer": opt.sharded_state_dict(msd, metadata={
            "distrib_optim_sharding_type": kind}), "args": args, "checkpoint_version": 3.0, "iteration": SAVE_AT},
            iter_dir)


def trainer(family: str = "gpt"):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build(family, parallel_output=True)
    randomize(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.01, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def train_step(ddp, opt, batch) -> float:
    """One step on this data-parallel rank's half of the batch; the loss averaged over the data-parallel ranks."""
    dp, r = mps.get_data_parallel_world_size(), mps.get_data_parallel_rank()
    ids = batch[2 * r:2 * r + 2]
    tokens, labels = ids[:, :-1], ids[:, 1:]
    ddp.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    loss = ddp(tokens, pos, mask, labels=labels).mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return float(loss) / dp


RNG_SEEDS = (41, 42, 43)  # python, numpy, torch generators just before the save


def megatron_lm_rng(seed: bool = True):
    """The RNG state as Megatron-LM 0.16's training/checkpointing.py get_rng_state builds it with torch_dist, to save
    or (as the template its load_checkpoint passes to dist_checkpointing.load) to load (megatron-core has no training
    loop): a ShardedObject 'rng_state' over (PP, TP), each the list of one RNG dict; the CUDA generator states
    (16-byte Philox states on a GPU) stood in for by tensors of that shape. `seed`: the generators seeded first."""
    import random

    import numpy as np

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if seed:
        random.seed(RNG_SEEDS[0])
        np.random.seed(RNG_SEEDS[1])
        torch.manual_seed(RNG_SEEDS[2])
    philox = torch.arange(16, dtype=torch.uint8)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": philox,
            "rng_tracker_states": {"model-parallel-rng": philox + 1}}]
    pp, tp = mps.get_pipeline_model_parallel_world_size(), mps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", rng, (pp, tp), (mps.get_pipeline_model_parallel_rank(),
                         mps.get_tensor_model_parallel_rank()), replica_id=mps.get_data_parallel_rank())


def restore_megatron_lm_rng(loaded: dict) -> dict:
    """What Megatron-LM 0.16's load_checkpoint does with a torch_dist checkpoint's RNG state (it loads it only when
    the saved TP x PP equals the run's and the saving run did not pass --no-save-rng): entry 0 of the rank's list
    (no --data-parallel-random-init) into the python, numpy and torch generators and, through
    convert_cuda_rng_state, the RNG tracker (an empty tracker state is its error). The CUDA generator is skipped:
    there is none here (a CPU run records None). Returns draws of each generator and the tracker states."""
    import random

    import numpy as np

    from megatron.core import tensor_parallel

    args = loaded["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (
        mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size())
    assert not getattr(args, "no_save_rng", False)
    rng = loaded["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    if not rng["rng_tracker_states"]:
        raise KeyError("rng_tracker_states")
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: tensor_parallel.convert_cuda_rng_state(v, to_graphable=False)
                        for k, v in rng["rng_tracker_states"].items()})
    return {"draws": (random.random(), float(np.random.random_sample()), float(torch.rand(()))),
            "tracker": dict(tracker.get_states()), "cuda_rng_state": rng["cuda_rng_state"]}


def train(job: dict) -> None:
    training_cpu_stand_ins()
    mps.initialize_model_parallel(1, 1)
    data = torch.load("batches.pt")
    model, ddp, opt = trainer()
    losses = []
    for step in range(len(data)):
        losses.append(train_step(ddp, opt, data[step]))
        if step + 1 == SAVE_AT:
            for root, meta in ((os.path.join("out", "train"), OPT_META), (os.path.join("out", "train_dp"), {})):
                iter_dir = os.path.join(root, f"iter_{SAVE_AT:07d}")  # the second: Megatron-LM's default layout
                if dist.get_rank() == 0:
                    os.makedirs(iter_dir, exist_ok=True)
                dist.barrier()
                msd = model.sharded_state_dict()
                dist_checkpointing.save({"model": msd, "optimizer": opt.sharded_state_dict(msd, metadata={
                    "distrib_optim_sharding_type": "dp_reshardable", **meta}), "args": megatron_lm_args("gpt", 1, 1),
                    "checkpoint_version": 3.0, "iteration": SAVE_AT, "rng_state": megatron_lm_rng()}, iter_dir)
                if dist.get_rank() == 0:
                    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                        f.write(str(SAVE_AT))
    result = {"losses": losses}
    if job.get("ours_train"):
        model, ddp, opt = trainer()
        for inner in opt.chained_optimizers:  # torch's AdamW has no state before a step (Megatron Core's own helper)
            inner._init_optimizer_states_with_dummy_values()
        msd = model.sharded_state_dict()
        loaded = dist_checkpointing.load({"model": msd, "optimizer": opt.sharded_state_dict(
            msd, is_loading=True, metadata=OPT_META), "rng_state": megatron_lm_rng(seed=False)}, job["ours_train"])
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        result["ours_rng"] = restore_megatron_lm_rng(loaded)
        result["ours_resumed"] = [train_step(ddp, opt, data[step]) for step in range(SAVE_AT, len(data))]
    if dist.get_rank() == 0:
        torch.save(result, os.path.join("out", "train_losses.pt"))
    mps.destroy_model_parallel()
    for family, name, (tp, pp) in (("gpt", "tp2", (2, 1)), ("gpt", "pp2", (1, 2)), ("llama", "tp2", (2, 1))):
        # one distributed-optimizer state (random Adam moments) saved in both layouts, at TP2 / PP2 (tied embeddings
        # in a bucket of their own on both stages)
        mps.initialize_model_parallel(tp, pp)
        model, ddp, opt = trainer(family)
        torch.manual_seed(1 + mps.get_tensor_model_parallel_rank() + 10 * mps.get_pipeline_model_parallel_rank())
        for inner in opt.chained_optimizers:
            inner._init_optimizer_states_with_dummy_values()
            for state in inner.optimizer.state.values():
                for key, value in state.items():
                    if key != "step" and torch.is_tensor(value):
                        value.copy_(torch.rand_like(value) if key == "exp_avg_sq" else torch.randn_like(value))
        for kind in ("dp_reshardable", "fully_reshardable"):
            iter_dir = os.path.join("out", "layouts", f"{family}_{name}_{kind}", f"iter_{SAVE_AT:07d}")
            if dist.get_rank() == 0:
                os.makedirs(iter_dir, exist_ok=True)
            dist.barrier()
            msd = model.sharded_state_dict()
            dist_checkpointing.save({"model": msd, "optimizer": opt.sharded_state_dict(msd, metadata={
                "distrib_optim_sharding_type": kind}), "args": megatron_lm_args(family, tp, pp),
                "checkpoint_version": 3.0, "iteration": SAVE_AT}, iter_dir)
        mps.destroy_model_parallel()


def main() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    # without Transformer Engine the router's GEMM helper never gets defined (Megatron Core 0.16.1 tests its name)
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    job = json.load(open("job.json"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for family in job["families"]:
        out = os.path.join("out", family)
        mps.initialize_model_parallel(1, 1)
        model = build(family)
        randomize(model)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            torch.save(logits_of(model), os.path.join(out, "logits.pt"))
        save_torch(model, os.path.join(out, "torch_tp1"), family)
        save_dist(model, os.path.join(out, "dist_tp1"), family)
        source = os.path.join(out, "dist_tp1", f"iter_{ITER:07d}")
        ours = job.get("ours", {}).get(family)
        if ours:
            fresh = build(family)
            load_dist(fresh, ours)
            if rank == 0:
                torch.save(logits_of(fresh), os.path.join(out, "ours_logits_tp1.pt"))
        mps.destroy_model_parallel()
        for name, (tp, pp, *ep) in FAMILIES[family].get("layouts", (("tp2", (2, 1)), ("pp2", (1, 2)))):
            mps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep[0] if ep else 1)
            model = build(family)
            load_dist(model, source)
            save_torch(model, os.path.join(out, f"torch_{name}"), family)
            save_dist(model, os.path.join(out, f"dist_{name}"), family)
            if ours and tp == 2:
                fresh = build(family)
                load_dist(fresh, ours)
                logits = logits_of(fresh)
                if rank == 0:
                    torch.save(logits, os.path.join(out, "ours_logits_tp2.pt"))
            mps.destroy_model_parallel()
    if job.get("ours", {}).get("moe_mixed"):
        mixed_run(job["ours"]["moe_mixed"])
    for family in ("deepseek", "mtp_moe"):
        if job.get("ours", {}).get(family):
            mtp_family_run(family, job["ours"][family])
    if job.get("bert"):
        bert_run(job.get("ours", {}).get("bert"))
    if job.get("t5"):
        t5_run(job.get("ours", {}).get("t5"), job.get("ours", {}).get("t5_pp2"))
    if job.get("train"):
        train(job)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
