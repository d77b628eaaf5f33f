"""REST text-generation server with Megatron's API (`PUT /api`) and a small web page at `GET /`.

Every rank of the job takes part. Rank 0 runs a standard-library HTTP server; for each request it validates the
JSON body (bad requests get HTTP 400/413 with `{"message": ...}` and never reach the other ranks), then broadcasts
the checked request to the other ranks with `broadcast_object_list`, and all ranks run the same `generate` call
(tensor parallelism needs every rank in the forward pass). One request runs at a time (a lock). The other ranks sit
in `worker_loop()` until rank 0 broadcasts "stop" (graceful shutdown); while idle, rank 0 broadcasts a heartbeat so
the workers' collective never reaches the process group's timeout.

Cancel on disconnect: a request whose client has gone (closed or reset its connection, or, while streaming, stopped
reading for the stall timeout) stops generating so the next request is served. Rank 0 asks `client_gone` after every
decoding step and broadcasts the answer over the server's group (`StopCheck`), so every rank leaves the decoding loop
at the same step; a request whose client left while it waited for its turn is dropped before it reaches the others.

With an inference engine (`engine=`, the server's --inference-dynamic-batching), requests do not take turns: an
EngineDriver thread (megatron/text_generation/engine_driver.py) runs the engine's steps and the HTTP handler threads
submit each prompt as one engine request and wait for it (streaming as the tokens come); before each step rank 0
broadcasts ("engine_step", None) and the other ranks step too (`PUT /api` with "logprobs" included: the engine
returns the prompt's log-probs too). What the engine does not do (`tokens_to_generate: 0`; OpenAI requests with
"logprobs", which need the top alternatives, or max_tokens 0) takes the one-at-a-time path above.
`max_queued_requests` bounds the prompts the server holds (waiting or generating, both paths): past it the answer
is HTTP 429 with a `Retry-After` header; a client that disconnects cancels its engine requests (blocks freed).

`build_server` also serves OpenAI-style `POST /v1/completions` and `GET /v1/models` (megatron/text_generation/
openai_api.py) and `POST /v1/chat/completions` (openai_chat.py), broadcast to the other ranks as ("openai",
request) the same way.

The generation itself is injected: `generate_fn(prompts, tokens_to_generate, **options) -> dict` with keys
`text`, `segments` and (when asked) `logprobs`, normally `functools.partial(megatron.text_generation.generate,
model, tokenizer)`. The options passed are the ones its signature accepts.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
import random
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron.errors import MegatronUserError
from megatron.text_generation import openai_api, openai_chat
from megatron.text_generation.disconnect import StopCheck, client_gone
from megatron.text_generation.engine_driver import EngineDriver, EngineStopped, Ticket
from megatron.text_generation.generation import eol_token_ids, generate
from megatron.text_generation.http_limits import MAX_JSON_DEPTH, json_depth  # noqa: F401  (re-exported)

STATIC_DIR = Path(__file__).resolve().parent / "static"
DEFAULT_PORT = 5000
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_MAX_PROMPTS = 128
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # longest a request may wait for its turn (503 after), and a client may stall
LISTEN_BACKLOG = 128  # pending connections the kernel queues (the standard library's 5 resets bursts of clients)
CLIENT_CLOSED = 499  # handle_payload's status for a request whose client went away (nothing is sent back)
RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full)


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

# JSON field -> (generate() keyword, expected type, default). Types: "bool", "int", "float".
FIELDS: dict[str, tuple[str, str, Any]] = {
    "tokens_to_generate": ("tokens_to_generate", "int", 64),
    "logprobs": ("return_output_log_probs", "bool", False),
    "temperature": ("temperature", "float", 1.0),
    "top_k": ("top_k", "int", 0),
    "top_p": ("top_p", "float", 0.0),
    "top_p_decay": ("top_p_decay", "float", 0.0),
    "top_p_bound": ("top_p_bound", "float", 0.0),
    "add_BOS": ("add_BOS", "bool", False),
    "stop_on_eol": ("stop_on_eol", "bool", False),
    "stop_on_double_eol": ("stop_on_double_eol", "bool", False),
    "prevent_newline_after_colon": ("prevent_newline_after_colon", "bool", False),
    "random_seed": ("random_seed", "int", -1),
    "no_log": ("no_log", "bool", False),
}
SERVER_ONLY_FIELDS = {"no_log"}
# Options always handed to generate (the rest only when the request sets them to a non-default value).
MAX_RANDOM_SEED = 2**63 - 1  # a signed 64-bit integer (torch's generator seed and the broadcast to other ranks)
CORE_OPTIONS = ("return_output_log_probs", "temperature", "top_k", "top_p", "add_BOS", "stop_on_eol", "random_seed")


class BadRequest(Exception):
    """A request the server refuses; `status` is the HTTP status and the message goes back as JSON."""

    status = HTTPStatus.BAD_REQUEST


class PayloadTooLarge(BadRequest):
    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE



def accepted_options(generate_fn: Callable) -> Optional[set[str]]:
    """Keyword names `generate_fn` accepts (None: it takes **kwargs, so anything)."""
    try:
        params = inspect.signature(generate_fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _typed(name: str, value: Any, kind: str) -> Any:
    if kind == "bool":
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false, got {json.dumps(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {json.dumps(value)}")
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise BadRequest(f"{name} must be an integer, got {value}")
        return int(value)
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number")
    return float(value)


def _request_prompts(payload: Any, max_prompts: int) -> list:
    """The body's prompts (a non-empty list of at most `max_prompts` strings); BadRequest for any other shape."""
    if not isinstance(payload, dict):
        raise BadRequest("the request body must be a JSON object such as {\"prompts\": [\"Hello\"], "
                         "\"tokens_to_generate\": 16}")
    unknown = sorted(set(payload) - set(FIELDS) - {"prompts"})
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; accepted: prompts, {', '.join(FIELDS)}")
    if "prompts" not in payload:
        raise BadRequest("missing field prompts (a list of strings)")
    prompts = payload["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompts must be a list of strings")
    if not prompts:
        raise BadRequest("prompts is empty; send at least one prompt")
    if len(prompts) > max_prompts:
        raise BadRequest(f"too many prompts ({len(prompts)}); the maximum is {max_prompts}")
    return prompts


