"""MoELossSettings: what megatron/training.py's MoE router-loss logging reads (Megatron-LM's names and defaults)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class MoELossSettings:
    """Experts (None: a dense model), the router's auxiliary losses, the MoE layer pattern and per-layer logging."""

    num_experts: Optional[int] = None
    moe_router_load_balancing_type: Any = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_layer_freq: Any = 1
    num_layers: int = 0
    moe_per_layer_logging: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MoELossSettings:
        return cls(
            num_experts=getattr(args, "num_experts", None),
            moe_router_load_balancing_type=getattr(args, "moe_router_load_balancing_type", "aux_loss"),
            moe_aux_loss_coeff=getattr(args, "moe_aux_loss_coeff", 0.0),
            moe_z_loss_coeff=getattr(args, "moe_z_loss_coeff", None),
            moe_layer_freq=getattr(args, "moe_layer_freq", 1),
            num_layers=getattr(args, "num_layers", 0) or 0,
            moe_per_layer_logging=bool(getattr(args, "moe_per_layer_logging", False)),
        )
