"""Megatron optimizer wrappers around a torch optimizer.

- `FP32Optimizer`: fp32 params; reads grads from `param.main_grad` (local DDP) when present; clips; steps.
- `Float16OptimizerWithFloat16Params`: fp16/bf16 model params with fp32 "main" copies that the inner optimizer
  updates. Per step: copy model grads → main grads, unscale by the loss scale and check for inf/nan (all-reduced over
  the model-parallel group; an overflowing step is skipped and reported), clip, step, copy main → model params.

`.step()` returns `(update_successful, grad_norm, num_zeros_in_grad)`. The distributed optimizer
(`--use-distributed-optimizer`) is another `MixedPrecisionOptimizer` subclass that shards the main params
(megatron/optimizer/distrib_optimizer.py).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import saved_state
from megatron.optimizer.clip_grads import clip_grad_norm_fp32, count_zeros_fp32, grads_for_norm
from megatron.optimizer.grad_scaler import MegatronGradScaler

StepResult = Tuple[bool, Optional[float], Optional[int]]
PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared",
                   "allreduce")


def _zero_grad_group_helper(group: List[torch.Tensor], set_to_none: bool) -> None:
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def _model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The accumulated gradient of a model param: local DDP's `main_grad` if it has one, else `.grad`."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _load_inner_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a torch optimizer state, accepting apex FusedAdam layout (per-group 'step') from Megatron checkpoints."""
    groups = state_dict.get("param_groups", [])
    state = state_dict.get("state", {})
    for group in groups:
        if "step" in group:
            for index in group["params"]:
                if index in state and "step" not in state[index]:
                    state[index]["step"] = torch.tensor(float(group["step"]))
    try:
        optimizer.load_state_dict(state_dict)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"cannot load the optimizer state from the checkpoint ({exc}); it was saved for a different model, "
            "parallel layout or optimizer. Pass --no-load-optim to start the optimizer fresh"
        ) from exc


class _NullTimer:
    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


def optimizer_timer(timers: Optional[Callable], name: str):
    """Megatron's per-phase optimizer timers (log level 1) when a Timers object is given."""
    return timers(name, log_level=1) if timers is not None else _NullTimer()


class MegatronOptimizer:
    """Common part: parameter access, grad-norm clipping, zero counting, param_groups/state passthrough."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grad: float,
        log_num_zeros_in_grad: bool,
        model_parallel_group=None,
        tp_rank: int = 0,
    ) -> None:
        if optimizer is None:
            raise ValueError("MegatronOptimizer needs an inner torch optimizer, got None")
        self.optimizer = optimizer
        self.clip_grad = float(clip_grad or 0.0)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.model_parallel_group = model_parallel_group
        self.tp_rank = tp_rank
        # expert parallelism (set by get_megatron_optimizer): expert grads differ between expert-parallel ranks
        self.expert_parallel_group = None
        self.expert_data_parallel_group = None
        self.expert_tensor_parallel_group = None  # --expert-tensor-parallel-size != TP: the experts' split group

    def _expert_norm_kwargs(self, params: List[torch.Tensor], sharded: bool = False) -> dict:
        """grads_for_norm / expert_grads / groups for clip_grad_norm_fp32 (all grads together without EP)."""
        if self.expert_parallel_group is None:
            return {"grads_for_norm": grads_for_norm(params, self.tp_rank)}
        return {"grads_for_norm": grads_for_norm(params, self.tp_rank, expert=False),
                "expert_grads": grads_for_norm(params, self.tp_rank, expert=True),
                "expert_parallel_group": self.expert_parallel_group,
                "expert_data_parallel_group": self.expert_data_parallel_group if sharded else None,
                "expert_tensor_parallel_group": self.expert_tensor_parallel_group, "tp_rank": self.tp_rank}

    def get_parameters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return grads_for_norm(self.get_parameters(), self.tp_rank)

    def clip_grad_norm(self, clip_grad: float) -> float:
        if self.expert_parallel_group is not None:
            params = self.get_parameters()
            return clip_grad_norm_fp32(params, max_norm=clip_grad, model_parallel_group=self.model_parallel_group,
                                       **self._expert_norm_kwargs(params))
        return clip_grad_norm_fp32(
            self.get_parameters(), self.get_main_grads_for_grad_norm(), clip_grad, self.model_parallel_group
        )

    def count_zeros(self) -> int:
        return count_zeros_fp32(self.get_parameters(), self.model_parallel_group, self.tp_rank,
                                expert_parallel_group=self.expert_parallel_group,
                                expert_tensor_parallel_group=self.expert_tensor_parallel_group)

    def _clip_count_and_step(self, timers: Optional[Callable]) -> Tuple[Optional[float], Optional[int]]:
        """The shared tail of every step: clip the gradients (--clip-grad), count zeros if asked, inner step."""
        grad_norm = None
        if self.clip_grad > 0.0:
            optimizer_timer(timers, "optimizer-clip-main-grad").start()
            grad_norm = self.clip_grad_norm(self.clip_grad)
            optimizer_timer(timers, "optimizer-clip-main-grad").stop()
        num_zeros = None
        if self.log_num_zeros_in_grad:
            optimizer_timer(timers, "optimizer-count-zeros").start()
            num_zeros = self.count_zeros()
            optimizer_timer(timers, "optimizer-count-zeros").stop()
        optimizer_timer(timers, "optimizer-inner-step").start()
        self.optimizer.step()
        optimizer_timer(timers, "optimizer-inner-step").stop()
        return grad_norm, num_zeros

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Loss times the current loss scale (what backward should be called on)."""
        return (self.get_loss_scale() * loss).reshape(loss.shape)

    def get_loss_scale(self) -> torch.Tensor:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def step(self, timers: Optional[Callable] = None) -> StepResult:
        raise NotImplementedError

    def reload_model_params(self) -> None:
        """Refresh the main params from the model params (after loading a model checkpoint without optimizer)."""

    def state_dict(self) -> dict:
        raise NotImplementedError

    @property
    def state_dict_is_collective(self) -> bool:
        """True when `state_dict` is a collective every data-parallel rank must call (`--optimizer dist_muon`)."""
        return bool(getattr(self.optimizer, "state_dict_is_collective", False))

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError

    # Let the scheduler and training read/write param groups and state as on a torch optimizer.
    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value


