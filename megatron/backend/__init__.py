"""Training backends: the one seam between the training loop and the engine that runs a step.

`TrainingBackend` is what megatron/training.py's loop calls: set up (model, optimizer, LR schedule), load, train step,
evaluate, save, loss scale and parameter norm. `MegatronBackend` (megatron/backend/megatron.py) is Megatron's own path
(our DDP/distributed optimizer, its pipeline schedules, megatron/checkpoint/); `DeepSpeedBackend`
(megatron/backend/deepspeed.py) runs the DeepSpeed engine (ZeRO, DeepSpeed's pipeline engine with the family's pipe
model, DeepSpeed checkpoints) through the glue in megatron/ds/. `backend_for(configs)` picks one from --deepspeed; the
loop itself never asks which.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.backend.base import StepResult, TrainingBackend
from megatron.backend.deepspeed import DeepSpeedBackend
from megatron.backend.megatron import MegatronBackend

if TYPE_CHECKING:
    from megatron.run_configs.bundle import RunConfigs

__all__ = ["StepResult", "TrainingBackend", "backend_for"]


def backend_for(configs: RunConfigs) -> TrainingBackend:
    """DeepSpeed's engine under --deepspeed (``configs.deepspeed``), else Megatron's own path (DeepSpeed itself is
    imported only when its engine is built)."""
    if configs.deepspeed.enabled:
        return DeepSpeedBackend()
    return MegatronBackend()
