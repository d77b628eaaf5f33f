"""Loss scalers for fp16 training: a constant scale, or Megatron's dynamic scale with hysteresis.

Dynamic rule (Megatron): on an inf/nan step the growth tracker resets and the hysteresis counter drops by one;
once it reaches 0 the scale is multiplied by `backoff_factor` (never below `min_scale`). After
`growth_interval` consecutive clean steps the scale is multiplied by `growth_factor` and hysteresis is re-armed.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

Device = Optional[Union[str, torch.device]]


class MegatronGradScaler:
    """Holds the loss scale as a 1-element fp32 tensor on `device`."""

    def __init__(self, initial_scale: float, device: Device = None) -> None:
        if initial_scale <= 0.0:
            raise ValueError(f"loss scale ({initial_scale}) must be > 0")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """`--loss-scale N`: the scale never changes (overflowing steps are still skipped)."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scaler (defaults in get_megatron_optimizer: growth 2, backoff 0.5)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        device: Device = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale ({min_scale}) must be > 0 and <= --initial-loss-scale ({initial_scale})")
        if growth_factor <= 1.0:
            raise ValueError(f"loss-scale growth factor ({growth_factor}) must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor ({backoff_factor}) must be in (0, 1)")
        if growth_interval <= 0:
            raise ValueError(f"--loss-scale-window ({growth_interval}) must be > 0")
        if hysteresis <= 0:
            raise ValueError(f"--hysteresis ({hysteresis}) must be > 0")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=self.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32, device=self.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32, device=self.device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        scale = state_dict["scale"]
        if not torch.is_tensor(scale):
            scale = torch.tensor([float(scale)])
        self._scale = scale.detach().to(device=self.device, dtype=torch.float32).reshape(1).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