class FP32Optimizer(MegatronOptimizer):
    """Plain fp32 training: no loss scaling, no master copies."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float, log_num_zeros_in_grad: bool,
                 model_parallel_group=None, tp_rank: int = 0) -> None:
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, model_parallel_group, tp_rank)
        device = next((p.device for p in self.get_parameters()), torch.device("cpu"))
        self._scale = torch.ones(1, dtype=torch.float32, device=device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    @torch.no_grad()
    def step(self, timers: Optional[Callable] = None) -> StepResult:
        """Clip and step; `timers` (a megatron Timers) records Megatron's optimizer-* phases."""
        saved_state.wait_for_copies()  # --async-save: the checkpoint's copy of the params must be complete
        for param in self.get_parameters():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad
        grad_norm, num_zeros = self._clip_count_and_step(timers)
        return True, grad_norm, num_zeros

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if "optimizer" in state_dict and "param_groups" not in state_dict:
            state_dict = state_dict["optimizer"]
        if "param_groups" not in state_dict:
            raise ValueError(
                "optimizer checkpoint is not a plain fp32 optimizer state (saved with --fp16/--bf16?); load it with "
                "the same precision flags, or pass --no-load-optim"
            )
        _load_inner_state(self.optimizer, state_dict)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared fp16/bf16 logic: loss scale, unscale + inf/nan check, the step sequence."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float, log_num_zeros_in_grad: bool,
                 fp16: bool, bf16: bool, params_dtype: torch.dtype, grad_scaler: Optional[MegatronGradScaler],
                 model_parallel_group=None, tp_rank: int = 0) -> None:
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, model_parallel_group, tp_rank)
        if fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a loss scaler (pass --loss-scale or use dynamic loss scaling)")
        self.fp16 = fp16
        self.bf16 = bf16
        self.params_dtype = params_dtype
        self.grad_scaler = grad_scaler
        device = next((p.device for p in self.get_parameters()), torch.device("cpu"))
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _collect_main_grads(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def _copy_model_grads_to_main_grads(self) -> None:
        raise NotImplementedError

    def _copy_main_params_to_model_params(self) -> None:
        raise NotImplementedError

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = self._collect_main_grads()
        self.found_inf.fill_(0.0)
        if main_grads:
            inv_scale = self.grad_scaler.inv_scale.to(self.found_inf.device)
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, self.found_inf, inv_scale)
        for group in self._inf_check_groups():
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(self.found_inf.item() > 0)

    def _inf_check_groups(self) -> tuple:
        """The groups over which an inf/nan in any rank's grads must skip the step everywhere."""
        return (self.model_parallel_group, self.expert_parallel_group)

    @torch.no_grad()
    def step(self, timers: Optional[Callable] = None) -> StepResult:
        """Copy grads, unscale + inf check (skip on overflow), clip, step, copy params back."""
        saved_state.wait_for_copies()  # --async-save: the checkpoint's copy of the params must be complete
        optimizer_timer(timers, "optimizer-copy-to-main-grad").start()
        self._copy_model_grads_to_main_grads()
        optimizer_timer(timers, "optimizer-copy-to-main-grad").stop()
        if self.grad_scaler is not None:
            optimizer_timer(timers, "optimizer-unscale-and-check-inf").start()
            found_inf = self._unscale_main_grads_and_check_for_nan()
            optimizer_timer(timers, "optimizer-unscale-and-check-inf").stop()
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        grad_norm, num_zeros = self._clip_count_and_step(timers)
        optimizer_timer(timers, "optimizer-copy-main-to-model-params").start()
        self._copy_main_params_to_model_params()
        optimizer_timer(timers, "optimizer-copy-main-to-model-params").stop()
        return True, grad_norm, num_zeros


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16/bf16 model params; the inner optimizer owns fp32 copies (`fp32_from_float16_groups`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, clip_grad: float, log_num_zeros_in_grad: bool,
                 fp16: bool, bf16: bool, params_dtype: torch.dtype, grad_scaler: Optional[MegatronGradScaler],
                 model_parallel_group=None, tp_rank: int = 0) -> None:
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        for param_group in optimizer.param_groups:
            float16_params, fp32_from_float16, fp32_params = [], [], []
            for i, param in enumerate(param_group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in (torch.float16, torch.bfloat16):
                    main_param = param.detach().clone().float()
                    for attr in PARALLEL_ATTRS:
                        if hasattr(param, attr):
                            setattr(main_param, attr, getattr(param, attr))
                    param_group["params"][i] = main_param
                    if param in optimizer.state:
                        optimizer.state[main_param] = optimizer.state.pop(param)
                    float16_params.append(param)
                    fp32_from_float16.append(main_param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(
                        f"optimizer params must be fp16, bf16 or fp32; got {param.dtype} (shape {tuple(param.shape)})"
                    )
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16)
            self.fp32_from_fp32_groups.append(fp32_params)
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, fp16, bf16, params_dtype, grad_scaler,
                         model_parallel_group, tp_rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grads(self) -> List[torch.Tensor]:
        grads = []
        for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                grads.extend(p.grad.data for p in group if p.grad is not None)
        return grads

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = _model_grad(model_param)
                main_param.grad = grad.float() if grad is not None else None
                model_param.grad = None
        for model_group in self.fp32_from_fp32_groups:
            for model_param in model_group:
                main_grad = getattr(model_param, "main_grad", None)
                if main_grad is not None:
                    model_param.grad = main_grad

    def _copy_main_params_to_model_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model_param.data.copy_(main_param.data)

    def _copy_model_params_to_main_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.data.copy_(model_param.data)

    def reload_model_params(self) -> None:
        self._copy_model_params_to_main_params()

    def state_dict(self) -> dict:
        state_dict = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        optimizer_key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if optimizer_key not in state_dict:
            raise ValueError(
                "optimizer checkpoint has no 'optimizer' entry (was it saved by an fp32 run? load it with the same "
                "--fp16/--bf16 setting, or pass --no-load-optim)"
            )
        _load_inner_state(self.optimizer, state_dict[optimizer_key])
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        if key not in state_dict:
            raise ValueError("optimizer checkpoint has no 'fp32_from_fp16_params'; pass --no-load-optim to skip it")
        saved_groups = state_dict[key]
        if len(saved_groups) != len(self.fp32_from_float16_groups):
            raise ValueError(
                f"optimizer checkpoint has {len(saved_groups)} param groups of fp32 main params, the model has "
                f"{len(self.fp32_from_float16_groups)}; the checkpoint is from a different model/optimizer setup"
            )
        for current_group, saved_group in zip(self.fp32_from_float16_groups, saved_groups):
            if len(current_group) != len(saved_group):
                raise ValueError(
                    f"optimizer checkpoint param group has {len(saved_group)} fp32 main params, the model has "
                    f"{len(current_group)}; the checkpoint is from a different model/parallel setup"
                )
            for current, saved in zip(current_group, saved_group):
                if current.shape != saved.shape:
                    raise ValueError(
                        f"optimizer checkpoint fp32 main param shape {tuple(saved.shape)} != model shape "
                        f"{tuple(current.shape)}; the checkpoint is from a different model/parallel setup"
                    )
                current.data.copy_(saved.data)
