"""Loader and saver plugins and how `--loader NAME` / `--saver NAME` find them.

A loader module/object has ``add_arguments(parser)`` and ``load_checkpoint(args) -> (ModelMeta, message iterator)``;
a saver has ``add_arguments(parser)`` and ``save_checkpoint(meta, messages, args, save_dir) -> dict`` (it writes
into `save_dir`, a fresh folder the driver renames to --save-dir on success). Built-ins: loaders/savers megatron, hf
and deepspeed (deepspeed_format.py; tools/checkpoint/loader_deepspeed.py / saver_deepspeed.py re-export them). Any
other NAME is imported as the module ``loader_NAME`` / ``saver_NAME``,
falling back to ``NAME`` (Megatron-LM's rule), so third-party plugins (and BERT/T5 adapters) plug in unchanged.

The built-ins keep that protocol (the namespace) at their edge and read it once, as a `ConversionOptions`
(megatron/run_configs/conversion.py): ``load_checkpoint(args)`` is ``load(options)``, ``save_checkpoint(..., args,
...)`` is ``save(..., options, ...)``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import shutil
from typing import Any, Dict, Iterator, Tuple

from megatron.checkpoint.atomic_io import atomic_write_text
from megatron.checkpoint.conversion.deepspeed_format import read_deepspeed, write_deepspeed
from megatron.checkpoint.conversion.hf_format import read_hf, write_hf
from megatron.checkpoint.conversion.interchange import ConversionError, Message, ModelMeta
from megatron.checkpoint.conversion.megatron_format import (
    find_iteration_dir,
    read_megatron,
    sign_output,
    write_megatron,
)
from megatron.checkpoint.conversion.t5_format import read_t5, write_t5
from megatron.checkpoint.conversion.torch_dist import is_dist_folder, read_torch_dist, write_torch_dist
from megatron.models import registry
from megatron.run_configs.conversion import ConversionOptions


class _BuiltinLoader:
    """The loader protocol over the typed ``load(options)`` of a built-in."""

    @classmethod
    def load_checkpoint(cls, args: argparse.Namespace) -> Tuple[ModelMeta, Iterator[Message]]:
        return cls.load(ConversionOptions.from_args(args))

    @staticmethod
    def load(opts: ConversionOptions) -> Tuple[ModelMeta, Iterator[Message]]:
        raise NotImplementedError


class _BuiltinSaver:
    """The saver protocol over the typed ``save(meta, messages, options, save_dir)`` of a built-in."""

    @classmethod
    def save_checkpoint(cls, meta: ModelMeta, messages: Iterator[Message], args: argparse.Namespace,
                        save_dir: str) -> Dict[str, Any]:
        return cls.save(meta, messages, ConversionOptions.from_args(args), save_dir)

    @staticmethod
    def save(meta: ModelMeta, messages: Iterator[Message], opts: ConversionOptions, save_dir: str) -> Dict[str, Any]:
        raise NotImplementedError


def copy_tokenizer_files(meta: ModelMeta, out_dir: str, final_dir: str) -> None:
    """Copy a HF source's tokenizer files into ``<out>/tokenizer`` and point the tokenizer flags at them."""
    files = meta.tokenizer.get("files") or []
    if not files:
        return
    dst = os.path.join(out_dir, "tokenizer")
    os.makedirs(dst, exist_ok=True)
    for f in files:
        shutil.copyfile(f, os.path.join(dst, os.path.basename(f)))
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        rel = meta.tokenizer.get(key)
        if rel and not os.path.isabs(rel):
            meta.tokenizer[key] = os.path.normpath(os.path.join(final_dir, "tokenizer", rel))
    meta.tokenizer["files"] = []


class MegatronLoader(_BuiltinLoader):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("Megatron loader")
        group.add_argument("--iteration", type=int, default=None,
                           help="Read iter_{N:07d} instead of the iteration named by "
                                "latest_checkpointed_iteration.txt")

    @staticmethod
    def load(opts: ConversionOptions) -> Tuple[ModelMeta, Iterator[Message]]:
        if registry.layout_for(opts.model_type).encoder_decoder:  # its own stream (t5_format.py)
            if opts.iteration is not None:
                raise ConversionError(f"--iteration is not supported for --model-type {opts.model_type}: point the "
                                      "tracker file at it")
            return read_t5(opts.load_dir, true_vocab_size=opts.true_vocab_size, trust=opts.trust_checkpoint,
                           optimizer=opts.keep_training_state)
        return read_megatron(opts.load_dir, true_vocab_size=opts.true_vocab_size, model_type=opts.model_type,
                             trust=opts.trust_checkpoint, optimizer=opts.keep_training_state,
                             iteration=opts.iteration)