def _check_sampling(values: dict) -> None:
    """Check the sampling fields; temperature 0 becomes greedy decoding (temperature 1, top_k 1) in `values`."""
    temperature = values["temperature"]
    if temperature < 0.0 or temperature > 100.0:
        raise BadRequest(f"temperature must be in [0, 100], got {temperature}")
    if values["top_k"] < 0:
        raise BadRequest(f"top_k must be >= 0, got {values['top_k']}")
    for name in ("top_p", "top_p_decay", "top_p_bound"):
        if not 0.0 <= values[name] <= 1.0:
            raise BadRequest(f"{name} must be in [0, 1], got {values[name]}")
    if values["top_k"] > 0 and values["top_p"] > 0.0:
        raise BadRequest("set top_k or top_p, not both")
    if temperature == 0.0:  # greedy decoding, expressed the way Megatron's sampler understands it
        if values["top_p"] > 0.0:
            raise BadRequest("temperature 0 means greedy decoding; leave top_p unset")
        values["temperature"], values["top_k"] = 1.0, 1
    if not -1 <= values["random_seed"] <= MAX_RANDOM_SEED:
        raise BadRequest(f"random_seed must be between 0 and 2**63-1 ({MAX_RANDOM_SEED}), or -1 for none; got "
                         f"{values['random_seed']}")


