"""examples/pretrain_gpt_oss.sh and the GPT-OSS presets: valid bash, the published shapes through the real flag
parser, and the published parameter counts in the start-up memory report (equal to the model those flags build on
the meta device)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.models.gpt.model import GPTModel
from megatron.presets import get_preset
from megatron.theoretical_memory_usage import count_parameters

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB = 201088  # o200k_harmony


def _args(name: str):
    argv = get_preset(name).argv() + ["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
                                      "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1"]
    args = parse_args(args=argv)
    args.rank, args.world_size = 1, 1
    args = validate_args(args, {})
    args.padded_vocab_size = VOCAB
    return args


def test_pretrain_gpt_oss_is_valid_bash_and_refuses_other_presets() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "pretrain_gpt_oss.sh")], check=True)
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_gpt_oss.sh")], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "PRESET": "llama_tiny"})
    assert proc.returncode == 1 and "gpt_oss_20b, gpt_oss_120b or gpt_oss_tiny" in proc.stderr


@pytest.mark.parametrize("name, layers, experts, total, active", [("gpt_oss_20b", 24, 32, 20.9, 3.6),
                                                                  ("gpt_oss_120b", 36, 128, 116.8, 5.1)])
def test_presets_have_the_published_parameter_counts(name, layers, experts, total, active) -> None:
    """The model card: gpt-oss-20b 20.9B total / 3.6B active, gpt-oss-120b 116.8B / 5.1B (its active count leaves
    out the input embedding table, a lookup; the memory report's active count holds it)."""
    args = _args(name)
    assert (args.num_layers, args.num_experts, args.moe_router_topk, args.softmax_type, args.quick_geglu) == \
        (layers, experts, 4, "learnable", True)
    with contextlib.redirect_stdout(io.StringIO()):
        counts = count_parameters(args)
    assert round(counts.total / 1e9, 1) == total
    assert round((counts.active - VOCAB * args.hidden_size) / 1e9, 1) == active
    if name == "gpt_oss_20b":
        with torch.device("meta"):
            model = GPTModel(core_transformer_config_from_args(args))
        assert sum(p.numel() for p in model.parameters()) == counts.total == 20_914_757_184
