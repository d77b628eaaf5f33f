"""MoELossSettings: what megatron/training.py's MoE router-loss logging reads (Megatron-LM's names and defaults)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

from megatron.run_configs.declared import fill_from_args


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
        return fill_from_args(cls, args)
