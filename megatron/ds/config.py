"""Load a DeepSpeed JSON config and reconcile it with Megatron's flags (pure Python; never imports deepspeed).

Start-up's validation (megatron/startup.py, step `reconcile_deepspeed`) calls `reconcile_deepspeed_config(args)` under
``--deepspeed``, after the parallel layout and batch sizes are known and before the precision flags are checked. It
does the work without touching ``args``: it returns a `ReconciledDeepSpeedConfig` (the config that
`deepspeed.initialize(config=...)` gets, kept as ``args.deepspeed_config_dict``; the ZeRO stage in effect; --clip-grad,
--fp16/--bf16 as the config makes them), whose `settled_values` validation applies to the namespace it builds.
`resolve_deepspeed_config(args)` is the same written onto a caller's namespace (`apply_to`). Rules (each violation is a one-line `ArgumentError` naming both sides and the fix):

- batch: the flags set it. ``train_micro_batch_size_per_gpu`` = --micro-batch-size, ``train_batch_size`` =
  --global-batch-size, ``gradient_accumulation_steps`` = global / (micro x data-parallel size) are written into the
  config; a batch key already in the config is optional but must agree (as upstream, where DeepSpeed checks
  train_batch = micro x gas x dp): a mismatch is an error naming both values and the flag to pass.
  With --rampup-batch-size the config's ``train_batch_size`` is the final one (the engine's batch size follows the
  ramp through ``engine.set_train_batch_size``).
- ZeRO: the config's ``zero_optimization.stage`` wins when --zero-stage is not given; a disagreement is an error.
  The Megatron-DeepSpeed --zero-* flags fill the matching ``zero_optimization`` keys when given.
  Legacy ``cpu_offload: true`` becomes ``offload_optimizer: {"device": "cpu"}`` (``cpu_offload_params`` →
  ``offload_param``) with a printed notice. ZeRO stage 2/3 with pipeline parallelism is refused: DeepSpeed's
  pipeline engine supports only ZeRO stage 0/1.
- clipping: ``gradient_clipping`` ↔ --clip-grad (a non-default --clip-grad that disagrees with the config is an error).
- precision: ``fp16.enabled`` / ``bf16.enabled`` ↔ --fp16 / --bf16 both ways (fp16 loss-scale settings come from
  Megatron's --loss-scale/--initial-loss-scale/... when the config has no fp16 section). fp16 on a machine without
  CUDA cannot train: the run falls back to fp32 with a one-line notice.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
from typing import Any, Optional

from megatron import optional
from megatron.errors import ArgumentError, MegatronUserError

_CLIP_GRAD_DEFAULT = 1.0  # --clip-grad's parser default


class DeepSpeedConfigError(MegatronUserError, ValueError):
    """A DeepSpeed config that is missing, unreadable or disagrees with the flags."""


def _error(message: str) -> Exception:
    return ArgumentError(message)


def _print0(args: argparse.Namespace, message: str) -> None:
    if getattr(args, "rank", 0) == 0:
        print(message, flush=True)


def load_deepspeed_config(source: Any) -> dict:
    """The config as a dict: from a JSON file path, or a copy of a dict."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"--deepspeed_config must be a JSON file path or a dict (got {type(source).__name__})")
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: file not found; pass the path of a DeepSpeed JSON "
                                   "config (e.g. examples/ds_config_gpt.json)")
    with open(path) as f:
        text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                                   f"{exc.msg}") from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: the top level must be a JSON object")
    return config


def _given(value: Any) -> bool:
    return value is not None and value != "auto"


def _as_int(config: dict, key: str, where: str) -> Optional[int]:
    value = config.get(key)
    if not _given(value):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise _error(f"{where}: '{key}' must be an integer (got {value!r})") from None
    if number != value and not (isinstance(value, str) and value.isdigit()):
        raise _error(f"{where}: '{key}' must be an integer (got {value!r})")
    return number