def _check_lengths(prompts: list, values: dict, count_tokens: Callable[[str], int], max_sequence_length: int,
                   max_batch_tokens: Optional[int]) -> None:
    """Every prompt (with BOS) plus tokens_to_generate fits the context and the batch fits `max_batch_tokens`."""
    n_tokens = values["tokens_to_generate"]
    bos = 1 if values["add_BOS"] else 0
    longest = 0
    for i, prompt in enumerate(prompts):
        length = count_tokens(prompt) + bos
        if length == 0:
            raise BadRequest(f"prompts[{i}] is empty; send some text or set \"add_BOS\": true")
        longest = max(longest, length)
    if longest + n_tokens > max_sequence_length:
        raise BadRequest(f"the longest prompt ({longest} tokens) plus tokens_to_generate ({n_tokens}) is longer "
                         f"than the model's context of {max_sequence_length} tokens; shorten it")
    if max_batch_tokens is not None and len(prompts) * (longest + n_tokens) > max_batch_tokens:
        raise BadRequest(f"{len(prompts)} prompt(s) x {longest + n_tokens} tokens is over this server's limit of "
                         f"{max_batch_tokens} tokens per request (--max-tokens-to-oom); send fewer or shorter prompts")


def validate_request(
    payload: Any,
    *,
    count_tokens: Callable[[str], int],
    max_sequence_length: int,
    max_tokens_to_generate: Optional[int] = None,
    max_prompts: int = DEFAULT_MAX_PROMPTS,
    max_batch_tokens: Optional[int] = None,
    accepted: Optional[set[str]] = None,
) -> dict:
    """Check a decoded JSON body; return {"prompts", "tokens_to_generate", "options", "no_log"} or raise BadRequest.

    `count_tokens(text)` gives a prompt's length in tokens; prompt + BOS + tokens_to_generate must fit in
    `max_sequence_length`; prompts x (longest + tokens_to_generate) must stay within `max_batch_tokens`
    (Megatron's --max-tokens-to-oom). `accepted` (from `accepted_options`) limits the optional fields to what generate takes.
    """
    prompts = _request_prompts(payload, max_prompts)

    values = {name: _typed(name, payload[name], kind) if name in payload else default
              for name, (_, kind, default) in FIELDS.items()}
    if "tokens_to_generate" not in payload and max_tokens_to_generate is not None:
        values["tokens_to_generate"] = min(values["tokens_to_generate"], max_tokens_to_generate)
    n_tokens = values["tokens_to_generate"]
    if n_tokens < 0:
        raise BadRequest(f"tokens_to_generate must be >= 0, got {n_tokens}")
    if n_tokens == 0 and not values["logprobs"]:
        raise BadRequest("tokens_to_generate=0 only makes sense with \"logprobs\": true")
    if max_tokens_to_generate is not None and n_tokens > max_tokens_to_generate:
        raise BadRequest(f"tokens_to_generate={n_tokens} exceeds this server's limit of {max_tokens_to_generate} "
                         "(--max-tokens-to-generate)")
    _check_sampling(values)

    _check_lengths(prompts, values, count_tokens, max_sequence_length, max_batch_tokens)

    options: dict[str, Any] = {}
    for name, (keyword, _, default) in FIELDS.items():
        if name in SERVER_ONLY_FIELDS or keyword == "tokens_to_generate":
            continue
        value = values[name]
        if keyword in CORE_OPTIONS or value != default:
            if accepted is not None and keyword not in accepted:
                if value == default:
                    continue
                raise BadRequest(f"{name} is not supported by this server")
            options[keyword] = value
    return {"prompts": prompts, "tokens_to_generate": n_tokens, "options": options, "no_log": values["no_log"]}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class MegatronServer:
    """Rank 0: HTTP front end + broadcaster; other ranks: `worker_loop()`. See the module docstring."""

    def __init__(
        self,
        generate_fn: Callable[..., dict],
        count_tokens: Callable[[str], int],
        *,
        max_sequence_length: int,
        max_tokens_to_generate: Optional[int] = None,
        max_prompts: int = DEFAULT_MAX_PROMPTS,
        max_batch_tokens: Optional[int] = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        group: Optional[Any] = None,
        src_rank: int = 0,
        heartbeat_s: float = 60.0,
        log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        engine: Any = None,
        sampling_params: Optional[Callable[..., Any]] = None,
        tokenizer: Any = None,
        max_queued_requests: Optional[int] = None,
    ) -> None:
        self.request_timeout_s = float(request_timeout_s)
        self.generate_fn = generate_fn
        self.count_tokens = count_tokens
        self.max_sequence_length = int(max_sequence_length)
        self.max_tokens_to_generate = max_tokens_to_generate
        self.max_prompts = int(max_prompts)
        self.max_batch_tokens = max_batch_tokens
        self.max_request_bytes = int(max_request_bytes)
        self.group = group
        self.src_rank = src_rank
        self.heartbeat_s = heartbeat_s
        self.log = log
        self.accepted = accepted_options(generate_fn)
        self.openai: Any = None  # OpenAICompletions (set by build_server): POST /v1/completions, GET /v1/models
        self.openai_chat: Any = None  # OpenAIChat (set by build_server): POST /v1/chat/completions
        self.lock = threading.Lock()
        self.httpd: Optional[ThreadingHTTPServer] = None
        self._stopped = False
        self._idle = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.cancelled_requests = 0  # requests stopped because their client left (rank 0)
        self.last_cancel_steps: Optional[int] = None  # decoding steps the last of them ran
        self.engine, self.sampling_params, self.tokenizer = engine, sampling_params, tokenizer
        self.max_queued_requests = max_queued_requests
        self._held = 0  # prompts in the server (waiting or generating), bounded by max_queued_requests
        self._held_lock = threading.Lock()
        self.driver: Optional[EngineDriver] = None
        if engine is not None:
            if sampling_params is None or tokenizer is None:
                raise ValueError("an engine needs sampling_params (its SamplingParams type) and the tokenizer")
            self.driver = EngineDriver(engine, step=self._engine_step, step_lock=self.lock, log=log)

    # -- admission (bounded queue) -------------------------------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Count `n` more prompts in the server; False (nothing counted) when that would pass max_queued_requests."""
        with self._held_lock:
            if self.max_queued_requests is not None and self._held + n > self.max_queued_requests:
                return False
            self._held += n
            return True

    def release(self, n: int) -> None:
        """The `n` prompts of a `reserve` have been answered."""
        with self._held_lock:
            self._held -= n

    def busy_message(self) -> str:
        """The message of a 429 (sent with a Retry-After header)."""
        return (f"the server is busy: {self._held} prompt(s) are waiting or generating and the limit is "
                f"{self.max_queued_requests} (--max-queued-requests); retry after {RETRY_AFTER_S} s")

    # -- the engine path (rank 0) ------------------------------------------------------------------------------
    def _engine_step(self) -> list:
        """One engine step on every rank (the driver thread, under the lock): the other ranks hear "engine_step" and
        call `engine.step()`, which follows the plan rank 0's step broadcasts. A step that ran no forward broadcast
        no plan: rank 0 then sends the engine's empty plan (`shutdown()`), which ends the followers' wait."""
        self._broadcast(("engine_step", None))
        before = self.engine.steps
        outputs = self.engine.step()
        if self._distributed() and self.engine.steps == before:
            self.engine.shutdown()
        return outputs

    def run_engine(self, prompts: list[list[int]], params: Any, gone: Callable[[], bool],
                   on_update: Optional[Callable[[Ticket, int], None]] = None) -> list[Ticket]:
        """Submit `prompts` to the engine driver and wait for all of them; `on_update(ticket, n_tokens)` after
        every step that generated for one (streaming). A gone client cancels them all at the next step."""
        assert self.driver is not None
        tickets = self.driver.submit(prompts, params, gone)
        pending = len(tickets)
        updates = tickets[0].updates
        while pending:
            index, n = updates.get()
            if n is None:
                pending -= 1
            elif on_update is not None:
                on_update(tickets[index], n)
        for t in tickets:
            t.wait()  # re-raises an engine refusal
        if any(t.cancelled for t in tickets):
            for t in tickets:
                self.driver.cancel(t)
        return tickets

    def _engine_payload(self, request: dict, gone: Callable[[], bool]) -> tuple[int, dict]:
        """`PUT /api` through the engine: the body generate() would give (text, segments; no logprobs)."""
        options, tok = request["options"], self.tokenizer
        eod = int(tok.eod)
        prompts = [([eod] if options.get("add_BOS") else []) + [int(t) for t in tok.tokenize(p)]
                   for p in request["prompts"]]
        params = self.sampling_params(
            max_new_tokens=request["tokens_to_generate"], temperature=options["temperature"],
            top_k=options["top_k"], top_p=options["top_p"], seed=options["random_seed"],
            stop_token_ids=tuple(eol_token_ids(tok)) if options.get("stop_on_eol") else (),
            return_logprobs=bool(options.get("return_output_log_probs")),
            return_prompt_logprobs=bool(options.get("return_output_log_probs")), vocab_size=int(tok.vocab_size))
        if not request["no_log"]:
            self.log(f"request (engine): {len(prompts)} prompt(s), tokens_to_generate={request['tokens_to_generate']}, "
                     f"options={options}")
        try:
            tickets = self.run_engine(prompts, params, gone)
        except EngineStopped as exc:
            return int(HTTPStatus.SERVICE_UNAVAILABLE), {"message": str(exc)}
        except (MegatronUserError, ValueError) as exc:  # the engine refuses the request (e.g. it can never fit)
            return int(HTTPStatus.BAD_REQUEST), {"message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - answer the client, keep serving
            self.log(f"server: engine generation failed: {exc!r}")
            return int(HTTPStatus.INTERNAL_SERVER_ERROR), {"message": f"generation failed: {exc}"}
        if any(t.cancelled for t in tickets):
            self.cancelled_requests += 1
            self.log("request (engine) cancelled: the client closed the connection")
            return CLIENT_CLOSED, {"message": "client closed the connection"}
        rows = [t.prompt_tokens + t.tokens for t in tickets]
        logprobs = ([t.prompt_logprobs + t.logprobs for t in tickets] if options.get("return_output_log_probs")
                    else None)  # generate()'s: log p(token j+1 | ..j) over prompt and generation
        return int(HTTPStatus.OK), {"text": [tok.detokenize(r) for r in rows],
                                    "segments": [[tok.detokenize([t]) for t in r] for r in rows], "logprobs": logprobs}

    # -- collectives -------------------------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        if self._distributed():
            dist.broadcast_object_list(box, src=self.src_rank, group=self.group)
        return box[0]

    def stop_check(self, gone: Callable[[], bool] = lambda: False) -> StopCheck:
        """The per-step cancel decision of one request (rank 0 passes its client test; the other ranks listen)."""
        return StopCheck(gone, self.group, self.src_rank, self._distributed())

    def note_cancelled(self, stop: StopCheck, what: str) -> None:
        """Count and log a request that `stop` ended because its client left."""
        self.cancelled_requests += 1
        self.last_cancel_steps = stop.steps
        self.log(f"{what} cancelled after {stop.steps} decoding step(s): the client closed the connection")

    def _run_generate(self, request: dict, stop: StopCheck) -> dict:
        options = dict(request["options"])
        if self.accepted is None or "should_stop" in self.accepted:
            options["should_stop"] = stop
        return self.generate_fn(request["prompts"], request["tokens_to_generate"], **options)

    def worker_loop(self) -> None:
        """Non-zero ranks: run every broadcast request until rank 0 says stop."""
        while True:
            kind, request = self._broadcast(None)
            if kind == "stop":
                return
            if kind == "engine_step" and self.engine is not None:
                self.engine.step()  # failures are collective: the engine raises alike on every rank
            elif kind == "generate":
                try:
                    self._run_generate(request, self.stop_check())
                except Exception as exc:  # noqa: BLE001 - rank 0 reports it; keep serving
                    self.log(f"server worker: generate failed: {exc}")
            elif kind == "openai" and self.openai is not None:
                try:
                    self.openai.run(request, should_stop=self.stop_check())
                except Exception as exc:  # noqa: BLE001 - rank 0 reports it; keep serving
                    self.log(f"server worker: openai completion failed: {exc}")

    # -- request handling (rank 0) -----------------------------------------------------------------------------
    def handle_payload(self, payload: Any, gone: Callable[[], bool] = lambda: False) -> tuple[int, dict]:
        """Validate, broadcast and run one decoded request; returns (HTTP status, JSON body).

        `gone()`: has the client disconnected? Checked before the request reaches the other ranks and after every
        decoding step; a gone client gets status CLIENT_CLOSED (nothing to send) and the generation stops there.
        """
        try:
            request = validate_request(payload, count_tokens=self.count_tokens,
                                       max_sequence_length=self.max_sequence_length,
                                       max_tokens_to_generate=self.max_tokens_to_generate,
                                       max_prompts=self.max_prompts, max_batch_tokens=self.max_batch_tokens,
                                       accepted=self.accepted)
        except BadRequest as exc:
            return int(exc.status), {"message": str(exc)}
        options = request["options"]
        if options.get("random_seed", 0) == -1:
            if self.accepted is None or "random_seed" in self.accepted:
                # every rank must sample the same tokens: rank 0 picks the seed
                options["random_seed"] = random.SystemRandom().randrange(2**31)
        n_prompts = len(request["prompts"])
        if not self.reserve(n_prompts):
            return int(HTTPStatus.TOO_MANY_REQUESTS), {"message": self.busy_message()}
        try:
            if self.driver is not None and request["tokens_to_generate"] > 0:
                return self._engine_payload(request, gone)
            return self._static_payload(request, gone)
        finally:
            self.release(n_prompts)

    def _static_payload(self, request: dict, gone: Callable[[], bool]) -> tuple[int, dict]:
        """One request on the one-at-a-time path (generate_fn under the lock, broadcast to the other ranks)."""
        options = request["options"]
        if not self.lock.acquire(timeout=self.request_timeout_s):  # one request at a time; a bounded wait
            return int(HTTPStatus.SERVICE_UNAVAILABLE), {
                "message": f"the server is busy: the request waited {self.request_timeout_s:g} s for its turn "
                           "(--request-timeout); retry later"}
        try:
            if self._stopped:
                return int(HTTPStatus.SERVICE_UNAVAILABLE), {"message": "the server is shutting down"}
            if gone():
                self.log("request dropped: the client left while it waited for its turn")
                return CLIENT_CLOSED, {"message": "client closed the connection"}
            if not request["no_log"]:
                self.log(f"request: {len(request['prompts'])} prompt(s), "
                         f"tokens_to_generate={request['tokens_to_generate']}, options={options}")
            self._broadcast(("generate", request))
            stop = self.stop_check(gone)
            try:
                result = self._run_generate(request, stop)
            except ValueError as exc:  # generate's own input checks (they fail alike on every rank)
                return int(HTTPStatus.BAD_REQUEST), {"message": str(exc)}
            except Exception as exc:  # noqa: BLE001 - answer the client, keep serving
                self.log(f"server: generate failed: {exc!r}")
                return int(HTTPStatus.INTERNAL_SERVER_ERROR), {"message": f"generation failed: {exc}"}
        finally:
            self.lock.release()
        if stop.cancelled:
            self.note_cancelled(stop, "request")
            return CLIENT_CLOSED, {"message": "client closed the connection"}
        body = {"text": result.get("text"), "segments": result.get("segments"),
                "logprobs": result.get("logprobs") if options.get("return_output_log_probs") else None}
        return int(HTTPStatus.OK), _jsonable(body)

    def _heartbeat(self) -> None:
        while not self._idle.wait(self.heartbeat_s):
            with self.lock:
                if self._stopped:
                    return
                self._broadcast(("ping", None))

    def release_workers(self) -> None:
        """Stop the engine driver and tell the other ranks to leave `worker_loop` (idempotent)."""
        if self.driver is not None:
            self.driver.stop()
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
            self._idle.set()
            self._broadcast(("stop", None))

    # -- HTTP plumbing -----------------------------------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> tuple[str, int]:
        """Create the listening socket (port 0 picks a free one); returns the bound (host, port)."""
        self.httpd = _HTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        return self.httpd.server_address[:2]

    def serve_forever(self) -> None:
        """Serve until `shutdown()` or KeyboardInterrupt; then release the worker ranks and close the socket."""
        assert self.httpd is not None, "call bind() first"
        if self._distributed():
            threading.Thread(target=self._heartbeat, name="server-heartbeat", daemon=True).start()
        if self.driver is not None:
            self.driver.start()
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            self.log("server: interrupted, shutting down")
        finally:
            self.release_workers()
            self.httpd.server_close()

    def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Bind and serve from a background thread (tests); returns the bound address."""
        address = self.bind(host, port)
        self._thread = threading.Thread(target=self.serve_forever, name="server", daemon=True)
        self._thread.start()
        return address

    def shutdown(self) -> None:
        """Stop a server started with `start()` (from another thread) and release the workers."""
        if self.httpd is not None:
            self.httpd.shutdown()
        if self._thread is not None:
            self._thread.join()
        self.release_workers()


def _make_handler(server: MegatronServer) -> type:
    class Handler(BaseHTTPRequestHandler):
        server_version = "megatron-lite"
        timeout = 120  # seconds a client may stall mid-request before its connection is dropped (see setup)

        def setup(self) -> None:
            self.timeout = min(120.0, server.request_timeout_s)
            super().setup()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
            server.log(f"{self.address_string()} {format % args}")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            if status == HTTPStatus.TOO_MANY_REQUESTS:
                self.send_header("Retry-After", str(RETRY_AFTER_S))
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: dict) -> None:
            self._send(status, json.dumps(obj).encode("utf-8"), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server naming
            path = self.path.split("?", 1)[0]
            if server.openai_chat is not None and openai_chat.serves(path):
                openai_api.handle_http(server, self, server.openai_chat)
                return
            if server.openai is not None and openai_api.serves(path):
                openai_api.handle_http(server, self)
                return
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, (STATIC_DIR / "index.html").read_bytes(), "text/html; charset=utf-8")
            elif path == "/api":
                self._json(HTTPStatus.METHOD_NOT_ALLOWED, {"message": "use PUT /api with a JSON body"})
            else:
                self._json(HTTPStatus.NOT_FOUND, {"message": f"no page {path}; try / or PUT /api"})

        def do_PUT(self) -> None:  # noqa: N802
            if server.openai_chat is not None and openai_chat.serves(self.path):
                openai_api.handle_http(server, self, server.openai_chat)
                return
            if server.openai is not None and openai_api.serves(self.path):
                openai_api.handle_http(server, self)
                return
            if self.path.split("?", 1)[0] != "/api":
                self._json(HTTPStatus.NOT_FOUND, {"message": f"no endpoint {self.path}; use PUT /api"})
                return
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                self._json(HTTPStatus.LENGTH_REQUIRED, {"message": "send the JSON body with a Content-Length"})
                return
            if int(length) > server.max_request_bytes:
                self.close_connection = True
                self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           {"message": f"request body of {length} bytes is over the limit of "
                                       f"{server.max_request_bytes} bytes (--max-request-bytes)"})
                return
            raw = self.rfile.read(int(length))
            if json_depth(raw) > MAX_JSON_DEPTH:
                self._json(HTTPStatus.BAD_REQUEST, {"message": f"the request body nests JSON deeper than "
                                                               f"{MAX_JSON_DEPTH} levels"})
                return
            try:
                payload = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"message": f"the request body is not valid JSON: {exc}"})
                return
            status, body = server.handle_payload(payload, lambda: client_gone(self.connection))
            if status == CLIENT_CLOSED:
                self.close_connection = True  # nobody to answer
                return
            self._json(status, body)

        do_POST = do_PUT  # noqa: N815 - convenience alias

    return Handler


def build_server(model: torch.nn.Module, tokenizer: Any, *, max_sequence_length: int, **kwargs: Any) -> MegatronServer:
    """A MegatronServer running `megatron.text_generation.generate(model, tokenizer, ...)` (kwargs: see the class)."""
    def count_tokens(text: str) -> int:
        return len(tokenizer.tokenize(text)) if text else 0

    server = MegatronServer(functools.partial(generate, model, tokenizer), count_tokens,
                            max_sequence_length=max_sequence_length, tokenizer=tokenizer, **kwargs)
    server.openai = openai_api.OpenAICompletions(
        model, tokenizer, max_sequence_length=max_sequence_length, max_tokens_limit=server.max_tokens_to_generate,
        max_prompts=server.max_prompts, max_batch_tokens=server.max_batch_tokens)
    server.openai_chat = openai_chat.OpenAIChat(server.openai)
    return server
