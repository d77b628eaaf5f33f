"""Zero-shot evaluation datasets: WikiText-103 sliding windows and LAMBADA last-word cloze (Megatron's formats).

Every sample is ``{"text": int64[seq_length + 1], "pad_mask": int64[seq_length]}``: the model reads text[:-1] and
is scored on text[1:] where pad_mask is 1.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megatron.errors import MegatronUserError
from tasks.zeroshot_gpt.detokenizer import get_detokenizer


class EvalDataError(MegatronUserError, ValueError):
    """An evaluation data file that cannot be read (names the file and the problem)."""


class LMWindowDataset(torch.utils.data.Dataset):
    """Sliding windows of `seq_len` over one token stream, advancing by `overlapping_eval` tokens.

    Window 0 scores all its targets; every later window scores only its last `overlapping_eval` targets (the ones
    not seen by the previous window), so each target is scored exactly once with up to seq_len - overlap context.
    """

    def __init__(self, tokens: Sequence[int], seq_len: int, pad_idx: int, num_original_tokens: int,
                 num_tokenized_tokens: int, overlapping_eval: Optional[int] = None) -> None:
        self.tokens = list(tokens)
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.overlapping_eval = max(1, seq_len if overlapping_eval is None else overlapping_eval)
        if self.overlapping_eval > seq_len:
            raise EvalDataError(f"--overlapping-eval {overlapping_eval} is larger than --seq-length {seq_len}; "
                                "use a value between 1 and the sequence length")
        self.num_original_tokens = num_original_tokens
        self.num_tokenized_tokens = num_tokenized_tokens
        total_targets = len(self.tokens) - 1
        targets = max(total_targets - self.overlapping_eval, 0)
        self.total_sequences = max(math.ceil(targets / self.overlapping_eval) + 1, 1)

    def __len__(self) -> int:
        return self.total_sequences

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        start = idx * self.overlapping_eval
        tokens = self.tokens[start:start + self.seq_len + 1]
        pad_mask = [1] * len(tokens)
        num_pad = self.seq_len + 1 - len(tokens)
        if num_pad > 0:
            pad_mask += [0] * num_pad
            tokens = tokens + [self.pad_idx] * num_pad
        mask = np.array(pad_mask[1:], dtype=np.int64)
        if self.overlapping_eval != self.seq_len and idx != 0:
            mask[:-self.overlapping_eval] = 0
        return {"text": np.array(tokens, dtype=np.int64), "pad_mask": mask}


class LambadaDataset(torch.utils.data.Dataset):
    """LAMBADA jsonl ({"text": ...} per line): context tokens + last-word tokens, scored on the last word only.

    Non-strict (Megatron's default): the whole text is tokenized and its last token is the target. Strict: the last
    whitespace word is tokenized on its own with a leading space and all its tokens are targets.
    Contexts longer than seq_len are cut from the left.
    """

    def __init__(self, path: str, pad_idx: int, tokenizer: Any, seq_len: int, strict: bool = False) -> None:
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.tokenizer = tokenizer
        self.strict = strict
        self.tokens: list[list[int]] = []
        self.labels: list[list[int]] = []
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as exc:
            raise EvalDataError(f"--valid-data {path}: cannot read it ({exc.strerror})") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise EvalDataError(f"{path}:{lineno}: not a LAMBADA jsonl line (expected {{\"text\": \"...\"}})"
                                    ) from None
            if not isinstance(text, str) or not text.split():
                raise EvalDataError(f"{path}:{lineno}: 'text' must be a non-empty string")
            context, label = self.get_tokens(text)
            if not label:
                raise EvalDataError(f"{path}:{lineno}: the last word tokenizes to nothing")
            self.tokens.append(context)
            self.labels.append(label)
        if not self.tokens:
            raise EvalDataError(f"--valid-data {path}: no examples in the file")

    def get_tokens(self, text: str) -> tuple[list[int], list[int]]:
        """(context tokens, target tokens) of one example."""
        if not self.strict:
            tokens = self.tokenizer.tokenize(text)
            return tokens[:-1], [tokens[-1]]
        last_word = text.split()[-1]
        start = text.rfind(last_word)
        context = self.tokenizer.tokenize(text[:start].strip())
        return context, self.tokenizer.tokenize(" " + last_word)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        labels = self.labels[idx]
        tokens = self.tokens[idx] + labels
        pad_mask = [0] * len(self.tokens[idx]) + [1] * len(labels)
        if len(tokens) > self.seq_len + 1:
            tokens, pad_mask = tokens[-(self.seq_len + 1):], pad_mask[-(self.seq_len + 1):]
        num_pad = self.seq_len + 1 - len(tokens)
        if num_pad > 0:
            pad_mask += [0] * num_pad
            tokens = tokens + [self.pad_idx] * num_pad
        return {"text": np.array(tokens, dtype=np.int64), "pad_mask": np.array(pad_mask[1:], dtype=np.int64)}


def build_wikitext_dataset(path: str, tokenizer: Any, seq_len: int, overlapping_eval: Optional[int]
                           ) -> LMWindowDataset:
    """Read a WikiText file, count its original words (Megatron: split on ' '), detokenize, tokenize, window."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except OSError as exc:
        raise EvalDataError(f"--valid-data {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise EvalDataError(f"--valid-data {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    num_original_tokens = len(raw.strip().split(" "))
    tokens = tokenizer.tokenize(get_detokenizer(path)(raw))
    if len(tokens) < 2:
        raise EvalDataError(f"--valid-data {path}: fewer than 2 tokens after tokenization; nothing to evaluate")
    return LMWindowDataset(tokens, seq_len, tokenizer.eod, num_original_tokens, len(tokens), overlapping_eval)


def build_lambada_dataset(path: str, tokenizer: Any, seq_len: int, strict: bool) -> LambadaDataset:
    """LAMBADA examples from a jsonl file."""
    return LambadaDataset(path, tokenizer.eod, tokenizer, seq_len, strict)
