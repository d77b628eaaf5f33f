"""Megatron-LM's mixture-of-experts flags (its ``_add_moe_args``, same names, defaults and choices) and their checks.

The architecture flags feed `TransformerConfig` fields (megatron/config_flags.py); the ones that only pick a kernel
or a communication pattern are same-result variants; the rest are refused at start-up with one line
(megatron/flag_registry.py).
"""
from __future__ import annotations

import argparse
import ast
from typing import Any, List, Union

from megatron.errors import ArgumentError


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


def add_moe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="moe")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="Degree of expert model parallelism.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor parallelism inside the experts (default: --tensor-model-parallel-size).")
    g.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (None: no MoE).")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="MoE layer every N layers, or a 0/1 list pattern such as \"([1]*3+[0]*1)*3\".")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Inner size of each expert (default --ffn-hidden-size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Total inner size of the shared expert(s); None: no shared expert.")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Gate the shared expert's output with sigmoid(x . w) (Qwen2-MoE; Megatron-LM core's "
                        "moe_shared_expert_gate).")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Overlap the shared expert with dispatch (same numbers on CPU).")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Grouped GEMM for the experts (always batched here).")
    g.add_argument("--moe-use-legacy-grouped-gemm", action="store_true", help="Legacy GroupedMLP (same numbers).")
    g.add_argument("--moe-layer-recompute", action="store_true", help="Recompute the MoE layer in backward.")
    g.add_argument("--moe-extended-tp", action="store_true", help="Deprecated: use --expert-tensor-parallel-size.")
    g.add_argument("--moe-use-upcycling", action="store_true", help="Upcycle a dense checkpoint to MoE.")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", type=str,
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"], default="aux_loss",
                   help="Load balancing: aux_loss (GShard/Switch), seq_aux_loss (per sequence), sinkhorn, none.")
    g.add_argument("--moe-router-dtype", type=str, choices=["fp32", "fp64"], default=None,
                   help="Dtype of the routing computation.")
    g.add_argument("--moe-router-fusion", action="store_true", help="Fused top-k routing kernels (same numbers).")
    g.add_argument("--moe-router-score-function", type=str, choices=["softmax", "sigmoid"], default="softmax",
                   help="Score function for top-k routing.")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax before the top-k selection (default: softmax over the k chosen logits).")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="Groups for group-limited routing.")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="Groups chosen per token.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Scaling factor of the routing weights (with --moe-router-pre-softmax).")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free load balancing with a dynamic expert bias.")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="Expert bias update rate.")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Random logits for benchmarking.")
    g.add_argument("--moe-router-padding-for-fp8", action="store_true", help="Pad the routing map for FP8.")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="Coefficient of the load-balancing loss (1e-2 is a good start).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Coefficient of the router z-loss.")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None, help="Multiplicative input jitter.")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="TensorBoard scalars of the aux losses per layer.")
    g.add_argument("--moe-token-dispatcher-type", type=str, choices=["allgather", "alltoall", "flex"],
                   default="allgather", help="Token dispatcher (allgather and alltoall give the same numbers).")
    g.add_argument("--moe-enable-deepep", action="store_true", help="DeepEP dispatch (flex dispatcher).")
    g.add_argument("--moe-deepep-num-sms", type=int, default=20, help="SMs for DeepEP.")
    g.add_argument("--moe-permute-fusion", action="store_true", help="Fused token permutation (same numbers).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Expert capacity factor; None: no token is dropped.")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to the capacity (needs --moe-expert-capacity-factor).")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                   help="Drop the lowest-probability tokens (probs) or the latest ones (position).")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="Apply the routing weight to the expert input (top-1).")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Overlap the expert-parallel all-to-all with compute.")
    g.add_argument("--delay-wgrad-compute", action="store_true", help="Delay weight-gradient compute.")
    g.add_argument("--moe-upcycling-granularity", type=int, default=1, help="Granular upcycling factor.")
    g.add_argument("--moe-pad-experts-for-cuda-graph-inference", action="store_true",
                   help="Drop-and-pad routing during CUDA-graph decoding.")
    return parser


def _single(args: argparse.Namespace, dest: str, flag: str) -> None:
    value = getattr(args, dest)
    if isinstance(value, list):
        if len(value) != 1:
            raise ArgumentError(f"{flag} takes one value here (one load-balancing type), got {value}")
        setattr(args, dest, value[0])


