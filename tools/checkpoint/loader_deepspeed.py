"""--loader deepspeed: a DeepSpeed ``global_stepN`` folder (ZeRO 0-3, pipeline engine) via
tools/convert_deepspeed_checkpoint.py (DeepSpeed -> Megatron into a temporary folder), then the Megatron loader."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Iterator, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/

from megatron.checkpoint_conversion.interchange import ConversionError, Message, ModelMeta  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DeepSpeed loader")
    group.add_argument("--iteration", type=int, default=None,
                       help="Read global_step{N} instead of the tag named by 'latest'")


def _cleanup_after(stream: Iterator[Message], tmp: str) -> Iterator[Message]:
    try:
        yield from stream
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(args: argparse.Namespace) -> Tuple[ModelMeta, Iterator[Message]]:
    import convert_deepspeed_checkpoint as ds

    if args.model_type != "GPT":
        raise ConversionError(f"--loader deepspeed reads GPT checkpoints (--model-type {args.model_type} is not "
                              "supported)")

    from megatron.checkpoint_conversion.megatron_format import read_megatron

    tmp = tempfile.mkdtemp(prefix="ds_to_megatron_", dir=os.path.dirname(os.path.abspath(args.save_dir)))
    try:
        try:
            ds.deepspeed_to_megatron(args.load_dir, os.path.join(tmp, "megatron"), iteration=args.iteration)
        except ds.ConvertCheckpointError as exc:
            raise ConversionError(str(exc).replace("--input-folder", "--load-dir")) from None
        meta, stream = read_megatron(os.path.join(tmp, "megatron"), true_vocab_size=args.true_vocab_size,
                                     model_type=args.model_type, trust=bool(args.trust_checkpoint))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta.source = args.load_dir
    return meta, _cleanup_after(stream, tmp)
