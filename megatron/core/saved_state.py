"""The one rule between an asynchronous checkpoint's background copy and training (--async-save,
megatron/checkpoint/async_save.py): the copy of the saved state (parameters, optimizer state, grad scaler, expert
bias) is taken in the background, from the live tensors, during the next forward and backward passes, and whatever
changes that state first waits for the copy to end.

Saved state changes only after the backward pass of an iteration: the expert-bias update of finalize_model_grads
(megatron/core/step_updates.py), then the optimizer step (megatron/optimizer/: the main and model parameters, the
optimizer state, the grad scaler); the LR scheduler and the counters are saved as values, not live objects. Each of
these calls `wait_for_copies` first. The loop's wait is then only what is left of the copy when the step arrives.
"""
from __future__ import annotations

import threading
import time

_PENDING: list[threading.Event] = []
_LOCK = threading.Lock()
_WAITED_S = [0.0]


def begin_copy() -> threading.Event:
    """A copy of the live state starts: the caller sets the returned event once it no longer reads the live
    tensors (done or failed); until then `wait_for_copies` blocks."""
    done = threading.Event()
    with _LOCK:
        _PENDING.append(done)
    return done


def copies_pending() -> bool:
    """Whether a background copy still reads the live state."""
    with _LOCK:
        _PENDING[:] = [e for e in _PENDING if not e.is_set()]
        return bool(_PENDING)


def wait_for_copies() -> None:
    """Block until no background copy reads the live state; call before changing saved state (a no-op without
    one in flight)."""
    with _LOCK:
        pending = list(_PENDING)
    if not pending:
        return
    start = time.perf_counter()
    for done in pending:
        done.wait()
    with _LOCK:
        _PENDING[:] = [e for e in _PENDING if not e.is_set()]
        _WAITED_S[0] += time.perf_counter() - start


def waited_seconds() -> float:
    """Seconds this process has spent in `wait_for_copies` (the loop's share of the copies' time)."""
    return _WAITED_S[0]
