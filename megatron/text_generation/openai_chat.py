"""OpenAI-compatible chat completions on the REST server: `POST /v1/chat/completions` (and `/chat/completions`).

The messages are rendered with the chat template of the served checkpoint's Hugging Face tokenizer (its
`apply_chat_template` with the generation prompt, through megatron/tokenizer/chat_format.py); a tokenizer
without a template gets a one-line 400 (Megatron-LM's server has no fallback template flag either). The rendered
prompt then runs as a completions request (megatron/text_generation/openai_api.py: same validation of the sampling
fields, size limits, broadcast to every rank, streaming writer and cancel on disconnect), `n` times in one batch,
with the template's end-of-turn token as a stop token: generation ends there and the token is not in the content.

Request fields (OpenAI's chat API): `messages` (system/developer/user/assistant turns, content a string or a list of
text parts), `max_completion_tokens` or `max_tokens` (default: the room left in the context, at most the server's
limit), `temperature`, `top_p`, `top_k` (extension), `n`, `stop`, `logprobs` (bool) with `top_logprobs` (0..20),
`seed`, `stream` with `stream_options`, `model`, `user`; penalties and `logit_bias` only at their neutral values.
Streaming sends, per choice, a role delta first, then content deltas, then a chunk with the finish_reason (and the
logprobs), optionally the usage, then `data: [DONE]`.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch

from megatron.errors import ArgumentError
from megatron.text_generation.openai_api import NEUTRAL_FIELDS, CompletionChunks, OpenAICompletions, OpenAIError
from megatron.tokenizer.chat_format import ChatFormat, ConversationError, chat_format_for

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20
KNOWN_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                "stop", "logprobs", "top_logprobs", "seed", "stream", "stream_options", "user",
                *(set(NEUTRAL_FIELDS) - {"suffix"})}
PASSED_ON = ("model", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options")


def serves(path: str) -> bool:
    """Whether `path` (query string ignored) is the chat route."""
    return path.split("?", 1)[0] in CHAT_PATHS


def _count(payload: dict, name: str, lo: int, hi: int) -> Optional[int]:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise OpenAIError(f"{name} must be an integer in [{lo}, {hi}], got {json.dumps(value)}", name)
    return value


def _content(index: int, message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"messages[{index}].content must be a string or a list of text parts "
                      '({"type": "text", "text": ...})', "messages")


def check_messages(messages: Any) -> list[dict]:
    """The conversation as the template takes it ({role, content[, name]}), or OpenAIError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise OpenAIError(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", "messages")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise OpenAIError(f"messages[{i}].{extra[0]} is not supported by this server", "messages")
        turn = {"role": "system" if message["role"] == "developer" else message["role"],
                "content": _content(i, message)}
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
        out.append(turn)
    return out


class ChatChunks(CompletionChunks):
    """The server-sent events of one streamed `chat.completion.chunk` response."""

    def __init__(self, req: dict) -> None:
        super().__init__(req, prefix="chatcmpl-", kind="chat.completion.chunk")

    def opening(self, index: int) -> list[dict]:
        return [self.event([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])]

    def text(self, index: int, text: str) -> dict:
        return self.event([{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])

    def final_text(self, choice: dict) -> str:
        return choice["message"]["content"]

    def finish(self, choice: dict) -> dict:
        return self.event([{"index": choice["index"], "delta": {}, "logprobs": choice["logprobs"],
                            "finish_reason": choice["finish_reason"]}])


class OpenAIChat:
    """Validation (rank 0) and response building for the chat route; execution is `OpenAICompletions.run`."""

    def __init__(self, completions: OpenAICompletions) -> None:
        self.completions = completions
        self.tokenizer, self.eod, self.vocab_size = completions.tokenizer, completions.eod, completions.vocab_size
        try:
            self.format: Optional[ChatFormat] = chat_format_for(self.tokenizer)
        except ArgumentError:  # not a Hugging Face tokenizer, or one without a chat_template
            self.format = None
        self.end_ids = [t for t in self.format.end_of_turn_ids if t != self.eod] if self.format else []
        self.end_texts = [self.tokenizer.detokenize([t]) for t in self.end_ids]

    def render(self, messages: list[dict]) -> list[int]:
        """The prompt tokens of a checked conversation: the template with the assistant's generation prompt."""
        if self.format is None:
            raise OpenAIError(f"this model's tokenizer ({type(self.tokenizer).__name__}) has no chat template; serve "
                              "a checkpoint whose Hugging Face tokenizer has one (chat_template in "
                              "tokenizer_config.json), or use /v1/completions", "messages")
        try:
            return self.format.generation_prompt(messages)
        except ConversationError as exc:
            raise OpenAIError(str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template's own checks (jinja raise_exception) refuse it
            raise OpenAIError(f"the chat template refused the messages: {exc}", "messages") from None

    def _max_tokens(self, payload: dict, n_prompt: int) -> int:
        given = {name: payload[name] for name in ("max_completion_tokens", "max_tokens") if name in payload}
        if len(set(json.dumps(v) for v in given.values())) > 1:
            raise OpenAIError("set max_completion_tokens or max_tokens, not both", "max_tokens")
        if given:
            return next(iter(given.values()))
        room = self.completions.max_sequence_length - n_prompt
        limit = self.completions.max_tokens_limit
        return max(1, min(room, limit) if limit is not None else room)

    def validate(self, payload: Any) -> dict:
        """Check a decoded JSON body; the completions request every rank runs (n rows of the prompt), or
        OpenAIError."""
        if not isinstance(payload, dict):
            raise OpenAIError('the request body must be a JSON object such as {"messages": [{"role": "user", '
                              '"content": "Hello"}]}')
        payload = {name: value for name, value in payload.items() if value is not None}
        unknown = sorted(set(payload) - KNOWN_FIELDS)
        if unknown:
            raise OpenAIError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
        if "messages" not in payload:
            raise OpenAIError("missing required field: messages", "messages")
        n = _count(payload, "n", 1, self.completions.max_prompts) or 1
        logprobs = payload.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise OpenAIError("logprobs must be true or false", "logprobs")
        top = _count(payload, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = self.render(check_messages(payload["messages"]))
        forwarded = {name: payload[name] for name in (*PASSED_ON, *NEUTRAL_FIELDS) if name in payload}
        req = self.completions.validate({**forwarded, "prompt": [prompt] * n,
                                         "max_tokens": self._max_tokens(payload, len(prompt))})
        req.update(stop=req["stop"] + self.end_texts, end_token_ids=self.end_ids, chat=True,
                   logprobs=(top or 0) if logprobs else None)
        return req

    def run(self, req: dict, on_step: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
            should_stop: Optional[Callable[[], bool]] = None) -> list[dict]:
        """Every rank: the completions run of `req` (what the other ranks run for the broadcast request too)."""
        return self.completions.run(req, on_step=on_step, should_stop=should_stop)

    def stop_token_ids(self, req: dict) -> list[int]:
        """The ids generation stops at besides eod (the end-of-turn token among them)."""
        return self.completions.stop_token_ids(req)

    def _logprobs(self, completion: dict, res: dict, n: int) -> Optional[dict]:
        lp = completion["logprobs"]
        if lp is None:
            return None
        count = len(lp["tokens"])
        if n and res["generated"][n - 1] in (self.eod, *self.end_ids):
            count -= 1  # the end of the turn is not content
        return {"content": [{"token": tok, "logprob": lp["token_logprobs"][k], "bytes": list(tok.encode("utf-8")),
                             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                              for t, v in lp["top_logprobs"][k].items()]}
                            for k, tok in enumerate(lp["tokens"][:count])], "refusal": None}

    def response(self, req: dict, results: list[dict]) -> dict:
        """The OpenAI `chat.completion` object."""
        choices, completion_tokens = [], 0
        for i, res in enumerate(results):
            done, n = self.completions.choice(i, req, res)
            choices.append({"index": i, "message": {"role": "assistant", "content": done["text"], "refusal": None},
                            "logprobs": self._logprobs(done, res, n), "finish_reason": done["finish_reason"]})
            if n < len(res["generated"]) and res["generated"][n] in self.end_ids:
                n += 1  # the end-of-turn token was generated (as eod is counted), though not content
            completion_tokens += n
        prompt_tokens = len(results[0]["prompt"])
        chunks = ChatChunks(req)
        return {"id": chunks.id, "object": "chat.completion", "created": chunks.created, "model": req["model"],
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    def stream_chunks(self, req: dict) -> ChatChunks:
        """The events of one streamed response to `req`."""
        return ChatChunks(req)
