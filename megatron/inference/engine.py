"""The inference engine: continuous batching over a paged KV cache (Megatron-LM's dynamic engine, for this model).

Requests are added at any time (`add_request`) and queued; each `step()` admits queued requests while the block pool
and `max_requests` allow (a request reserves the blocks of its whole prompt + max_new_tokens at admission, so a
running request never runs out; the blocks of a shared prompt prefix are taken from the prefix cache instead), then
runs ONE forward over the step's tokens of every running request: one token per decoding request, and prompt tokens
(the whole remaining prompt, or with chunked prefill as much as the `max_tokens` budget leaves after the decodes).
The tokens are flattened into one [T] sequence, each with its own position; the attention layers write their K/V to
the request's blocks and attend over its own context (megatron/layers/paged_kv.py). Each request then samples with
its own parameters and generator and finishes at its stop token or length; its blocks go back to the pool (full
prompt blocks stay in the prefix cache until evicted).

Tensor and pipeline parallelism: every rank of the model-parallel group (TP x PP) calls `step()`; its rank 0 (first
stage, TP rank 0) owns the requests, builds the step's plan (token ids, positions, slots) and broadcasts it, so all
ranks run the same forward (through the stages as the static generator: P2P hidden states [T, 1, h]); the logits
are gathered over TP, broadcast from the last stage over the pipeline, and rank 0 samples. The other ranks'
`step()` returns [] (`follow()` loops on it) until rank 0 calls `shutdown()`.
"""
from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import group_size
from megatron.core.utils import sequence_parallel_off
from megatron.core.utils import unwrap_model as unwrapped_model
from megatron.inference.block_pool import BlockPool, prefix_hashes
from megatron.inference.types import EngineConfig, EngineStats, RequestRejected, SamplingParams, StepOutput
from megatron.layers.attention import ParallelAttention
from megatron.layers.enums import AttnType
from megatron.layers.paged_kv import PagedKVCache, PagedStep
from megatron.models.deepseek.mla import MLASelfAttention
from megatron.text_generation.generation import (
    broadcast_from_last_stage,
    forward_step_logits,
    pipeline_state,
    pipeline_step_logits,
)
from megatron.text_generation.sampling import check_sampling_args, sample


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the cache
    registered: int = 0  # full prompt blocks registered in the prefix cache
    reserved: int = 0  # blocks this request holds (shared ones included)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token takes on this rank: every attention layer's K and V (this rank's query groups),
    or multi-latent attention's latent and rope key."""
    total = 0
    for module in unwrapped_model(model).modules():
        if isinstance(module, MLASelfAttention):
            width = module.kv_rank + module.pe_dim
        elif isinstance(module, ParallelAttention) and module.attention_type == AttnType.self_attn:
            width = 2 * module.num_query_groups_per_partition * module.hidden_size_per_attention_head
        else:
            continue
        total += width * torch.empty(0, dtype=module.config.params_dtype).element_size()
    if total == 0:
        raise RequestRejected("the inference engine found no self-attention layer in the model")
    return total