def validate_moe_args(args: argparse.Namespace) -> None:
    """One-line errors for MoE settings this build cannot run; normalises the one-element lists."""
    _single(args, "moe_router_load_balancing_type", "--moe-router-load-balancing-type")
    _single(args, "moe_aux_loss_coeff", "--moe-aux-loss-coeff")
    if args.num_experts is None:
        if args.expert_model_parallel_size != 1:
            raise ArgumentError("--expert-model-parallel-size needs --num-experts (experts to shard)")
        return
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # Megatron-LM's default
    if args.moe_router_load_balancing_type == "global_aux_loss":
        raise ArgumentError("--moe-router-load-balancing-type global_aux_loss is not implemented; use aux_loss, "
                            "seq_aux_loss, sinkhorn or none")
    if args.moe_token_dispatcher_type == "flex":
        raise ArgumentError("--moe-token-dispatcher-type flex (DeepEP) is not implemented; use allgather or alltoall")
    if args.add_bias_linear:
        raise ArgumentError("--num-experts needs --disable-bias-linear (Megatron-LM core's experts have no bias)")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ArgumentError("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                            "(as Megatron-LM)")
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    etp = args.expert_tensor_parallel_size
    if etp != tp:
        _check_expert_tensor_parallel(args, tp, etp, ep)
    if ep > 1 and (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ArgumentError("--expert-model-parallel-size > 1 with --context-parallel-size > 1 is not implemented; "
                            "use one of them")
    world = getattr(args, "world_size", 1) or 1
    dp = world // max(1, tp * args.pipeline_model_parallel_size)
    if etp == tp and (ep < 1 or dp % ep):
        raise ArgumentError(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size ({dp} = world "
                            f"size {world} / (TP x PP)); launch a multiple of "
                            f"{tp * args.pipeline_model_parallel_size * max(ep, 1)} processes")
    if (ep > 1 or etp != tp) and getattr(args, "deepspeed", False):
        raise ArgumentError("--expert-model-parallel-size > 1 with --deepspeed is not implemented (DeepSpeed's engine "
                            "reduces every grad over its data-parallel group); train without --deepspeed, whose "
                            "local DDP and distributed optimizer reduce expert grads over the expert-data-parallel "
                            "group")
    if args.num_experts % max(1, args.expert_model_parallel_size):
        raise ArgumentError(f"--num-experts ({args.num_experts}) must be divisible by --expert-model-parallel-size "
                            f"({args.expert_model_parallel_size})")
    if getattr(args, "deepspeed", False) and args.pipeline_model_parallel_size > 1 and \
            not getattr(args, "no_pipeline_parallel", False):
        raise ArgumentError("--num-experts with --deepspeed runs on DeepSpeed's data-parallel engine (ZeRO-1/2/3), "
                            "not its pipeline engine: drop --pipeline-model-parallel-size or train without "
                            "--deepspeed (our 1F1B schedules run MoE under PP)")


def _check_expert_tensor_parallel(args: Any, tp: int, etp: int, ep: int) -> None:
    """--expert-tensor-parallel-size different from TP (Megatron-LM core's expert grid): what is implemented."""
    world, pp = getattr(args, "world_size", 1) or 1, args.pipeline_model_parallel_size
    if etp < 1 or world % (etp * ep * pp):
        raise ArgumentError(f"--expert-tensor-parallel-size ({etp}) x --expert-model-parallel-size ({ep}) x "
                            f"--pipeline-model-parallel-size ({pp}) must divide the world size ({world})")
    if args.moe_ffn_hidden_size % etp:
        raise ArgumentError(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be divisible by "
                            f"--expert-tensor-parallel-size ({etp})")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ArgumentError("--expert-tensor-parallel-size different from --tensor-model-parallel-size with "
                            "--context-parallel-size > 1 is not implemented")
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        raise ArgumentError("--expert-tensor-parallel-size different from --tensor-model-parallel-size with "
                            "--ckpt-format torch_dist is not implemented; use --ckpt-format torch")
    if etp > 1 and (getattr(args, "save", None) or getattr(args, "load", None)):
        raise ArgumentError(f"--expert-tensor-parallel-size {etp} (> 1, != TP {tp}) cannot be saved or loaded: "
                            f"Megatron-LM's per-rank folders mp_rank_TT[_PPP]_EEE cannot tell its expert-TP shards "
                            f"apart; drop --save/--load or use --expert-tensor-parallel-size 1 or {tp}")
