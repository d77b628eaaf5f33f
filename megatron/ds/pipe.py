"""Train and evaluation steps for DeepSpeed's pipeline engine (``--deepspeed`` with PP > 1, model = GPTModelPipe).

`pipe_train_step` / `pipe_eval_step` have the shapes megatron.ds.engine dispatches to for a PipelineEngine:
``engine.train_batch`` / ``engine.eval_batch`` run the whole 1F1B schedule (forward, backward, gradient
reductions, optimizer step) over ``gradient_accumulation_steps`` micro-batches. The LR scheduler is not stepped
here (the caller owns it, as for the non-pipeline engine).

Batches: our data iterators yield dicts with "text" [b, s+1]. The engine wants ``(inputs, labels)`` tuples and only
the first stage reads ``inputs`` = (tokens, position_ids[, attention_mask]) and only the last stage reads
``labels`` = (labels, loss_mask); middle stages never pull from the iterator. Each stage builds only the part it
uses, and the causal mask / position ids / loss mask are built only when a flag makes them differ from the defaults
(--reset-attention-mask, --reset-position-ids, --eod-mask-loss).

Gradient clipping: for fp32 without ZeRO, DeepSpeed's own clip counts parameters that are not tensor-parallel only
on the first rank of the whole (pipe x tensor) model group, which drops them on the other pipeline stages.
`prepare_pipe_engine` replaces that engine's fp32 clip with ours (megatron.optimizer.clip_grads: every parameter
once over TP x PP, the tied embedding copy on the last stage not counted) and records the norm, so ``grad norm`` is
logged. With ZeRO-1 or fp16/bf16 DeepSpeed's optimizer wrappers clip (they count parameters correctly).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterator, Optional

import torch

from megatron import global_vars
from megatron.optimizer.clip_grads import clip_grad_norm_fp32, param_is_not_tp_duplicate
from megatron.run_configs.deepspeed import DeepSpeedSettings
from megatron.utils import get_ltor_masks_and_position_ids

_PREPARED_ATTR = "_megatron_pipe_prepared"


def _carry_attention_mask(engine: Any, settings: DeepSpeedSettings) -> bool:
    module = getattr(engine, "module", None)
    return bool(getattr(module, "carry_attention_mask", settings.reset_attention_mask))


def prepare_pipe_engine(engine: Any, settings: DeepSpeedSettings, state: Any) -> None:
    """One-time set-up of a PipelineEngine for GPTModelPipe (idempotent; called by the steps too)."""
    if getattr(engine, _PREPARED_ATTR, False):
        return
    # DeepSpeed's p2p sends activations with an in-place broadcast on tensors that require grad; autograd then
    # warns once at backward that broadcast_ has no autograd kernel (harmless: the send is not part of the math).
    warnings.filterwarnings("ignore", message=r"c10d::broadcast_: an autograd kernel was not registered")
    if _carry_attention_mask(engine, settings):
        engine.set_has_attention_mask(True)  # the mask is the last tensor crossing stages: sent as fp16, no grad
    if (engine.gradient_clipping() > 0.0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and not engine.zero_optimization()):
        engine.clip_fp32_gradients = _fp32_clip(engine, state)
    setattr(engine, _PREPARED_ATTR, True)


def _fp32_clip(engine: Any, state: Any):
    def clip_fp32_gradients() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        counted = [p.grad for p in params
                   if not getattr(p, "ds_pipe_replicated", False) and param_is_not_tp_duplicate(p, state.tp_rank)]
        engine._global_grad_norm = clip_grad_norm_fp32(params, counted, engine.gradient_clipping(),
                                                       model_parallel_group=state.mp_group)

    return clip_fp32_gradients


def pipe_micro_batches(data_iterator: Optional[Iterator], settings: DeepSpeedSettings, eod_token: int,
                       first_stage: bool, last_stage: bool, carry_attention_mask: bool = False) -> Iterator[tuple]:
    """Our micro-batches ({"text": [b, s+1]}) as the engine's ((tokens, position_ids[, mask]), (labels, loss_mask))."""
    plain = not (settings.reset_position_ids or settings.reset_attention_mask or settings.eod_mask_loss)
    while True:
        if data_iterator is None:
            raise RuntimeError("the first and last pipeline stages need a training data iterator (none was built)")
        data = next(data_iterator)
        text = data["text"].long()
        tokens = text[:, :-1].contiguous()
        if plain:
            mask = None
            position_ids = torch.arange(tokens.size(1), dtype=torch.long).unsqueeze(0).expand_as(tokens)
            loss_mask = torch.ones(tokens.shape, dtype=torch.float)
        else:
            mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens, eod_token, settings.reset_position_ids, settings.reset_attention_mask, settings.eod_mask_loss)
        inputs = labels = None
        if first_stage:
            inputs = (tokens, position_ids, mask) if carry_attention_mask else (tokens, position_ids)
        if last_stage:
            labels = (text[:, 1:].contiguous(), loss_mask)
        yield inputs, labels


def _eod_token() -> int:
    return global_vars.get_tokenizer().eod


def _batches(engine: Any, data_iterator: Optional[Iterator], settings: DeepSpeedSettings) -> Optional[Iterator]:
    first, last = engine.is_first_stage(), engine.is_last_stage()
    if not (first or last):
        return None  # middle stages only receive activations
    return pipe_micro_batches(data_iterator, settings, _eod_token(), first, last,
                              _carry_attention_mask(engine, settings))


def _as_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def pipe_train_step(engine: Any, data_iterator: Optional[Iterator], settings: DeepSpeedSettings, state: Any
                    ) -> tuple[dict, int, Optional[float], Optional[int]]:
    """One iteration through ``engine.train_batch``: (loss dict, skipped, grad norm, num zeros in grad).

    The loss is the mean over the batch's micro-batches and data-parallel ranks (the value Megatron logs), known on
    every rank (the engine broadcasts it over the pipeline). `skipped` is 1 when the fp16 loss scaler skipped the
    update (overflow).
    """
    prepare_pipe_engine(engine, settings, state)
    engine._global_grad_norm = None
    loss = engine.train_batch(data_iter=_batches(engine, data_iterator, settings))
    skipped = 0 if engine.was_step_applied() else 1
    return {"lm loss": _as_float(loss)}, skipped, _as_float(engine.get_global_grad_norm()), None


def pipe_eval_step(engine: Any, data_iterator: Optional[Iterator], settings: DeepSpeedSettings, state: Any) -> dict:
    """Forward-only pass over one batch (``engine.eval_batch``): {"lm loss": mean over its micro-batches and DP}."""
    prepare_pipe_engine(engine, settings, state)
    loss = engine.eval_batch(_batches(engine, data_iterator, settings),
                             num_micro_batches=global_vars.get_num_microbatches())
    return {"lm loss": _as_float(loss)}
