"""Megatron-LM's mixture-of-experts settings (its ``_add_moe_args``: same names, defaults and choices)."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from typing import Any, ClassVar, List, Optional, Union

from megatron.settings.declare import ConfigField, setting


def moe_freq_type(text: str) -> Union[int, List[int]]:
    """--moe-layer-freq: an int N (every N-th layer is MoE) or a Python list expression such as "([1]*3+[0])*2"."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        value = ast.literal_eval(text) if text.startswith("[") else _eval_pattern(text)
    except (ValueError, SyntaxError) as exc:
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} is neither an int nor a list pattern") from exc
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} must give a list of 0/1 (one per layer)")
    return value


def _eval_pattern(text: str) -> Any:
    """Evaluate a pattern made only of list literals of 0/1, +, * and integers (never arbitrary code)."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.List, ast.Constant, ast.Load)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or (isinstance(node, ast.Constant) and not isinstance(node.value, int)):
            raise ValueError("unsupported element")
    return eval(compile(tree, "<moe-layer-freq>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 (checked AST)


_RESTORE_NUM_MOE_EXPERTS = (("num_experts", lambda v: v),)


@dataclasses.dataclass
class MoESettings:
    """--help group "moe"."""

    TITLE: ClassVar[str] = "moe"
    expert_model_parallel_size: int = setting("--expert-model-parallel-size", default=1,
        help="Degree of expert model parallelism.", config=True, restore_if_unset=True)
    expert_tensor_parallel_size: Optional[int] = setting("--expert-tensor-parallel-size",
        help="Tensor parallelism inside the experts (default: --tensor-model-parallel-size).",
        read_by="megatron/settings/moe_checks.py", restore_if_unset=True)
    num_experts: Optional[int] = setting("--num-experts", help="Experts per MoE layer (None: no MoE).",
        config=ConfigField("num_moe_experts", arch=33, kept=31, hint="--num-experts", restore=_RESTORE_NUM_MOE_EXPERTS))
    moe_layer_freq: Union[int, List[int]] = setting("--moe-layer-freq", default=1, type=moe_freq_type,
        help="MoE layer every N layers, or a 0/1 list pattern such as \"([1]*3+[0]*1)*3\".", config=True, arch=36, kept=44)
    moe_ffn_hidden_size: Optional[int] = setting("--moe-ffn-hidden-size",
        help="Inner size of each expert (default --ffn-hidden-size).", config=True, arch=34, kept=32)
    moe_shared_expert_intermediate_size: Optional[int] = setting("--moe-shared-expert-intermediate-size",
        help="Total inner size of the shared expert(s); None: no shared expert.", config=True, arch=37, kept=45)
    moe_shared_expert_gate: bool = setting("--moe-shared-expert-gate", default=False,
        help="Gate the shared expert's output with sigmoid(x . w) (Qwen2-MoE; Megatron-LM core's "
             "moe_shared_expert_gate).", config=True, arch=38, kept=46)
    moe_shared_expert_overlap: bool = setting("--moe-shared-expert-overlap", default=False,
        help="Overlap the shared expert with dispatch (same numbers on CPU).",
        variant="overlaps the shared expert with dispatch on GPU; the shared expert's output is the same (only the "
                "order of gradient additions differs)")
    moe_grouped_gemm: bool = setting("--moe-grouped-gemm", default=False,
        help="Grouped GEMM for the experts (always batched here).",
        variant="the experts always run as one batched GEMM per projection (megatron/layers/moe.py)")
    moe_use_legacy_grouped_gemm: bool = setting("--moe-use-legacy-grouped-gemm", default=False,
        help="Legacy GroupedMLP (same numbers).",
        variant="one expert implementation (batched GEMM); legacy or TE grouped GEMM alike")
    moe_layer_recompute: bool = setting("--moe-layer-recompute", default=False,
        help="Recompute the MoE layer in backward.", refused="is not implemented (use --recompute-granularity full)")
    moe_extended_tp: bool = setting("--moe-extended-tp", default=False,
        help="Deprecated: use --expert-tensor-parallel-size.",
        refused="is deprecated in Megatron-LM and not implemented")
    moe_use_upcycling: bool = setting("--moe-use-upcycling", default=False, help="Upcycle a dense checkpoint to MoE.",
        refused="(dense -> MoE upcycling) is not implemented")
    moe_router_load_balancing_type: Union[str, List[str]] = setting("--moe-router-load-balancing-type",
        default="aux_loss", type=str, choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        nargs="+", help="Load balancing: aux_loss (GShard/Switch), seq_aux_loss (per sequence), sinkhorn, none.",
        config=True, arch=42, kept=34)
    moe_router_dtype: Optional[str] = setting("--moe-router-dtype", choices=["fp32", "fp64"],
        help="Dtype of the routing computation.", config=True, arch=43, kept=40)
    moe_router_fusion: bool = setting("--moe-router-fusion", default=False,
        help="Fused top-k routing kernels (same numbers).",
        variant="picks TE's fused top-k/aux-loss kernels; the routing is the same")
    moe_router_score_function: str = setting("--moe-router-score-function", default="softmax",
        choices=["softmax", "sigmoid"], help="Score function for top-k routing.", config=True, arch=40, kept=38)
    moe_router_topk: int = setting("--moe-router-topk", default=2, help="Experts per token.", config=True, arch=35, kept=33)
    moe_router_pre_softmax: bool = setting("--moe-router-pre-softmax", default=False,
        help="Softmax before the top-k selection (default: softmax over the k chosen logits).", config=True, arch=39, kept=37)
    moe_router_num_groups: Optional[int] = setting("--moe-router-num-groups",
        help="Group-limited routing: the experts in this many equal groups (DeepSeek's n_group; needs "
             "--moe-router-group-topk).", config=True, arch=66, kept=66)
    moe_router_group_topk: Optional[int] = setting("--moe-router-group-topk",
        help="Groups each token may use, ranked by the sum of their top-(topk/group-topk) scores (DeepSeek's "
             "topk_group).", config=True, arch=67, kept=67)
    moe_router_topk_scaling_factor: Optional[float] = setting("--moe-router-topk-scaling-factor",
        help="Scaling factor of the routing weights (with --moe-router-pre-softmax).", config=True, arch=41, kept=39)
    moe_router_enable_expert_bias: bool = setting("--moe-router-enable-expert-bias", default=False,
        help="Aux-loss-free load balancing: experts chosen by sigmoid score + a per-expert bias (saved as "
             "mlp.router.expert_bias) updated after every iteration.", config=True, arch=68, kept=68)
    moe_router_bias_update_rate: float = setting("--moe-router-bias-update-rate", default=0.001,
        help="Expert bias update rate: bias += rate * sign(mean tokens - tokens of the expert).", config=True)
    moe_router_force_load_balancing: bool = setting("--moe-router-force-load-balancing", default=False,
        help="Random logits for benchmarking.", refused="(random benchmark routing) is not implemented")
    moe_router_padding_for_fp8: bool = setting("--moe-router-padding-for-fp8", default=False,
        help="Pad the routing map for FP8.", refused="is an FP8 setting; FP8 is not supported")
    moe_aux_loss_coeff: Union[float, List[float]] = setting("--moe-aux-loss-coeff", default=0.0, type=float, nargs="+",
        help="Coefficient of the load-balancing loss (1e-2 is a good start).", config=True, kept=35)
    moe_z_loss_coeff: Optional[float] = setting("--moe-z-loss-coeff", help="Coefficient of the router z-loss.",
        config=True, kept=36)
    moe_input_jitter_eps: Optional[float] = setting("--moe-input-jitter-eps", help="Multiplicative input jitter.",
        refused="(input jitter) is not implemented")
    moe_per_layer_logging: bool = setting("--moe-per-layer-logging", default=False,
        help="TensorBoard scalars of the aux losses per layer.", config=True)
    moe_token_dispatcher_type: str = setting("--moe-token-dispatcher-type", default="allgather",
        choices=["allgather", "alltoall", "flex"],
        help="Token dispatcher (allgather and alltoall give the same numbers).", config=True, restore_if_unset=True)
    moe_enable_deepep: bool = setting("--moe-enable-deepep", default=False, help="DeepEP dispatch (flex dispatcher).",
        refused="(DeepEP) needs CUDA; not supported")
    moe_deepep_num_sms: int = setting("--moe-deepep-num-sms", default=20, help="SMs for DeepEP.",
        refused="(DeepEP) needs CUDA; not supported")
    moe_permute_fusion: bool = setting("--moe-permute-fusion", default=False,
        help="Fused token permutation (same numbers).",
        variant="picks TE's fused permutation kernel; the permutation is the same")
    moe_expert_capacity_factor: Optional[float] = setting("--moe-expert-capacity-factor",
        help="Expert capacity factor; None: no token is dropped.", config=True, arch=44, kept=41)
    moe_pad_expert_input_to_capacity: bool = setting("--moe-pad-expert-input-to-capacity", default=False,
        help="Pad every expert's input to the capacity (needs --moe-expert-capacity-factor).", config=True, arch=46, kept=43)
    moe_token_drop_policy: str = setting("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
        help="Drop the lowest-probability tokens (probs) or the latest ones (position).", config=True, arch=45, kept=42)
    moe_apply_probs_on_input: bool = setting("--moe-apply-probs-on-input", default=False,
        help="Apply the routing weight to the expert input (top-1).", config=True, arch=47, kept=47)
    overlap_moe_expert_parallel_comm: bool = setting("--overlap-moe-expert-parallel-comm", default=False,
        help="Overlap the expert-parallel all-to-all with compute.",
        refused="needs expert parallelism on GPUs; not supported")
    delay_wgrad_compute: bool = setting("--delay-wgrad-compute", default=False, help="Delay weight-gradient compute.",
        refused="is not implemented")
    moe_upcycling_granularity: int = setting("--moe-upcycling-granularity", default=1,
        help="Granular upcycling factor.", refused="(upcycling) is not implemented")
    moe_pad_experts_for_cuda_graph_inference: bool = setting("--moe-pad-experts-for-cuda-graph-inference",
        default=False, help="Drop-and-pad routing during CUDA-graph decoding.",
        refused="is a CUDA-graph setting; not supported")