def _reconcile_batch(config: dict, args: argparse.Namespace, where: str) -> None:
    mbs, gbs, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    gas = gbs // (mbs * dp) if gbs % (mbs * dp) == 0 else None
    cfg_mbs = _as_int(config, "train_micro_batch_size_per_gpu", where)
    cfg_tbs = _as_int(config, "train_batch_size", where)
    cfg_gas = _as_int(config, "gradient_accumulation_steps", where)
    if cfg_mbs is not None and cfg_mbs != mbs:
        raise _error(f"{where} has train_micro_batch_size_per_gpu={cfg_mbs} but --micro-batch-size is {mbs}; "
                     f"pass --micro-batch-size {cfg_mbs} (or drop the key from the config: the flags set the batch)")
    if cfg_tbs is not None and cfg_tbs != gbs:
        raise _error(f"{where} has train_batch_size={cfg_tbs} but --global-batch-size is {gbs}; pass "
                     f"--global-batch-size {cfg_tbs} (or drop the key from the config: the flags set the batch)")
    if cfg_gas is not None and cfg_gas != gas:
        raise _error(f"{where} has gradient_accumulation_steps={cfg_gas} but --global-batch-size {gbs} / "
                     f"(--micro-batch-size {mbs} x data-parallel size {dp}) = {gbs / (mbs * dp):g}; drop the key "
                     "(it is derived) or change the batch flags")
    if gas is None:
        raise _error(f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({mbs}) x data-parallel "
                     f"size ({dp}) under --deepspeed")
    config["train_micro_batch_size_per_gpu"] = mbs
    config["train_batch_size"] = gbs
    config["gradient_accumulation_steps"] = gas


_ZERO_FLAG_KEYS = (
    ("zero_reduce_scatter", "reduce_scatter", "--zero-reduce-scatter"),
    ("zero_contigious_gradients", "contiguous_gradients", "--zero-contigious-gradients"),
    ("zero_reduce_bucket_size", "reduce_bucket_size", "--zero-reduce-bucket-size"),
    ("zero_allgather_bucket_size", "allgather_bucket_size", "--zero-allgather-bucket-size"),
)


