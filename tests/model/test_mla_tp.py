"""Multi-latent attention under tensor parallelism (2 gloo processes): a TP=2 model, with and without sequence
parallelism, equals TP=1 from the same seed: weights at initialisation (the up/output projections split over heads,
the down projections replicated), logits, loss, every gradient (the replicated down projections' and latent norms'
summed over TP as training does under SP), and greedy KV-cache generation under TP=2 and TP=2 + SP (the latent cache)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import get_tp_layout
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.text_generation.generation import generate_tokens
from tests.dist_utils import run_distributed
from tests.model.helpers import batch, build_gpt, reference_pass, tiny_config

SEED = 2024
TOL = dict(rtol=1e-5, atol=1e-5)
PROMPTS = [[5, 17, 33], [9, 2, 60, 40, 3, 58, 12]]


def mla_config(**overrides):
    kw = dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
              add_bias_linear=False, swiglu=True, ffn_hidden_size=24, q_lora_rank=24, kv_lora_rank=16,
              qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, max_position_embeddings=32, init_method_std=0.1,
              share_embeddings_and_output_weights=False)
    kw.update(overrides)
    return tiny_config(**kw)


def gather_shards(t: torch.Tensor, layout, group) -> torch.Tensor:
    """The full tensor of a TP-split parameter (or the replicated one)."""
    if layout.replicated:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return layout.merge(parts)


def greedy(model) -> torch.Tensor:
    return generate_tokens(model, PROMPTS, 6, eod_id=63, greedy=True, use_eod_token_for_early_termination=False).tokens


def tp2_worker(rank: int, world_size: int, ref_state, ref_logits, ref_loss, ref_grads, ref_tokens) -> list:
    done = []
    for sp in (False, True):
        state = initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            config = mla_config(tensor_model_parallel_size=2, sequence_parallel=sp)
            model = build_gpt(config, seed=SEED, tp_rank=state.tp_rank, pp_state=state)
            expected = split_tensor_parallel_state_dict(ref_state, 2, config=config)[state.tp_rank]
            for name, value in model.state_dict().items():
                assert torch.equal(value, expected[name]), name
            ids, pos, mask, labels = batch()
            model.parallel_output = False
            torch.testing.assert_close(model(ids, pos, mask), ref_logits, **TOL)
            model.parallel_output = True
            loss = model(ids, pos, mask, labels=labels)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            loss.mean().backward()
            for name, p in model.named_parameters():
                g = p.grad.clone()
                if sp and getattr(p, "sequence_parallel", False):
                    dist.all_reduce(g, group=state.tp_group)
                torch.testing.assert_close(gather_shards(g, get_tp_layout(p), state.tp_group), ref_grads[name],
                                           **TOL, msg=name)
            assert torch.equal(greedy(model.eval()), ref_tokens)  # under SP generation runs without the split
            done.append(sp)
        finally:
            destroy_model_parallel()
    return done


def test_tp2_and_sp_equal_tp1():
    ref = build_gpt(mla_config(), seed=SEED)
    logits, loss, grads = reference_pass(ref, batch())
    tokens = greedy(build_gpt(mla_config(), seed=SEED).eval())
    results = run_distributed(tp2_worker, 2, args=(ref.state_dict(), logits, loss, grads, tokens))
    assert results == [[False, True], [False, True]]