class InferenceEngine:
    """Continuous batching with a paged KV cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, eod: int, tp_group: Any = None,
                 state: Any = None) -> None:
        self.model = model
        self.config = config
        self.eod = int(eod)
        if getattr(ps.current_parallel_state(state), "cp_size", 1) > 1:
            raise RequestRejected("the inference engine runs at --context-parallel-size 1; split long prompts with "
                                  "--enable-chunked-prefill instead")
        if getattr(ps.current_parallel_state(state), "ep_size", 1) > 1:
            raise RequestRejected("the inference engine runs at --expert-model-parallel-size 1 (its steps differ "
                                  "per data-parallel rank); use tensor parallelism, or the static generator")
        self.pp = pipeline_state(state)
        if tp_group is None and ps.model_parallel_is_initialized():
            tp_group = (state or ps.get_parallel_state()).tp_group
        self.tp_group = tp_group if group_size(tp_group) > 1 else None
        # The ranks that run each step together: TP x PP (the model-parallel group), or the TP group.
        self.plan_group = self.pp.mp_group if self.pp is not None else self.tp_group
        self.leader = self.plan_group is None or dist.get_rank(self.plan_group) == 0
        self.device = next(model.parameters()).device
        bs = config.block_size
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        else:
            num_blocks = int(config.buffer_size_gb * 1024**3) // (bs * kv_bytes_per_token(model))
        if num_blocks < 1:
            raise RequestRejected(f"--inference-dynamic-batching-buffer-size-gb {config.buffer_size_gb} holds no "
                                  f"block of {bs} tokens for this model; raise it or lower the block size")
        self.pool = BlockPool(num_blocks)
        self.cache = PagedKVCache(num_blocks, bs)
        self.max_requests = min(config.max_requests or num_blocks, config.max_tokens)
        self.max_positions = getattr(unwrapped_model(model).config, "max_position_embeddings", None)
        self.vocab = getattr(unwrapped_model(model).config, "padded_vocab_size", None)
        self.sequence_parallel = any(getattr(obj, "sequence_parallel", None) is True for m in model.modules()
                                     for obj in (m, getattr(m, "config", None)))  # switched off per step
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.ids: set[str] = set()
        self.cancelled: set[str] = set()
        self.steps = 0
        self.prefix_hit_blocks = 0  # blocks taken from the prefix cache instead of computed
        self.finished_signal = False

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_tokens: list[int], params: SamplingParams) -> None:
        """Queue a request (rank 0). Raises RequestRejected (one line) if it can never run."""
        self._check_request(request_id, prompt_tokens, params)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed >= 0 else int(torch.randint(0, 2**62, ()).item()))
        req = _Request(request_id, [int(t) for t in prompt_tokens], params, generator)
        if self.config.prefix_caching and not params.return_prompt_logprobs:
            req.hashes = prefix_hashes(req.prompt, self.config.block_size)
        self.ids.add(request_id)
        self.queue.append(req)

    def _check_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if not self.leader:
            raise RuntimeError("add_request is for model-parallel rank 0, which owns the requests")
        if request_id in self.ids:
            raise RequestRejected(f"request id {request_id!r} is already in the engine; use a new id")
        if not prompt:
            raise RequestRejected("a request needs at least one prompt token (add a BOS token)")
        if self.vocab is not None and not all(0 <= int(t) < self.vocab for t in prompt):
            raise RequestRejected(f"a prompt token id is outside the vocabulary [0, {self.vocab}); check the tokenizer")
        if params.max_new_tokens < 0 or (params.max_new_tokens == 0 and not params.return_prompt_logprobs):
            raise RequestRejected(f"max_new_tokens must be >= 1 (0 only to score the prompt with "
                                  f"return_prompt_logprobs), got {params.max_new_tokens}")
        try:
            greedy = params.greedy or params.top_k == 1  # the temperature does not matter (0 allowed)
            check_sampling_args(params.top_k, params.top_p, 1.0 if greedy else params.temperature)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        total = len(prompt) + params.max_new_tokens
        if self.max_positions is not None and total > self.max_positions:
            raise RequestRejected(f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                                  f"the model's --max-position-embeddings {self.max_positions}; shorten the prompt")
        need = self._blocks_for(self._kv_tokens(len(prompt), params))
        if need > self.pool.num_blocks:
            raise RequestRejected(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) needs {need} KV-cache "
                f"blocks, the cache has {self.pool.num_blocks}; raise --inference-dynamic-batching-buffer-size-gb "
                "or generate fewer tokens")
        if not self.config.chunked_prefill and len(prompt) > self.config.max_tokens:
            raise RequestRejected(f"prompt ({len(prompt)} tokens) exceeds --inference-dynamic-batching-max-tokens "
                                  f"{self.config.max_tokens}; raise it or add --enable-chunked-prefill")

    @staticmethod
    def _kv_tokens(prompt: int, params: SamplingParams) -> int:
        """Positions a request writes to the cache: its prompt and every generated token but the last."""
        return max(prompt, prompt + params.max_new_tokens - 1)

    def _blocks_for(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.config.block_size))

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its blocks are freed at the next step (unknown ids are ignored)."""
        if request_id in self.ids:
            self.cancelled.add(request_id)

    def has_work(self) -> bool:
        """Whether any request is queued or running (or a cancellation is pending)."""
        return bool(self.queue or self.running or self.cancelled)

    @property
    def stats(self) -> EngineStats:
        """Queued / running counts and free blocks (for backpressure)."""
        return EngineStats(queued=len(self.queue), running=len(self.running), free_blocks=self.pool.available(),
                           total_blocks=self.pool.num_blocks, cached_blocks=self.pool.cached_count(),
                           steps=self.steps, prefix_hit_blocks=self.prefix_hit_blocks)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit, run one forward over every running request's next tokens, sample; the outputs of this step (new
        tokens, finished and cancelled requests). On the other model-parallel ranks: run rank 0's next forward, return
        []."""
        if not self.leader:
            self.follow_one()
            return []
        outputs = self._apply_cancellations()
        self._admit()
        plan = self._schedule()
        if not plan:
            return outputs
        batch = self._layout(plan)
        self._broadcast_plan(batch)
        logits = self._forward(batch)
        self.steps += 1
        outputs += self._advance(plan, batch["row_spec"], logits)
        return outputs

    def _apply_cancellations(self) -> list[StepOutput]:
        outputs = []
        for rid in sorted(self.cancelled):
            queued = [r for r in self.queue if r.request_id == rid]
            running = [r for r in self.running if r.request_id == rid]
            for req in queued:
                self.queue.remove(req)
                self.ids.discard(rid)
            for req in running:
                self._release(req)
            if queued or running:
                outputs.append(StepOutput(rid, finished=True, finish_reason="cancelled"))
        self.cancelled.clear()
        return outputs

    def _release(self, req: _Request) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        self.running.remove(req)
        self.ids.discard(req.request_id)

    def _admit(self) -> None:
        """Move queued requests to running, first come first served, while their blocks and max_requests allow."""
        bs = self.config.block_size
        while self.queue and len(self.running) < self.max_requests:
            req = self.queue[0]
            total = self._blocks_for(self._kv_tokens(len(req.prompt), req.params))
            shared = self.pool.lookup(req.hashes[: (len(req.prompt) - 1) // bs])
            idle_shared = sum(1 for b in shared if self.pool.refcount[b] == 0)
            need = total - len(shared)
            if need > self.pool.available() - idle_shared:
                break
            self.queue.popleft()
            self.pool.acquire(shared)
            self.prefix_hit_blocks += len(shared)
            req.blocks = shared + self.pool.allocate(need)
            req.computed = len(shared) * bs
            req.registered = len(shared)
            self.running.append(req)

    def _schedule(self) -> list[tuple[_Request, int]]:
        """(request, tokens to feed) for this step: every decoding request's one token, then prompt tokens within
        the max_tokens budget (a whole remaining prompt, or with chunked prefill as much as fits)."""
        budget = self.config.max_tokens
        plan = []
        for req in self.running:
            if req.computed >= len(req.prompt):
                plan.append((req, 1))
                budget -= 1
        for req in self.running:
            remaining = len(req.prompt) - req.computed
            if remaining <= 0 or budget <= 0:
                continue
            n = min(remaining, budget) if self.config.chunked_prefill else remaining
            if n <= budget:
                plan.append((req, n))
                budget -= n
        return plan

    def _layout(self, plan: list[tuple[_Request, int]]) -> dict:
        """The step's tensors: token ids, positions, write slots [T]; read slots [R, L]; the logit rows wanted."""
        bs, dev = self.config.block_size, self.device
        ids, rows, row_spec, tables = [], [], [], []
        offset = 0
        for req, n in plan:
            ids.extend(req.prompt[req.computed:req.computed + n] if req.computed < len(req.prompt)
                       else req.output[-1:])  # a prompt chunk, or the last sampled token
            samples = req.computed + n == len(req.prompt) + len(req.output)
            first = len(rows)
            if req.params.return_prompt_logprobs and req.computed < len(req.prompt):
                rows.extend(range(offset, offset + n))
            elif samples:
                rows.append(offset + n - 1)
            row_spec.append((first, len(rows) - first, samples))
            tables.append(req.blocks)
            offset += n
        counts = torch.tensor([n for _, n in plan], dtype=torch.long, device=dev)
        starts = torch.tensor([req.computed for req, _ in plan], dtype=torch.long, device=dev)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        owner = torch.repeat_interleave(torch.arange(len(plan), device=dev), counts)  # [T]: the token's request
        first_token = torch.cumsum(counts, 0) - counts
        positions = starts[owner] + torch.arange(offset, device=dev) - first_token[owner]
        write_slots = table[owner, positions // bs] * bs + positions % bs
        lengths = starts + counts
        keys = torch.arange(int(lengths.max()), device=dev)[None, :].minimum(lengths[:, None] - 1)  # [R, L]
        read_slots = table.gather(1, keys // bs) * bs + keys % bs
        return dict(ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=positions,
                    write_slots=write_slots, counts=counts, read_slots=read_slots,
                    rows=torch.tensor(rows, dtype=torch.long, device=dev), row_spec=row_spec)

    def _broadcast_plan(self, batch: Optional[dict]) -> Optional[dict]:
        """Send (rank 0) or receive (the other model-parallel ranks) the step's tensors; None = shut down. Collective
        over the plan group (TP, or TP x PP)."""
        if self.plan_group is None:
            return batch
        src = dist.get_global_rank(self.plan_group, 0)
        header = torch.zeros(5, dtype=torch.long, device=self.device)
        if batch is not None:
            header.copy_(torch.tensor([1, batch["ids"].numel(), batch["read_slots"].size(0),
                                       batch["read_slots"].size(1), batch["rows"].numel()]))
        dist.broadcast(header, src=src, group=self.plan_group)
        if int(header[0]) == 0:
            return None
        t, r, length, k = (int(x) for x in header[1:])
        if batch is None:
            batch = dict(ids=self._empty(t), positions=self._empty(t), write_slots=self._empty(t),
                         counts=self._empty(r), read_slots=self._empty(r, length), rows=self._empty(k))
        for name in ("ids", "positions", "write_slots", "counts", "read_slots", "rows"):
            dist.broadcast(batch[name], src=src, group=self.plan_group)
        return batch

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.long, device=self.device)

    def follow_one(self) -> bool:
        """(Model-parallel ranks other than 0) Run rank 0's next step; False when rank 0 has shut the engine down."""
        batch = self._broadcast_plan(None)
        if batch is None:
            self.finished_signal = True
            return False
        self._forward(batch)
        return True

    def follow(self) -> None:
        """(Model-parallel ranks other than 0) Run rank 0's steps until it calls `shutdown()`."""
        while self.follow_one():
            pass

    def shutdown(self) -> None:
        """(rank 0) Tell the other model-parallel ranks to leave `follow()` (or end one `step()`); collective."""
        if self.plan_group is not None and self.leader:
            self._broadcast_plan(None)

    @torch.no_grad()
    def _forward(self, batch: dict) -> torch.Tensor:
        """One forward of the step's tokens over the paged cache: fp32 logits [K, v] of the wanted rows."""
        step = PagedStep(self.cache, batch["positions"], batch["write_slots"], batch["counts"].tolist(),
                         batch["read_slots"])
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with sequence_parallel_off(self.model) if self.sequence_parallel else contextlib.nullcontext():
                rows = batch["rows"] if batch["rows"].numel() else batch["rows"].new_zeros(1)  # (a prefill chunk)
                ids, positions = batch["ids"][None], batch["positions"][None]
                if self.pp is None:
                    return forward_step_logits(self.model, ids, positions, None, step, False, self.tp_group,
                                               rows=rows[None])[0]
                logits = pipeline_step_logits(self.model, ids, positions, None, step, False, self.tp_group, self.pp,
                                              rows=rows[None])
                if logits is None:  # not the last stage: receive the last stage's logits
                    logits = torch.empty(1, rows.numel(), self.vocab, device=self.device)
                return broadcast_from_last_stage(logits.contiguous(), self.pp)[0]
        finally:
            if self.pp is not None:
                unwrapped_model(self.model).set_input_tensor(None)
            if was_training:
                self.model.train(True)

    def _advance(self, plan: list[tuple[_Request, int]], row_spec: list[tuple[int, int, bool]],
                 logits: torch.Tensor) -> list[StepOutput]:
        """Record the fed tokens, sample the requests whose prompt is done, finish those that stop."""
        outputs = []
        for (req, n), (first, count, samples) in zip(plan, row_spec):
            start = req.computed
            req.computed += n
            rows = logits[first:first + count]
            if req.params.return_prompt_logprobs and start < len(req.prompt):
                targets = req.prompt[start + 1:start + 1 + count]
                lp = torch.log_softmax(rows[:len(targets)], dim=-1)
                req.prompt_logprobs += lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
            self._register(req)
            if samples:
                if req.params.max_new_tokens == 0:  # scoring only: the prompt log-probs, no token
                    outputs.append(StepOutput(req.request_id, finished=True, finish_reason="length",
                                              prompt_logprobs=req.prompt_logprobs))
                    self._release(req)
                else:
                    outputs.append(self._sample(req, rows[-1]))
        return outputs

    def _register(self, req: _Request) -> None:
        full = min(req.computed, len(req.prompt)) // self.config.block_size
        for i in range(req.registered, min(full, len(req.hashes))):
            self.pool.register(req.blocks[i], req.hashes[i])
        req.registered = max(req.registered, min(full, len(req.hashes)))

    def _sample(self, req: _Request, row: torch.Tensor) -> StepOutput:
        p = req.params
        token = int(sample(row[None], greedy=p.greedy, top_k=p.top_k, top_p=p.top_p, temperature=p.temperature,
                           vocab_size=p.vocab_size, generator=req.generator)[0])
        out = StepOutput(req.request_id, new_tokens=[token])
        if p.return_logprobs:
            out.new_logprobs = [float(torch.log_softmax(row, dim=-1)[token])]
        if p.return_prompt_logprobs and not req.output:
            out.prompt_logprobs = req.prompt_logprobs
        req.output.append(token)
        if token in p.stop_token_ids or (p.stop_on_eod and token == self.eod):
            out.finished, out.finish_reason = True, "stop"
        elif len(req.output) >= p.max_new_tokens:
            out.finished, out.finish_reason = True, "length"
        if out.finished:
            self._release(req)
        return out
