"""Batched autoregressive generation for GPTModel (Megatron's approach).

Prompts of different lengths are left-aligned in one [b, prompt_max + tokens_to_generate] buffer; decoding starts at
the shortest prompt and, at each position, rows still inside their prompt keep their own token while the others take
the sampled one. With the KV cache (default) each step feeds only the new positions; `use_kv_cache=False` recomputes
the whole prefix every step (Megatron's --recompute). Under tensor parallelism the logits are gathered over the TP
group and the sampled tokens are broadcast from TP rank 0, so every TP rank holds identical tokens. Sequence
parallelism (needed by MoE under TP) is switched off while generating (megatron.core.utils.sequence_parallel_off),
as in Megatron's inference: prompts and one-token steps need not be multiples of TP.

Under pipeline parallelism every step runs through the stages: stage i receives the [s, b, h] hidden states of the
step from stage i-1 (P2PCommunicator), runs its layers with its own KV cache and sends them on; the last stage
computes the logits and samples, and the new tokens are broadcast from the last stage over the pipeline group, so
every stage appends the same tokens and reaches the same early-termination decision. Log-probs are computed on the
last stage and broadcast once at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.pipelined import tensor_shape_for
from megatron.core.tensor_parallel.mappings import all_gather_along_dim, group_size
from megatron.core.utils import sequence_parallel_off
from megatron.core.utils import unwrap_model as unwrapped_model
from megatron.layers.inference_params import InferenceParams
from megatron.models.gpt.model import GPTModel
from megatron.text_generation.sampling import check_sampling_args, sample


@dataclass
class GenerationOutput:
    """Raw result: tokens [b, n], lengths [b] (prompt + generated, eod included), log-probs [b, n-1] or None."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    logprobs: Optional[torch.Tensor]
    cancelled: bool = False  # `should_stop` ended the decoding early (every rank alike)




def generation_tp_group(tp_group: Any, state: Any) -> Any:
    """The tensor-parallel group to generate with: the one given, the state's, the current parallel state's, or None."""
    if tp_group is not None:
        return tp_group
    if state is not None:
        return state.tp_group
    if ps.model_parallel_is_initialized():
        return ps.get_parallel_state().tp_group
    return None


