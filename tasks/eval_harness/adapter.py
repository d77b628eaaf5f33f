"""lm-evaluation-harness (>= 0.4) `LM` on our GPT model: log-likelihoods, rolling perplexity and generation.

`MegatronLM(model, tokenizer, ...)` answers lm-eval's three request types with the model of this rank:

* `loglikelihood` (via lm-eval's `TemplateLM`: empty contexts become the end-of-document token, trailing context
  spaces move into the continuation) -> `_loglikelihood_tokens`: requests sorted by length (longest first) and run
  in batches (requests with the same input share a row), inputs `(context + continuation)[-(max_length + 1):][:-1]`
  right-padded, the log-softmax over the real vocabulary only (the rows that pad the vocabulary to a multiple of 128 x TP are dropped first), the continuation's
  summed log-probability and whether every continuation token is the argmax;
* `loglikelihood_rolling`: lm-eval's disjoint rolling windows of `max_length` with the end-of-document prefix;
* `generate_until`: our KV-cache generation (`generate_tokens`), greedy or sampled, `max_gen_toks` new tokens, stop
  at end-of-document or a one-token stop string, the text cut at the first stop string.

Parallelism: every rank runs lm-eval with all requests (lm-eval sees one process); the scoring forward is
megatron/text_generation/scoring.py (the generation stack's forward: logits gathered over TP, stage-to-stage under
PP, float64 log-softmax over the real vocabulary). The sorted requests are dealt round-robin to the data-parallel
ranks (the ranks of one expert-parallel group alike); under PP the last stage computes the answers and broadcasts them over the pipeline group; the answers are
all-gathered over the data-parallel group and put back in request order, so every rank returns the same list.

lm-eval is imported here at module level: import this module through `tasks.eval_harness.require_lm_eval()` (or
after checking for lm-eval) so a missing package gives a one-line message.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from tqdm import tqdm

from megatron.core import parallel_state as ps
from megatron.inference import SamplingParams
from megatron.text_generation.engine_driver import run_to_completion
from megatron.text_generation.generation import generate_tokens
from megatron.text_generation.scoring import score_tokens, sequence_logprob


class _LineProgress:
    """Progress for a redirected log: whole lines (no '\r'), at most every 30 seconds, and one at the end."""

    def __init__(self, total: int, desc: str, every: float = 30.0) -> None:
        self.total, self.desc, self.every, self.done = total, desc, every, 0
        self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(f"{self.desc}: {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(f"{self.desc}: {self.done}/{self.total} done", file=sys.stderr, flush=True)


GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}


class MegatronLM(TemplateLM):
    """lm-eval model over a (TP/PP-sharded, possibly Float16-wrapped) GPTModel of this rank; see the module doc."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_length: int, batch_size: int = 1,
                 max_gen_toks: int = 256, state: Optional[ps.ParallelState] = None, adaptive_seq_len: bool = True,
                 seed: int = 1234, progress: bool = True, engine: Any = None) -> None:
        super().__init__()
        self.engine = engine  # megatron/inference's engine: generate_until submits a whole group of requests at once
        self.model = model
        self.megatron_tokenizer = tokenizer
        self.state = state or (ps.get_parallel_state() if ps.model_parallel_is_initialized()
                               else ps.ParallelState.single())
        self._max_length = int(max_length)
        self._batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self.adaptive_seq_len = adaptive_seq_len
        self.vocab_size = int(tokenizer.vocab_size)
        self.seed = int(seed)
        self.progress = progress
        self._device = next(model.parameters()).device
        self._calls = 0

    # -- lm-eval properties --------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.megatron_tokenizer.eod)

    @property
    def prefix_token_id(self) -> int:
        """What empty contexts and the first rolling window start from: BOS where the tokenizer has one (Llama; as
        lm-eval's HF backend), else the end-of-document token (GPT-2's <|endoftext|>)."""
        try:
            bos = self.megatron_tokenizer.bos
        except (AttributeError, NotImplementedError, ValueError):
            return self.eot_token_id
        return self.eot_token_id if bos is None else int(bos)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return type(self.megatron_tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.megatron_tokenizer.tokenize(string)] if string else []

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.megatron_tokenizer.detokenize(list(tokens))

    # -- parallel plumbing ---------------------------------------------------------------------------------------
    def _bar(self, total: int, desc: str, disable: bool) -> Any:
        show = self.progress and not disable and self.state.global_rank == 0
        if show and not sys.stderr.isatty():
            return _LineProgress(total, desc)
        return tqdm(total=total, desc=desc, disable=not show, file=sys.stderr, dynamic_ncols=True)

    def _my_share(self, order: list[int]) -> list[int]:
        """This rank's requests; under expert parallelism the ranks of one expert group get the same ones (their
        MoE layers exchange tokens in every forward, so their batches and decoding steps must match)."""
        shard, shards = self.state.forward_only_shard()
        return order[shard::shards]

    def _gather(self, answers: dict[int, Any], n: int) -> list[Any]:
        """Answers of every data-parallel rank, in request order."""
        if self.state.dp_size > 1 and dist.is_initialized():
            parts: list[Any] = [None] * self.state.dp_size
            dist.all_gather_object(parts, answers, group=self.state.dp_group)
            answers = {k: v for part in parts for k, v in part.items()}
        assert len(answers) == n, f"lost answers: {len(answers)} of {n}"
        return [answers[i] for i in range(n)]

    # -- loglikelihood -------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """Score `requests` = [(cache key or None, context tokens, continuation tokens)] batched by length.

        Requests with the same model input (context + continuation minus its last token, e.g. the one-token answer
        choices of one question, or repeated requests) form one row of a batch and are scored from the same logits.
        """
        if any(not cont for _, _, cont in requests):
            raise ValueError("loglikelihood: a continuation encodes to no tokens; nothing to score")
        full = [(ctx + cont)[-(self.max_length + 1):] for _, ctx, cont in requests]
        starts = [len(f) - len(cont) for f, (_, _, cont) in zip(full, requests)]
        groups: dict[tuple, list[int]] = {}
        for i, (f, s) in enumerate(zip(full, starts)):
            groups.setdefault((tuple(f[:-1]), s), []).append(i)
        order = sorted(groups, key=lambda key: (-len(key[0]), key))  # longest first: the first batch is the widest
        mine = self._my_share(order)
        answers: dict[int, tuple[float, bool]] = {}
        bar = self._bar(len(requests), "loglikelihood requests", disable_tqdm)
        for start in range(0, len(mine), self.batch_size):
            members = [i for key in mine[start: start + self.batch_size] for i in groups[key]]
            scored = score_tokens(self.model, [full[i] for i in members], vocab_size=self.vocab_size,
                                  score_from=[starts[i] for i in members], pad_id=self.eot_token_id,
                                  width=None if self.adaptive_seq_len else self.max_length, state=self.state)
            for i, sc in zip(members, scored):
                answers[i] = sequence_logprob(sc)
            bar.update(len(members) * self.state.forward_only_shard()[1])
        bar.close()
        results = self._gather(answers, len(requests))
        for (key, _, _), ans in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, ans)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document over disjoint windows of max_length (EOT-prefixed first window)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            doc = [(None, ctx, cont) for ctx, cont in map(lm_utils.make_disjoint_window, rolling)]
            windows += doc
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        results, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(lp for lp, _ in scores[at: at + n])
            at += n
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return results

    # -- generation ----------------------------------------------------------------------------------------------
    def _stop_token_ids(self, until: list[str]) -> list[int]:
        """Ids of stop strings that are one token: generation may end there (the text is cut there anyway)."""
        ids = []
        for stop in until:
            tok = self.tok_encode(stop) if stop else []
            if len(tok) == 1:
                ids.append(tok[0])
        return ids

    def _generate_batch(self, contexts: list[str], kwargs: dict) -> list[str]:
        max_gen = int(kwargs["max_gen_toks"])
        if max_gen >= self.max_length:
            raise ValueError(f"generate_until: max_gen_toks={max_gen} leaves no room for a prompt in the model's "
                             f"{self.max_length} tokens")
        until = list(kwargs["until"])
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-(self.max_length - max_gen):] for c in contexts]
        temperature = float(kwargs.get("temperature") or 0.0)
        greedy = not kwargs.get("do_sample") or temperature == 0.0
        top_p = float(kwargs.get("top_p") or 0.0)
        self._calls += 1
        if self.engine is not None:
            return self._engine_batch(prompts, max_gen, until, greedy, temperature, top_p, kwargs)
        out = generate_tokens(
            self.model, prompts, max_gen, eod_id=self.eot_token_id, greedy=greedy,
            temperature=1.0 if greedy else temperature, top_k=int(kwargs.get("top_k") or 0),
            top_p=0.0 if top_p >= 1.0 else top_p, stop_token_ids=self._stop_token_ids(until),
            random_seed=self.seed + self._calls, vocab_size=self.vocab_size, tp_group=self.state.tp_group,
            state=self.state)
        return self._texts([row[len(p): n] for row, n, p in zip(out.tokens.tolist(), out.lengths.tolist(), prompts)],
                           until)

    def _engine_batch(self, prompts: list[list[int]], max_gen: int, until: list[str], greedy: bool,
                      temperature: float, top_p: float, kwargs: dict) -> list[str]:
        """`_generate_batch` on the inference engine: every prompt submitted at once, the same texts (greedy)."""
        params = SamplingParams(max_new_tokens=max_gen, greedy=greedy, temperature=1.0 if greedy else temperature,
                                top_k=int(kwargs.get("top_k") or 0), top_p=0.0 if top_p >= 1.0 else top_p,
                                seed=self.seed + self._calls, stop_token_ids=tuple(self._stop_token_ids(until)),
                                vocab_size=self.vocab_size)
        return self._texts([c.tokens for c in run_to_completion(self.engine, prompts, params)], until)

    def _texts(self, generated: list[list[int]], until: list[str]) -> list[str]:
        """Each generation's text, cut at end-of-document and at the first stop string."""
        texts = []
        for new in generated:
            if self.eot_token_id in new:
                new = new[: new.index(self.eot_token_id)]
            text = self.tok_decode(new)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context until a stop string, max_gen_toks tokens or end-of-document."""
        args = [req.args for req in requests]
        groups: dict[str, list[int]] = {}
        normalized = []
        for i, (_, gen_kwargs) in enumerate(args):
            unknown = sorted(set(gen_kwargs) - GEN_KWARGS - {"max_new_tokens", "max_tokens"})
            if unknown:
                raise ValueError(f"generate_until: unsupported generation kwargs {unknown}; "
                                 f"supported: {sorted(GEN_KWARGS)}")
            kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            normalized.append(kw)
            groups.setdefault(json.dumps(kw, sort_keys=True, default=str), []).append(i)
        answers: dict[int, str] = {}
        bar = self._bar(len(args), "generate_until requests", disable_tqdm)
        for members in groups.values():
            order = sorted(members, key=lambda i: (-len(self.tok_encode(args[i][0])), args[i][0]))
            mine = self._my_share(order)
            step = max(len(mine), 1) if self.engine is not None else self.batch_size  # the engine: all at once
            for start in range(0, len(mine), step):
                chunk = mine[start: start + step]
                for i, text in zip(chunk, self._generate_batch([args[i][0] for i in chunk], normalized[chunk[0]])):
                    answers[i] = text
                bar.update(len(chunk) * self.state.forward_only_shard()[1])
        bar.close()
        results = self._gather(answers, len(args))
        for a, text in zip(args, results):
            self.cache_hook.add_partial("generate_until", a, text)
        return results
