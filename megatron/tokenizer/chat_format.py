"""Chat rendering: a conversation (a list of {"role", "content"}) to token ids plus the per-token assistant targets.

Two ways to render, chosen by name (`--sft-tokenizer-prompt-format`):
- Megatron-LM's named prompt formats (its SFTTokenizer's `nemotron-h-aligned` (Megatron's default) and
  `nemotron-nano-v2`, and the text formats of its MultimodalTokenizer: `chatml`, `qwen2p0`, `qwen2p5`, `llama3`,
  `mistral`, `nemotron5`). The targets follow Megatron's `tokenize_conversation`: each turn rendered alone must equal
  its slice of the whole conversation; system and user turns are IGNORE_INDEX, so are the first
  `assistant_prefix_len` tokens of an assistant turn; with a BOS in the template, turns after the first drop theirs.
- `hf`: the tokenizer's own `chat_template` (tokenizer_config.json). An assistant turn's targets are the characters
  the template adds between the conversation up to that turn rendered with the generation prompt and the conversation
  through that turn, mapped to tokens through the fast tokenizer's offsets (so merges across a boundary are safe).

`end_of_turn_ids` gives the ids a chat generation stops at (the template's end-of-turn token, and the EOS/EOD).
Needs only numpy and a transformers tokenizer object (passed in): no model code, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from megatron.errors import ArgumentError, InputFileError

IGNORE_INDEX = -100
HF_TEMPLATE = "hf"
ROLES = ("system", "user", "assistant")

# Megatron-LM's templates (core_v0.16.1 sft_tokenizer.py / multimodal_tokenizer.py): format definitions, kept equal
# so that token ids match Megatron's.
_NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + message['content'].strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\n' + message['content'].strip() + '\n' + '<SPECIAL_11>Assistant\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\n' }}{% endif %}{% endfor %}")
_NEMOTRON_NANO_V2 = (
    "{% for message in messages %}{% set content = message['content'] %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\n' + content.replace('/think', '').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<SPECIAL_11>Assistant\n' + content.strip() + '\n<SPECIAL_12>\n' }}{% endif %}{% endfor %}")
_MISTRAL = (
    "\n{{- bos_token }}\n{%- for message in messages %}\n    {%- if message['role'] == 'user' %}\n"
    "        {{- '[INST] ' + message['content'] + '[/INST]' }}\n    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n    {%- endif %}\n{%- endfor %}\n"
    "{% if add_generation_prompt %}{{ ' ' }}{% endif %}\n")
_QWEN2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_NEMOTRON5 = ("{{- bos_token }}{% for message in messages %}{{'<SPECIAL_14>' + message['role'] + '\n' + "
              "message['content'] + '<SPECIAL_15>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<SPECIAL_14>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class PromptFormat:
    """One of Megatron's named prompt formats (its PromptConfig, plus the token a turn ends with)."""

    template: Optional[str]          # None: the tokenizer's own chat_template
    assistant_prefix_len: int        # tokens of an assistant turn's header (not trained on)
    pad_token: Optional[str]         # None: the tokenizer's pad token (unk for mistral)
    has_bos: bool
    has_system_role: bool
    end_of_turn: Optional[str]       # the token an assistant turn ends with (None: only EOS/EOD)
    empty_turn_is_error: str = "assistant"   # "assistant" (SFTTokenizer) or "any" (MultimodalTokenizer)


PROMPT_FORMATS = {
    "nemotron-h-aligned": PromptFormat(_NEMOTRON_H_ALIGNED, 0, "<SPECIAL_233>", False, True, None),
    "nemotron-nano-v2": PromptFormat(_NEMOTRON_NANO_V2, 3, "<unk>", False, True, "<SPECIAL_12>"),
    "chatml": PromptFormat(None, 3, None, False, True, "<|im_end|>", "any"),
    "qwen2p0": PromptFormat(_QWEN2, 3, None, False, True, "<|im_end|>", "any"),
    "qwen2p5": PromptFormat(_QWEN2, 3, None, False, True, "<|im_end|>", "any"),
    "llama3": PromptFormat(None, 4, "<|end_of_text|>", True, True, "<|eot_id|>", "any"),
    "mistral": PromptFormat(_MISTRAL, 0, "<unk>", True, False, None, "any"),
    "nemotron5": PromptFormat(_NEMOTRON5, 3, "<SPECIAL_233>", True, True, "<SPECIAL_15>", "any"),
}
# Megatron formats refused here, with the reason.
REFUSED_FORMATS = {
    "nvlm-yi-34b": "a vision-language format (image tags)",
    "llama3p1": "Megatron's copy of the Llama-3.1 template with tool calls; use 'hf' with the model's own template",
    "llama3p2": "Megatron's copy of the Llama-3.1 template with tool calls; use 'hf' with the model's own template",
    "nemotron5-aligned": "a multimodal format that rewrites role names",
}
FORMAT_CHOICES = (*PROMPT_FORMATS, HF_TEMPLATE)


