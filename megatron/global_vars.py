"""Process-wide singletons for entry scripts: args, tokenizer, timers, tensorboard writer, micro-batch calculator,
the rerun state machine.

Only entry scripts, megatron/training.py-level code and this module read them; library layers get explicit
arguments instead. `unset_global_variables()` resets everything (tests).
"""
from __future__ import annotations

import argparse
import signal
from typing import Any, List, Optional

import torch

from megatron import optional
from megatron.microbatches import build_num_microbatches_calculator
from megatron.rerun_state_machine import RerunStateMachine
from megatron.timers import Timers
from megatron.tokenizer.tokenizer import build_tokenizer
from megatron.tokenizer.tokenizer import vocab_size_with_padding as _pad_vocab

_GLOBAL_ARGS: Optional[argparse.Namespace] = None
_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Any = None
_GLOBAL_TOKENIZER: Any = None
_GLOBAL_TENSORBOARD_WRITER: Any = None
_GLOBAL_TIMERS: Optional[Timers] = None
_GLOBAL_SIGNAL_HANDLER: Any = None
_GLOBAL_RERUN_STATE_MACHINE: Optional[RerunStateMachine] = None


def _ensure_initialized(var: Any, name: str) -> None:
    if var is None:
        raise RuntimeError(f"{name} is not initialized: call megatron.initialize.initialize_megatron() first")


def _ensure_not_initialized(var: Any, name: str) -> None:
    if var is not None:
        raise RuntimeError(f"{name} is already initialized (call unset_global_variables() to reset)")


def get_args() -> argparse.Namespace:
    """The validated command-line arguments."""
    _ensure_initialized(_GLOBAL_ARGS, "args")
    return _GLOBAL_ARGS


def get_num_microbatches() -> int:
    """Micro-batches per global batch (per data-parallel rank) at the current point of a batch-size ramp-up."""
    _ensure_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get()


def get_current_global_batch_size() -> int:
    _ensure_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    _ensure_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR.update(consumed_samples, consistency_check)


def get_num_microbatches_calculator() -> Any:
    """The calculator object itself (`.get()`, `.get_current_global_batch_size()`, `.update()`)."""
    _ensure_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_tokenizer() -> Any:
    """The tokenizer built from --tokenizer-type (None when no tokenizer type was given)."""
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer() -> Any:
    """The SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def get_timers() -> Timers:
    _ensure_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def get_signal_handler() -> Any:
    _ensure_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler")
    return _GLOBAL_SIGNAL_HANDLER


def get_rerun_state_machine() -> RerunStateMachine:
    """The run's rerun state machine (pretrain() installs it; a disabled one until then, as Megatron's implicit
    initialisation)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine()
    return _GLOBAL_RERUN_STATE_MACHINE


def set_rerun_state_machine(machine: Optional[RerunStateMachine]) -> None:
    """Install the run's rerun state machine (None: forget it)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = machine


def set_args(args: argparse.Namespace) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def set_global_variables(args: argparse.Namespace, build_tokenizer: bool = True) -> None:
    """Megatron's API: every global from validated args (Megatron's order: args, micro-batches, tokenizer, tb,
    timers); like Megatron's it records padded_vocab_size on `args`. Start-up (megatron/startup.py) builds the
    tokenizer and the calculator as steps and calls `install_global_variables` instead."""
    if args is None:
        raise ValueError("set_global_variables needs the parsed args")
    _ensure_not_initialized(_GLOBAL_ARGS, "args")
    calculator = build_num_microbatches_calculator_from(args)
    tokenizer = _build_tokenizer(args) if build_tokenizer else None
    install_global_variables(args, tokenizer, calculator)


def install_global_variables(args: argparse.Namespace, tokenizer: Any, calculator: Any) -> None:
    """Install start-up's results as the globals (args, micro-batch calculator, tokenizer), then the tensorboard
    writer, the timers and the signal handler."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR, _GLOBAL_TOKENIZER
    _ensure_not_initialized(_GLOBAL_ARGS, "args")
    _ensure_not_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _ensure_not_initialized(_GLOBAL_TOKENIZER, "tokenizer")
    set_args(args)
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator
    _GLOBAL_TOKENIZER = tokenizer
    _set_tensorboard_writer(args)
    _set_timers(args)
    if getattr(args, "exit_signal_handler", False):
        _set_signal_handler()


