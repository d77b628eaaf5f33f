"""Inference loading from a checkpoint on disk, in the quick lane: a tiny GPT saved by the training path's
`save_checkpoint` is rebuilt by `load_model_for_inference` (what generate_samples_gpt.py, the server and the
evaluation tasks call) with the same weights and logits; a wrong --load is one line. A regression in the records the
loader builds (issue #36's settings move broke it once, caught only by the slow end-to-end tests) fails here first.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron import compat as ck
from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.text_generation.model_loading import InferenceLoadError, load_model_for_inference
from tests.model.helpers import batch, build_gpt

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "100", "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0"]


def _args(*flags: str) -> argparse.Namespace:
    args = parse_args(args=[*FLAGS, *flags])
    args.rank = 1  # quiet argument dump
    args = validate_args(args, {})
    args.padded_vocab_size = 128
    return args


def test_saved_checkpoint_loads_for_inference_with_the_same_logits(tmp_path):
    saved = _args("--save", str(tmp_path), "--save-interval", "1")
    model = build_gpt(core_transformer_config_from_args(saved), seed=11)
    ck.save_checkpoint(3, [model], None, None, saved)

    loaded = load_model_for_inference(_args("--load", str(tmp_path)))
    ids, pos, mask, _ = batch(seq=8, vocab=100)
    model.eval()
    with torch.no_grad():
        want, got = model(ids, pos, mask), loaded(ids, pos, mask)
    assert not loaded.training and got.shape == want.shape == (2, 8, 128)
    assert torch.equal(got, want)


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(InferenceLoadError) as info:
        load_model_for_inference(_args("--load", str(tmp_path / "nothing")))
    assert "--load" in str(info.value) and "\n" not in str(info.value)
