"""The server's engine driver: one thread on rank 0 runs the inference engine's `step()` while requests are in it;
HTTP handler threads submit requests and wait on their own ticket for the tokens as they come.

The engine (megatron/inference/, or any object with the same methods) is touched by the driver thread only:
`submit` and `cancel` queue their change and wake the thread, which applies them right before the next step. So
the engine needs no locks. A step is `step()` (default: the engine's own); the server passes one that first tells the
other ranks of the job to step too (they then follow the plan the engine broadcasts).

A ticket whose `gone()` (its client disconnected) answers True is cancelled before the next step: the engine frees
its blocks. (The server bounds how many requests it holds; see server.py's `--max-queued-requests`.)
"""
from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

CANCELLED = "cancelled"


class EngineStopped(Exception):
    """The driver was stopped (the server is shutting down) before the request finished."""


@dataclass
class Ticket:
    """One request in the driver, seen from the thread that submitted it.

    `tokens` / `logprobs` grow as steps come in; `finish_reason` is set at the end ("stop", "length", "cancelled"),
    `error` when the engine refused the request. `updates` (shared by the tickets of one HTTP request) receives
    (index, tokens so far) after every step that touched the request and (index, None) at its end, for streaming.
    """

    request_id: str
    prompt_tokens: list[int]
    params: Any
    gone: Callable[[], bool] = lambda: False
    index: int = 0
    updates: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # prompt tokens 1.. (when asked for)
    finish_reason: Optional[str] = None
    error: Optional[Exception] = None
    done: threading.Event = field(default_factory=threading.Event)

    def _deliver(self, new_tokens: list[int], new_logprobs: Optional[list[float]], finished: bool,
                 finish_reason: Optional[str], prompt_logprobs: Optional[list[float]] = None) -> None:
        if prompt_logprobs:
            self.prompt_logprobs.extend(float(x) for x in prompt_logprobs)
        self.tokens.extend(int(t) for t in new_tokens)
        if new_logprobs:
            self.logprobs.extend(float(x) for x in new_logprobs)
        if finished:
            self.finish_reason = finish_reason or "stop"
            self.done.set()
            self.updates.put((self.index, None))
        else:
            self.updates.put((self.index, len(self.tokens)))

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.done.set()
        self.updates.put((self.index, None))

    def wait(self) -> Ticket:
        """Block until the request ends; re-raise the engine's refusal."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self

    @property
    def cancelled(self) -> bool:
        return self.finish_reason == CANCELLED


class EngineDriver:
    """Runs `engine.step()` in a thread while it has work; see the module docstring."""

    def __init__(self, engine: Any, *, step: Optional[Callable[[], list]] = None,
                 step_lock: Optional[Any] = None, log: Callable[[str], None] = lambda msg: None) -> None:
        self.engine = engine
        self.step = step if step is not None else engine.step
        self.step_lock = step_lock if step_lock is not None else threading.Lock()
        self.log = log
        self.steps = 0
        self.cancelled_requests = 0
        self._cv = threading.Condition()
        self._live: dict[str, Ticket] = {}  # submitted, not finished
        self._to_add: list[Ticket] = []
        self._to_cancel: list[str] = []
        self._in_engine: set[str] = set()  # ids added to the engine and not finished (driver thread only)
        self._ids = itertools.count()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    # -- handler threads ---------------------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: Any, gone: Callable[[], bool] = lambda: False
               ) -> list[Ticket]:
        """Queue the prompts of one HTTP request (one engine request each, sharing `params`, `gone` and one
        updates queue); EngineStopped after `stop()`."""
        updates: queue.SimpleQueue = queue.SimpleQueue()
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            tickets = [Ticket(f"req-{next(self._ids)}", list(p), params, gone, i, updates)
                       for i, p in enumerate(prompts)]
            for t in tickets:
                self._live[t.request_id] = t
            self._to_add.extend(tickets)
            self._cv.notify_all()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Ask the engine to drop `ticket`'s request at the next step (its blocks are freed)."""
        with self._cv:
            if ticket.request_id in self._live and not ticket.done.is_set():
                self._to_cancel.append(ticket.request_id)
                self._cv.notify_all()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished."""
        with self._cv:
            return len(self._live)

    # -- the driver thread -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the driver thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-driver", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread; requests still in the driver end with EngineStopped."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _next_batch(self) -> Optional[tuple[list[Ticket], list[str]]]:
        """Wait for work; the submissions and cancellations to apply before the next step (None: stop)."""
        with self._cv:
            while not (self._stopping or self._to_add or self._to_cancel or self._live):
                self._cv.wait()
            if self._stopping:
                for t in self._live.values():
                    t._fail(EngineStopped("the server is shutting down"))
                self._live.clear()
                return None
            adds, self._to_add = self._to_add, []
            cancels, self._to_cancel = self._to_cancel, []
            cancels += [rid for rid, t in self._live.items() if rid not in cancels and t.gone()]
            return adds, cancels

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            adds, cancels = batch
            try:
                with self.step_lock:
                    self._apply(adds, cancels)
                    if not self.engine.has_work():
                        self._fail_all(RuntimeError("the engine dropped a request without finishing it"))
                        continue
                    outputs = self.step()
                    self.steps += 1
            except Exception as exc:  # noqa: BLE001 - fail every request in the driver, keep serving
                self.log(f"server: engine step failed: {exc!r}")
                self._fail_all(exc)
                continue
            self._dispatch(outputs)

    def _apply(self, adds: list[Ticket], cancels: list[str]) -> None:
        for t in adds:
            if t.request_id in cancels:
                self._finish(t, CANCELLED)
                continue
            try:
                self.engine.add_request(t.request_id, t.prompt_tokens, t.params)
            except Exception as exc:  # noqa: BLE001 - the engine refuses this request (e.g. it can never fit)
                with self._cv:
                    self._live.pop(t.request_id, None)
                t._fail(exc)
                continue
            self._in_engine.add(t.request_id)
        for rid in cancels:
            with self._cv:
                ticket = self._live.get(rid)
            if ticket is not None and rid in self._in_engine:
                self.engine.cancel(rid)
                self._finish(ticket, CANCELLED)

    def _finish(self, ticket: Ticket, reason: str) -> None:
        self._in_engine.discard(ticket.request_id)
        with self._cv:
            self._live.pop(ticket.request_id, None)
        if reason == CANCELLED:
            self.cancelled_requests += 1
        ticket._deliver([], None, True, reason)

    def _dispatch(self, outputs: list[Any]) -> None:
        """Hand each StepOutput to its ticket (outputs of requests cancelled here already are dropped)."""
        for out in outputs:
            with self._cv:
                ticket = self._live.get(out.request_id)
            if ticket is None:
                continue
            if out.finished:
                self._in_engine.discard(out.request_id)
                with self._cv:
                    self._live.pop(out.request_id, None)
                if out.finish_reason == CANCELLED:
                    self.cancelled_requests += 1
            ticket._deliver(list(out.new_tokens), out.new_logprobs, out.finished, out.finish_reason,
                            getattr(out, "prompt_logprobs", None))

    def _fail_all(self, exc: Exception) -> None:
        """Fail (and cancel in the engine) every request the engine holds; submissions not yet applied stay."""
        with self._cv:
            live = [self._live.pop(rid) for rid in list(self._in_engine) if rid in self._live]
        for t in live:
            try:
                self.engine.cancel(t.request_id)
            except Exception:  # noqa: BLE001 - the engine is already in trouble; the tickets fail below
                pass
            t._fail(exc)
        self._in_engine.clear()


@dataclass
class Completion:
    """One finished request of `run_to_completion`: its generated tokens (a stop token included), their log-probs
    (when asked) and why it ended ("stop" or "length")."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: Optional[str]


