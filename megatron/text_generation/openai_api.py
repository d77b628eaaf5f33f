"""OpenAI-compatible completions on the REST server: `POST /v1/completions` (and `/completions`), `GET /v1/models`.

Request fields (OpenAI's legacy completions API): `prompt` (string, list of strings, token ids or list of token-id
lists), `max_tokens` (default 16; 0 only with `echo`), `temperature` (default 1; 0 = greedy), `top_p`, `top_k`
(extension; not together with top_p < 1), `stop` (string or up to 16 strings: OpenAI allows 4, but lm-eval adds
EOS to a task's list), `logprobs` (top-n, 0..5), `echo` (prompt tokens and their log-probs returned too: what
lm-eval's `local-completions` sends, with `max_tokens` 1),
`seed`, `n` / `best_of` = 1, `stream` (server-sent events), `model` (any name: one model is served), `user`.
Penalties and `logit_bias` are accepted only at their neutral values; any other field is refused. Errors use
OpenAI's shape `{"error": {"message", "type", "param", "code"}}` with HTTP 400 (413 for bodies over the limit).

Execution follows the server's `PUT /api`: rank 0 validates, broadcasts the checked request to every rank
(`("openai", request)`) and all ranks run `OpenAICompletions.run`: KV-cache generation (`generate_tokens`, stopping at
end-of-document or a one-token stop string) and, when log-probs are asked for, one teacher-forced scoring pass
(megatron/text_generation/scoring.py) over prompt + completion. The completion text is cut at the first stop
string (`finish_reason` "stop"; "length" when `max_tokens` ran out). With `stream`, server-sent events carry the
text while it is generated (held back only where a stop string could still begin), then each choice's
finish_reason and logprobs, then `data: [DONE]`.
"""
from __future__ import annotations

import json
import random
import time
import uuid
from http import HTTPStatus
from typing import Any, Callable, Optional

import torch

from megatron.errors import MegatronUserError
from megatron.text_generation.disconnect import client_gone
from megatron.text_generation.engine_driver import EngineStopped
from megatron.text_generation.generation import generate_tokens
from megatron.text_generation.http_limits import MAX_JSON_DEPTH, json_depth
from megatron.text_generation.scoring import score_tokens
from megatron.text_generation.stream_writer import StreamWriter

COMPLETION_PATHS = ("/v1/completions", "/completions")
MODEL_PATHS = ("/v1/models", "/models")
MAX_LOGPROBS = 5
MAX_STOP = 16
NEUTRAL_FIELDS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None}
KNOWN_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stop", "logprobs",
                "echo", "seed", "stream", "stream_options", "user", *NEUTRAL_FIELDS}


