"""Packed sequences (Megatron-LM's ``PackedSeqParams``, the ``thd`` format): several documents in one row.

A batch row of S tokens holds documents back to back; ``cu_seqlens`` gives their boundaries (int [n + 1], 0 first,
offsets into the row; the batch key of Megatron's SFT dataset, with ``max_seqlen`` the longest document). Tokens
after the last boundary (end padding) form one more document of their own, which the loss mask leaves out.

The model takes one `PackedSeqParams` per micro-batch (``GPTModel(..., packed_seq_params=p)``) and hands it
explicitly down to every attention layer:

* attention stays inside a document (megatron/layers/attention.py): on CUDA with flash-attn through
  ``flash_attn_varlen_func`` over ``cu_seqlens``; otherwise one causal SDPA call per document (`flat_cu_seqlens`;
  the faster CPU path, measured); where that cannot run (window, ALiBi, dropout, MLA, CP) through the
  block-diagonal causal mask built here once per micro-batch (`attention_mask`, cached, vectorised);
* positions restart at 0 in every document (`position_ids`): the learned position embedding and RoPE both use them;
* a sliding window (--window-size) is ORed onto the document mask, so it stays inside a document too;
* under context parallelism the row is split as every other sequence (chunks r and 2N-1-r of 2N) and each rank
  attends with its rows of the document mask (`attention_mask(rows=...)`), for p2p, all_gather and a2a alike.

`cu_seqlens` may be 1-D (one row, or offsets into the flattened [b * S] tokens with every row boundary also a
document boundary) or 2-D [b, n + 1] (one list per row; a shorter list repeats its last offset).
`from_eod` builds the object from EOD-terminated documents, the ``--reset-attention-mask --reset-position-ids`` case.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class PackedSeqParams:
    """Megatron Core's fields (``qkv_format`` ``"thd"``, ``cu_seqlens_q/kv``, ``max_seqlen_q/kv``; self-attention
    uses q = kv) plus a cache of the tensors derived from them for one micro-batch."""

    qkv_format: str = "thd"
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def document_ids(self, batch: int, seq_len: int, device: Any = None) -> torch.Tensor:
        """long [b, S]: the index of each token's document in its row (end padding: one more document)."""
        key = ("doc", batch, seq_len, str(device))
        if key not in self._cache:
            self._cache[key] = _documents(self.cu_seqlens_q, batch, seq_len, device)[0]
        return self._cache[key]

    def position_ids(self, batch: int, seq_len: int, device: Any = None) -> torch.Tensor:
        """long [b, S]: each token's position inside its document."""
        key = ("pos", batch, seq_len, str(device))
        if key not in self._cache:
            self._cache[key] = _documents(self.cu_seqlens_q, batch, seq_len, device)[1]
        return self._cache[key]

    def attention_mask(self, batch: int, seq_len: int, device: Any = None,
                       rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bool [b, 1, len(rows) or S, S], True = masked: causal inside each document, nothing across documents.
        `rows`: the true positions of the queries this rank holds (context parallelism), else all S."""
        key = ("mask", batch, seq_len, str(device), None if rows is None else tuple(rows.tolist()))
        if key not in self._cache:
            doc = self.document_ids(batch, seq_len, device)
            keys = torch.arange(seq_len, device=doc.device)
            queries = keys if rows is None else rows.to(doc.device)
            q_doc = doc.index_select(1, queries)
            allowed = (q_doc[:, :, None] == doc[:, None, :]) & (keys[None, None, :] <= queries[None, :, None])
            self._cache[key] = (~allowed).unsqueeze(1)
        return self._cache[key]

    def flat_cu_seqlens(self, batch: int, seq_len: int, device: Any = None) -> tuple[torch.Tensor, int]:
        """(int32 offsets of every document into the flattened [b * S] tokens, the longest document), the form
        flash-attn's varlen kernels take; end padding counts as a document."""
        key = ("flat", batch, seq_len, str(device))
        if key not in self._cache:
            flat = self.position_ids(batch, seq_len, device).reshape(-1)
            starts = torch.nonzero(flat == 0).reshape(-1)
            cu = torch.cat([starts, starts.new_full((1,), flat.numel())]).to(torch.int32)
            self._cache[key] = (cu, int((cu[1:] - cu[:-1]).max()))
        return self._cache[key]


def _documents(cu_seqlens: torch.Tensor, batch: int, seq_len: int,
               device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position inside the document), both long [b, S], from `cu_seqlens` (1-D or [b, n + 1])."""
    if cu_seqlens is None:
        raise ValueError("PackedSeqParams needs cu_seqlens_q (the batch key cu_seqlens of a packed dataset)")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if cu.dim() == 2 and cu.size(0) == 1 and batch > 1:
        cu = cu.reshape(-1)
    if cu.dim() == 1 and batch > 1:  # offsets into the flattened batch: each row boundary is a document boundary
        bounds = torch.arange(0, batch + 1, device=cu.device) * seq_len
        if not bool(torch.isin(bounds, cu).all()):
            raise ValueError(f"cu_seqlens {cu.tolist()} does not end a document at every row end (rows of "
                             f"{seq_len}); give one cu_seqlens list per row ([b, n + 1])")
        rows = [cu[(cu >= r * seq_len) & (cu <= (r + 1) * seq_len)] - r * seq_len for r in range(batch)]
        width = max(len(r) for r in rows)
        cu = torch.stack([torch.cat([r, r[-1:].expand(width - len(r))]) for r in rows])
    elif cu.dim() == 1:
        cu = cu.unsqueeze(0)
    if cu.size(0) != batch:
        raise ValueError(f"cu_seqlens has {cu.size(0)} rows for a micro-batch of {batch}")
    if bool((cu[:, 1:] < cu[:, :-1]).any()) or int(cu[:, 0].abs().max()) != 0 or int(cu.max()) > seq_len:
        raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to at most {seq_len}, got {cu.tolist()}")
    index = torch.arange(seq_len, device=cu.device).expand(batch, seq_len).contiguous()
    doc = torch.searchsorted(cu.contiguous(), index, right=True)  # cu[doc - 1] <= i < cu[doc]
    start = cu.gather(1, doc - 1)
    return doc, index - start


def from_cu_seqlens(cu_seqlens: torch.Tensor, max_seqlen: Optional[Any] = None) -> PackedSeqParams:
    """PackedSeqParams of a packed batch's ``cu_seqlens`` (and ``max_seqlen``, computed when None)."""
    if max_seqlen is None:
        cu = cu_seqlens.reshape(-1, cu_seqlens.size(-1)).long()
        max_seqlen = int((cu[:, 1:] - cu[:, :-1]).max())
    max_seqlen = int(max_seqlen.max()) if isinstance(max_seqlen, torch.Tensor) else int(max_seqlen)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def from_eod(tokens: torch.Tensor, eod_token: int) -> PackedSeqParams:
    """PackedSeqParams of rows [b, S] of EOD-terminated documents (the EOD belongs to the document it ends), the
    documents ``--reset-attention-mask --reset-position-ids`` separate; cu_seqlens is [b, n + 1]."""
    batch, seq_len = tokens.shape
    ends = [torch.nonzero(row == eod_token).reshape(-1) + 1 for row in tokens]  # one small op per row, not token
    width = max(len(e) for e in ends) + 2
    cu = torch.full((batch, width), seq_len, dtype=torch.int32, device=tokens.device)
    cu[:, 0] = 0
    for i, e in enumerate(ends):
        cu[i, 1:1 + len(e)] = e.to(torch.int32)
    return from_cu_seqlens(cu)