def _reconcile_zero(config: dict, args: argparse.Namespace, where: str) -> int:
    zero = config.get("zero_optimization")
    if zero is None:
        zero = {}
    elif isinstance(zero, bool):  # very old configs: "zero_optimization": true means stage 1
        zero = {"stage": 1 if zero else 0}
    elif not isinstance(zero, dict):
        raise _error(f"{where}: 'zero_optimization' must be an object like {{\"stage\": 1}}")
    cfg_stage = zero.get("stage")
    if cfg_stage is not None:
        try:
            cfg_stage = int(cfg_stage)
        except (TypeError, ValueError):
            raise _error(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3 (got {cfg_stage!r})") from None
    flag_stage = getattr(args, "zero_stage", None)
    if flag_stage is not None and cfg_stage is not None and int(flag_stage) != cfg_stage:
        raise _error(f"--zero-stage {flag_stage} disagrees with zero_optimization.stage={cfg_stage} in {where}; "
                     "drop --zero-stage (the config wins) or make them equal")
    stage = cfg_stage if cfg_stage is not None else (int(flag_stage) if flag_stage is not None else 0)
    if stage not in (0, 1, 2, 3):
        raise _error(f"ZeRO stage must be 0, 1, 2 or 3 (got {stage} from {where if cfg_stage is not None else '--zero-stage'})")
    zero["stage"] = stage

    for attr, key, flag in _ZERO_FLAG_KEYS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if key in zero and zero[key] != value:
            raise _error(f"{flag} {value} disagrees with zero_optimization.{key}={zero[key]} in {where}; "
                         "drop one of them")
        zero[key] = value
    remote = getattr(args, "remote_device", "none") or "none"
    if remote != "none":
        if stage != 3:
            raise _error(f"--remote-device {remote} needs ZeRO stage 3 (parameter offload); got stage {stage}")
        offload = {"device": remote}
        if getattr(args, "use_pin_memory", False):
            offload["pin_memory"] = True
        zero.setdefault("offload_param", offload)

    # Legacy offload keys (DeepSpeed < 0.3.x tutorials): map them to today's and say so.
    if "cpu_offload" in zero:
        legacy = zero.pop("cpu_offload")
        if legacy:
            pin = bool(zero.pop("cpu_offload_use_pin_memory", False))
            zero.setdefault("offload_optimizer", {"device": "cpu", **({"pin_memory": True} if pin else {})})
            _print0(args, f"notice: {where}: legacy zero_optimization.cpu_offload=true is mapped to "
                          "\"offload_optimizer\": {\"device\": \"cpu\"}; write that in the config to silence this")
    if "cpu_offload_params" in zero:
        legacy = zero.pop("cpu_offload_params")
        if legacy:
            zero.setdefault("offload_param", {"device": "cpu"})
            _print0(args, f"notice: {where}: legacy zero_optimization.cpu_offload_params=true is mapped to "
                          "\"offload_param\": {\"device\": \"cpu\"}")
    zero.pop("cpu_offload_use_pin_memory", None)
    config["zero_optimization"] = zero
    return stage


def _reconcile_clip(config: dict, args: argparse.Namespace, where: str) -> Any:
    """Fills ``gradient_clipping``; returns --clip-grad as the run uses it (the config's value over the default)."""
    cfg_clip = config.get("gradient_clipping")
    if cfg_clip is None or cfg_clip == "auto":
        config["gradient_clipping"] = float(args.clip_grad or 0.0)
        return args.clip_grad
    cfg_clip = float(cfg_clip)
    clip_grad = args.clip_grad
    if clip_grad != cfg_clip:
        if clip_grad not in (None, _CLIP_GRAD_DEFAULT):
            raise _error(f"--clip-grad {clip_grad} disagrees with gradient_clipping={cfg_clip} in {where}; "
                         "drop one of them or make them equal")
        clip_grad = cfg_clip
    config["gradient_clipping"] = cfg_clip
    return clip_grad


def _enabled(section: Any) -> bool:
    if isinstance(section, dict):
        value = section.get("enabled", False)
        return value is True or (isinstance(value, str) and value.lower() == "true")
    return bool(section)


def _fp16_section_from_args(args: argparse.Namespace) -> dict:
    """DeepSpeed's fp16 section from Megatron's loss-scale flags (loss_scale 0 = dynamic)."""
    initial = float(getattr(args, "initial_loss_scale", 2**32) or 2**32)
    return {
        "enabled": True,
        "loss_scale": float(args.loss_scale) if getattr(args, "loss_scale", None) else 0,
        "initial_scale_power": int(round(math.log2(initial))),
        "loss_scale_window": int(getattr(args, "loss_scale_window", 1000) or 1000),
        "hysteresis": int(getattr(args, "hysteresis", 2) or 2),
        "min_loss_scale": float(getattr(args, "min_loss_scale", 1.0) or 1.0),
    }


def _reconcile_precision(config: dict, args: argparse.Namespace, where: str, cuda_available: bool
                         ) -> tuple[bool, bool]:
    """Fills the fp16/bf16 sections; returns (--fp16, --bf16) as the run uses them."""
    if "bfloat16" in config and "bf16" not in config:  # DeepSpeed's older spelling
        config["bf16"] = config.pop("bfloat16")
    cfg_fp16, cfg_bf16 = _enabled(config.get("fp16")), _enabled(config.get("bf16"))
    if cfg_fp16 and cfg_bf16:
        raise _error(f"{where} enables both fp16 and bf16; enable one")
    if cfg_fp16 and args.bf16:
        raise _error(f"--bf16 disagrees with fp16.enabled=true in {where}; drop --bf16 or use a bf16 config")
    if cfg_bf16 and args.fp16:
        raise _error(f"--fp16 disagrees with bf16.enabled=true in {where}; drop --fp16 or use an fp16 config")
    fp16 = bool(args.fp16 or cfg_fp16)
    bf16 = bool(args.bf16 or cfg_bf16)
    if fp16 and not cuda_available:
        _print0(args, "notice: fp16 training needs a CUDA GPU and none is available: training in fp32 instead "
                      "(use a bf16 config or --bf16 for reduced precision on CPU)")
        fp16 = False
        config.pop("fp16", None)
    if fp16 and not cfg_fp16:
        config["fp16"] = _fp16_section_from_args(args)
    if bf16 and not cfg_bf16:
        config["bf16"] = {"enabled": True}
    if not fp16 and "fp16" in config and not _enabled(config["fp16"]):
        config.pop("fp16")
    return fp16, bf16


@dataclasses.dataclass(frozen=True)
class ReconciledDeepSpeedConfig:
    """The DeepSpeed config reconciled with the flags, and the flag values the reconciliation settles."""

    config: dict  # what deepspeed.initialize(config=...) gets (``args.deepspeed_config_dict``)
    zero_stage: int
    clip_grad: Any  # --clip-grad (the config's gradient_clipping when the flag kept its default)
    fp16: bool  # False on a machine without CUDA (fp32 instead), True when the config enables fp16
    bf16: bool

    def settled_values(self) -> dict:
        """The flag values the config settles, by dest, in the order Megatron-DeepSpeed records them on ``args``
        (start-up's validation applies them to the namespace it builds)."""
        return {"clip_grad": self.clip_grad, "fp16": self.fp16, "bf16": self.bf16, "zero_stage": self.zero_stage,
                "deepspeed_config_dict": self.config}

    def apply_to(self, args: argparse.Namespace) -> None:
        """Write the settled values onto a namespace (`resolve_deepspeed_config`'s contract)."""
        for name, value in self.settled_values().items():
            setattr(args, name, value)


def resolve_deepspeed_config(args: argparse.Namespace, cuda_available: Optional[bool] = None) -> dict:
    """The DeepSpeed config for this run, reconciled with the flags; sets args.zero_stage/deepspeed_config_dict
    (and --clip-grad, --fp16/--bf16 as the config settles them)."""
    resolved = reconcile_deepspeed_config(args, cuda_available)
    resolved.apply_to(args)
    return resolved.config


def reconcile_deepspeed_config(args: argparse.Namespace, cuda_available: Optional[bool] = None
                               ) -> ReconciledDeepSpeedConfig:
    """The DeepSpeed config reconciled with the flags (see the module docstring); reads ``args``, never writes it."""
    source = getattr(args, "deepspeed_config", None)
    if source is None:
        source = getattr(args, "deepscale_config", None)
    if source is None:
        source = getattr(args, "deepspeed_config_dict", None)
    if source is None:
        raise _error("--deepspeed needs --deepspeed_config <json file> (e.g. examples/ds_config_gpt.json)")
    where = "the DeepSpeed config" if isinstance(source, dict) else f"--deepspeed_config {os.fspath(source)}"
    config = load_deepspeed_config(source)
    if cuda_available is None:
        try:
            cuda_available = bool(optional.load("torch").cuda.is_available())
        except ImportError:  # pragma: no cover
            cuda_available = False

    if getattr(args, "use_distributed_optimizer", False):
        raise _error("--use-distributed-optimizer cannot be combined with --deepspeed: ZeRO (zero_optimization.stage "
                     ">= 1) shards the optimizer state instead; drop --use-distributed-optimizer")
    _reconcile_batch(config, args, where)
    stage = _reconcile_zero(config, args, where)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if pp > 1 and getattr(args, "no_pipeline_parallel", False):
        raise _error(f"--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (got {pp})")
    if pp > 1 and stage >= 2:
        raise _error(f"ZeRO stage {stage} cannot be used with --pipeline-model-parallel-size {pp}: DeepSpeed's "
                     "pipeline engine supports only ZeRO stage 0/1; use --zero-stage 1 (or stage 1 in the config) "
                     "or --pipeline-model-parallel-size 1")
    clip_grad = _reconcile_clip(config, args, where)
    fp16, bf16 = _reconcile_precision(config, args, where, cuda_available)
    return ReconciledDeepSpeedConfig(config=config, zero_stage=stage, clip_grad=clip_grad, fp16=fp16, bf16=bf16)
