"""Megatron's args-taking checkpoint functions (megatron/compat.py), called the way Megatron users' scripts call them:
imported from ``megatron.checkpointing``, with the global flags or a parsed namespace; each gives what the run-time
layer (megatron/checkpoint/, records and state only) gives for the records built from those flags."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron import global_vars
from megatron.arguments import build_parser, parse_args, validate_args
from megatron.checkpoint.args import flag_defaults
from megatron.checkpoint.loading import read_checkpoint
from megatron.checkpoint.paths import load_state_dict_file
from megatron.checkpoint.saving import write_checkpoint
from megatron.checkpoint.selection import restored_flag_values
from megatron.run_configs.architecture import architecture_from_args
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import TrainingState

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--train-iters", "4"]


def _flags(*extra: str) -> argparse.Namespace:
    args = validate_args(parse_args(None, False, [*BASE, *extra]), {})
    args.padded_vocab_size = 128
    return args


@pytest.fixture
def global_flags():
    def install(args: argparse.Namespace) -> argparse.Namespace:
        global_vars.set_args(args)
        return args

    yield install
    global_vars.set_args(None)


def test_save_and_load_checkpoint_with_the_global_flags(tmp_path: Path, global_flags) -> None:
    from megatron.checkpointing import load_checkpoint, save_checkpoint

    args = global_flags(_flags("--save", str(tmp_path / "a"), "--load", str(tmp_path / "a")))
    args.consumed_train_samples = 12
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    path = save_checkpoint(3, [model], None, None)
    args.consumed_train_samples = 0
    other = torch.nn.Linear(2, 2)
    assert load_checkpoint([other], None, None) == 3
    assert torch.equal(other.weight, model.weight) and args.consumed_train_samples == 12

    # The run-time layer with the records built from the same flags writes the same file and reads it back the same.
    cfg = CheckpointSettings.from_args(args)
    run = TrainingState.from_args(args)
    torch.manual_seed(0)
    again = write_checkpoint(3, [model], None, None, cfg, architecture_from_args(args), args, run,
                             save_dir=str(tmp_path / "b"))
    ours, theirs = load_state_dict_file(path), load_state_dict_file(again)
    assert ours.keys() == theirs.keys() and ours["architecture"] == theirs["architecture"]
    assert torch.equal(ours["model"]["weight"], theirs["model"]["weight"])
    state = TrainingState()
    assert read_checkpoint([torch.nn.Linear(2, 2)], None, None, cfg, architecture_from_args(args), state) == 3
    assert state.consumed_train_samples == 12


def test_load_checkpoint_reads_the_folder_load_arg_names(tmp_path: Path) -> None:
    from megatron.checkpointing import load_checkpoint, save_checkpoint

    args = _flags("--save", str(tmp_path / "pre"))
    save_checkpoint(5, [torch.nn.Linear(2, 2)], None, None, args)
    args.pretrained_checkpoint = str(tmp_path / "pre")
    args.load = str(tmp_path / "none")
    assert load_checkpoint([torch.nn.Linear(2, 2)], None, None, args, load_arg="pretrained_checkpoint") == 5
    assert load_checkpoint([torch.nn.Linear(2, 2)], None, None, args) == 0  # --load holds no checkpoint yet


def test_load_args_from_checkpoint_restores_what_the_records_say(tmp_path: Path) -> None:
    from megatron.checkpointing import load_args_from_checkpoint, save_checkpoint

    save_checkpoint(2, [torch.nn.Linear(2, 2)], None, None, _flags("--save", str(tmp_path), "--swiglu",
                                                                      "--ffn-hidden-size", "16"))
    given = parse_args(None, False, [*BASE[:2], "--load", str(tmp_path), "--use-checkpoint-args"])
    expected = restored_flag_values(CheckpointSettings.from_args(given), vars(given))
    assert load_args_from_checkpoint(given) is given
    assert {k: getattr(given, k) for k in expected} == expected
    assert (given.hidden_size, given.ffn_hidden_size, given.swiglu) == (8, 16, True)
    clash = parse_args(None, False, [*BASE[:2], "--hidden-size", "16", "--load", str(tmp_path)])
    with pytest.raises(RuntimeError, match="--use-checkpoint-args: the checkpoint has hidden_size=8 but the flags "
                                           "set hidden_size=16; drop that flag"):
        load_args_from_checkpoint(clash)


def test_check_checkpoint_args_and_check_architecture_take_the_flags(tmp_path: Path) -> None:
    from megatron.checkpointing import CheckpointError, check_architecture, check_checkpoint_args

    saved = _flags()
    check_checkpoint_args(saved, _flags(), "ckpt")  # same flags: nothing to say
    with pytest.raises(CheckpointError, match="has tensor_model_parallel_size=1 but this run has "
                                              "tensor_model_parallel_size=2: set --tensor-model-parallel-size 1"):
        check_checkpoint_args(saved, argparse.Namespace(**{**vars(_flags()), "tensor_model_parallel_size": 2}),
                              "ckpt")
    with pytest.raises(RuntimeError, match="checkpoint ckpt has hidden_size=8 but this run's flags give "
                                           "hidden_size=16: pass --hidden-size 8"):
        check_architecture(architecture_from_args(saved), _flags("--hidden-size", "16", "--num-attention-heads",
                                                                 "2"), "ckpt")


def test_the_declared_flag_defaults_are_the_parsers() -> None:
    """--use-checkpoint-args compares the flags with their defaults; the checkpoint code takes them from the settings'
    declarations, which give exactly what Megatron's parser's actions hold."""
    assert flag_defaults() == {action.dest: action.default for action in build_parser()._actions}
