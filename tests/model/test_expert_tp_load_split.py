"""A Megatron Core / torch_dist checkpoint loaded under --expert-tensor-parallel-size != TP
(megatron/checkpoint/formats.rank_piece): the dense weights get this rank's TP slice, the experts this rank's
expert-TP slice (whole experts with expert-TP 1 under TP 2; the TP slice when expert-TP = TP). No processes."""
from __future__ import annotations

import torch

from megatron.checkpoint.formats import rank_piece
from megatron.core.parallel_state import ParallelState
from megatron.model.tp_shards import split_tensor_parallel_state_dict, tensor_parallel_layouts
from tests.model.helpers import build_gpt, tiny_config


def test_experts_split_over_the_expert_tensor_parallel_group() -> None:
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, ffn_hidden_size=48,
                         swiglu=True)
    model = build_gpt(config)
    full = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    expert = next(k for k in full if k.endswith(".mlp.experts.weight1"))
    dense = next(k for k in full if k.endswith("self_attention.query_key_value.weight"))
    tp_split = split_tensor_parallel_state_dict(full, 2, layouts=tensor_parallel_layouts(model))
    for rank in range(2):
        same = ParallelState(tp_size=2, tp_rank=rank)  # expert-TP = TP (its default)
        etp1 = ParallelState(tp_size=2, tp_rank=rank, etp_size=1, etp_rank=0)
        piece = rank_piece(full, full, model, config.num_layers, 0, same)
        assert torch.equal(piece[expert], tp_split[rank][expert]) and piece[expert].shape != full[expert].shape
        piece = rank_piece(full, full, model, config.num_layers, 0, etp1)
        assert torch.equal(piece[expert], full[expert])  # whole experts on each TP rank
        assert torch.equal(piece[dense], tp_split[rank][dense])  # dense weights still split over TP