def forward_step_logits(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 inference_params: Optional[InferenceParams], last_only: bool, tp_group: Any,
                 rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Full-vocab fp32 logits [b, s', v] of this step (s' = 1 with `last_only`), identical on every TP rank.

    `rows` [b, k] (scoring): only the logits of these positions of each sequence, [b, k, v].

    For a GPTModel the output layer is applied here, to the needed positions only, as W @ h^T: for the few rows of
    a decoding step this weight-major product runs ~2.5x faster on CPU than h @ W^T (what nn.Linear does).
    """
    inner = unwrapped_model(model)
    if isinstance(inner, GPTModel) and inner.post_process and not inner.sequence_parallel:
        hidden = inner.language_model(ids, pos, mask, inference_params=inference_params)  # [s, b, h]
        if last_only:
            hidden = hidden[-1:]
        elif rows is not None:
            hidden = hidden.gather(0, rows.t().unsqueeze(-1).expand(-1, -1, hidden.size(-1)))
        s, b, h = hidden.shape
        logits = torch.mm(inner.output_weight(), hidden.reshape(s * b, h).t()).t().reshape(s, b, -1)
        logits = logits.transpose(0, 1)
        gather = True
    else:
        logits = model(ids, pos, mask, inference_params=inference_params)
        if last_only:
            logits = logits[:, -1:]
        elif rows is not None:
            logits = logits.gather(1, rows.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
        gather = getattr(inner, "parallel_output", False)
    if gather and group_size(tp_group) > 1:
        logits = all_gather_along_dim(logits, tp_group, dim=-1)
    return logits.float()


def pipeline_state(state: Any) -> Any:
    """The parallel state when pipeline parallelism is on (pp_size > 1), else None."""
    state = ps.current_parallel_state(state)
    return state if state is not None and getattr(state, "pp_size", 1) > 1 else None


def pipeline_step_logits(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                          inference_params: Optional[InferenceParams], last_only: bool, tp_group: Any,
                          pp: Any, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """One step through the pipeline: the logits of `forward_step_logits` on the last stage, None on the other stages."""
    inner = unwrapped_model(model)
    config = inner.config
    dtype = torch.float32 if getattr(config, "fp32_residual_connection", False) else config.params_dtype
    shape = tensor_shape_for(inner, ids.size(1), ids.size(0))
    p2p = P2PCommunicator(pp, shape, dtype, ids.device)
    inner.set_input_tensor(None if pp.is_pipeline_first_stage() else p2p.communicate(recv_prev=True)[0])
    if pp.is_pipeline_last_stage():
        return forward_step_logits(model, ids, pos, mask, inference_params, last_only, tp_group, rows)
    hidden = model(ids, pos, mask, inference_params=inference_params)  # [s, b, h]
    p2p.communicate(send_next=hidden.to(dtype))
    return None


def broadcast_from_last_stage(x: torch.Tensor, pp: Any) -> torch.Tensor:
    """Broadcast `x` from the last pipeline stage to every stage (no-op without a pipeline); collective."""
    if pp is not None:
        dist.broadcast(x, src=pp.pp_last_rank(), group=pp.pp_group)
    return x


def _broadcast_from_tp_rank0(x: torch.Tensor, tp_group: Any) -> torch.Tensor:
    if group_size(tp_group) > 1:
        dist.broadcast(x, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    return x


@torch.no_grad()
def generate_tokens(
    model: torch.nn.Module,
    prompt_tokens: Sequence[Sequence[int]],
    tokens_to_generate: int,
    *,
    eod_id: int,
    return_output_log_probs: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    greedy: bool = False,
    use_eod_token_for_early_termination: bool = True,
    stop_token_ids: Sequence[int] = (),
    random_seed: int = -1,
    use_kv_cache: bool = True,
    vocab_size: Optional[int] = None,
    max_position_embeddings: Optional[int] = None,
    tp_group: Any = None,
    state: Any = None,
    on_step: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> GenerationOutput:
    """Generate up to `tokens_to_generate` tokens after each prompt (lists of token ids, each non-empty).

    Row i ends after its own `tokens_to_generate` tokens, or at its first eod / stop token (included in its length)
    when `use_eod_token_for_early_termination`; decoding stops once every row has ended. `on_step(tokens, lengths)`
    (streaming) is called after every decoding step with the tokens so far [b, n] and each row's current length.
    `should_stop()` (the server: has the client gone?) is called after every step on every rank and must answer the
    same on all of them; True ends the decoding there (`cancelled`). Sequence parallelism is off while generating
    (`sequence_parallel_off`): prompts and one-token steps of any length run under TP + SP.
    """
    # port of Megatron's generate_tokens_probs_and_return_on_first_stage
    check_sampling_args(top_k, top_p, temperature)
    if not prompt_tokens or any(len(p) == 0 for p in prompt_tokens):
        raise ValueError("every prompt needs at least one token (pass add_BOS=True or a non-empty prompt)")
    if tokens_to_generate < 0:
        raise ValueError(f"tokens_to_generate must be >= 0, got {tokens_to_generate}")
    tp_group = generation_tp_group(tp_group, state)
    pp = pipeline_state(state)
    last_stage = pp is None or pp.is_pipeline_last_stage()
    device = next(model.parameters()).device
    lengths = torch.tensor([len(p) for p in prompt_tokens], dtype=torch.long, device=device)
    batch, min_len, max_len = len(prompt_tokens), int(lengths.min()), int(lengths.max()) + tokens_to_generate
    if max_position_embeddings is None:
        max_position_embeddings = getattr(getattr(unwrapped_model(model), "config", None), "max_position_embeddings", None)
    if max_position_embeddings is not None and max_len > max_position_embeddings:
        raise ValueError(
            f"longest prompt ({max_len - tokens_to_generate} tokens) + tokens_to_generate ({tokens_to_generate}) "
            f"exceeds the model's --max-position-embeddings {max_position_embeddings}; shorten the prompt or "
            "generate fewer tokens"
        )
    tokens = torch.full((batch, max_len), eod_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompt_tokens):
        tokens[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=device)
    positions = torch.arange(max_len, device=device).unsqueeze(0).expand(batch, max_len)
    causal = torch.ones(1, 1, max_len, max_len, dtype=torch.bool, device=device).triu(1)
    out_lengths = lengths + tokens_to_generate  # each row gets its own budget; an eod ends it earlier
    logprobs = torch.zeros(batch, max(max_len - 1, 0), device=device) if return_output_log_probs else None
    is_done = torch.zeros(batch, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(sorted({eod_id, *stop_token_ids}), dtype=torch.long, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(random_seed if random_seed >= 0 else int(torch.randint(0, 2**62, ()).item()))
    inference_params = InferenceParams(batch, max_len) if use_kv_cache else None

    def step_logits(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, params: Optional[InferenceParams],
                    last_only: bool) -> Optional[torch.Tensor]:
        if pp is None:
            return forward_step_logits(model, ids, pos, mask, params, last_only, tp_group)
        return pipeline_step_logits(model, ids, pos, mask, params, last_only, tp_group, pp)

    was_training = model.training
    model.eval()
    prev, cur, cancelled = 0, min_len, False
    with sequence_parallel_off(model):  # each TP rank runs the whole sequence (any length)
        try:
            if logprobs is not None and max_len == min_len and max_len > 1:
                # Nothing to generate and no prompt is shorter than another: the loop below never runs, so score the
                # prompts in one full forward (the server's `tokens_to_generate: 0, logprobs: true`).
                logits = step_logits(tokens, positions, causal, None, False)
                if last_stage:
                    lp = torch.log_softmax(logits, dim=-1)
                    logprobs.copy_(lp[:, :-1].gather(2, tokens[:, 1:].unsqueeze(2)).squeeze(2))
            for cur in range(min_len, max_len):
                start = prev if use_kv_cache else 0
                if inference_params is not None:
                    inference_params.sequence_len_offset = start
                logits = step_logits(tokens[:, start:cur], positions[:, start:cur], causal[..., start:cur, :cur],
                                     inference_params, logprobs is None)  # [b, 1 or cur - start, v]; None off last stage
                if last_stage:
                    new = sample(logits[:, -1, :], greedy=greedy, top_k=top_k, top_p=top_p, temperature=temperature,
                                 vocab_size=vocab_size, generator=generator)
                    new = _broadcast_from_tp_rank0(new.contiguous(), tp_group)
                else:
                    new = torch.empty(batch, dtype=torch.long, device=device)
                new = broadcast_from_last_stage(new, pp)
                started = lengths <= cur
                tokens[started, cur] = new[started]
                if logprobs is not None and last_stage:
                    lp = torch.log_softmax(logits, dim=-1)
                    targets = tokens[:, prev + 1 : cur + 1]
                    logprobs[:, prev:cur] = lp[:, -(cur - prev):, :].gather(2, targets.unsqueeze(2)).squeeze(2)
                if use_eod_token_for_early_termination:
                    just_done = started & ~is_done & torch.isin(tokens[:, cur], stop_ids)
                    out_lengths[just_done] = cur + 1
                    is_done |= just_done
                is_done |= out_lengths <= cur + 1
                prev = cur
                if on_step is not None:
                    on_step(tokens[:, : cur + 1], out_lengths.clamp(max=cur + 1))
                if bool(is_done.all()):
                    break
                if should_stop is not None and should_stop():
                    cancelled = True
                    break
        finally:
            if pp is not None:
                unwrapped_model(model).set_input_tensor(None)
            model.train(was_training)
    if logprobs is not None:
        logprobs = broadcast_from_last_stage(logprobs.contiguous(), pp)
    final_len = cur + 1 if max_len > min_len else max_len
    out_lengths.clamp_(max=final_len)
    tokens = tokens[:, :final_len]
    if logprobs is not None:
        logprobs = logprobs[:, : final_len - 1]
    return GenerationOutput(tokens=tokens, lengths=out_lengths, logprobs=logprobs, cancelled=cancelled)


def eol_token_ids(tokenizer: Any) -> list[int]:
    """The one-token newline ids of `tokenizer` ("\\n", "\\n\\n"): the stop tokens of stop_on_eol."""
    ids = []
    for text in ("\n", "\n\n"):
        try:
            tok = tokenizer.tokenize(text)
        except Exception:  # noqa: BLE001 - a tokenizer without newlines simply has no EOL stop tokens
            continue
        if len(tok) == 1:
            ids.append(int(tok[0]))
    return ids


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Union[Sequence[str], Sequence[Sequence[int]]],
    tokens_to_generate: int,
    *,
    return_output_log_probs: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    greedy: bool = False,
    add_BOS: bool = False,
    use_eod_token_for_early_termination: bool = True,
    stop_on_eol: bool = False,
    random_seed: int = -1,
    use_kv_cache: bool = True,
    eod_id: Optional[int] = None,
    tp_group: Any = None,
    state: Any = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> dict:
    """Generate continuations of text prompts (needs `tokenizer`) or token-id prompts (tokenizer may be None).

    Returns dict(tokens=list of token lists (prompt + generation, cut at each row's length), lengths=list[int],
    text=list[str] or None, segments=list of per-token strings or None, logprobs=list of per-token log-probs
    (len = length - 1; entry j is log p(token j+1 | tokens ..j)) or None, cancelled=whether `should_stop` ended it
    early; see `generate_tokens`). Every TP and PP rank gets the same result.
    """
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list of strings or of token-id lists, not a single string")
    if eod_id is None:
        if tokenizer is None:
            raise ValueError("generate: pass a tokenizer or eod_id")
        eod_id = int(tokenizer.eod)
    prompt_tokens = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            ids = list(tokenizer.tokenize(p))
        else:
            ids = [int(t) for t in p]
        if add_BOS:  # as Megatron: GPT's beginning-of-sequence is the end-of-document token
            ids = [eod_id] + ids
        prompt_tokens.append(ids)
    stop_ids = eol_token_ids(tokenizer) if (stop_on_eol and tokenizer is not None) else []
    vocab_size = getattr(tokenizer, "vocab_size", None) if tokenizer is not None else None
    out = generate_tokens(
        model, prompt_tokens, tokens_to_generate, eod_id=eod_id, return_output_log_probs=return_output_log_probs,
        top_k=top_k, top_p=top_p, temperature=temperature, greedy=greedy,
        use_eod_token_for_early_termination=use_eod_token_for_early_termination, stop_token_ids=stop_ids,
        random_seed=random_seed, use_kv_cache=use_kv_cache, vocab_size=vocab_size, tp_group=tp_group, state=state,
        should_stop=should_stop,
    )
    lengths = [int(n) for n in out.lengths.tolist()]
    token_lists = [row[:n] for row, n in zip(out.tokens.tolist(), lengths)]
    text = segments = None
    if tokenizer is not None:
        text = [tokenizer.detokenize(t) for t in token_lists]
        segments = [[tokenizer.detokenize([t]) for t in row] for row in token_lists]
    logprobs = None
    if out.logprobs is not None:
        logprobs = [row[: n - 1] for row, n in zip(out.logprobs.tolist(), lengths)]
    return dict(tokens=token_lists, lengths=lengths, text=text, segments=segments, logprobs=logprobs,
                cancelled=out.cancelled)