def run_to_completion(engine: Any, prompts: list[list[int]], params: Any) -> list[Completion]:
    """Submit every prompt to `engine` at once (`params`: one SamplingParams for all, or a list, one per prompt)
    and step it until all have finished (one thread, no driver): the
    batch tools' way to use the engine (tools/generate_samples_gpt.py, the lm-eval adapter). Every rank calls it:
    under model parallelism the engine's leader runs the requests while the others follow its steps, and the
    completions are broadcast over the engine's plan group so that every rank returns them. An engine refusal is
    raised before any step runs."""
    tp_group = getattr(engine, "plan_group", getattr(engine, "tp_group", None))
    if not getattr(engine, "leader", True):
        engine.follow()  # until TP rank 0's shutdown()
        return _share_result(None, None, tp_group)
    completions, error = None, None
    try:
        completions = _complete(engine, prompts, params)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    finally:
        if tp_group is not None:
            engine.shutdown()
    return _share_result(completions, error, tp_group)


def _complete(engine: Any, prompts: list[list[int]], params: Any) -> list[Completion]:
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    tickets = [Ticket(f"batch-{i}", list(p), q, index=i) for i, (p, q) in enumerate(zip(prompts, per_prompt))]
    for t in tickets:
        engine.add_request(t.request_id, t.prompt_tokens, t.params)
    by_id = {t.request_id: t for t in tickets}
    while engine.has_work():
        for out in engine.step():
            ticket = by_id.get(out.request_id)
            if ticket is not None:
                ticket._deliver(list(out.new_tokens), out.new_logprobs, out.finished, out.finish_reason,
                            getattr(out, "prompt_logprobs", None))
    unfinished = [t.request_id for t in tickets if not t.done.is_set()]
    if unfinished:
        raise RuntimeError(f"the engine stopped with request(s) {unfinished[:3]} unfinished")
    return [Completion(t.tokens, t.logprobs, t.finish_reason) for t in tickets]


def _share_result(completions: Optional[list[Completion]], error: Optional[Exception], tp_group: Any
                  ) -> list[Completion]:
    """TP rank 0's completions (or its error, raised) on every rank of `tp_group`."""
    if tp_group is not None:
        box = [(completions, error)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        completions, error = box[0]
    if error is not None:
        raise error
    return completions or []
