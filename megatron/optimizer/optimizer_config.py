"""Typed optimizer settings (`OptimizerConfig`) and their construction from Megatron's parsed flags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron.settings import optimizer_fields


@dataclass
class OptimizerConfig:
    """What `get_megatron_optimizer` needs; field names follow Megatron's flags (defaults are Megatron's)."""

    optimizer: str = "adam"  # "adam" (decoupled weight decay, i.e. AdamW) | "sgd" | "muon" (Muon + AdamW) | "dist_muon" (the same, layer-wise distributed over DP)
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.9
    muon_split_qkv: bool = True
    muon_use_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "blockwise"
    muon_extra_scale_factor: float = 1.0
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None  # constant loss scale; None → dynamic (fp16) / none (bf16)
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    log_num_zeros_in_grad: bool = False
    use_distributed_optimizer: bool = False
    params_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd", "muon", "dist_muon"):
            raise ValueError(f"--optimizer {self.optimizer!r} is not supported; use 'adam', 'sgd', 'muon' or "
                             "'dist_muon'")
        if self.optimizer in ("muon", "dist_muon") and self.use_distributed_optimizer:
            raise ValueError(f"--optimizer {self.optimizer} does not work with --use-distributed-optimizer (as in "
                             "Megatron-LM core 0.16.1: Muon orthogonalises whole matrices); drop "
                             "--use-distributed-optimizer and use --optimizer dist_muon (layer-wise distributed)")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pass only one")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale ({self.loss_scale}) must be > 0 (omit it for dynamic loss scaling)")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(
                f"--initial-loss-scale ({self.initial_loss_scale}) and --min-loss-scale ({self.min_loss_scale}) "
                "must be > 0"
            )
        if self.loss_scale_window <= 0 or self.hysteresis <= 0:
            raise ValueError(
                f"--loss-scale-window ({self.loss_scale_window}) and --hysteresis ({self.hysteresis}) must be > 0"
            )


def optimizer_config_from_args(args: Any) -> OptimizerConfig:
    """Build an OptimizerConfig from an argparse namespace with Megatron's attribute names: the settings declared
    with ``optimizer_config=True`` (megatron/settings/), and ``params_dtype`` (validate_args' value, else from
    --fp16/--bf16). A None value (or an absent one) takes the config's default, except --loss-scale (None: dynamic)."""
    defaults = OptimizerConfig()
    values = {}
    for name in optimizer_fields() + ("params_dtype",):
        value = getattr(args, name, None)
        values[name] = getattr(defaults, name) if value is None and name != "loss_scale" else value
    if getattr(args, "params_dtype", None) is None:
        values["params_dtype"] = torch.half if values["fp16"] else torch.bfloat16 if values["bf16"] else torch.float32
    return OptimizerConfig(**values)
