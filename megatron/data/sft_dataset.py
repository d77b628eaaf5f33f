"""Supervised finetuning data (`--sft`): Megatron-LM's SFTDataset over JSONL conversations, and its split/blend rules.

File format (Megatron-LM's): one JSON object per line with "messages", a list of {"role", "content"} turns (system,
user, assistant). A line may hold several conversations one after another: each system turn starts a new one.

A sample (Megatron-LM core_v0.16.1 `SFTDataset.__getitem__`): the conversations of one line, each rendered by the
chat format with its targets (megatron/tokenizer/chat_format.py) and followed by the EOD unless it ends with it,
packed one after the other with positions restarting per conversation; under context parallelism each conversation
is padded to a multiple of 2 x CP. The pack is cut at seq_length + 1 tokens (the conversation that crosses is
truncated and the rest of the line dropped) or padded up to it with the format's pad id (positions continuing);
tokens/labels are the pack shifted by one, loss_mask is 0 where the label is the pad id or IGNORE_INDEX, cu_seqlens
holds the conversations' boundaries (the last one covering the padding), max_seqlen the longest.

Sample order: sample i of a split is line `indices[i % len(indices)]`, where a split's indices are the lines
[round(start x N), round(end x N)) of its share of `--split`; several weighted paths are blended with Megatron-LM's
blending indices (each path built with its share of the samples plus 0.5%, rounded up twice).

Bad lines are errors naming file and line (Megatron-LM's loader stops on them too): not JSON, no "messages", a
missing or unknown role, an empty assistant turn. Reading needs only the standard json module.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import parse_data_prefix, print_rank_0
from megatron.errors import ArgumentError, InputFileError, InputFileNotFoundError
from megatron.tokenizer.chat_format import IGNORE_INDEX, ConversationError, check_conversation

SURPLUS = 0.005  # Megatron-LM's --mid-level-dataset-surplus default


class SFTLineError(InputFileError):
    """A line of an SFT JSONL file that cannot be used; the message names file and line."""


def split_conversations(messages: Sequence[dict]) -> list[list[dict]]:
    """The conversations of one line: a new one starts at every system turn."""
    out: list[list[dict]] = []
    current: list[dict] = []
    for msg in messages:
        if msg["role"] == "system" and current:
            out.append(current)
            current = []
        current.append(msg)
    if current:
        out.append(current)
    return out


class SFTLowLevelDataset:
    """The "messages" of every non-blank line of one JSONL file, checked when read (one line per bad line)."""

    def __init__(self, path: str, empty_turn_is_error: str = "assistant") -> None:
        self.path = str(path)
        if not Path(self.path).is_file():
            raise InputFileNotFoundError(f"--data-path {self.path}: no such file (SFT data is a JSONL file with a "
                                         "'messages' list per line)")
        self.messages: list[list[dict]] = []
        self.line_numbers: list[int] = []
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    self.messages.append(self._parse(line, number, empty_turn_is_error))
                    self.line_numbers.append(number)
        if not self.messages:
            raise SFTLineError(f"{self.path}: no conversations (expected one JSON object with 'messages' per line)")

    def _parse(self, line: str, number: int, empty_turn_is_error: str) -> list[dict]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SFTLineError(f"{self.path}:{number}: not JSON ({exc.msg}); each line must be one JSON object "
                               "with a 'messages' list") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise SFTLineError(f"{self.path}:{number}: no 'messages' key; each line must be a JSON object with a "
                               "'messages' list of {\"role\", \"content\"}")
        try:
            check_conversation(record["messages"], empty_turn_is_error)
        except ConversationError as exc:
            raise SFTLineError(f"{self.path}:{number}: {exc}") from None
        return record["messages"]

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, idx: int) -> list[dict]:
        return self.messages[idx]

    def where(self, idx: int) -> str:
        """file:line of item idx (for error messages)."""
        return f"{self.path}:{self.line_numbers[idx]}"


class SFTDataset(torch.utils.data.Dataset):
    """Megatron-LM's SFTDataset: `num_samples` packed rows from the lines `indices` of `dataset` (see the module
    docstring). `chat` is a ChatFormat (tokenize_conversation, eod, pad)."""

    def __init__(self, dataset: SFTLowLevelDataset, indices: np.ndarray, num_samples: Optional[int], chat: Any,
                 seq_length: int, context_parallel_size: int = 1) -> None:
        if len(indices) == 0:
            raise SFTLineError(f"{dataset.path}: this split has no lines (--split gives it none of the "
                               f"{len(dataset)} conversations lines)")
        self.dataset, self.indices, self.chat = dataset, np.asarray(indices), chat
        self.num_samples = len(self.indices) if num_samples is None else int(num_samples)
        self.seq_length, self.cp_size = int(seq_length), int(context_parallel_size)

    def __len__(self) -> int:
        return self.num_samples

    def _render(self, line: int, conversation: list[dict]) -> tuple[list[int], list[int]]:
        try:
            tokens, targets = self.chat.tokenize_conversation(conversation, return_target=True,
                                                              add_generation_prompt=False)
        except ConversationError as exc:
            raise SFTLineError(f"{self.dataset.where(line)}: {exc}") from None
        tokens, targets = tokens.tolist(), targets.tolist()
        if tokens[-1] != self.chat.eod:
            tokens.append(self.chat.eod)
            targets.append(self.chat.eod)
        return tokens, targets

    def _pack(self, line: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Megatron's packing loop: (tokens, targets, positions) of length seq_length + 1 and cu_seqlens."""
        pad, length = self.chat.pad, self.seq_length
        toks: list[int] = []
        tgts: list[int] = []
        pos: list[int] = []
        cu = [0]

        def extend_with_padding(n: int) -> None:
            toks.extend([pad] * n)
            tgts.extend([pad] * n)
            pos.extend(range(pos[-1] + 1, pos[-1] + 1 + n))

        for conversation in split_conversations(self.dataset[line]):
            tokens, targets = self._render(line, conversation)
            toks.extend(tokens)
            tgts.extend(targets)
            pos.extend(range(len(tokens)))
            if self.cp_size > 1 and len(toks) % (2 * self.cp_size):
                extend_with_padding(2 * self.cp_size - len(toks) % (2 * self.cp_size))
            cu.append(len(toks))
            if len(toks) >= length + 1:  # truncate on the right, the last position a pad
                toks[:], tgts[:], pos[:] = toks[:length] + [pad], tgts[:length] + [pad], pos[:length + 1]
                cu[-1] = length
                break
        if len(toks) < length + 1:
            extend_with_padding(length + 1 - len(toks))
            cu[-1] = len(toks) - 1
        return toks, tgts, pos, cu

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        line = int(self.indices[idx % len(self.indices)])
        toks, tgts, pos, cu = self._pack(line)
        labels = torch.tensor(tgts[1:], dtype=torch.int64)
        loss_mask = torch.ones(self.seq_length, dtype=torch.float32)
        loss_mask[labels == self.chat.pad] = 0.0
        loss_mask[labels == IGNORE_INDEX] = 0.0
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        return {"tokens": torch.tensor(toks[:-1], dtype=torch.int64), "labels": labels, "loss_mask": loss_mask,
                "position_ids": torch.tensor(pos[:-1], dtype=torch.int64), "cu_seqlens": cu_seqlens,
                "max_seqlen": (cu_seqlens[1:] - cu_seqlens[:-1]).max()}


