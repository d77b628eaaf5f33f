"""Merge a tensor-parallel Megatron checkpoint into TP=1 (optionally re-split into pipeline stages).

    python tools/merge_mp_partitions.py --model-type GPT --tensor-model-parallel-size 2 \
        [--target-pipeline-model-parallel-size 2] --load CK --save OUT [model flags]

The bigscience / Megatron-LM v2 interface, a thin wrapper over tools/checkpoint/convert.py's code
(megatron/checkpoint/conversion): unlike the original it also reads PP > 1 (and virtual-pipeline) inputs. The
architecture comes from the checkpoint; model flags given here must agree with it (one-line error otherwise).
BERT and the finetuned classification (MNLI, QQP) and multiple-choice (RACE) checkpoints of tasks/main.py merge too.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.conversion.interchange import ConversionError  # noqa: E402
from megatron.errors import exit_on_user_error  # noqa: E402
from megatron.settings.cli_parser import FlagParser  # noqa: E402

# model flags accepted for compatibility: (flag, architecture field) - checked against the checkpoint
_CHECKED = (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
            ("--num-attention-heads", "num_attention_heads"), ("--ffn-hidden-size", "ffn_hidden_size"),
            ("--max-position-embeddings", "max_position_embeddings"), ("--kv-channels", "kv_channels"))


def get_parser() -> argparse.ArgumentParser:
    parser = FlagParser(description="Merge tensor-parallel partitions of a Megatron checkpoint",
                                     allow_abbrev=False)
    parser.add_argument("--model-type", required=True, choices=("GPT", "BERT", "RACE", "MNLI", "QQP"))
    parser.add_argument("--tensor-model-parallel-size", type=int, required=True,
                        help="Tensor-parallel size of the input checkpoint (it is checked)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                        help="Pipeline-parallel size of the input (read from the checkpoint; checked when given)")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1,
                        help="Pipeline stages of the merged checkpoint (default 1)")
    parser.add_argument("--load", required=True, help="Input checkpoint folder")
    parser.add_argument("--save", required=True, help="Output folder (new)")
    for flag, _ in _CHECKED:
        parser.add_argument(flag, type=int, default=None, help="Checked against the checkpoint")
    parser.add_argument("--seq-length", type=int, default=None, help="Accepted (not stored in the weights)")
    parser.add_argument("--vocab-file", default=None, help="Vocabulary: its size re-pads the embedding for TP=1")
    parser.add_argument("--merge-file", default=None, help="Accepted (the tokenizer is not needed to merge)")
    parser.add_argument("--tokenizer-type", default=None, help="Accepted (the tokenizer is not needed to merge)")
    parser.add_argument("--trust-checkpoint", action="store_true", help="Load with full unpickling")
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = get_parser().parse_args(argv)
    # RACE (multiple choice), MNLI and QQP (classification) are finetuned BERT checkpoints (tasks/)
    model_type = "GPT" if args.model_type == "GPT" else "BERT"
    from megatron.checkpoint.conversion.driver import convert, parse_args
    from megatron.checkpoint.conversion.megatron_format import MegatronCheckpointReader

    reader = MegatronCheckpointReader(args.load, args.trust_checkpoint)
    if reader.tp != args.tensor_model_parallel_size:
        raise ConversionError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: {args.load} was "
                              f"saved with {reader.tp} tensor-parallel partitions")
    if args.pipeline_model_parallel_size not in (None, reader.pp):
        raise ConversionError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: {args.load} "
                              f"has {reader.pp} pipeline stages")
    last = reader.chunks[(0, reader.pp - 1, reader.vp - 1)]
    head = {"MNLI": "classification_head", "QQP": "classification_head", "RACE": "multichoice_head"}.get(
        args.model_type)
    if head is not None and f"{head}.weight" not in last:
        raise ConversionError(f"--model-type {args.model_type}: {args.load} has no {head} (a {args.model_type} "
                              "finetuning checkpoint of tasks/main.py is expected)")
    for flag, field in _CHECKED:
        given = getattr(args, flag[2:].replace("-", "_"))
        have = reader.architecture.get(field)
        if given is not None and have is not None and given != have:
            raise ConversionError(f"{flag} {given} but the checkpoint {args.load} has {field}={have}; fix the flag")
    iteration = reader.iteration  # the one verified above (the newest intact one: see verified_source)
    del reader
    conv = ["--model-type", model_type, "--load-dir", args.load, "--save-dir", args.save,
            "--target-tensor-parallel-size", "1",
            "--target-pipeline-parallel-size", str(args.target_pipeline_model_parallel_size),
            "--no-save-optim"]  # the model only, as the original tool
    if args.vocab_file:
        conv += ["--vocab-file", args.vocab_file]
    if args.trust_checkpoint:
        conv.append("--trust-checkpoint")
    if iteration is not None:
        conv += ["--iteration", str(iteration)]
    summary = convert(parse_args(conv))
    print(f"merged {args.load} into TP=1, PP={summary['pp']} at {args.save}", flush=True)
    return summary


if __name__ == "__main__":
    exit_on_user_error(main)