class HFLoader(_BuiltinLoader):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def load(opts: ConversionOptions) -> Tuple[ModelMeta, Iterator[Message]]:
        return read_hf(opts.load_dir, true_vocab_size=opts.true_vocab_size, model_type=opts.model_type,
                       trust=opts.trust_checkpoint)


class MegatronSaver(_BuiltinSaver):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--target-pipeline-model-parallel-split-rank", type=int, default=None,
                            help="T5 with --target-pipeline-parallel-size > 1: the first decoder stage (default: "
                                 "the source's when the pipeline size is unchanged)")
        parser.add_argument("--target-expert-parallel-size", type=int, default=None,
                            help="Expert-parallel size of the output (MoE models; default: the input's)")

    @staticmethod
    def save(meta: ModelMeta, messages: Iterator[Message], opts: ConversionOptions, save_dir: str) -> Dict[str, Any]:
        tp = opts.target_tensor_parallel_size or meta.extra.get("tp") or 1
        pp = opts.target_pipeline_parallel_size or meta.extra.get("pp") or 1
        vp_layers = opts.target_num_layers_per_virtual_pipeline_stage
        ep = opts.target_expert_parallel_size or meta.extra.get("ep") or 1
        if ep < 1:
            raise ConversionError(f"--target-expert-parallel-size must be positive, got {ep}")
        encoder_decoder = registry.layout_for(meta.model_type).encoder_decoder
        if ep > 1 and encoder_decoder:
            raise ConversionError(f"--target-expert-parallel-size applies to GPT MoE models, not {meta.model_type}")
        copy_tokenizer_files(meta, save_dir, os.path.abspath(opts.save_dir))
        meta.extra["target_split_rank"] = opts.target_pipeline_model_parallel_split_rank
        if encoder_decoder:
            files = write_t5(meta, messages, save_dir, tp, pp, vp_layers)
        else:
            files = write_megatron(meta, messages, save_dir, tp, pp, vp_layers, ep)
        return {"files": files, "tp": tp, "pp": pp, "vp_layers": vp_layers, "ep": ep}