def split_matrix(splits_string: str) -> list[Optional[tuple[float, float]]]:
    """Megatron-LM core's split matrix: "969,30,1" -> the [start, end) share of each split (None when empty)."""
    weights = [float(x) for x in re.findall(r"[.0-9]+", splits_string or "")]
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    total = sum(weights)
    if total <= 0:
        raise InputFileError(f"--split {splits_string!r}: needs a positive weight, e.g. 969,30,1")
    bounds = np.cumsum([0.0] + [w / total for w in weights]).tolist()
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def _sizes_per_dataset(weights: Sequence[float], sizes: Sequence[int], surplus: float) -> list[list[int]]:
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) for n in sizes] for w in weights]


class SFTBuilder:
    """Builds the (train, valid, test) SFT datasets from Megatron-LM's data flags with Megatron-LM core's rules."""

    def __init__(self, chat: Any, seq_length: int, context_parallel_size: int = 1) -> None:
        self.chat, self.seq_length, self.cp_size = chat, seq_length, context_parallel_size
        self._files: dict[str, SFTLowLevelDataset] = {}

    def _file(self, path: str) -> SFTLowLevelDataset:
        if path not in self._files:
            fmt = getattr(self.chat, "format", None)
            self._files[path] = SFTLowLevelDataset(path, fmt.empty_turn_is_error if fmt else "assistant")
        return self._files[path]

    def _splits(self, path: str, matrix: list, sizes: Sequence[Optional[int]]) -> list[Optional[SFTDataset]]:
        low = self._file(path)
        n = len(low)
        out: list[Optional[SFTDataset]] = []
        for bounds, size in zip(matrix, sizes):
            if bounds is None or size == 0:  # a split asked for 0 samples (e.g. --eval-iters 0): none, as the blend
                out.append(None)
                continue
            beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
            out.append(SFTDataset(low, np.arange(beg, end, dtype=np.int32), size, self.chat, self.seq_length,
                                  self.cp_size))
        return out

    def _blend(self, prefix: Sequence[Any], matrix: list, sizes: Sequence[int]) -> list[Any]:
        if len(prefix) == 1:
            return self._splits(str(prefix[0]), matrix, sizes)
        paths, weights = parse_data_prefix(prefix)
        targets = _sizes_per_dataset(weights, sizes, 0.0)
        parts = [self._splits(p, matrix, buf) for p, buf in zip(paths, _sizes_per_dataset(weights, sizes, SURPLUS))]
        out: list[Any] = []
        for i in range(3):
            if matrix[i] is None or sizes[i] == 0:
                out.append(None)
                continue
            out.append(BlendableDataset([part[i] for part in parts], weights, sum(t[i] for t in targets)))
        return out

    def build(self, num_samples: Sequence[int], data_path: Optional[Sequence[Any]], splits_string: str,
              per_split: Sequence[Optional[Sequence[Any]]] = (None, None, None)) -> tuple:
        """(train, valid, test): from --data-path with --split, or from --train/valid/test-data-path."""
        if data_path:
            datasets = self._blend(list(data_path), split_matrix(splits_string), list(num_samples))
        else:
            datasets = []
            for i, prefix in enumerate(per_split):
                matrix: list = [None, None, None]
                matrix[i] = (0.0, 1.0)
                sizes = [0, 0, 0]
                sizes[i] = num_samples[i]
                datasets.append(self._blend(list(prefix), matrix, sizes)[i] if prefix else None)
        for name, ds in zip(("train", "validation", "test"), datasets):
            if ds is not None:
                print_rank_0(f"    SFT {name}: {len(ds)} samples")
        return tuple(datasets)


def check_sft_flags(micro_batch_size: int, reset_position_ids: bool, reset_attention_mask: bool,
                    eod_mask_loss: bool = False, deepspeed_pipeline: bool = False) -> None:
    """The flags --sft cannot take (Megatron-LM's SFT path asserts the same or ignores them), one line each."""
    if deepspeed_pipeline:
        raise ArgumentError("--sft under DeepSpeed's pipeline engine: its pipe model (GPTModelPipe) does not read "
                            "packed rows (conversations would attend across boundaries); use "
                            "--no-pipeline-parallel or Megatron's pipeline (without --deepspeed)")
    if micro_batch_size != 1:
        raise ArgumentError(f"--sft packs conversations into rows with their own cu_seqlens: --micro-batch-size "
                            f"must be 1 (got {micro_batch_size}), as in Megatron-LM; raise --global-batch-size")
    if reset_position_ids or reset_attention_mask:
        raise ArgumentError("--sft restarts positions and attention per conversation itself: drop "
                            "--reset-position-ids / --reset-attention-mask")
    if eod_mask_loss:
        raise ArgumentError("--sft takes the loss where the chat format's targets are (the EOD after a conversation "
                            "included, unless it is the pad id): drop --eod-mask-loss")
