"""--saver deepspeed: the stream as a DeepSpeed ``global_stepN`` checkpoint at the target TP (``mp_rank_XX_model_states.pt``
or, with --target-pipeline-parallel-size > 1, the pipeline engine's layer files) through
megatron/checkpoint_conversion/deepspeed_format.py, one tensor rank at a time. Weights and client state only: train
from it with --finetune or --no-load-optim --no-load-rng (any ZeRO stage)."""
from __future__ import annotations

import argparse
from typing import Any, Dict, Iterator

from megatron.checkpoint_conversion.interchange import ConversionError, Message, ModelMeta


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def save_checkpoint(meta: ModelMeta, messages: Iterator[Message], args: argparse.Namespace,
                    save_dir: str) -> Dict[str, Any]:
    from megatron.checkpoint_conversion.deepspeed_format import write_deepspeed

    if args.target_num_layers_per_virtual_pipeline_stage:
        raise ConversionError("--saver deepspeed has no virtual pipeline chunks; drop "
                              "--target-num-layers-per-virtual-pipeline-stage")
    tp = args.target_tensor_parallel_size or meta.extra.get("tp") or 1
    pp = args.target_pipeline_parallel_size or meta.extra.get("pp") or 1
    result = write_deepspeed(meta, messages, save_dir, tp, pp)
    return {"files": result["files"], "tp": tp, "pp": pp, "vp_layers": None}
