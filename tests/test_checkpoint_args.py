"""Checkpoints store the architecture; loading with different flags is a one-line error naming the field and both
values; --use-checkpoint-args restores all of it; old checkpoints (args namespace only) still load."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron import compat as ck
from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.checkpoint.args import ARCHITECTURE_FIELDS, ArchitectureMismatchError, architecture_from_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
LLAMA = ["--swiglu", "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96", "--kv-channels", "16"]


def _args(tmp: Path, *flags: str, validate: bool = True) -> argparse.Namespace:
    args = parse_args(args=[*BASE, *flags, "--save", str(tmp), "--save-interval", "1", "--load", str(tmp)])
    if validate:
        args.rank = 1  # quiet argument dump
        validate_args(args, {})
        args.padded_vocab_size = 128
    return args


def _save(tmp: Path, *flags: str) -> Path:
    ck.save_checkpoint(3, [torch.nn.Linear(2, 2)], None, None, _args(tmp, *flags))
    return tmp / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"


def test_checkpoint_stores_the_architecture_as_plain_values(tmp_path: Path) -> None:
    path = _save(tmp_path, *LLAMA)
    sd = ck.load_state_dict_file(str(path))  # weights-only load: plain Python values
    arch = sd["architecture"]
    assert set(arch) == set(ARCHITECTURE_FIELDS)
    assert (arch["swiglu"], arch["position_embedding_type"], arch["rotary_base"], arch["normalization"]) == (
        True, "rope", 500000.0, "RMSNorm")
    assert (arch["num_query_groups"], arch["add_bias_linear"], arch["share_embeddings_and_output_weights"]) == (
        2, False, False)
    assert (arch["ffn_hidden_size"], arch["kv_channels"], arch["padded_vocab_size"]) == (96, 16, 128)


@pytest.mark.parametrize("field, change, saved, given", [
    ("swiglu", ["--swiglu"], "False", "True"),
    ("normalization", ["--normalization", "RMSNorm"], "'LayerNorm'", "'RMSNorm'"),
    ("position_embedding_type", ["--use-rotary-position-embeddings"], "'learned_absolute'", "'rope'"),
    ("group_query_attention", ["--group-query-attention", "--num-query-groups", "2"], "False", "True"),
    ("share_embeddings_and_output_weights", ["--untie-embeddings-and-output-weights"], "True", "False"),
    ("add_bias_linear", ["--disable-bias-linear"], "True", "False"),
    ("bias_gelu_fusion", ["--no-bias-gelu-fusion"], "True", "False"),
    ("num_layers", ["--num-layers", "3"], "2", "3"),
])
def test_architecture_mismatch_is_one_line_naming_field_and_values(tmp_path, field, change, saved, given):
    _save(tmp_path)
    args = _args(tmp_path, *change)
    with pytest.raises(ArchitectureMismatchError) as info:
        ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None, args)
    msg = str(info.value)
    assert "\n" not in msg and f"has {field}={saved}" in msg and f"give {field}={given}" in msg, msg


def test_same_architecture_loads(tmp_path: Path) -> None:
    _save(tmp_path, *LLAMA)
    assert ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None, _args(tmp_path, *LLAMA)) == 3
    # --no-bias-gelu-fusion changes nothing for SwiGLU without biases: not a mismatch
    assert ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None,
                              _args(tmp_path, *LLAMA, "--no-bias-gelu-fusion")) == 3


def test_use_checkpoint_args_restores_the_whole_architecture(tmp_path: Path) -> None:
    _save(tmp_path, *LLAMA)
    saved_config = core_transformer_config_from_args(_args(tmp_path, *LLAMA))
    args = parse_args(args=["--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                            "--load", str(tmp_path), "--use-checkpoint-args"])
    ck.load_args_from_checkpoint(args)
    args.rank = 1
    validate_args(args, {})
    restored = core_transformer_config_from_args(args)
    for name in ARCHITECTURE_FIELDS:
        if name != "padded_vocab_size":  # rebuilt from the tokenizer at start-up
            assert getattr(restored, name) == getattr(saved_config, name), name
    assert args.seq_length == 32


def test_use_checkpoint_args_refuses_a_conflicting_flag(tmp_path: Path) -> None:
    _save(tmp_path, *LLAMA)
    args = parse_args(args=["--micro-batch-size", "2", "--load", str(tmp_path), "--use-checkpoint-args",
                            "--num-layers", "2", "--rotary-base", "20000"])  # the same layers: fine
    with pytest.raises(ArchitectureMismatchError) as info:
        ck.load_args_from_checkpoint(args)
    assert "rotary_base=500000.0" in str(info.value) and "rotary_base=20000.0" in str(info.value)


def test_old_checkpoint_without_architecture_falls_back_to_saved_args(tmp_path: Path) -> None:
    path = _save(tmp_path, "--swiglu")
    sd = ck.load_state_dict_file(str(path))
    del sd["architecture"]
    for name in ("normalization", "group_query_attention", "num_query_groups", "rotary_base"):  # older flag set
        delattr(sd["args"], name)
    torch.save(sd, path)
    (path.parent.parent / "manifest.json").unlink(missing_ok=True)  # an older checkpoint has no integrity manifest
    with pytest.raises(ArchitectureMismatchError, match="has swiglu=True"):
        ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None, _args(tmp_path))
    # fields the old namespace lacks are neither checked nor restored
    assert ck.load_checkpoint([torch.nn.Linear(2, 2)], None, None, _args(tmp_path, "--swiglu",
                                                                           "--normalization", "RMSNorm")) == 3
    args = parse_args(args=["--micro-batch-size", "2", "--load", str(tmp_path), "--use-checkpoint-args"])
    ck.load_args_from_checkpoint(args)
    assert (args.swiglu, args.num_layers, args.hidden_size, args.normalization) == (True, 2, 64, "LayerNorm")


def test_architecture_from_an_older_namespace_skips_missing_flags() -> None:
    arch = architecture_from_args(argparse.Namespace(num_layers=2, hidden_size=8))
    assert arch == {"num_layers": 2, "hidden_size": 8, "padded_vocab_size": 0}
