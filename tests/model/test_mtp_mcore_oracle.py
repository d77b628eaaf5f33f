"""Multi-token prediction against NVIDIA megatron-core 0.16.1's GPTModel with its MultiTokenPredictionBlock (the
oracle, local non-Transformer-Engine spec, run on CPU in a subprocess) from the same weights: the per-token LM loss,
each depth's MTP loss as Megatron's MTPLossLoggingHelper records it, and every parameter's gradient after backward of
the masked mean LM loss (into which the MTP losses enter through their auto-scaler), 1e-5. Cases: untied SwiGLU +
GQA + RMSNorm with two depths and a partial loss mask; tied LayerNorm + GeLU + biases with one depth; a first-k-dense
MoE model whose MTP layer is MoE (its router's losses recorded after the decoder's layers, as Megatron-LM counts)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.core import aux_losses
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.mcore_names import ours_to_core
from megatron.models.gpt.model import GPTModel
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

pytestmark = pytest.mark.slow

H, FFN, HEADS, VOCAB, SEQ, BATCH, LAYERS = 32, 64, 4, 64, 16, 2, 2
CASES = {
    "untied_swiglu_gqa_d2": dict(depths=2, factor=0.3, tied=False, rms=True, glu=True, bias=False, groups=2,
                                 mask=True),
    "tied_gelu_bias_d1": dict(depths=1, factor=0.1, tied=True, rms=False, glu=False, bias=True, groups=None,
                              mask=False),
    # first layer dense, the second and the MTP layer MoE (top-2 of 4, load-balancing loss and z-loss)
    "moe_first_dense_d1": dict(depths=1, factor=0.2, tied=False, rms=True, glu=True, bias=False, groups=None,
                               mask=True, moe=True),
}
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[0, 1], moe_aux_loss_coeff=0.01,
           moe_z_loss_coeff=1e-3, moe_ffn_hidden_size=48)

ORACLE_SCRIPT = ORACLE_CPU_PRELUDE + r'''
import json, os
import torch
import torch.distributed as dist
import torch.nn.functional as F

if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.transformer.transformer_config import TransformerConfig

    dims = json.load(open("dims.json"))
    moe = json.load(open("moe.json"))
    for name, kw in json.load(open("cases.json")).items():
        cfg = TransformerConfig(
            num_layers=dims["layers"], hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
            ffn_hidden_size=dims["ffn"], num_query_groups=kw["groups"],
            normalization="RMSNorm" if kw["rms"] else "LayerNorm", gated_linear_unit=kw["glu"],
            activation_func=F.silu if kw["glu"] else F.gelu, add_bias_linear=kw["bias"],
            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
            mtp_num_layers=kw["depths"], mtp_loss_scaling_factor=kw["factor"],
            **(dict(moe, moe_token_dispatcher_type="allgather") if kw.get("moe") else {}))
        layer_spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=cfg.normalization)
                      if kw.get("moe") else get_gpt_layer_local_spec(normalization=cfg.normalization))
        model = GPTModel(cfg, layer_spec, dims["vocab"], dims["seq"], share_embeddings_and_output_weights=kw["tied"],
                         position_embedding_type="rope",
                         mtp_block_spec=get_gpt_mtp_block_spec(cfg, layer_spec, use_transformer_engine=False))
        weights = torch.load(name + "_weights.pt")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        batch = torch.load(name + "_batch.pt")
        model.train()
        MTPLossLoggingHelper.tracker.clear()
        moe_utils.clear_aux_losses_tracker()
        losses = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"],
                       loss_mask=batch["loss_mask"])
        lm = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        lm.backward()
        router = {k: v["values"].clone() for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()
                  if v["values"].abs().sum() > 0}
        torch.save({"losses": losses.detach(), "mtp": MTPLossLoggingHelper.tracker["values"].clone(),
                    "router": router,
                    "grads": {k: p.grad for k, p in model.named_parameters() if p.grad is not None}},
                   name + "_out.pt")
'''


def _config(kw: dict) -> TransformerConfig:
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, padded_vocab_size=VOCAB,
        max_position_embeddings=SEQ, position_embedding_type="rope", normalization="RMSNorm" if kw["rms"] else
        "LayerNorm", swiglu=kw["glu"], bias_gelu_fusion=False, add_bias_linear=kw["bias"],
        group_query_attention=kw["groups"] is not None, num_query_groups=kw["groups"],
        share_embeddings_and_output_weights=kw["tied"], hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=kw["depths"], mtp_loss_scaling_factor=kw["factor"], **(MOE if kw.get("moe") else {}))


def _batch(kw: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(BATCH, SEQ)
    if kw["mask"]:
        loss_mask[0, 3:6] = 0
        loss_mask[1, -2:] = 0
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "positions": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous(),
            "mask": torch.ones(1, 1, SEQ, SEQ).triu(1).bool(), "loss_mask": loss_mask}


def _ours(model: GPTModel, batch: dict) -> dict:
    model.train()
    aux_losses.clear()
    losses = model(batch["tokens"], batch["positions"], batch["mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    ((losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    tracked = aux_losses.tracked()
    mtp = torch.cat([tracked[f"mtp_{k + 1} loss"] for k in range(model.config.mtp_num_layers)])
    grads = ours_to_core({k: p.grad for k, p in model.named_parameters()})
    router = {k: v for k, v in tracked.items() if not k.startswith("mtp_")}
    return {"losses": losses.detach(), "mtp": mtp, "grads": grads, "router": router}


def test_mtp_losses_and_grads_equal_megatron_core(tmp_path):
    ours = {}
    for i, (name, kw) in enumerate(CASES.items()):
        torch.manual_seed(100 + i)
        model = GPTModel(_config(kw))
        batch = _batch(kw, 200 + i)
        torch.save(ours_to_core(model.state_dict()), tmp_path / f"{name}_weights.pt")
        torch.save(batch, tmp_path / f"{name}_batch.pt")
        ours[name] = _ours(model, batch)
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    (tmp_path / "moe.json").write_text(json.dumps(MOE))
    (tmp_path / "dims.json").write_text(json.dumps(dict(layers=LAYERS, hidden=H, heads=HEADS, ffn=FFN, vocab=VOCAB,
                                                        seq=SEQ)))
    run_oracle(ORACLE_SCRIPT, tmp_path)
    for name, kw in CASES.items():
        ref = torch.load(tmp_path / f"{name}_out.pt")
        got = ours[name]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=0, atol=1e-5, msg=name)
        assert ref["mtp"].shape == (kw["depths"],)
        torch.testing.assert_close(got["mtp"], ref["mtp"], rtol=0, atol=1e-5, msg=name)
        # the routers' losses: the MTP layer's recorded after the decoder's layers (Megatron-LM's count)
        assert set(got["router"]) == set(ref["router"]) == ({"load_balancing_loss", "z_loss"} if kw.get("moe")
                                                             else set())
        for key, values in ref["router"].items():
            assert values.shape == (LAYERS + kw["depths"],) and values[-1] > 0
            torch.testing.assert_close(got["router"][key], values, rtol=0, atol=1e-6, msg=f"{name}: {key}")
        assert set(got["grads"]) == set(ref["grads"]), (name, set(got["grads"]) ^ set(ref["grads"]))
        assert any(k.startswith("mtp.layers.") for k in ref["grads"])
        for key, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][key], grad, rtol=0, atol=1e-5, msg=f"{name}: {key}")
