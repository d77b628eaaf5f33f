"""Next-token selection for text generation: temperature, top-k and top-p (nucleus) filtering, greedy and sampling."""
from __future__ import annotations

from typing import Optional

import torch


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (in place); returns `logits`."""
    if top_k <= 0 or top_k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill_(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches `top_p` (the top token always stays)."""
    if top_p <= 0.0 or top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # drop a token when the mass of the tokens strictly before it already reaches top_p
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill_(drop, float("-inf"))


def check_sampling_args(top_k: int, top_p: float, temperature: float) -> None:
    """Reject contradictory or out-of-range sampling settings with a clear message."""
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if top_k > 0 and top_p > 0.0:
        raise ValueError("use either top_k or top_p, not both (Megatron's rule)")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def sample(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One token id per row of `logits` [b, v]. Ids >= vocab_size (vocab padding) are never chosen."""
    logits = logits.float().clone()
    if vocab_size is not None and vocab_size < logits.size(-1):
        logits[:, vocab_size:] = float("-inf")
    if greedy or top_k == 1:
        return logits.argmax(dim=-1)
    logits.div_(temperature)
    filter_top_k(logits, top_k)
    filter_top_p(logits, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)
