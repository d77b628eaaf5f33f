"""Model weights into a built DeepSpeed engine from a checkpoint of another format or layout.

Used by megatron.ds.engine when ``--load`` holds

- a Megatron checkpoint (``latest_checkpointed_iteration.txt``: pretraining output, tools/checkpoint/convert.py from
  Hugging Face, any TP/PP/virtual-PP layout) with ``--finetune`` (or ``--no-load-optim --no-load-rng``), or
- a DeepSpeed checkpoint whose files are not the ones this engine reads (the ``--to-deepspeed`` / ``--saver
  deepspeed`` output or a ZeRO-1/2 checkpoint under ZeRO-3, a pipeline checkpoint under the non-pipeline engine, ...).

The checkpoint is read as the conversion tools' interchange stream (megatron.checkpoint.conversion: one layer at a
time, full TP=1 tensors, QKV order fixed) and each tensor is split for this rank with the parameter's own TP layout
and copied into the engine's module: the GPTModel under ZeRO 0-3 (under ZeRO-3 inside
``deepspeed.zero.GatheredParameters(..., modifier_rank=0)`` one message at a time, so the partitions are rewritten)
or the pipe layers of this stage of GPTModelPipe (both copies of a tied word embedding). The vocabulary rows are
re-padded to this run's padded size as Megatron's tools do (padding rows repeat the last row). Then the optimizer's
fp32 master copies follow the loaded weights (``refresh_fp32_params`` of ZeRO-1/2/3, bf16 and fp16 optimizers).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch

from megatron import global_vars, optional
from megatron.checkpoint import integrity
from megatron.checkpoint.args import compare_architecture
from megatron.checkpoint.conversion.deepspeed_format import DeepSpeedCheckpointReader, tag_layout
from megatron.checkpoint.conversion.interchange import ConversionError, state_dict_from_messages
from megatron.checkpoint.conversion.megatron_format import WORD as MEGATRON_WORD
from megatron.checkpoint.conversion.megatron_format import (
    find_iteration_dir,
    megatron_meta,
    read_megatron,
    stream_messages,
)
from megatron.checkpoint.conversion.vocab import repad_rows
from megatron.checkpoint.paths import CheckpointError, first_failure_reason
from megatron.core.tensor_parallel.layout import TensorParallelLayout, get_tp_layout
from megatron.ds.engine_kind import is_pipe_engine
from megatron.logging_utils import print_rank_0
from megatron.models.gpt.model import GPTModel
from megatron.models.gpt.model_pipe import TIED_KEY, is_gpt_model_pipe, pipe_layer_specs_names
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import TrainingState

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
WORD = "language_model.embedding.word_embeddings.weight"
VOCAB_ROWS = (WORD, "language_model.output_layer.weight")


def is_megatron_checkpoint(load_dir: str) -> bool:
    """A Megatron checkpoint folder (tracker file) that is not also a DeepSpeed one (no ``latest``)."""
    return os.path.isfile(os.path.join(load_dir, MEGATRON_TRACKER)) and not os.path.isfile(
        os.path.join(load_dir, "latest"))


def _is_pipe(module: Any) -> bool:
    return is_gpt_model_pipe(module)


def engine_parameters(engine: Any) -> tuple[Dict[str, List[torch.nn.Parameter]], List[str]]:
    """({GPTModel (TP=1 numbering) name: this rank's parameters holding it}, name prefixes built on other stages)."""
    module = engine.module
    out: Dict[str, List[torch.nn.Parameter]] = {}
    if not _is_pipe(module):
        for name, param in module.named_parameters():
            out.setdefault(name, []).append(param)
        return out, []
    tied = bool(module.share_embeddings_and_output_weights)
    names = pipe_layer_specs_names(module.config.num_layers, tied=tied)
    local = module.local_layer_modules()
    for idx, layer in local.items():
        for name, param in layer.named_parameters():
            out.setdefault(names[idx] + name, []).append(param)
    head = module.tied_modules[TIED_KEY] if tied and TIED_KEY in module.tied_modules else None
    if head is not None and not any(m is head for m in local.values()):  # the last stage's copy of the embedding
        out.setdefault(WORD, []).append(head.word_embeddings.weight)
    others = [p for i, p in enumerate(names) if p is not None and i not in local]
    return out, others


def _vocab_rows(value: torch.Tensor, name: str, rows: int, true_vocab: Optional[int], source: str) -> torch.Tensor:
    if value.size(0) == rows:
        return value
    if true_vocab is None or value.size(0) < true_vocab or true_vocab > rows:
        raise CheckpointError(f"{source}: {name} has {value.size(0)} vocabulary rows but this run pads the "
                              f"vocabulary to {rows}; check --vocab-file / --make-vocab-size-divisible-by")
    return repad_rows(value[:true_vocab], rows)


def load_stream_into_engine(engine: Any, messages: Iterator[Any], padded_vocab_size: int, state: Any,
                            source: str, true_vocab_size: Optional[int] = None) -> int:
    """Copy the interchange stream's tensors into this rank's engine parameters; returns how many were set.

    Collective over the data-parallel group under ZeRO-3. Every parameter of the module must be set exactly by the
    stream and every tensor of the stream must have a parameter on some stage (one-line CheckpointError otherwise).
    """
    targets, other_stages = engine_parameters(engine)
    zero3 = getattr(engine, "zero_optimization_stage", lambda: 0)() == 3
    rows = int(padded_vocab_size)
    filled: set = set()
    unknown: List[str] = []
    for msg in messages:
        flat = state_dict_from_messages(iter([msg]))
        pairs = []
        for name, full in flat.items():
            if name.endswith("_extra_state"):
                continue
            if name not in targets:
                if not any(name.startswith(p) for p in other_stages):
                    unknown.append(name)
                continue
            if name in VOCAB_ROWS:
                full = _vocab_rows(full, name, rows, true_vocab_size, source)
            for param in targets[name]:
                layout = get_tp_layout(param)
                try:
                    value = layout.split(full, state.tp_size, name)[state.tp_rank] if state.tp_size > 1 else full
                except ValueError as exc:
                    raise CheckpointError(f"{source}: {exc}") from None
                shape = tuple(getattr(param, "ds_shape", param.shape))
                if tuple(value.shape) != shape:
                    raise CheckpointError(
                        f"{source}: {name} has shape {tuple(value.shape)} for tensor rank {state.tp_rank} but the "
                        f"model's is {shape}; check --num-layers, --hidden-size, --num-attention-heads, "
                        "--ffn-hidden-size and --num-query-groups")
                pairs.append((param, value))
            filled.add(name)
        if unknown:
            break
        params = [p for p, _ in pairs]
        if zero3 and params:
            gathered: Any = optional.deepspeed().zero.GatheredParameters(params, modifier_rank=0)
        else:
            gathered = contextlib.nullcontext()
        with gathered, torch.no_grad():
            for param, value in pairs:
                param.data.copy_(value)
    if unknown:
        raise CheckpointError(f"{source} holds {unknown[0]}, which this model has no parameter for; check the "
                              "model flags (--untie-embeddings-and-output-weights, --disable-bias-linear, ...)")
    missing = sorted(set(targets) - filled)
    if missing:
        raise CheckpointError(f"{source} has no {missing[0]} for this model; check the model flags "
                              "(--untie-embeddings-and-output-weights, --add-qkv-bias, --swiglu, ...)")
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if callable(refresh):  # ZeRO-1/2/3, bf16/fp16 optimizers: the fp32 master copies follow the loaded weights
        refresh()
    return len(filled)


def _true_vocab(meta_true: Optional[int]) -> Optional[int]:
    if meta_true is not None:
        return int(meta_true)
    try:
        return int(global_vars.get_tokenizer().vocab_size)
    except Exception:  # noqa: BLE001 - no tokenizer built (tests): only an equal row count loads
        return None


def load_megatron_checkpoint_into_engine(engine: Any, architecture: Mapping[str, Any], state: Any,
                                         train_state: TrainingState, settings: CheckpointSettings) -> int:
    """--deepspeed --load <Megatron checkpoint> with --finetune (iteration 0) or --no-load-optim --no-load-rng
    (the checkpoint's iteration and consumed samples, into `train_state`); returns the iteration to continue from.
    The checkpoint must have this run's `architecture`; its vocabulary rows are padded to the run's size (the
    architecture's ``padded_vocab_size``)."""
    cfg = settings
    load_dir = cfg.load
    finetune = cfg.finetune
    if not (isinstance(engine.module, GPTModel) or _is_pipe(engine.module)):
        raise CheckpointError(f"--deepspeed --load of a Megatron checkpoint ({load_dir}) loads GPT models only, not "
                              f"{type(engine.module).__name__}: train without --deepspeed to start from it")
    if not finetune and not (cfg.no_load_optim and cfg.no_load_rng):
        raise CheckpointError(f"--load {load_dir} holds a Megatron checkpoint (no DeepSpeed optimizer or RNG state): "
                              "add --finetune to start from its weights, or --no-load-optim --no-load-rng to continue "
                              "its iteration count")
    try:
        iter_dir, _ = find_iteration_dir(load_dir)
        reason = integrity.verify(iter_dir) if cfg.rank == 0 else None
        reason = first_failure_reason(None if reason == integrity.NO_MANIFEST else reason)
        if reason is not None:
            raise CheckpointError(f"checkpoint {iter_dir} is damaged: {reason}; restore it")
        meta, messages = read_megatron(load_dir, model_type="GPT", trust=cfg.trust_checkpoint,
                                       verify=False)  # verified above, collectively
        release = meta.iteration is None
        print_rank_0(f" loading checkpoint from {load_dir} at iteration {0 if release else meta.iteration} "
                     f"(Megatron checkpoint, TP={meta.extra.get('tp')} PP={meta.extra.get('pp')}, into the "
                     "DeepSpeed engine)")
        compare_architecture({k: v for k, v in meta.architecture.items() if k != "padded_vocab_size"}, architecture,
                             iter_dir)
        load_stream_into_engine(engine, messages, architecture["padded_vocab_size"], state, iter_dir,
                                _true_vocab(meta.true_vocab_size))
    except ConversionError as exc:
        raise CheckpointError(str(exc).replace("--load-dir", "--load")) from None
    if finetune or release:
        iteration = 0
    else:
        iteration = int(meta.iteration)
        train_state.consumed_train_samples = int(meta.consumed_train_samples)
        train_state.consumed_valid_samples = int(meta.consumed_valid_samples)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    loaded = 0 if release else int(meta.iteration)
    restart = "" if iteration == loaded else f"; training starts at iteration {iteration} (--finetune)"
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} at iteration {loaded}{restart}")
    return iteration


def expected_layout(engine: Any) -> str:
    """The DeepSpeed file layout this engine's load_checkpoint reads: 'pipe', 'zero3' or 'module'."""
    if is_pipe_engine(engine):
        return "pipe"
    return "zero3" if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3 else "module"


def load_other_layout_into_engine(engine: Any, tag_dir: str, architecture: Mapping[str, Any],
                                  padded_vocab_size: int, state: Any, settings: CheckpointSettings
                                  ) -> tuple[str, dict]:
    """A DeepSpeed tag of another layout than the engine's: its weights through the stream (vocabulary rows padded
    to `padded_vocab_size`); (path, client state). The tag must have this run's `architecture`."""
    try:
        reader = DeepSpeedCheckpointReader(tag_dir, trust=settings.trust_checkpoint)
        compare_architecture({k: v for k, v in reader.architecture.items() if k != "padded_vocab_size"}, architecture,
                             tag_dir)
        meta = megatron_meta(reader, None, "GPT")
        meta.architecture["padded_vocab_size"] = reader.merged(0, 0, MEGATRON_WORD, TensorParallelLayout(dim=0)).size(0)
        print_rank_0(f" loading the weights of {tag_dir} ({reader.layout} layout, TP={reader.tp}) into the "
                     f"{expected_layout(engine)} engine")
        load_stream_into_engine(engine, stream_messages(reader, meta), padded_vocab_size, state, tag_dir,
                                _true_vocab(None))
    except ConversionError as exc:
        raise CheckpointError(str(exc)) from None
    return tag_dir, dict(reader.first)


def tag_layout_or_none(tag_dir: str) -> Optional[str]:
    """'pipe' / 'module' / 'zero3' for a DeepSpeed tag folder, None when it is none of them (DeepSpeed explains)."""
    if not os.path.isdir(tag_dir):
        return None
    try:
        return tag_layout(tag_dir)[0]
    except ConversionError:
        return None
