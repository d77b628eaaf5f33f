"""The checks of Megatron-LM's mixture-of-experts flags (declared in megatron/settings/moe.py).

The architecture flags feed `TransformerConfig` fields; the ones that only pick a kernel or a communication pattern
are same-result variants; the rest are refused at start-up with one line (their declarations say which).
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Optional

from megatron.errors import ArgumentError


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
    check_moe_values(args)
    if args.moe_router_load_balancing_type == "global_aux_loss":
        raise ArgumentError("--moe-router-load-balancing-type global_aux_loss is not implemented; use aux_loss, "
                            "seq_aux_loss, sinkhorn or none")
    if args.moe_token_dispatcher_type == "flex":
        raise ArgumentError("--moe-token-dispatcher-type flex (DeepEP) is not implemented; use allgather or alltoall")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        raise ArgumentError("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                            "(as Megatron-LM)")
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    etp = args.expert_tensor_parallel_size
    if etp != tp and args.add_bias_linear:
        raise ArgumentError("expert biases (--num-experts without --disable-bias-linear) need "
                            "--expert-tensor-parallel-size equal to --tensor-model-parallel-size")
    if args.add_bias_linear and getattr(args, "ckpt_format", "torch") == "torch_dist":
        raise ArgumentError("expert biases (--num-experts without --disable-bias-linear) have no Megatron Core name "
                            "here yet: use --ckpt-format torch")
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


def _finite(flag: str, value: Optional[float], low: float = 0.0, low_ok: bool = True) -> None:
    """A real coefficient: finite and at least (or above) `low`; None passes (not set)."""
    if value is None:
        return
    if not math.isfinite(value) or value < low or (value == low and not low_ok):
        bound = f">= {low:g}" if low_ok else f"> {low:g}"
        raise ArgumentError(f"{flag} must be a finite number {bound} (got {value})")


def _check_layer_freq(freq: Any, num_layers: Optional[int]) -> None:
    if isinstance(freq, list):
        if num_layers is not None and len(freq) != num_layers:
            raise ArgumentError(f"--moe-layer-freq gives {len(freq)} layers but --num-layers is {num_layers}: "
                                "give one 0/1 per layer (e.g. \"([1]*3+[0]*1)*N\")")
        if not any(freq):
            raise ArgumentError("--moe-layer-freq has no MoE layer (all 0): drop --num-experts for a dense model")
    elif freq < 1:
        raise ArgumentError(f"--moe-layer-freq must be >= 1 (an MoE layer every N layers) or a 0/1 list (got {freq})")


def check_moe_values(args: argparse.Namespace) -> None:
    """With --num-experts: counts, sizes and coefficients that cannot train are one line each at start-up (not a
    traceback at model build or a nan at the first step)."""
    experts, topk = args.num_experts, args.moe_router_topk
    if experts < 1:
        raise ArgumentError(f"--num-experts must be >= 1 (got {experts}); drop it for a dense model")
    if not 1 <= topk <= experts:
        raise ArgumentError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})")
    for flag, dest in (("--expert-model-parallel-size", "expert_model_parallel_size"),
                       ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
                       ("--moe-ffn-hidden-size", "moe_ffn_hidden_size"),
                       ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size")):
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ArgumentError(f"{flag} must be positive (got {value})")
    _check_layer_freq(args.moe_layer_freq, args.num_layers)
    _finite("--moe-expert-capacity-factor", args.moe_expert_capacity_factor, low_ok=False)
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ArgumentError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    _finite("--moe-aux-loss-coeff", args.moe_aux_loss_coeff)
    _finite("--moe-z-loss-coeff", args.moe_z_loss_coeff)
    _finite("--moe-router-topk-scaling-factor", args.moe_router_topk_scaling_factor, low_ok=False)
    _check_router_groups(args)
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise ArgumentError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as "
                            "Megatron-LM)")
    _finite("--moe-router-bias-update-rate", args.moe_router_bias_update_rate)


def _check_router_groups(args: argparse.Namespace) -> None:
    """Group-limited routing (--moe-router-num-groups / --moe-router-group-topk): Megatron-LM core's checks, and
    the top-k within the chosen groups' experts (a smaller top-k scores every group 0; a larger one picks -inf)."""
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    experts, topk = args.num_experts, args.moe_router_topk
    if groups is not None and not group_topk:
        raise ArgumentError("--moe-router-num-groups needs --moe-router-group-topk (the groups each token may use)")
    if not group_topk:
        return
    if not groups:
        raise ArgumentError("--moe-router-group-topk needs --moe-router-num-groups (as Megatron-LM)")
    if groups < 1 or experts % groups:
        raise ArgumentError(f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts})")
    if not 1 <= group_topk <= groups:
        raise ArgumentError(f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups "
                            f"({groups})")
    if not group_topk <= topk <= group_topk * (experts // groups):
        raise ArgumentError(f"--moe-router-topk ({topk}) must be between --moe-router-group-topk ({group_topk}) and "
                            f"the experts of the chosen groups ({group_topk * (experts // groups)})")
    if args.moe_router_load_balancing_type == "sinkhorn":
        raise ArgumentError("--moe-router-group-topk does not apply to --moe-router-load-balancing-type sinkhorn")
