"""Convert a DeepSpeed checkpoint of pretrain_gpt.py --deepspeed into Megatron's layout (and back, weights only).

A thin command line over tools/checkpoint/convert.py's driver (megatron/checkpoint/conversion/driver.py) with the
built-in DeepSpeed loader/saver (deepspeed_format.py), which read and write one layer / one tensor rank at a time:

    python tools/convert_deepspeed_checkpoint.py --input-folder ds_ckpt --output-folder megatron_ckpt \
        [--iteration N] [--target-tp T] [--target-pp P] [--true-vocab-size V]
  = python tools/checkpoint/convert.py --model-type GPT --loader deepspeed --saver megatron --no-save-optim \
        --load-dir ds_ckpt --save-dir megatron_ckpt [--iteration N] [--target-tensor-parallel-size T] ...

    python tools/convert_deepspeed_checkpoint.py --to-deepspeed --input-folder megatron_ckpt --output-folder ds_ckpt
  = python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver deepspeed --load-dir ... --save-dir ...

DeepSpeed layouts read (``latest`` names the tag, or --iteration N picks ``global_step{N}``; the folder may also be
the tag folder itself): the non-pipeline engine (ZeRO 0/1/2: ``mp_rank_XX_model_states.pt``), ZeRO-3 (consolidated
per tensor rank with DeepSpeed's ``zero_to_fp32``) and the pipeline engine (``layer_XX-model_XX-model_states.pt``).

Megatron layout written: ``latest_checkpointed_iteration.txt`` and ``iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/
model_optim_rng.pt`` with the weights, ``args``, ``iteration``, consumed samples and the LR schedule; the RNG state
only when the layout is unchanged (non-pipeline, same TP). This tool writes no optimizer state (load with
--no-load-optim --no-load-rng, or --finetune); to carry a ZeRO-1/2 run's optimizer state over to a Megatron layout,
use tools/checkpoint/convert.py --loader deepspeed without --no-save-optim. --output-folder must be new or empty.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.conversion.interchange import ConversionError  # noqa: E402
from megatron.errors import MegatronUserError, exit_on_user_error  # noqa: E402
from megatron.settings.cli_parser import FlagParser  # noqa: E402

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
DS_LATEST = "latest"

# convert.py's flag names in the driver's messages -> this tool's
_FLAG_NAMES = (("--load-dir", "--input-folder"), ("--save-dir", "--output-folder"),
               ("--target-tensor-parallel-size", "--target-tp"), ("--target-pipeline-parallel-size", "--target-pp"),
               (" or --vocab-file", ""))


class ConvertCheckpointError(MegatronUserError, ValueError):
    """The input checkpoint is missing, of an unknown layout, or does not fit the requested target layout."""


def _in_tool_terms(message: str) -> str:
    for driver_flag, flag in _FLAG_NAMES:
        message = message.replace(driver_flag, flag)
    return re.sub(r"pass --model-type (\w+)",
                  r"this tool converts GPT models; use tools/checkpoint/convert.py --model-type \1", message)


def _check_direction(args: argparse.Namespace) -> None:
    """One line naming the other direction when --input-folder holds the other format."""
    folder = args.input_folder
    if not os.path.isdir(folder):
        raise ConvertCheckpointError(f"--input-folder {folder} does not exist")
    names = os.listdir(folder)
    if args.to_deepspeed:
        if args.iteration is None and MEGATRON_TRACKER not in names and DS_LATEST in names:
            raise ConvertCheckpointError(f"--input-folder {folder} is a DeepSpeed checkpoint ('{DS_LATEST}' file); "
                                         "drop --to-deepspeed to convert it to Megatron's layout")
        return
    if args.iteration is None and DS_LATEST not in names and not any(n.endswith("_model_states.pt") for n in names):
        if MEGATRON_TRACKER in names:
            raise ConvertCheckpointError(f"--input-folder {folder} is a Megatron checkpoint ({MEGATRON_TRACKER}); "
                                         "add --to-deepspeed to convert it to DeepSpeed's layout")
        tags = sorted(n for n in names if n.startswith("global_step"))
        hint = f" (found {', '.join(tags[:5])})" if tags else ""
        raise ConvertCheckpointError(f"no '{DS_LATEST}' file in --input-folder {folder}: pass --iteration N to pick "
                                     f"global_step{{N}}{hint}, or point it at a DeepSpeed checkpoint folder")


def driver_argv(args: argparse.Namespace) -> list[str]:
    """This tool's flags as tools/checkpoint/convert.py's."""
    loader, saver = ("megatron", "deepspeed") if args.to_deepspeed else ("deepspeed", "megatron")
    argv = ["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", args.input_folder,
            "--save-dir", args.output_folder, "--no-save-optim"]
    for flag, value in (("--iteration", args.iteration), ("--target-tensor-parallel-size", args.target_tp),
                        ("--target-pipeline-parallel-size", args.target_pp),
                        ("--true-vocab-size", args.true_vocab_size)):
        if value is not None:
            argv += [flag, str(value)]
    if args.trust_checkpoint:
        argv.append("--trust-checkpoint")
    return argv


def _written_files(folder: str) -> list[str]:
    return sorted(os.path.join(root, n) for root, _, names in os.walk(folder) for n in names if n.endswith(".pt"))


# ----------------------------------------------------------------------------------------------- CLI
def get_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        description="Convert a DeepSpeed checkpoint (global_step{N}/, latest) of pretrain_gpt.py --deepspeed into "
                    "Megatron's layout (iter_{N:07d}/mp_rank_XX/model_optim_rng.pt), or back with --to-deepspeed; "
                    "weights, iteration, consumed samples and LR schedule (no optimizer state: for a ZeRO-1/2 "
                    "run's optimizer state use tools/checkpoint/convert.py --loader deepspeed). Runs "
                    "tools/checkpoint/convert.py's driver, one layer / tensor rank in memory at a time.",
        allow_abbrev=False)
    parser.add_argument("--input-folder", required=True,
                        help="DeepSpeed checkpoint folder (holding 'latest' and global_step{N}/, or a global_step "
                             "folder itself); a Megatron checkpoint folder with --to-deepspeed")
    parser.add_argument("--output-folder", required=True,
                        help="Where to write the converted checkpoint (a new or empty folder)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="Convert global_step{N} / iter_{N:07d} instead of the one named by 'latest' / "
                             f"{MEGATRON_TRACKER}")
    parser.add_argument("--target-tp", type=int, default=None,
                        help="Tensor-parallel size of the output (default: the input's)")
    parser.add_argument("--target-pp", type=int, default=None,
                        help="Pipeline-parallel size of the output (default: the input's; use 1 for single-process "
                             "generation). With --to-deepspeed, > 1 writes pipe-engine layer files")
    parser.add_argument("--true-vocab-size", type=int, default=None,
                        help="Tokenizer vocabulary size: the padding rows are dropped and re-padded for the target "
                             "TP (needed when the vocabulary rows do not divide by --target-tp)")
    parser.add_argument("--to-deepspeed", action="store_true",
                        help="Reverse direction: Megatron checkpoint → DeepSpeed checkpoint (weights and client "
                             "state; resume it with --no-load-optim --no-load-rng or --finetune)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="Load the input with full unpickling (can run code in it); default: weights-only with an "
                             "allow-list (also MEGATRON_TRUST_CHECKPOINT=1)")
    return parser


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run one conversion; returns {'iteration', 'tp', 'pp', 'files'} plus 'layout' and 'rng' (DeepSpeed →
    Megatron) or 'tag' (--to-deepspeed)."""
    from megatron.checkpoint.conversion import driver

    args = get_parser().parse_args(argv)
    for flag, value in (("--target-tp", args.target_tp), ("--target-pp", args.target_pp),
                        ("--true-vocab-size", args.true_vocab_size), ("--iteration", args.iteration)):
        if value is not None and value < (0 if flag == "--iteration" else 1):
            raise ConvertCheckpointError(f"{flag} must be {'non-negative' if flag == '--iteration' else 'positive'}"
                                         f", got {value}")
    if os.path.abspath(args.input_folder) == os.path.abspath(args.output_folder):
        raise ConvertCheckpointError("--output-folder must differ from --input-folder")
    _check_direction(args)
    try:
        summary = driver.convert(driver.parse_args(driver_argv(args)))
    except ConversionError as exc:
        raise ConvertCheckpointError(_in_tool_terms(str(exc))) from None
    meta = summary["meta"]
    iteration = int(meta.iteration or 0)
    result: dict[str, Any] = {"iteration": iteration, "tp": summary["tp"], "pp": summary["pp"],
                              "files": _written_files(args.output_folder)}
    if args.to_deepspeed:
        result["tag"] = f"global_step{iteration}"
        print(f"wrote DeepSpeed checkpoint {result['tag']} (TP={result['tp']}, PP={result['pp']}, weights only) to "
              f"{args.output_folder}; resume with --no-load-optim --no-load-rng or --finetune", flush=True)
        return result
    rng_states = meta.extra.get("rng_states") or {}
    result["layout"] = meta.extra["layout"]
    result["rng"] = bool(rng_states) and len(rng_states) == result["tp"] and result["pp"] == 1
    rng = "" if result["rng"] else " --no-load-rng"
    print(f"wrote Megatron checkpoint iteration {iteration} (TP={result['tp']}, PP={result['pp']}, from a "
          f"{result['layout']} DeepSpeed checkpoint) to {args.output_folder}; load it with "
          f"--tensor-model-parallel-size {result['tp']} --pipeline-model-parallel-size {result['pp']} "
          f"--no-load-optim{rng} (or --finetune)", flush=True)
    return result


if __name__ == "__main__":
    exit_on_user_error(main)
