"""DeepSpeed's own flags (deepspeed.add_config_arguments) and Megatron-DeepSpeed's ZeRO/checkpointing flags."""
from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar, Optional

from megatron.settings.declare import setting


def _int_or_sci(text: str) -> int:
    """An integer flag value that also accepts scientific notation (Megatron-DeepSpeed scripts pass 5e8)."""
    value = float(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)

@dataclasses.dataclass
class DeepSpeedSettings:
    """--help group "DeepSpeed"."""

    TITLE: ClassVar[str] = "DeepSpeed"
    DESCRIPTION: ClassVar[str] = "DeepSpeed configurations"
    deepspeed: bool = setting("--deepspeed", default=False,
        help="Enable DeepSpeed (ZeRO, DeepSpeed pipeline engine); needs --deepspeed_config.",
        read_by="megatron/backend/__init__.py")
    deepspeed_config: Optional[str] = setting("--deepspeed_config", help="DeepSpeed json configuration file.",
        read_by="megatron/ds/config.py")
    deepscale: bool = setting("--deepscale", default=False, help="Deprecated enable DeepSpeed (same as --deepspeed).",
        read_by="megatron/arguments.py")
    deepscale_config: Optional[str] = setting("--deepscale_config",
        help="Deprecated DeepSpeed json configuration file (same as --deepspeed_config).",
        read_by="megatron/ds/config.py")
    deepspeed_mpi: bool = setting("--deepspeed_mpi", default=False,
        help="Run via MPI: take rank and world size from the MPI (OpenMPI) environment.",
        read_by="megatron/arguments.py")
    zero_stage: Optional[int] = setting("--zero-stage", choices=[0, 1, 2, 3],
        help="ZeRO stage (default: zero_optimization.stage of the DeepSpeed config, else 0).",
        read_by="megatron/ds/config.py")
    zero_reduce_scatter: Optional[bool] = setting("--zero-reduce-scatter", action="store_true",
        help="Use reduce-scatter for gradient reduction (zero_optimization.reduce_scatter).",
        read_by="megatron/ds/config.py")
    zero_contigious_gradients: Optional[bool] = setting("--zero-contigious-gradients", action="store_true",
        help="Copy gradients into a contiguous buffer (zero_optimization.contiguous_gradients).",
        read_by="megatron/ds/config.py")
    zero_reduce_bucket_size: Optional[int] = setting("--zero-reduce-bucket-size", type=_int_or_sci,
        help="Elements reduced at a time (zero_optimization.reduce_bucket_size).", read_by="megatron/ds/config.py")
    zero_allgather_bucket_size: Optional[int] = setting("--zero-allgather-bucket-size", type=_int_or_sci,
        help="Elements all-gathered at a time (zero_optimization.allgather_bucket_size).",
        read_by="megatron/ds/config.py")
    remote_device: str = setting("--remote-device", default="none", choices=["none", "cpu", "nvme"],
        help="ZeRO-3: keep parameters on this device (zero_optimization.offload_param).",
        read_by="megatron/ds/config.py")
    use_pin_memory: bool = setting("--use-pin-memory", default=False, help="ZeRO-3 parameter offload: pin CPU memory.",
        read_by="megatron/ds/config.py")
    deepspeed_activation_checkpointing: bool = setting("--deepspeed-activation-checkpointing", default=False,
        help="Recompute activations with deepspeed.checkpointing (with --checkpoint-activations).",
        read_by="megatron/ds/engine.py")
    partition_activations: bool = setting("--partition-activations", default=False,
        help="DeepSpeed activation checkpointing: partition checkpoints across tensor-parallel ranks.",
        read_by="megatron/ds/engine.py")
    contigious_checkpointing: bool = setting("--contigious-checkpointing", default=False,
        help="DeepSpeed activation checkpointing: contiguous checkpoint buffers (needs --partition-activations).",
        read_by="megatron/ds/engine.py")
    checkpoint_in_cpu: bool = setting("--checkpoint-in-cpu", default=False,
        help="DeepSpeed activation checkpointing: keep checkpoints in CPU memory.", read_by="megatron/ds/engine.py")
    synchronize_each_layer: bool = setting("--synchronize-each-layer", default=False,
        help="DeepSpeed activation checkpointing: synchronize at the start and end of each layer.",
        read_by="megatron/ds/engine.py")
    profile_backward: bool = setting("--profile-backward", default=False,
        help="DeepSpeed activation checkpointing: time the forward and backward of each layer.",
        read_by="megatron/ds/engine.py")
    no_pipeline_parallel: bool = setting("--no-pipeline-parallel", default=False,
        help="Under --deepspeed: use the plain GPT model, not DeepSpeed's pipeline engine (PP=1).",
        read_by="megatron/backend/deepspeed.py")