class OpenAIError(Exception):
    """A refused request: HTTP `status` and OpenAI's error object."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = HTTPStatus.BAD_REQUEST,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param, self.status, self.kind = param, int(status), kind

    def body(self) -> dict:
        return error_body(str(self), self.param, self.kind)


def error_body(message: str, param: Optional[str] = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _int(payload: dict, name: str, default: Optional[int], lo: Optional[int] = None, hi: Optional[int] = None
         ) -> Optional[int]:
    value = payload.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                          and not value.is_integer()):
        raise OpenAIError(f"{name} must be an integer, got {json.dumps(value)}", name)
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise OpenAIError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", name)
    return value


def _float(payload: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = payload.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise OpenAIError(f"{name} must be a number, got {json.dumps(value)}", name)
    if not lo <= value <= hi:
        raise OpenAIError(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return float(value)


class OpenAICompletions:
    """Validation (rank 0), execution (every rank) and response building for the OpenAI-style endpoints."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_sequence_length: int,
                 model_name: str = "megatron-gpt", max_tokens_limit: Optional[int] = None, max_prompts: int = 128,
                 max_batch_tokens: Optional[int] = None, state: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_sequence_length = int(max_sequence_length)
        self.model_name = model_name
        self.max_tokens_limit = max_tokens_limit
        self.max_prompts = max_prompts
        self.max_batch_tokens = max_batch_tokens
        self.state = state
        self.eod = int(tokenizer.eod)
        self.vocab_size = int(tokenizer.vocab_size)
        self.created = int(time.time())

    # -- validation (rank 0) -------------------------------------------------------------------------------------
    def _prompts(self, prompt: Any) -> tuple[list[list[int]], list[Optional[str]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise OpenAIError("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "token-id lists (non-empty)", "prompt")
        if len(prompt) > self.max_prompts:
            raise OpenAIError(f"too many prompts ({len(prompt)}); the maximum is {self.max_prompts}", "prompt")
        ids, texts = [], []
        for p in prompt:
            if isinstance(p, str):
                toks = [int(t) for t in self.tokenizer.tokenize(p)] if p else []
                texts.append(p)
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad:
                    raise OpenAIError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      "prompt")
                toks = list(p)
                texts.append(None)
            else:
                raise OpenAIError("prompt must be strings or lists of token ids, not a mix", "prompt")
            ids.append(toks or [self.eod])  # an empty prompt starts from <|endoftext|>, as OpenAI's models do
        return ids, texts

    def validate(self, payload: Any) -> dict:
        """Check a decoded JSON body; the request every rank runs, or OpenAIError."""
        if not isinstance(payload, dict):
            raise OpenAIError('the request body must be a JSON object such as {"prompt": "Hello", "max_tokens": 16}')
        # null means absent, as in OpenAI's API for optional fields (lm-eval's local-completions sends "model": null)
        payload = {name: value for name, value in payload.items() if value is not None}
        unknown = sorted(set(payload) - KNOWN_FIELDS)
        if unknown:
            raise OpenAIError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
        for name, neutral in NEUTRAL_FIELDS.items():
            value = payload.get(name)
            if value not in (None, neutral) and not (name == "logit_bias" and value == {}):
                raise OpenAIError(f"{name} is not supported by this server (only {json.dumps(neutral)})", name)
        if "prompt" not in payload:
            raise OpenAIError("missing required field: prompt", "prompt")
        if not isinstance(payload.get("model", ""), str):
            raise OpenAIError("model must be a string", "model")
        for name in ("n", "best_of"):
            if _int(payload, name, 1) != 1:
                raise OpenAIError(f"{name} must be 1 on this server (one completion per prompt)", name)
        prompts, texts = self._prompts(payload["prompt"])
        max_tokens = _int(payload, "max_tokens", 16, 0)
        echo = payload.get("echo", False)
        stream = payload.get("stream", False)
        for name, value in (("echo", echo), ("stream", stream)):
            if not isinstance(value, bool):
                raise OpenAIError(f"{name} must be true or false", name)
        if max_tokens == 0 and not echo:
            raise OpenAIError("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        if self.max_tokens_limit is not None and max_tokens > self.max_tokens_limit:
            raise OpenAIError(f"max_tokens={max_tokens} exceeds this server's limit of {self.max_tokens_limit}",
                              "max_tokens")
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.max_sequence_length:
            raise OpenAIError(f"this model's maximum context length is {self.max_sequence_length} tokens; the "
                              f"prompt has {longest} and max_tokens asks for {max_tokens}; shorten one",
                              "max_tokens")
        if self.max_batch_tokens is not None and len(prompts) * (longest + max_tokens) > self.max_batch_tokens:
            raise OpenAIError(f"{len(prompts)} prompt(s) x {longest + max_tokens} tokens is over this server's "
                              f"limit of {self.max_batch_tokens} tokens per request", "prompt")
        temperature = _float(payload, "temperature", 1.0, 0.0, 2.0)
        top_p = _float(payload, "top_p", 1.0, 0.0, 1.0)
        top_k = _int(payload, "top_k", 0, 0)
        if top_p == 0.0:
            raise OpenAIError("top_p must be > 0", "top_p")
        if top_k and top_p < 1.0:
            raise OpenAIError("set top_k or top_p, not both", "top_k")
        stop = payload.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
            raise OpenAIError(f"stop must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
        logprobs = _int(payload, "logprobs", None, 0, MAX_LOGPROBS)
        seed = _int(payload, "seed", None, 0, 2**63 - 1)
        options = payload.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict)
                                    or set(options) - {"include_usage"}):
            raise OpenAIError("stream_options must be {\"include_usage\": bool} and needs stream: true",
                              "stream_options")
        return {"prompts": prompts, "texts": texts, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "stop": stop, "logprobs": logprobs, "echo": echo,
                "seed": seed if seed is not None else random.SystemRandom().randrange(2**31),
                "stream": stream, "include_usage": bool((options or {}).get("include_usage")),
                "model": payload.get("model") or self.model_name}

    # -- execution (every rank) ----------------------------------------------------------------------------------
    def stop_token_ids(self, req: dict) -> list[int]:
        """The ids generation stops at besides eod: one-token stop strings and the request's `end_token_ids` (the
        chat route's end-of-turn token)."""
        ids = []
        for s in req["stop"]:
            toks = self.tokenizer.tokenize(s)
            if len(toks) == 1:
                ids.append(int(toks[0]))
        return ids + [int(t) for t in req.get("end_token_ids", ())]

    def run(self, req: dict, on_step: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
            should_stop: Optional[Callable[[], bool]] = None) -> list[dict]:
        """Generate (and score) on every rank; the raw per-prompt results (tokens, scores) used by `response`.

        `on_step(tokens, lengths)` (rank 0, streaming) sees the tokens after every decoding step; `should_stop`
        (the server's StopCheck, on every rank) ends a request whose client left: no scoring pass follows then.
        """
        prompts, max_tokens = req["prompts"], req["max_tokens"]
        cancelled = False
        if max_tokens > 0:
            greedy = req["temperature"] == 0.0
            out = generate_tokens(
                self.model, prompts, max_tokens, eod_id=self.eod, greedy=greedy,
                temperature=1.0 if greedy else req["temperature"], top_k=req["top_k"],
                top_p=0.0 if req["top_p"] >= 1.0 else req["top_p"], stop_token_ids=self.stop_token_ids(req),
                random_seed=req["seed"] % 2**62, vocab_size=self.vocab_size, state=self.state, on_step=on_step,
                should_stop=should_stop)
            seqs = [row[:n] for row, n in zip(out.tokens.tolist(), out.lengths.tolist())]
            cancelled = out.cancelled
        else:
            seqs = [list(p) for p in prompts]
        results = [{"prompt": p, "generated": s[len(p):]} for p, s in zip(prompts, seqs)]
        if req["logprobs"] is not None and not cancelled:
            starts = [1 if req["echo"] else len(p) for p in prompts]
            todo = [i for i, (s, a) in enumerate(zip(seqs, starts)) if a < len(s)]
            scored = score_tokens(self.model, [seqs[i] for i in todo], vocab_size=self.vocab_size,
                                  score_from=[starts[i] for i in todo], top_n=max(req["logprobs"], 1),
                                  pad_id=self.eod, state=self.state)
            for i, s in zip(todo, scored):
                results[i]["scored"] = s
        return results

    # -- response (rank 0) ---------------------------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.tokenizer.detokenize([token])

    def choice(self, index: int, req: dict, res: dict) -> tuple[dict, int]:
        """One `text_completion` choice of result `res` (cut at eod or a stop string) and its completion tokens."""
        prompt, gen = res["prompt"], list(res["generated"])
        finish = "length"
        if self.eod in gen:
            gen, finish = gen[: gen.index(self.eod) + 1], "stop"  # the eod stays in the token list, not the text
        text_tokens = gen[:-1] if finish == "stop" else gen
        text = self.tokenizer.detokenize(text_tokens)
        cut = min((i for i in (text.find(s) for s in req["stop"]) if i >= 0), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
            keep, covered = 0, 0  # tokens that start before the cut
            for t in text_tokens:
                if covered >= cut:
                    break
                covered += len(self._piece(t))
                keep += 1
            gen = text_tokens[:keep]
        n_completion = len(gen)
        prompt_text = req["texts"][index] if req["texts"][index] is not None else self.tokenizer.detokenize(prompt)
        choice = {"index": index, "text": (prompt_text + text) if req["echo"] else text, "logprobs": None,
                  "finish_reason": finish}
        if req["logprobs"] is not None:
            shown = (prompt + gen) if req["echo"] else gen  # scored entry k is shown[k + 1] (echo) or shown[k]
            scored = res.get("scored")
            tokens = [self._piece(t) for t in shown]
            token_logprobs: list[Optional[float]] = []
            top_logprobs: list[Optional[dict]] = []
            if req["echo"]:
                token_logprobs.append(None)
                top_logprobs.append(None)
            for k in range(len(shown) - (1 if req["echo"] else 0)):
                token_logprobs.append(scored.logprobs[k])
                top = {}
                for tid, lp in zip(scored.top_ids[k][: max(req["logprobs"], 1)],
                                   scored.top_logprobs[k][: max(req["logprobs"], 1)]):
                    top.setdefault(self._piece(tid), lp)
                top_logprobs.append(top if req["logprobs"] > 0 else {})
            offsets, at = [], len(prompt_text) if not req["echo"] else 0
            for piece in tokens:
                offsets.append(at)
                at += len(piece)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                                  "text_offset": offsets}
        return choice, n_completion

    def response(self, req: dict, results: list[dict]) -> dict:
        """The OpenAI `text_completion` object."""
        choices, completion = [], 0
        for i, res in enumerate(results):
            choice, n = self.choice(i, req, res)
            choices.append(choice)
            completion += n
        prompt_tokens = sum(len(r["prompt"]) for r in results)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req["model"], "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def stream_chunks(self, req: dict) -> CompletionChunks:
        """The events of one streamed response to `req`."""
        return CompletionChunks(req)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megatron"}]}


class CompletionChunks:
    """The server-sent events of one streamed `text_completion` (the chat route has its own kind)."""

    def __init__(self, req: dict, prefix: str = "cmpl-", kind: str = "text_completion") -> None:
        self.req, self.id, self.created, self.kind = req, f"{prefix}{uuid.uuid4().hex}", int(time.time()), kind

    def event(self, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.req["model"],
                "choices": choices, **extra}

    def opening(self, index: int) -> list[dict]:
        """Events sent before any text of choice `index` (none here)."""
        return []

    def text(self, index: int, text: str) -> dict:
        return self.event([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def final_text(self, choice: dict) -> str:
        """The whole (stop-cut) text of a choice of the non-streamed response."""
        return choice["text"]

    def finish(self, choice: dict) -> dict:
        return self.event([{"index": choice["index"], "text": "", "logprobs": choice["logprobs"],
                            "finish_reason": choice["finish_reason"]}])

    def usage(self, usage: dict) -> dict:
        return self.event([], usage=usage)


class TextStream:
    """The text of one choice, sent while it is generated: never text that a stop string could still cut away."""

    def __init__(self, api: OpenAICompletions, req: dict, index: int, emit: Callable[[int, str], None]) -> None:
        self.api, self.req, self.index, self.emit = api, req, index, emit
        self.prefix = ""
        if req["echo"]:
            texts = req["texts"]
            self.prefix = texts[index] if texts[index] is not None else api.tokenizer.detokenize(req["prompts"][index])
        self.holdback = max((len(stop) for stop in req["stop"]), default=1) - 1
        self.sent = ""

    def _send_upto(self, text: str, end: int) -> None:
        if end > len(self.sent) and text.startswith(self.sent):
            self.emit(self.index, text[len(self.sent):end])
            self.sent = text[:end]

    def feed(self, generated: list[int]) -> None:
        """The tokens generated so far: send what is certain."""
        if self.api.eod in generated:
            generated = generated[: generated.index(self.api.eod)]
        text = self.prefix + self.api.tokenizer.detokenize(generated)
        cuts = [i for i in (text.find(stop, len(self.prefix)) for stop in self.req["stop"]) if i >= 0]
        end = min(cuts) if cuts else len(text) - self.holdback
        while end > 0 and text[end - 1] == "\ufffd":  # a character whose bytes are not all generated yet
            end -= 1
        self._send_upto(text, end)

    def finish(self, final_text: str) -> None:
        """Send the rest of the final (stop-cut) text."""
        self._send_upto(final_text, len(final_text))


# -- HTTP glue (called from megatron/text_generation/server.py) ----------------------------------------------------
def serves(path: str) -> bool:
    return path.split("?", 1)[0] in COMPLETION_PATHS + MODEL_PATHS


def handle_http(server: Any, handler: Any, api: Any = None) -> None:
    """Answer one request for an OpenAI path on `handler` (a BaseHTTPRequestHandler of `server`); `api` (default
    the server's OpenAICompletions) validates, runs and answers it (megatron/text_generation/openai_chat.py's
    OpenAIChat for /v1/chat/completions)."""
    api = api if api is not None else server.openai
    path = handler.path.split("?", 1)[0]

    def send(status: int, obj: dict) -> None:
        handler._send(status, json.dumps(obj).encode("utf-8"), "application/json")

    if path in MODEL_PATHS:
        if handler.command != "GET":
            send(HTTPStatus.METHOD_NOT_ALLOWED, error_body(f"use GET {path}"))
        else:
            send(HTTPStatus.OK, api.models())
        return
    if handler.command != "POST":
        send(HTTPStatus.METHOD_NOT_ALLOWED, error_body(f"use POST {path} with a JSON body"))
        return
    length = handler.headers.get("Content-Length")
    if length is None or not length.isdigit():
        handler.close_connection = True
        send(HTTPStatus.LENGTH_REQUIRED, error_body("send the JSON body with a Content-Length"))
        return
    if int(length) > server.max_request_bytes:
        handler.close_connection = True
        send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
             error_body(f"request body of {length} bytes is over the limit of {server.max_request_bytes} bytes"))
        return
    raw = handler.rfile.read(int(length))
    if json_depth(raw) > MAX_JSON_DEPTH:
        send(HTTPStatus.BAD_REQUEST, error_body(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"))
        return
    try:
        payload = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        send(HTTPStatus.BAD_REQUEST, error_body(f"the request body is not valid JSON: {exc}"))
        return
    try:
        req = api.validate(payload)
    except OpenAIError as exc:
        send(exc.status, exc.body())
        return
    n_prompts = len(req["prompts"])
    if not server.reserve(n_prompts):
        send(HTTPStatus.TOO_MANY_REQUESTS, error_body(server.busy_message(), kind="rate_limit_error"))
        return
    try:
        if server.driver is not None and req["logprobs"] is None and req["max_tokens"] > 0:
            _engine_completion(server, api, handler, req, send)
        else:
            _static_completion(server, api, handler, req, send)
    finally:
        server.release(n_prompts)


def _static_completion(server: Any, api: OpenAICompletions, handler: Any, req: dict,
                       send: Callable[[int, dict], None]) -> None:
    """One validated completion on the server's one-at-a-time path (under its lock, broadcast to every rank)."""
    if not server.lock.acquire(timeout=server.request_timeout_s):  # one request at a time; a bounded wait
        send(HTTPStatus.SERVICE_UNAVAILABLE, error_body(
            f"the server is busy: the request waited {server.request_timeout_s:g} s for its turn (--request-timeout);"
            " retry later", kind="server_error"))
        return
    if server._stopped:
        server.lock.release()
        send(HTTPStatus.SERVICE_UNAVAILABLE, error_body("the server is shutting down", kind="server_error"))
        return
    gone = _client_test(handler)
    if gone():
        server.lock.release()
        server.log("openai completion dropped: the client left while it waited for its turn")
        handler.close_connection = True
        return
    if req["stream"]:
        _stream(server, api, handler, req)  # releases the lock
        return
    stop = server.stop_check(gone)
    try:
        server.log(f"openai completion: {len(req['prompts'])} prompt(s), max_tokens={req['max_tokens']}")
        server._broadcast(("openai", req))
        results = api.run(req, should_stop=stop)
    except ValueError as exc:  # generation's own input checks fail alike on every rank
        server.lock.release()
        send(HTTPStatus.BAD_REQUEST, error_body(str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - answer the client, keep serving
        server.lock.release()
        server.log(f"server: openai completion failed: {exc!r}")
        send(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(f"generation failed: {exc}", kind="server_error"))
        return
    server.lock.release()
    if stop.cancelled:
        server.note_cancelled(stop, "openai completion")
        handler.close_connection = True
        return
    send(HTTPStatus.OK, api.response(req, results))


def engine_params(server: Any, api: OpenAICompletions, req: dict) -> Any:
    """The engine's SamplingParams of a validated request (what `OpenAICompletions.run` gives generate_tokens)."""
    greedy = req["temperature"] == 0.0
    return server.sampling_params(
        max_new_tokens=req["max_tokens"], temperature=1.0 if greedy else req["temperature"],
        top_k=1 if greedy else req["top_k"], top_p=0.0 if req["top_p"] >= 1.0 else req["top_p"],
        seed=req["seed"] % 2**62, stop_token_ids=tuple(api.stop_token_ids(req)), return_logprobs=False,
        vocab_size=api.vocab_size)


def _engine_completion(server: Any, api: OpenAICompletions, handler: Any, req: dict,
                       send: Callable[[int, dict], None]) -> None:
    """One validated completion through the engine driver (no lock: it runs among the other requests)."""
    if req["stream"]:
        _stream(server, api, handler, req, engine=True)
        return
    server.log(f"openai completion (engine): {len(req['prompts'])} prompt(s), max_tokens={req['max_tokens']}")
    try:
        tickets = server.run_engine(req["prompts"], engine_params(server, api, req), _client_test(handler))
    except EngineStopped as exc:
        send(HTTPStatus.SERVICE_UNAVAILABLE, error_body(str(exc), kind="server_error"))
        return
    except (MegatronUserError, ValueError) as exc:  # the engine refuses the request (e.g. it can never fit)
        send(HTTPStatus.BAD_REQUEST, error_body(str(exc)))
        return
    except Exception as exc:  # noqa: BLE001 - answer the client, keep serving
        server.log(f"server: openai completion failed: {exc!r}")
        send(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(f"generation failed: {exc}", kind="server_error"))
        return
    if any(t.cancelled for t in tickets):
        server.cancelled_requests += 1
        server.log("openai completion (engine) cancelled: the client closed the connection")
        handler.close_connection = True
        return
    results = [{"prompt": p, "generated": t.tokens} for p, t in zip(req["prompts"], tickets)]
    send(HTTPStatus.OK, api.response(req, results))


def _client_test(handler: Any) -> Callable[[], bool]:
    """`gone()` for the client of `handler`: its connection closed, or (streaming) its stream dropped."""
    connection = getattr(handler, "connection", None)
    return lambda: client_gone(connection)


def _stream(server: Any, api: OpenAICompletions, handler: Any, req: dict, engine: bool = False) -> None:
    """Server-sent events: text chunks while the tokens are generated, then each choice's finish_reason (and
    logprobs), optionally the usage, then `data: [DONE]`. Called holding the server lock (not with `engine`: the
    engine driver runs the request among the others); releases it when the generation ends. The socket is written
    by a StreamWriter thread, never under the lock: a client that does not read stalls only itself and is dropped
    after the stall timeout. A client that goes away (its connection closed, or its stream dropped) stops the
    generation at the next decoding step on every rank (StopCheck; with the engine, its requests are cancelled)."""
    unlock = (lambda: None) if engine else server.lock.release
    chunks = api.stream_chunks(req)
    try:
        handler.send_response(HTTPStatus.OK)
        handler.send_header("Content-Type", "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.close_connection = True  # the end of the stream is the end of the connection
        handler.end_headers()  # a few bytes into a fresh connection's empty send buffer
        out = StreamWriter(handler.wfile, getattr(handler, "connection", None), getattr(handler, "timeout", None)
                           or server.request_timeout_s, server.log, handler.address_string())
    except BaseException:
        unlock()
        raise

    def event(obj: dict) -> None:
        out.put(f"data: {json.dumps(obj)}\n\n".encode())

    connection_gone = _client_test(handler)
    try:
        for i in range(len(req["prompts"])):
            for obj in chunks.opening(i):
                event(obj)
        streams = [TextStream(api, req, i, lambda i, text: event(chunks.text(i, text)))
                   for i in range(len(req["prompts"]))]
        run = _stream_engine if engine else _stream_static
        results, cancelled = run(server, api, req, streams, lambda: out.broken or connection_gone())
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream, keep serving
        unlock()
        server.log(f"server: openai completion failed: {exc!r}")
        event(error_body(f"generation failed: {exc}", kind="server_error"))
        out.put(b"data: [DONE]\n\n")
        out.close()
        return
    unlock()
    if cancelled:
        out.close()
        return
    body = api.response(req, results)
    for stream, choice in zip(streams, body["choices"]):
        stream.finish(chunks.final_text(choice))
        event(chunks.finish(choice))
    if req["include_usage"]:
        event(chunks.usage(body["usage"]))
    out.put(b"data: [DONE]\n\n")
    out.close()


def _stream_static(server: Any, api: OpenAICompletions, req: dict, streams: list[TextStream],
                   gone: Callable[[], bool]) -> tuple[list[dict], bool]:
    """A streamed request on the one-at-a-time path: (results, cancelled)."""
    prompt_lengths = [len(p) for p in req["prompts"]]

    def on_step(tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        for i, (row, n) in enumerate(zip(tokens.tolist(), lengths.tolist())):
            streams[i].feed(row[prompt_lengths[i]: n])

    stop = server.stop_check(gone)
    server.log(f"openai completion (stream): {len(req['prompts'])} prompt(s), max_tokens={req['max_tokens']}")
    server._broadcast(("openai", req))
    results = api.run(req, on_step=on_step, should_stop=stop)
    if stop.cancelled:
        server.note_cancelled(stop, "openai completion (stream)")
    return results, stop.cancelled


def _stream_engine(server: Any, api: OpenAICompletions, req: dict, streams: list[TextStream],
                   gone: Callable[[], bool]) -> tuple[list[dict], bool]:
    """A streamed request through the engine driver: (results, cancelled)."""
    server.log(f"openai completion (engine, stream): {len(req['prompts'])} prompt(s), max_tokens={req['max_tokens']}")
    tickets = server.run_engine(req["prompts"], engine_params(server, api, req), gone,
                                lambda ticket, n: streams[ticket.index].feed(ticket.tokens[:n]))
    cancelled = any(t.cancelled for t in tickets)
    if cancelled:
        server.cancelled_requests += 1
        server.log("openai completion (engine, stream) cancelled: the client closed the connection")
    return [{"prompt": p, "generated": t.tokens} for p, t in zip(req["prompts"], tickets)], cancelled


def run_on_worker(server: Any, req: dict) -> None:
    """Non-zero ranks: take part in one broadcast OpenAI request."""
    server.openai.run(req, should_stop=server.stop_check())
