"""A packed chat-like dataset for the packed-sequence and --calculate-per-token-loss curves: rows of 64 tokens
holding 4 documents each (uneven lengths, the first third of each document out of the loss as a prompt would be,
end padding out of the loss), in Megatron's packed batch keys (tokens, labels, loss_mask, position_ids,
cu_seqlens, max_seqlen); the unpacked twin serves each document in a row of its own, padded, in the same order."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

SEQ = 64
DOCS_PER_ROW = 4
VOCAB = 200


def _row_documents(g: torch.Generator) -> list[torch.Tensor]:
    total = int(torch.randint(24, SEQ + 1, (1,), generator=g))
    cuts = sorted(torch.randperm(total // 2 - 1, generator=g)[:DOCS_PER_ROW - 1].add(1).mul(2).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return [torch.randint(1, VOCAB, (n + 1,), generator=g) for n in lengths]  # n inputs + the last label


class PackedDocuments(torch.utils.data.Dataset):
    """`rows` packed rows (packed=True) or their 4 x `rows` documents one per row (packed=False)."""

    def __init__(self, rows: int, seed: int, packed: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.docs = [_row_documents(g) for _ in range(rows)]
        self.packed = packed

    def __len__(self) -> int:
        return len(self.docs) * (1 if self.packed else DOCS_PER_ROW)

    def __getitem__(self, index: int) -> dict:
        docs = self.docs[index] if self.packed else [self.docs[index // DOCS_PER_ROW][index % DOCS_PER_ROW]]
        tokens = torch.zeros(SEQ, dtype=torch.long)
        labels = torch.zeros(SEQ, dtype=torch.long)
        loss_mask = torch.zeros(SEQ)
        position_ids = torch.zeros(SEQ, dtype=torch.long)
        cu = [0]
        for doc in docs:
            start, n = cu[-1], doc.numel() - 1
            tokens[start:start + n], labels[start:start + n] = doc[:-1], doc[1:]
            loss_mask[start + n // 3:start + n] = 1.0
            position_ids[start:start + n] = torch.arange(n)
            cu.append(start + n)
        position_ids[cu[-1]:] = torch.arange(SEQ - cu[-1])  # the end padding: a document of its own
        cu = torch.tensor(cu, dtype=torch.int32)
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                "cu_seqlens": cu, "max_seqlen": (cu[1:] - cu[:-1]).max()}


def _provider(packed: bool, num_samples: list[int]) -> tuple[Any, Any, Any]:
    per_row = 1 if packed else DOCS_PER_ROW
    train, valid = (max(1, -(-n // per_row)) for n in num_samples[:2])
    return PackedDocuments(train, 1, packed), PackedDocuments(valid, 2, packed), None


def datasets_provider(packed: bool) -> Any:
    """A train_valid_test_datasets_provider serving packed rows or the unpacked documents."""
    return partial(_provider, packed)
