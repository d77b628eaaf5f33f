"""Tensor / sequence / pipeline parallel GPTModel equals the TP=1 model (4 gloo processes, one spawn).

Weights agree by construction (CPU initialisation of the full weight from the same seed); logits, per-token
loss and gathered gradients must match the single-process model within 1e-5.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import allreduce_embedding_grads
from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from megatron.models.gpt.model import GPTModel
from tests.dist_utils import run_distributed
from tests.model.helpers import batch, build_gpt, reference_pass, tiny_config

SEED = 1234
TOL = dict(rtol=1e-5, atol=1e-5)


def _gather_tp(t: torch.Tensor, p: torch.nn.Parameter, group) -> torch.Tensor:
    """Full (TP=1) tensor from this rank's shard of parameter `p`."""
    if not getattr(p, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=p.partition_dim)


def _shard(full: torch.Tensor, p: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    if not getattr(p, "tensor_model_parallel", False):
        return full
    return full.chunk(tp_size, dim=p.partition_dim)[tp_rank]


def _reference():
    ref = build_gpt(tiny_config(), seed=SEED)
    return (ref, *reference_pass(ref, batch()))


def _check_tensor_parallel(tp: int, sp: bool, ref_state, ref_logits, ref_loss, ref_grads) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
        model = build_gpt(config, seed=SEED, tp_rank=state.tp_rank, pp_state=state)
        # CPU initialisation: this rank's weights are exactly its shard of the TP=1 weights
        expected = split_tensor_parallel_state_dict(ref_state, tp)[state.tp_rank]
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), name
        ids, pos, mask, labels = batch()
        logits = model(ids, pos, mask)
        vocab_shard = ref_logits.chunk(tp, dim=-1)[state.tp_rank]
        torch.testing.assert_close(logits, vocab_shard, **TOL)
        model.parallel_output = False
        torch.testing.assert_close(model(ids, pos, mask), ref_logits, **TOL)
        model.parallel_output = True
        loss = model(ids, pos, mask, labels=labels)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.mean().backward()
        checked = 0
        for name, p in model.named_parameters():
            g = p.grad.clone()
            if getattr(p, "sequence_parallel", False) and sp:
                dist.all_reduce(g, group=state.tp_group)  # what training does for SP params
            torch.testing.assert_close(_gather_tp(g, p, state.tp_group), ref_grads[name], **TOL, msg=name)
            checked += 1
        return {"tp": tp, "sp": sp, "params_checked": checked}
    finally:
        destroy_model_parallel()


def _check_recompute_with_dropout(tp: int, sp: bool) -> dict:
    """Under TP (and SP) with dropout on, full and selective recomputation reproduce the plain run exactly."""
    state = initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        ids, pos, mask, labels = batch()
        runs = []
        variants = (
            {},
            dict(recompute_granularity="selective"),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                 distribute_saved_activations=True),
        )
        for extra in variants:
            config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp, hidden_dropout=0.2,
                                 attention_dropout=0.2, **extra)
            model = build_gpt(config, seed=SEED, tp_rank=state.tp_rank, pp_state=state)
            model_parallel_manual_seed(77, state.tp_rank)
            loss = model(ids, pos, mask, labels=labels)
            loss.mean().backward()
            runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        for loss, grads in runs[1:]:
            torch.testing.assert_close(loss, runs[0][0], rtol=0, atol=1e-6)
            for g, g0 in zip(grads, runs[0][1]):
                torch.testing.assert_close(g, g0, rtol=1e-5, atol=1e-6)
        return {"tp": tp, "sp": sp, "recompute_variants": len(runs) - 1}
    finally:
        destroy_model_parallel()


def _local_to_ref_name(name: str, layer_offset: int) -> str:
    if name == "word_embeddings.weight":
        return "language_model.embedding.word_embeddings.weight"
    if ".layers." in name:
        head, rest = name.split(".layers.", 1)
        idx, tail = rest.split(".", 1)
        return f"{head}.layers.{int(idx) + layer_offset}.{tail}"
    return name


def _check_pipeline(ref: GPTModel, ref_loss, ref_grads) -> dict:
    state = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    try:
        config = tiny_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        pre, post = state.is_pipeline_first_stage(), state.is_pipeline_last_stage()
        model_parallel_manual_seed(SEED + 100 * state.pp_rank, state.tp_rank)
        model = GPTModel(config, pp_state=state, pre_process=pre, post_process=post)
        # initialize_word_embeddings: the last stage's copy equals the first stage's initial embedding
        w = model.shared_embedding_or_output_weight().detach().clone()
        both = [torch.empty_like(w) for _ in range(2)]
        dist.all_gather(both, w, group=state.pp_group)
        assert torch.equal(both[0], both[1]), "last-stage word embedding copy differs from the first stage"
        assert post == hasattr(model, "word_embeddings")

        # load the reference weights (sharded) into this stage
        offset = state.pp_rank * (config.num_layers // 2)
        ref_sd = ref.state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_shard(ref_sd[_local_to_ref_name(name, offset)], p, state.tp_rank, 2))

        ids, pos, mask, labels = batch()
        h = config.hidden_size
        result = {"pp_rank": state.pp_rank}
        if pre:
            out = model(ids, pos, mask)
            dist.send(out.detach().contiguous(), state.pp_next_rank())
            grad = torch.empty_like(out)
            dist.recv(grad, state.pp_next_rank())
            out.backward(grad)
        else:
            recv = torch.empty(ids.size(1), ids.size(0), h)
            dist.recv(recv, state.pp_prev_rank())
            recv.requires_grad_(True)
            model.set_input_tensor(recv)
            loss = model(None, None, mask, labels=labels)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            loss.mean().backward()
            dist.send(recv.grad.contiguous(), state.pp_prev_rank())
            result["loss_checked"] = True
        allreduce_embedding_grads([model], state)  # what finalize_model_grads runs in training
        for name, p in model.named_parameters():
            full = _gather_tp(p.grad, p, state.tp_group)
            ref_name = _local_to_ref_name(name, offset)
            torch.testing.assert_close(full, ref_grads[ref_name], **TOL, msg=f"stage {state.pp_rank}: {name}")
        result["params_checked"] = sum(1 for _ in model.parameters())
        return result
    finally:
        destroy_model_parallel()


def _body(rank: int, world_size: int) -> list:
    ref, ref_logits, ref_loss, ref_grads = _reference()
    out = []
    for tp, sp in ((4, False), (2, False), (2, True)):
        out.append(_check_tensor_parallel(tp, sp, ref.state_dict(), ref_logits, ref_loss, ref_grads))
    out.append(_check_pipeline(ref, ref_loss, ref_grads))
    out.append(_check_recompute_with_dropout(2, False))
    out.append(_check_recompute_with_dropout(2, True))
    return out


def test_tp_sp_pp_match_single_process():
    results = run_distributed(_body, world_size=4)
    assert len(results) == 4
    for rank, res in enumerate(results):
        assert [(r["tp"], r["sp"]) for r in res[:3]] == [(4, False), (2, False), (2, True)]
        assert all(r["params_checked"] == 28 for r in res[:3])
        pipe = res[3]
        assert pipe["pp_rank"] == rank // 2
        if pipe["pp_rank"] == 1:
            assert pipe["loss_checked"]
            assert pipe["params_checked"] == 12 + 2 + 1  # one layer, final LN, word_embeddings copy
        else:
            assert pipe["params_checked"] == 2 + 12
        assert [(r["sp"], r["recompute_variants"]) for r in res[4:]] == [(False, 2), (True, 2)]
