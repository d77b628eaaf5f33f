"""examples/pretrain_mixtral.sh and the Mixtral presets: valid bash, the published shapes through the real flag
parser, and Mixtral-8x7B's published parameter count from the model those flags build (on the meta device)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron.presets import get_preset

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _preset_args(name: str) -> list:
    """The preset's model flags (megatron/presets.py; examples/presets/NAME.sh is written from it)."""
    return get_preset(name).argv()


def _args(name: str, vocab: int = 32000):
    from megatron.arguments import parse_args, validate_args

    argv = _preset_args(name) + ["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                 str(vocab), "--make-vocab-size-divisible-by", "1"]
    args = parse_args(args=argv)
    args.rank = 1
    return validate_args(args, {})


def test_pretrain_mixtral_is_valid_bash_and_refuses_other_presets() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "pretrain_mixtral.sh")], check=True)
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_mixtral.sh")], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "PRESET": "llama_tiny"})
    assert proc.returncode == 1 and "mixtral_8x7b or mixtral_tiny" in proc.stderr


@pytest.mark.parametrize("name, shape", [("mixtral_8x7b", (32, 4096, 14336, 8, 8, 2)),
                                         ("mixtral_tiny", (4, 128, 256, 2, 8, 2))])
def test_presets_define_the_published_models(name: str, shape: tuple) -> None:
    args = _args(name)
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_query_groups, args.num_experts,
            args.moe_router_topk) == shape
    assert args.swiglu and args.normalization == "RMSNorm" and not args.add_bias_linear


def test_mixtral_8x7b_has_the_published_parameter_count() -> None:
    """Hugging Face's Mixtral-8x7B-v0.1: 46,702,792,704 parameters."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.models.gpt.model import GPTModel

    args = _args("mixtral_8x7b")
    args.padded_vocab_size = 32000
    with torch.device("meta"):
        model = GPTModel(core_transformer_config_from_args(args))
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704
