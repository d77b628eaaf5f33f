"""--qk-layernorm under tensor parallelism: each TP rank normalises its own heads with the shared q/k norm weights,
so a rank's gradient of them is partial; finalize_model_grads sums it over TP (with and without sequence
parallelism, as Megatron Core) and the result equals the TP=1 model's gradient (2 gloo processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
from megatron.layers.tp_shards import split_tensor_parallel_state_dict
from tests.dist_utils import run_distributed
from tests.model.helpers import batch, build_gpt, tiny_config

QK = dict(qk_layernorm=True, normalization="RMSNorm", kv_channels=12, window_size=(3, 0))
NORMS = ("q_layernorm", "k_layernorm")


def _body(rank: int, world_size: int) -> dict:
    ids, pos, mask, labels = batch()
    ref = build_gpt(tiny_config(**QK), seed=5)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if any(n in name for n in NORMS):
                p.add_(0.3 * torch.randn_like(p))
    ref(ids, pos, mask, labels=labels).mean().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if any(k in n for k in NORMS)}
    out = {}
    for sp in (False, True):
        state = initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            model = build_gpt(tiny_config(tensor_model_parallel_size=2, sequence_parallel=sp, **QK), seed=5,
                              tp_rank=state.tp_rank, pp_state=state)
            model.load_state_dict(split_tensor_parallel_state_dict(ref.state_dict(), 2)[state.tp_rank])
            model(ids, pos, mask, labels=labels).mean().backward()
            partial = {n: p.grad.clone() for n, p in model.named_parameters() if n in ref_grads}
            finalize_model_grads([model], state, sequence_parallel=sp)
            summed = {n: p.grad for n, p in model.named_parameters() if n in ref_grads}
            out[sp] = {"partial_differs": max((partial[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                       "summed_error": max((summed[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                       "names": len(ref_grads)}
            dist.barrier()
        finally:
            destroy_model_parallel()
    return out


def test_qk_norm_grads_are_summed_over_tensor_parallel_ranks() -> None:
    for result in run_distributed(_body, world_size=2):
        for sp, r in result.items():
            assert r["names"] == 4  # q and k norms of 2 layers
            assert r["partial_differs"] > 1e-4, (sp, r)  # one rank's heads alone give another gradient
            assert r["summed_error"] <= 1e-5, (sp, r)


def test_deepspeed_with_tensor_parallel_qk_layernorm_is_refused_in_one_line() -> None:
    """DeepSpeed's engine does not sum the partial q/k norm grads over TP: refused at start-up (TP 1 is accepted)."""
    import pytest

    from megatron.arguments import parse_args, validated_args
    from megatron.errors import MegatronUserError

    def provider(parser):
        parser.add_argument_group(title="DeepSpeed").add_argument("--deepspeed", action="store_true")
        return parser

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --qk-layernorm --deepspeed")
    args = parse_args(provider, args=(base + " --tensor-model-parallel-size 2").split())
    args.world_size = 2
    with pytest.raises(MegatronUserError, match=r"^--qk-layernorm with --deepspeed runs at --tensor-model-parallel-size 1"):
        validated_args(args, deepspeed_step=lambda a: {})
    args = parse_args(provider, args=base.split())
    args.world_size = 1
    assert validated_args(args, deepspeed_step=lambda a: {}).qk_layernorm