class HFSaver(_BuiltinSaver):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("Hugging Face saver")
        group.add_argument("--max-shard-size", default="2GB",
                           help="Largest safetensors shard (HF's save_pretrained naming and index file)")
        group.add_argument("--hf-architecture", default=None,
                           choices=("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
                           help="HF class to write (default: GPT2LMHeadModel, or LlamaForCausalLM for "
                                "Llama-family models, Qwen2ForCausalLM with --add-qkv-bias)")

    @staticmethod
    def save(meta: ModelMeta, messages: Iterator[Message], opts: ConversionOptions, save_dir: str) -> Dict[str, Any]:
        for flag, value in opts.sharding_targets():
            if value not in (None, 1):
                raise ConversionError(f"--{flag.replace('_', '-')} does not apply to --saver hf (HF models are "
                                      "not sharded by tensor/pipeline rank)")
        return write_hf(meta, messages, save_dir, max_shard_size=opts.max_shard_size,
                        hf_architecture=opts.hf_architecture, checking=opts.checking)


class DeepSpeedLoader(_BuiltinLoader):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("DeepSpeed loader")
        group.add_argument("--iteration", type=int, default=None,
                           help="Read global_step{N} instead of the tag named by 'latest'")

    @staticmethod
    def load(opts: ConversionOptions) -> Tuple[ModelMeta, Iterator[Message]]:
        return read_deepspeed(opts.load_dir, iteration=opts.iteration, true_vocab_size=opts.true_vocab_size,
                              model_type=opts.model_type, trust=opts.trust_checkpoint,
                              optimizer=opts.keep_training_state)


class DeepSpeedSaver(_BuiltinSaver):
    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("DeepSpeed saver")
        group.add_argument("--bigscience-layout", action="store_true",
                           help="Pipeline layer files at any PP numbered as Megatron-DeepSpeed's GPTModelPipe, the "
                                "layout of BigScience's BLOOM checkpoints (embedding layer_01, transformer layers "
                                "from layer_03, final norm layer_{L+4})")

    @staticmethod
    def save(meta: ModelMeta, messages: Iterator[Message], opts: ConversionOptions, save_dir: str) -> Dict[str, Any]:
        if opts.target_num_layers_per_virtual_pipeline_stage:
            raise ConversionError("--saver deepspeed has no virtual pipeline chunks; drop "
                                  "--target-num-layers-per-virtual-pipeline-stage")
        tp = opts.target_tensor_parallel_size or meta.extra.get("tp") or 1
        pp = opts.target_pipeline_parallel_size or meta.extra.get("pp") or 1
        result = write_deepspeed(meta, messages, save_dir, tp, pp, bigscience=opts.bigscience_layout)
        return {"files": result["files"], "tp": tp, "pp": pp, "vp_layers": None}


class McoreLoader(_BuiltinLoader):
    """Megatron Core checkpoints (GPT / Llama-family / MoE, BERT, T5): per-rank `torch` files with Core names (any
    TP/PP; T5: one pipeline stage) or a `torch_dist` folder."""

    add_arguments = MegatronLoader.add_arguments

    @staticmethod
    def load(opts: ConversionOptions) -> Tuple[ModelMeta, Iterator[Message]]:
        iter_dir, _ = find_iteration_dir(opts.load_dir, opts.iteration)
        if is_dist_folder(iter_dir):  # (read_torch_dist names a damaged metadata.json)
            print(f" detected checkpoint format torch_dist in {iter_dir}", flush=True)
            return read_torch_dist(opts.load_dir, trust=opts.trust_checkpoint, iteration=opts.iteration,
                                   optimizer=opts.keep_training_state, model_type=opts.model_type)
        if registry.layout_for(opts.model_type).encoder_decoder:  # its own stream; Core's names read as ours
            return MegatronLoader.load(dataclasses.replace(opts, keep_training_state=False))
        return read_megatron(opts.load_dir, true_vocab_size=opts.true_vocab_size, model_type=opts.model_type,
                             trust=opts.trust_checkpoint, iteration=opts.iteration)


class McoreSaver(_BuiltinSaver):
    """A `torch_dist` folder (Megatron-LM's default format; Megatron Core loads it at any layout) of a GPT /
    Llama-family / MoE, BERT or T5 model (with its optimizer state unless --no-save-optim)."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def save(meta: ModelMeta, messages: Iterator[Message], opts: ConversionOptions, save_dir: str) -> Dict[str, Any]:
        name = "release" if meta.iteration is None else f"iter_{meta.iteration:07d}"
        write_torch_dist(meta, messages, os.path.join(save_dir, name))
        sign_output(os.path.join(save_dir, name), meta)  # its manifest, unless the source was read unverified
        atomic_write_text(os.path.join(save_dir, "latest_checkpointed_iteration.txt"),
                          "release" if meta.iteration is None else str(meta.iteration))
        copy_tokenizer_files(meta, save_dir, os.path.abspath(opts.save_dir))
        return {"files": [os.path.join(save_dir, name)], "tp": 1, "pp": 1, "vp_layers": None}


BUILTIN: Dict[Tuple[str, str], Any] = {
    ("loader", "mcore"): McoreLoader,
    ("saver", "mcore"): McoreSaver,
    ("loader", "megatron"): MegatronLoader,
    ("loader", "hf"): HFLoader,
    ("loader", "deepspeed"): DeepSpeedLoader,
    ("saver", "megatron"): MegatronSaver,
    ("saver", "hf"): HFSaver,
    ("saver", "deepspeed"): DeepSpeedSaver,
}


def resolve_plugin(kind: str, name: str) -> Any:
    """The plugin for ``--loader NAME`` (kind 'loader') or ``--saver NAME`` (kind 'saver')."""
    if (kind, name) in BUILTIN:
        return BUILTIN[(kind, name)]
    for module_name in (f"{kind}_{name}", name):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        need = "load_checkpoint" if kind == "loader" else "save_checkpoint"
        if not (hasattr(module, "add_arguments") and hasattr(module, need)):
            raise ConversionError(f"--{kind} {name}: module {module_name} has no add_arguments/{need}")
        return module
    raise ConversionError(f"--{kind} {name}: no such {kind} (built-in: megatron, mcore, hf, deepspeed; or an importable "
                          f"module {kind}_{name})")
