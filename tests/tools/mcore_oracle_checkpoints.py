"""Run by tests/tools/test_checkpoint_mcore.py under megatron-core 0.16.1 (never imported by this repository's code).

On 2 gloo processes, for a tiny GPT (LayerNorm, GeLU, learned positions, tied embeddings) and a tiny Llama (RMSNorm,
SwiGLU, RoPE, GQA, no biases, untied): builds Megatron Core's GPTModel (local layer spec) at TP1 with random weights,
writes its logits on fixed tokens, saves it as `torch` (per-rank files with Core names, as Megatron-LM's
`--ckpt-format torch`) and `torch_dist` (dist_checkpointing.save) at TP1, then rebuilds it at TP2 and PP2 (weights
loaded by dist_checkpointing from the TP1 folder) and saves both formats there too. When `ours/<family>` holds a
torch_dist checkpoint written by our code, it is loaded with dist_checkpointing.load into Core models at TP1 and TP2
and their logits are written. Inputs and outputs: the folder it runs in (see job.json). The test prepends
tests/mcore_oracle.py's ORACLE_CPU_PRELUDE (the CPU stand-ins).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mps

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


def megatron_lm_args(family: str, tp: int, pp: int) -> argparse.Namespace:
    """The fields of Megatron-LM's args namespace that describe the model (what its checkpoints hold)."""
    return argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=None,
                              max_position_embeddings=SEQ, seq_length=SEQ, padded_vocab_size=VOCAB,
                              make_vocab_size_divisible_by=128, norm_epsilon=1e-5, bias_activation_fusion=False,
                              openai_gelu=False, squared_relu=False, add_qkv_bias=False, rotary_percent=1.0,
                              apply_layernorm_1p=False, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, iteration=ITER, consumed_train_samples=80,
                              consumed_valid_samples=0, tokenizer_type="NullTokenizer",
                              **FAMILIES[family]["args"])


def build(family: str, parallel_output: bool = False) -> GPTModel:
    spec = FAMILIES[family]
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            pipeline_dtype=torch.float32, tensor_model_parallel_size=mps.get_tensor_model_parallel_world_size(),
                            pipeline_model_parallel_size=mps.get_pipeline_model_parallel_world_size(),
                            **spec["config"])
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
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


def save_torch(model: GPTModel, root: str, family: str) -> None:
    tp, pp = mps.get_tensor_model_parallel_world_size(), mps.get_pipeline_model_parallel_world_size()
    if mps.get_data_parallel_rank() == 0:
        t, p = mps.get_tensor_model_parallel_rank(), mps.get_pipeline_model_parallel_rank()
        sub = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        path = os.path.join(root, f"iter_{ITER:07d}", sub, "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": model.state_dict_for_save_checkpoint(), "args": megatron_lm_args(family, tp, pp),
                    "checkpoint_version": 3.0, "iteration": ITER}, path)
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


def main() -> None:
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
        for name, (tp, pp) in (("tp2", (2, 1)), ("pp2", (1, 2))):
            mps.initialize_model_parallel(tp, pp)
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
