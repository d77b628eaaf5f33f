"""`tools/checkpoint/convert.py`: Megatron-LM's command line (--model-type, --loader, --saver, --load-dir,
--save-dir, --target-*-parallel-size, --true-vocab-size | --vocab-file, --megatron-path) over the plugins. A
training checkpoint converted megatron -> megatron keeps its optimizer state unless --no-save-optim (resume on another
layout: megatron/checkpoint/conversion/optimizer_state.py).

The output is written into a temporary sibling folder and renamed to --save-dir only when everything succeeded, so a
failure leaves nothing under the target name. The model flags for the converted checkpoint are printed at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from typing import Any, Dict, List, Optional

from megatron.checkpoint.atomic_io import DiskFullError, is_disk_full
from megatron.checkpoint.conversion.interchange import MODEL_TYPES, SUPPORTED_MODEL_TYPES, ConversionError, model_flags
from megatron.checkpoint.conversion.plugins import resolve_plugin
from megatron.checkpoint.conversion.vocab import true_vocab_size_from_file
from megatron.checkpoint.safe_load import guarded_torch_load
from megatron.settings.cli_parser import FlagParser


def base_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        description="Convert a checkpoint between Megatron layouts (any TP/PP/virtual PP), Hugging Face and "
                    "DeepSpeed", allow_abbrev=False, conflict_handler="resolve")
    parser.add_argument("--model-type", required=True, choices=MODEL_TYPES, help="Type of the model")
    parser.add_argument("--loader", default="megatron",
                        help="Loader plugin: megatron, mcore (Megatron Core torch / torch_dist), hf, deepspeed or a "
                             "module")
    parser.add_argument("--saver", default="megatron",
                        help="Saver plugin: megatron, mcore (torch_dist), hf, deepspeed or a module")
    parser.add_argument("--load-dir", required=True, help="Folder to read the checkpoint from")
    parser.add_argument("--save-dir", required=True, help="Folder to write the converted checkpoint to (must not "
                        "hold a checkpoint already)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="Tensor-parallel size of the output (default: the input's)")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="Pipeline-parallel size of the output (default: the input's)")
    parser.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, default=None,
                        help="Layers per virtual pipeline chunk of the output (interleaved schedule)")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--true-vocab-size", type=int, default=None,
                       help="Tokenizer vocabulary size: padding rows are dropped and re-padded for the target TP")
    vocab.add_argument("--vocab-file", default=None, help="Vocabulary file to take the true vocabulary size from")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="Vocabulary padding multiple (times the target TP) for the output; default: the "
                             "source checkpoint's, else 128")
    parser.add_argument("--megatron-path", default=None, help="Accepted for Megatron-LM compatibility (this "
                        "repository's megatron package is used)")
    parser.add_argument("--max-queue-size", type=int, default=50, help="Accepted for Megatron-LM compatibility "
                        "(loader and saver run in one process, one layer at a time)")
    parser.add_argument("--no-checking", action="store_false", dest="checking",
                        help="Let the Hugging Face saver drop tensors it has no name for (default: one-line error)")
    parser.add_argument("--no-save-optim", action="store_true",
                        help="Write the weights only. By default a training checkpoint converted by the megatron "
                             "saver keeps its training state: the optimizer state (fp32 main params, Adam moments, "
                             "step; Megatron's regular or distributed optimizer, or DeepSpeed ZeRO-1/2 with --loader "
                             "deepspeed) resharded for the target layout, the "
                             "iteration, consumed samples and LR schedule, so --load on the new TP x PP x DP layout "
                             "continues the run (with --no-load-rng; any DP size, with or without "
                             "--use-distributed-optimizer). Keep the padded vocabulary equal (see "
                             "--make-vocab-size-divisible-by) for a continuation equal to the original layout's")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="Load the input with full unpickling (can run code in it); default: weights-only with "
                             "an allow-list (also MEGATRON_TRUST_CHECKPOINT=1)")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = base_parser()
    first = FlagParser(add_help=False, allow_abbrev=False)  # plugin names first, so --help lists theirs
    first.add_argument("--loader", default="megatron")
    first.add_argument("--saver", default="megatron")
    known, _ = first.parse_known_args(argv)
    loader = resolve_plugin("loader", known.loader)
    saver = resolve_plugin("saver", known.saver)
    loader.add_arguments(parser)
    saver.add_arguments(parser)
    args = parser.parse_args(argv)
    args.loader_plugin, args.saver_plugin = loader, saver
    return args


def _check_args(args: argparse.Namespace) -> None:
    if args.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"--model-type {args.model_type}: no {args.model_type} model exists in this "
                              f"repository yet; its adapter arrives with the model (supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_num_layers_per_virtual_pipeline_stage", "true_vocab_size", "make_vocab_size_divisible_by"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConversionError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.vocab_file:
        args.true_vocab_size = true_vocab_size_from_file(args.vocab_file)
    load, save = os.path.abspath(args.load_dir), os.path.abspath(args.save_dir)
    if load == save or save.startswith(load + os.sep):
        raise ConversionError("--save-dir must be outside --load-dir")
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise ConversionError(f"--save-dir {args.save_dir} already exists and is not empty; choose a new folder")


def remove_stale_conversions(save: str) -> List[str]:
    """Delete ``.<name>.converting.<pid>`` folders of conversions into `save` whose process is gone (a SIGKILL or a
    power cut left them); one line says how many. Returns the removed paths."""
    parent, name = os.path.dirname(save), os.path.basename(save)
    pattern = re.compile(rf"^\.{re.escape(name)}\.converting\.(\d+)$")
    removed = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        m = pattern.match(entry)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        removed.append(os.path.join(parent, entry))
    if removed:
        print(f"removed {len(removed)} unfinished conversion folder(s) of interrupted runs (e.g. {removed[0]})",
              flush=True)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def convert(args: argparse.Namespace) -> Dict[str, Any]:
    """Run one conversion; returns the saver's summary plus the model flags."""
    _check_args(args)
    args.keep_training_state = not getattr(args, "no_save_optim", False) and args.saver in ("megatron", "mcore")
    save = os.path.abspath(args.save_dir)
    remove_stale_conversions(save)
    tmp = os.path.join(os.path.dirname(save), f".{os.path.basename(save)}.converting.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with guarded_torch_load(trust=args.trust_checkpoint):
            meta, messages = args.loader_plugin.load_checkpoint(args)
            if args.make_vocab_size_divisible_by:
                meta.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
            summary = args.saver_plugin.save_checkpoint(meta, messages, args, tmp)
        if os.path.isdir(save):
            os.rmdir(save)  # empty (checked above)
        os.replace(tmp, save)
    except BaseException as exc:
        # (asked before the partial output is removed: torch's writer reports no errno, the free space tells)
        full = isinstance(exc, (OSError, RuntimeError)) and is_disk_full(exc, os.path.dirname(save))
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(f"no space left on the device holding {os.path.dirname(save)} while converting into "
                                f"{args.save_dir}: free space or choose another --save-dir; nothing was written "
                                "there") from None
        raise
    summary["meta"] = meta
    src, dst = meta.extra.get("source_padded_vocab_size"), meta.architecture.get("padded_vocab_size")
    if meta.extra.get("optimizer") and src != dst:
        summary["note"] = (f"note: the padded vocabulary changed from {src} to {dst} rows, so the continuation is "
                           "close to but not equal to the original layout's (choose --make-vocab-size-divisible-by "
                           "to keep it)")
    if args.saver in ("megatron", "deepspeed", "mcore"):
        summary["flags"] = model_flags(meta, summary.get("tp", 1), summary.get("pp", 1), summary.get("vp_layers"))
        if args.saver == "mcore":  # loads at any layout: the parallel sizes are the run's
            summary["flags"] += " --auto-detect-ckpt-format"
    return summary


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    summary = convert(args)
    meta = summary["meta"]
    if args.saver == "hf":
        print(f"wrote Hugging Face {summary['architecture']} ({len(summary['files'])} safetensors file(s), "
              f"vocabulary {summary['vocab_size']}) to {args.save_dir}", flush=True)
    else:
        kind = "release checkpoint" if meta.iteration is None else f"checkpoint iteration {meta.iteration}"
        if meta.extra.get("optimizer"):
            print(f"wrote {args.saver} {kind} with its optimizer state to {args.save_dir} (TP={summary.get('tp', 1)}"
                  f", PP={summary.get('pp', 1)}, any data-parallel size); continue the run with --load "
                  f"{args.save_dir} --no-load-rng, the parallel sizes and these model flags:", flush=True)
            if summary.get("note"):
                print(summary["note"], flush=True)
        else:
            print(f"wrote {args.saver} {kind} to {args.save_dir} (TP={summary.get('tp', 1)}, "
                  f"PP={summary.get('pp', 1)}); load it with --load {args.save_dir} --finetune (or --no-load-optim "
                  "--no-load-rng) and these model flags:", flush=True)
        print(summary["flags"], flush=True)
    sys.stdout.flush()
    return summary