class ConversationError(InputFileError):
    """A conversation the chat format cannot render (bad role, empty assistant turn, ...); one line."""


def check_prompt_format(name: str) -> None:
    """Raise ArgumentError (one line) unless `name` is a prompt format this module renders."""
    if name in PROMPT_FORMATS or name == HF_TEMPLATE:
        return
    why = REFUSED_FORMATS.get(name, "not one of Megatron's prompt formats")
    raise ArgumentError(f"--sft-tokenizer-prompt-format {name}: {why}; choose one of {', '.join(FORMAT_CHOICES)}")


def check_conversation(conversation: Any, empty_turn_is_error: str = "assistant") -> None:
    """Raise ConversationError unless `conversation` is a list of {role, content} with known roles and no empty
    assistant turn (or no empty turn at all with empty_turn_is_error="any")."""
    if not isinstance(conversation, list) or not conversation:
        raise ConversationError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    for i, turn in enumerate(conversation):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise ConversationError(f"message {i} must be an object with 'role' and 'content'")
        if turn["role"] not in ROLES:
            raise ConversationError(f"message {i} has role {turn['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(turn["content"], str):
            raise ConversationError(f"message {i} ({turn['role']}): 'content' must be a string")
        if not turn["content"] and (empty_turn_is_error == "any" or turn["role"] == "assistant"):
            raise ConversationError(f"message {i} ({turn['role']}) is empty")


def _ids(encoded: Any) -> list[int]:
    """Token ids out of apply_chat_template(tokenize=True) (a list, or a BatchEncoding in transformers 5)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


class ChatFormat:
    """Renders conversations for one tokenizer and one prompt format (see the module docstring)."""

    def __init__(self, hf_tokenizer: Any, prompt_format: str = HF_TEMPLATE, eod: Optional[int] = None) -> None:
        check_prompt_format(prompt_format)
        self.tokenizer = hf_tokenizer
        self.name = prompt_format
        self.format = PROMPT_FORMATS.get(prompt_format)
        if self.template is None:
            raise ArgumentError(f"--sft-tokenizer-prompt-format {prompt_format}: the tokenizer has no chat_template "
                                "(tokenizer_config.json); choose a named format, e.g. nemotron-h-aligned")
        self.eod = int(eod if eod is not None else hf_tokenizer.eos_token_id)

    @property
    def template(self) -> Optional[str]:
        """The Jinja template used (the format's, else the tokenizer's own)."""
        own = getattr(self.tokenizer, "chat_template", None)
        return self.format.template if self.format is not None and self.format.template is not None else own

    @property
    def pad(self) -> int:
        """Megatron's pad id for this format (the tokenizer's pad, or its unk, when the format names none)."""
        fmt, tok = self.format, self.tokenizer
        if fmt is not None and fmt.pad_token is not None:
            return int(tok.convert_tokens_to_ids(fmt.pad_token))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.unk_token_id
        return int(pad if pad is not None else self.eod)

    def _apply(self, conversation: Sequence[dict], add_generation_prompt: bool = False) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(list(conversation), tokenize=True, return_dict=False,
                                                       add_generation_prompt=add_generation_prompt,
                                                       chat_template=self.template))

    def _text(self, conversation: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(conversation), tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt)

    def _prepare(self, conversation: Sequence[dict]) -> list[dict]:
        conversation = [dict(turn) for turn in conversation]
        if self.format is not None and not self.format.has_system_role and conversation \
                and conversation[0]["role"] == "system":
            conversation = conversation[1:]
        return conversation

    def tokenize_conversation(self, conversation: Sequence[dict], return_target: bool,
                              add_generation_prompt: bool) -> Any:
        """Megatron's signature: token ids (np.int64) and, with return_target, the targets (IGNORE_INDEX where no
        loss is taken, the token id elsewhere)."""
        check_conversation(list(conversation), self.format.empty_turn_is_error if self.format else "assistant")
        conversation = self._prepare(conversation)
        if not return_target:
            return np.asarray(self._apply(conversation, add_generation_prompt), dtype=np.int64)
        if self.format is None:
            tokens, mask = self._hf_targets(conversation)
        else:
            tokens = self._apply(conversation, add_generation_prompt)
            mask = self._megatron_targets(conversation, tokens)
        tokens = np.asarray(tokens, dtype=np.int64)
        target = np.where(np.asarray(mask, dtype=bool), tokens, IGNORE_INDEX).astype(np.int64)
        return tokens, target

    def render(self, conversation: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """(token ids, per-token flag: an assistant target) of a whole conversation."""
        tokens, target = self.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)
        return tokens.tolist(), (target != IGNORE_INDEX).tolist()

    def generation_prompt(self, conversation: Sequence[dict]) -> list[int]:
        """Token ids of the conversation followed by the template's assistant header (what a chat reply continues)."""
        return self.tokenize_conversation(conversation, return_target=False, add_generation_prompt=True).tolist()

    def _megatron_targets(self, conversation: list[dict], tokens: list[int]) -> list[bool]:
        """Megatron's per-turn masking: every turn rendered alone is the next slice of the whole."""
        mask = [True] * len(tokens)
        idx = 0
        for turn_idx, turn in enumerate(conversation):
            role = turn["role"]
            if role == "assistant" and self.format.empty_turn_is_error == "assistant" and (
                    turn_idx == 0 or conversation[turn_idx - 1]["role"] != "user"):
                raise ConversationError(f"message {turn_idx} (assistant) must follow a user message")
            turn_tokens = self._apply([turn])
            if self.format.has_bos and turn_idx > 0:
                turn_tokens = turn_tokens[1:]
            n = len(turn_tokens)
            if tokens[idx:idx + n] != turn_tokens:
                raise ConversationError(f"message {turn_idx} ({role}) does not render to the same tokens alone as "
                                        f"in the conversation under prompt format {self.name}")
            if role in ("system", "user"):
                mask[idx:idx + n] = [False] * n
            else:
                k = min(self.format.assistant_prefix_len, n)
                mask[idx:idx + k] = [False] * k
            idx += n
        if idx != len(tokens):
            raise ConversationError(f"the turns of a conversation do not add up to the whole under prompt format "
                                    f"{self.name}")
        return mask

    def _hf_targets(self, conversation: list[dict]) -> tuple[list[int], list[bool]]:
        """The tokenizer's template: assistant spans from rendered prefixes, mapped to tokens by offsets."""
        full = self._text(conversation)
        spans = []
        for i, turn in enumerate(conversation):
            if turn["role"] != "assistant":
                continue
            before = self._text(conversation[:i], add_generation_prompt=True) if i else ""
            through = self._text(conversation[:i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise ConversationError(f"the tokenizer's chat_template does not render message {i} (assistant) as "
                                        "an extension of the conversation before it; use a named prompt format")
            spans.append((len(before), len(through)))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
        return [int(i) for i in enc["input_ids"]], mask

    @property
    def end_of_turn_ids(self) -> list[int]:
        """Ids a chat generation stops at: the template's end-of-turn token (when it has one) and the EOD."""
        ids = []
        marker = self.format.end_of_turn if self.format is not None else self._hf_end_of_turn()
        if marker is not None:
            ids.append(int(self.tokenizer.convert_tokens_to_ids(marker)))
        if self.eod not in ids:
            ids.append(self.eod)
        return ids

    def _hf_end_of_turn(self) -> Optional[str]:
        """The first special token the tokenizer's template writes after an assistant message's content."""
        probe = "Zq9x"
        text = self._text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}])
        tail = text[text.rindex(probe) + len(probe):]
        specials = sorted(set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab()),
                          key=lambda s: tail.find(s) if s in tail else len(tail) + 1)
        return specials[0] if specials and specials[0] in tail else None


def chat_format_for(tokenizer: Any, prompt_format: str = HF_TEMPLATE) -> ChatFormat:
    """The ChatFormat of one of our tokenizers (a HuggingFace/PretrainedFromHF one: `.hf_tokenizer`) or of a
    transformers tokenizer; one line for any other tokenizer type."""
    hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
    if not hasattr(hf, "apply_chat_template"):
        raise ArgumentError(f"chat formats need a Hugging Face tokenizer (--tokenizer-type HuggingFaceTokenizer or "
                            f"SFTTokenizer with --tokenizer-model FOLDER), not {type(tokenizer).__name__}")
    eod = getattr(tokenizer, "eod", None) if hf is not tokenizer else None
    return ChatFormat(hf, prompt_format, eod=eod)