def unset_global_variables() -> None:
    """Forget every global (closing the tensorboard writer); for tests and re-initialisation."""
    global _GLOBAL_ARGS, _GLOBAL_NUM_MICROBATCHES_CALCULATOR, _GLOBAL_TOKENIZER
    global _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_TIMERS, _GLOBAL_SIGNAL_HANDLER, _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        try:
            _GLOBAL_TENSORBOARD_WRITER.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
    if _GLOBAL_SIGNAL_HANDLER is not None:
        _GLOBAL_SIGNAL_HANDLER.release()
    _GLOBAL_ARGS = None
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TENSORBOARD_WRITER = None
    _GLOBAL_TIMERS = None
    _GLOBAL_SIGNAL_HANDLER = None
    _GLOBAL_RERUN_STATE_MACHINE = None


def build_num_microbatches_calculator_from(args: argparse.Namespace) -> Any:
    """The micro-batch calculator for validated args (prints Megatron's schedule line on rank 0)."""
    rampup = getattr(args, "rampup_batch_size", None)
    if rampup is not None:
        rampup = [int(v) for v in rampup]
    return build_num_microbatches_calculator(
        getattr(args, "rank", 0), rampup, args.global_batch_size, args.micro_batch_size, args.data_parallel_size
    )


def _build_tokenizer(args: argparse.Namespace) -> Any:
    """Megatron's set_global_variables path: the tokenizer (build_tokenizer records args.padded_vocab_size); with
    no --tokenizer-type only --vocab-size is padded."""
    if getattr(args, "tokenizer_type", None) is None:
        if getattr(args, "vocab_size", None) is not None and getattr(args, "padded_vocab_size", None) is None:
            args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args)
        return None
    return build_tokenizer(args)


def vocab_size_with_padding(orig_vocab_size: int, args: argparse.Namespace) -> int:
    """Megatron's padding (round up to make_vocab_size_divisible_by x TP), printed on rank 0."""
    return _pad_vocab(orig_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
                      log=getattr(args, "rank", 0) == 0)


def rebuild_tokenizer(args: argparse.Namespace) -> Any:
    """Drop and rebuild the global tokenizer (e.g. after --use-checkpoint-args changed tokenizer flags)."""
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = None
    _GLOBAL_TOKENIZER = _build_tokenizer(args)
    return _GLOBAL_TOKENIZER


def _set_tensorboard_writer(args: argparse.Namespace) -> None:
    """SummaryWriter on the last rank (Megatron logs from the last rank, which holds the loss)."""
    global _GLOBAL_TENSORBOARD_WRITER
    _ensure_not_initialized(_GLOBAL_TENSORBOARD_WRITER, "tensorboard writer")
    if getattr(args, "tensorboard_dir", None) and getattr(args, "rank", 0) == (getattr(args, "world_size", 1) - 1):
        try:
            summary_writer = optional.load("torch", "utils.tensorboard").SummaryWriter
        except ImportError:
            print("WARNING: TensorBoard writing requested but is not available (pip install tensorboard); "
                  "no TensorBoard logs will be written.", flush=True)
            return
        print("> setting tensorboard ...", flush=True)
        _GLOBAL_TENSORBOARD_WRITER = summary_writer(log_dir=args.tensorboard_dir,
                                                   max_queue=args.tensorboard_queue_size)


def _set_timers(args: argparse.Namespace) -> None:
    global _GLOBAL_TIMERS
    _ensure_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = Timers(getattr(args, "timing_log_level", 0), getattr(args, "timing_log_option", "minmax"))


def _set_signal_handler() -> None:
    global _GLOBAL_SIGNAL_HANDLER
    _ensure_not_initialized(_GLOBAL_SIGNAL_HANDLER, "signal handler")
    _GLOBAL_SIGNAL_HANDLER = DistributedSignalHandler().__enter__()


class DistributedSignalHandler:
    """Records SIGTERM instead of dying; `signals_received()` all-gathers the flag so every rank agrees to exit."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._signal_received = False
        self._released = False
        self._original_handler: Any = None

    def signals_received(self) -> List[bool]:
        flag = torch.tensor([int(self._signal_received)], dtype=torch.int32)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_backend() == "nccl":
                flag = flag.cuda()
            gathered = [torch.zeros_like(flag) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(gathered, flag)
            return [bool(t.item()) for t in gathered]
        return [bool(flag.item())]

    def __enter__(self) -> DistributedSignalHandler:
        self._signal_received = False
        self._released = False
        self._original_handler = signal.getsignal(self.sig)

        def handler(signum, frame):  # noqa: ARG001 - signal API
            self._signal_received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()

    def release(self) -> bool:
        if self._released:
            return False
        signal.signal(self.sig, self._original_handler)
        self._released = True
        return True
