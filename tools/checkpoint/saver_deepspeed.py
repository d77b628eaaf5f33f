"""--saver deepspeed: the stream as a Megatron checkpoint at the target TP in a temporary folder, then
tools/convert_deepspeed_checkpoint.py --to-deepspeed (``global_stepN`` with ``mp_rank_XX_model_states.pt`` or, with
--target-pipeline-parallel-size > 1, the pipeline engine's layer files). Weights and client state only: resume it
with --finetune or --no-load-optim --no-load-rng."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/

from megatron.checkpoint_conversion.interchange import ConversionError, Message, ModelMeta  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def save_checkpoint(meta: ModelMeta, messages: Iterator[Message], args: argparse.Namespace,
                    save_dir: str) -> Dict[str, Any]:
    import convert_deepspeed_checkpoint as ds

    if meta.model_type != "GPT":
        raise ConversionError(f"--saver deepspeed writes GPT checkpoints (--model-type {meta.model_type} is not "
                              "supported)")

    from megatron.checkpoint_conversion.megatron_format import write_megatron

    if args.target_num_layers_per_virtual_pipeline_stage:
        raise ConversionError("--saver deepspeed has no virtual pipeline chunks; drop "
                              "--target-num-layers-per-virtual-pipeline-stage")
    tp = args.target_tensor_parallel_size or meta.extra.get("tp") or 1
    pp = args.target_pipeline_parallel_size or meta.extra.get("pp") or 1
    if meta.iteration is None:
        meta.iteration = 0
    tmp = tempfile.mkdtemp(prefix="megatron_to_ds_", dir=os.path.dirname(os.path.abspath(save_dir)))
    try:
        write_megatron(meta, messages, tmp, tp, 1, None)
        try:
            result = ds.megatron_to_deepspeed(tmp, save_dir, target_pp=pp)
        except ds.ConvertCheckpointError as exc:
            raise ConversionError(str(exc)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"files": result["files"], "tp": tp, "pp": pp, "vp_layers": None}
