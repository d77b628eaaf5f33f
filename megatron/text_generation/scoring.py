"""Teacher-forced scoring of token sequences: per-token log-probs, greedy flags and top-n alternatives.

Used by the lm-eval adapter (tasks/eval_harness) and the OpenAI-style `/v1/completions` endpoint (logprobs, echo).
The forward pass is the generation stack's (`forward_step_logits` / `pipeline_step_logits`: logits gathered over tensor
parallelism, stage to stage under pipeline parallelism); the log-softmax runs in float64 over the real vocabulary
only (ids >= vocab_size pad the embedding to a multiple of 128 x TP and are never a prediction), and the answers
are computed on the last pipeline stage and broadcast over the pipeline group, so every rank returns the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron.core import parallel_state as ps
from megatron.core.utils import sequence_parallel_off
from megatron.text_generation.generation import (
    broadcast_from_last_stage,
    forward_step_logits,
    generation_tp_group,
    pipeline_state,
    pipeline_step_logits,
    unwrapped_model,
)

ROW_CHUNK = 256  # positions per float64 log-softmax block (bounds memory for long sequences x large vocabularies)


@dataclass
class ScoredSequence:
    """Scores of tokens[score_from:] of one sequence: entry j is about token score_from + j given those before."""

    logprobs: list[float]
    greedy: list[bool]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def _state(state: Optional[ps.ParallelState]) -> ps.ParallelState:
    return ps.current_parallel_state(state)


@torch.no_grad()
def forward_logits(model: torch.nn.Module, ids: torch.Tensor, state: Optional[ps.ParallelState] = None,
                   rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Full-vocabulary logits [b, s, v] of a causal forward over `ids` [b, s] on the last stage, None elsewhere.

    `rows` [b, k]: only the logits at these positions of each sequence ([b, k, v]; the output layer, the costliest
    part of a small model's forward, then runs on k positions instead of s).
    """
    state = _state(state)
    pp = pipeline_state(state)
    tp_group = generation_tp_group(None, state)
    n = ids.size(1)
    pos = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
    mask = torch.ones(1, 1, n, n, dtype=torch.bool, device=ids.device).triu(1)
    was_training = model.training
    model.eval()
    try:
        with sequence_parallel_off(model):  # any length under TP + SP, as in generation
            if pp is None:
                return forward_step_logits(model, ids, pos, mask, None, False, tp_group, rows)
            return pipeline_step_logits(model, ids, pos, mask, None, False, tp_group, pp, rows)
    finally:
        if pp is not None:
            unwrapped_model(model).set_input_tensor(None)
        model.train(was_training)


@torch.no_grad()
def score_tokens(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, vocab_size: int,
                 score_from: Optional[Sequence[int]] = None, top_n: int = 0, pad_id: int = 0,
                 width: Optional[int] = None, state: Optional[ps.ParallelState] = None) -> list[ScoredSequence]:
    """Score tokens[score_from[i]:] of every sequence (default: all but the first token) in one batched forward.

    The inputs are the sequences minus their last token, right-padded with `pad_id` to `width` (default: the
    longest). Sequences with the same input and score_from (e.g. one-token answer choices after one context) share
    one row of the forward. Every rank of the job returns the same scores.
    """
    state = _state(state)
    if not sequences:
        return []
    starts = [1] * len(sequences) if score_from is None else [int(s) for s in score_from]
    for seq, s in zip(sequences, starts):
        if not 1 <= s < len(seq):
            raise ValueError(f"score_from {s} leaves nothing to score in a sequence of {len(seq)} tokens")
    device = next(model.parameters()).device
    unique: dict[tuple, int] = {}
    which = [unique.setdefault((tuple(seq[:-1]), s), len(unique)) for seq, s in zip(sequences, starts)]
    keys = list(unique)
    width = max(max(len(x) for x, _ in keys), 1) if width is None else width
    ids = torch.full((len(keys), width), pad_id, dtype=torch.long, device=device)
    for u, (x, _) in enumerate(keys):
        ids[u, : len(x)] = torch.as_tensor(x, dtype=torch.long, device=device)
    counts = [len(seq) - s for seq, s in zip(sequences, starts)]
    k = max(counts)
    rows = torch.tensor([[s - 1 + min(j, len(x) - s) for j in range(k)] for x, s in keys],
                        dtype=torch.long, device=device)  # scored positions, the last repeated as padding
    logits = forward_logits(model, ids, state, rows)  # [u, k, v]: logits[u, j] predicts token starts + j
    packed = torch.zeros(len(sequences), k, 2 + 2 * top_n, dtype=torch.float64, device=device)
    if logits is not None:
        # the scored rows of the unique inputs, flattened; then (sequence, position, row, target) of every score
        first = [0]
        for x, s in keys:
            first.append(first[-1] + len(x) + 1 - s)
        flat_rows = torch.tensor([u * k + j for u, (x, s) in enumerate(keys) for j in range(len(x) + 1 - s)],
                                 dtype=torch.long, device=device)
        pair_i = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.long, device=device)
        pair_j = torch.tensor([j for n in counts for j in range(n)], dtype=torch.long, device=device)
        pair_row = torch.tensor([first[u] + j for u, n in zip(which, counts) for j in range(n)], dtype=torch.long,
                                device=device)
        pair_tgt = torch.tensor([t for seq, s in zip(sequences, starts) for t in seq[s:]], dtype=torch.long,
                                device=device)
        flat = logits.reshape(-1, logits.size(-1))
        for a in range(0, first[-1], ROW_CHUNK):
            b = min(a + ROW_CHUNK, first[-1])
            logp = torch.log_softmax(flat[flat_rows[a:b], :vocab_size].double(), dim=-1)
            sel = (pair_row >= a) & (pair_row < b)
            r, i, j, t = pair_row[sel] - a, pair_i[sel], pair_j[sel], pair_tgt[sel]
            packed[i, j, 0] = logp[r, t]
            packed[i, j, 1] = (logp.argmax(-1)[r] == t).double()
            if top_n:
                values, top = torch.topk(logp, top_n, dim=-1)
                packed[i, j, 2: 2 + top_n] = top[r].double()
                packed[i, j, 2 + top_n:] = values[r]
    packed = broadcast_from_last_stage(packed, pipeline_state(state)).cpu()
    out = []
    for i, n in enumerate(counts):
        r = packed[i, :n]
        out.append(ScoredSequence(logprobs=r[:, 0].tolist(), greedy=[bool(g) for g in r[:, 1].tolist()],
                                  top_ids=r[:, 2: 2 + top_n].long().tolist() if top_n else [],
                                  top_logprobs=r[:, 2 + top_n:].tolist() if top_n else []))
    return out


def sequence_logprob(scored: ScoredSequence) -> tuple[float, bool]:
    """(summed log-prob, every token the argmax) of one scored sequence."""
    return float(sum(scored.logprobs)), all(scored.greedy)


__all__ = ["ScoredSequence", "forward_logits", "score_tokens", "sequence_logprob"]
