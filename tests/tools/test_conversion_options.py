"""The built-in conversion plugins read convert.py's namespace once, as a ConversionOptions (issue #23): the record
holds what the parser gave (each plugin's own flags included, defaults for a namespace without them), and the
plugins' refusals of options that cannot apply come through the Megatron-LM protocol (``load_checkpoint(args)`` /
``save_checkpoint(meta, messages, args, save_dir)``) as one line, before anything is read or written. No processes.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from megatron.checkpoint.conversion.driver import parse_args
from megatron.checkpoint.conversion.interchange import ConversionError, ModelMeta
from megatron.checkpoint.conversion.plugins import DeepSpeedSaver, HFSaver, MegatronLoader, MegatronSaver
from megatron.run_configs.conversion import ConversionOptions


def test_options_hold_the_parsed_flags_and_defaults(tmp_path: Path) -> None:
    args = parse_args(["--model-type", "GPT", "--loader", "deepspeed", "--saver", "hf", "--load-dir", "in",
                       "--save-dir", str(tmp_path / "out"), "--iteration", "7", "--max-shard-size", "1GB",
                       "--no-checking", "--trust-checkpoint", "--true-vocab-size", "50257"])
    opts = ConversionOptions.from_args(args)
    assert (opts.load_dir, opts.model_type, opts.iteration, opts.true_vocab_size) == ("in", "GPT", 7, 50257)
    assert (opts.max_shard_size, opts.checking, opts.trust_checkpoint) == ("1GB", False, True)
    assert opts.bigscience_layout is False and opts.target_expert_parallel_size is None  # another saver's flags
    bare = ConversionOptions.from_args(argparse.Namespace())
    assert (bare.max_shard_size, bare.checking, bare.keep_training_state, bare.iteration) == ("2GB", True, False, None)


@pytest.mark.parametrize("plugin, flags, message", [
    (HFSaver, {"target_pipeline_parallel_size": 2}, "--target-pipeline-parallel-size does not apply to --saver hf"),
    (DeepSpeedSaver, {"target_num_layers_per_virtual_pipeline_stage": 1}, "--saver deepspeed has no virtual"),
    (MegatronSaver, {"target_expert_parallel_size": -1}, "--target-expert-parallel-size must be positive"),
])
def test_savers_refuse_in_one_line_through_the_protocol(tmp_path: Path, plugin: type, flags: dict,
                                                       message: str) -> None:
    meta = ModelMeta(model_type="GPT", architecture={})
    args = argparse.Namespace(save_dir=str(tmp_path / "out"), **flags)
    with pytest.raises(ConversionError) as exc:
        plugin.save_checkpoint(meta, iter(()), args, str(tmp_path / "tmp"))
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "tmp").exists()


@pytest.mark.parametrize("plugin, flags, message", [
    (MegatronLoader, {"model_type": "T5", "iteration": 3}, "--iteration is not supported for --model-type T5"),
])
def test_loaders_refuse_in_one_line_through_the_protocol(tmp_path: Path, plugin: type, flags: dict,
                                                        message: str) -> None:
    with pytest.raises(ConversionError) as exc:
        plugin.load_checkpoint(argparse.Namespace(load_dir=str(tmp_path), **flags))
    assert message in str(exc.value) and "\n" not in str(exc.value)
