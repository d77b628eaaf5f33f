"""MoELossSettings: what megatron/training.py's MoE router-loss logging reads (Megatron-LM's names and defaults)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from megatron.run_configs.declared import SettingValue, from_settings
from megatron.settings.values import Settings


@dataclasses.dataclass(frozen=True)
class MoELossSettings:
    """Experts (None: a dense model), the router's auxiliary losses, the MoE layer pattern and per-layer logging."""

    settings: Settings = dataclasses.field(repr=False)

    num_experts = SettingValue()
    moe_router_load_balancing_type = SettingValue()
    moe_aux_loss_coeff = SettingValue()
    moe_z_loss_coeff = SettingValue()
    moe_layer_freq = SettingValue()
    num_layers = SettingValue(when_none=0)
    moe_per_layer_logging = SettingValue()

    @classmethod
    def from_args(cls, args: argparse.Namespace, settings: Optional[Settings] = None) -> MoELossSettings:
        return from_settings(cls, args, settings)
