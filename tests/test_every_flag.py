"""Nothing accepted is ignored: every parser destination of every entry script is a config-field source, a run-time
setting read by a named file, a same-result variant, or refused at start-up with one line.

Entry scripts are found by content (any script outside megatron/ and tests/ that calls initialize_megatron or
pretrain), run as __main__ with the parser captured before anything else happens.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import runpy
import sys
from pathlib import Path
from typing import Dict, List

import pytest

import megatron.arguments as arguments_module
import megatron.startup as startup_module
from megatron.arguments import ArgumentError, build_parser, core_transformer_config_from_args, parse_args, validate_args
from megatron.core.transformer_config import TransformerConfig
from megatron.settings.config_flags import CONFIG_FIELDS, config_mapped_dests, dests_without_config_field
from megatron.settings.flag_registry import (
    DERIVED_ATTRIBUTES,
    FAMILY_ONLY,
    REFUSED,
    RUNTIME_SETTINGS,
    SAME_RESULT_VARIANTS,
)

REPO = Path(__file__).resolve().parents[1]
# TransformerConfig fields that no flag feeds (set by code, not by the user).
NOT_FROM_FLAGS = {"init_method", "output_layer_init_method"}


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _entry_scripts() -> List[Path]:
    found = []
    for path in sorted(REPO.glob("*.py")) + sorted(REPO.glob("tasks/**/*.py")) + sorted(REPO.glob("tools/**/*.py")):
        text = path.read_text(encoding="utf-8")
        if re.search(r"\b(initialize_megatron|pretrain)\(", text) and '__name__ == "__main__"' in text:
            found.append(path)
    return found


def _capture_parser(script: Path, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def fake_parse_args(extra_args_provider=None, ignore_unknown_args=False, args=None):  # noqa: ANN001
        raise _Captured(build_parser(extra_args_provider))

    monkeypatch.setattr(startup_module, "parse_args", fake_parse_args)  # the pipeline's parse step
    monkeypatch.setattr(arguments_module, "parse_args", fake_parse_args)
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(_Captured) as info:
        runpy.run_path(str(script), run_name="__main__")
    return info.value.parser


@pytest.fixture(scope="module")
def entry_parsers() -> Dict[str, argparse.ArgumentParser]:
    parsers = {}
    with pytest.MonkeyPatch.context() as mp:
        for script in _entry_scripts():
            parsers[str(script.relative_to(REPO))] = _capture_parser(script, mp)
    return parsers


def test_entry_scripts_are_found(entry_parsers):
    assert {"pretrain_gpt.py", "tasks/main.py", "tools/generate_samples_gpt.py",
            "tools/run_text_generation_server.py"} <= set(entry_parsers)


def test_every_destination_of_every_entry_script_is_accounted_for(entry_parsers):
    mapped = config_mapped_dests()
    known = set(mapped) | set(RUNTIME_SETTINGS) | set(SAME_RESULT_VARIANTS) | set(REFUSED) | set(FAMILY_ONLY)
    problems = []
    for script, parser in entry_parsers.items():
        for action in parser._actions:
            if action.dest == "help" or action.dest in known:
                continue
            flag = (action.option_strings or [action.dest])[0]
            problems.append(
                f"{script}: {flag} (dest {action.dest!r}) is neither a config field source nor a known setting. "
                "Read it, then say where in its declaration (megatron/settings/): setting(..., "
                "read_by=\"<file that reads it>\"), or config=... for an architecture flag, or refused=\"<why>\" "
                "so that start-up refuses it (an entry script's own flag too: declare its group in megatron/settings/ "
                "and add it with add_group)")
    assert not problems, "\n".join(problems)


def test_runtime_settings_name_a_file_that_reads_them(entry_parsers):
    all_dests = {a.dest for p in entry_parsers.values() for a in p._actions}
    stale, unread = [], []
    for dest, rel in RUNTIME_SETTINGS.items():
        if dest not in all_dests and dest not in ("rank", "world_size"):
            stale.append(dest)
        path = REPO / rel
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        name = re.escape(dest)
        if not re.search(rf"(\.{name}\b|[\"']{name}[\"'])", text):
            unread.append(f"{dest} -> {rel}")
    assert not stale, f"RUNTIME_SETTINGS entries no entry script parses (remove them): {stale}"
    assert not unread, f"RUNTIME_SETTINGS names a file that does not read the setting: {unread}"


def test_config_table_names_only_real_destinations(entry_parsers):
    all_dests = {a.dest for p in entry_parsers.values() for a in p._actions}
    stale = sorted(set(config_mapped_dests()) - all_dests)
    assert not stale, f"config fields (megatron/settings/ config=/feeds=) name destinations no parser has: {stale}"


def test_refused_and_family_defaults_are_the_parser_defaults(entry_parsers):
    defaults = {a.dest: a.default for p in entry_parsers.values() for a in p._actions}
    for dest, (default, _why) in REFUSED.items():
        assert dest in defaults and defaults[dest] == default, dest
    for dest, (_families, default) in FAMILY_ONLY.items():
        assert dest in defaults and defaults[dest] == default, dest
    assert not DERIVED_ATTRIBUTES & set(defaults), DERIVED_ATTRIBUTES & set(defaults)


def test_config_table_covers_every_transformer_config_field():
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unmapped = fields - set(CONFIG_FIELDS) - NOT_FROM_FLAGS
    assert not unmapped, (f"TransformerConfig fields no flag feeds: {sorted(unmapped)}; declare each on the setting "
                          "that feeds it (megatron/settings/: setting(..., config=...))")
    # The contract's architecture fields all exist (--no-initialization is TransformerConfig.perform_initialization).
    assert not set(CONFIG_FIELDS) - fields
    assert not set(dests_without_config_field(TransformerConfig))


# ------------------------------------------------------------------------------------------------ start-up behaviour
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100"]


def _validated(*extra: str, defaults: dict | None = None) -> argparse.Namespace:
    args = parse_args(args=[*BASE, *extra])
    args.rank = 1  # keep the argument dump quiet
    return validate_args(args, defaults or {})


@pytest.mark.parametrize("flags, named", [
    (["--standalone-embedding-stage"], "--standalone-embedding-stage"),
    (["--bert-no-binary-head"], "--bert-no-binary-head"),
    (["--mask-prob", "0.2"], "--mask-prob"),
    (["--decoder-seq-length", "16"], "--decoder-seq-length"),
    (["--encoder-num-layers", "4"], "--encoder-num-layers"),
    (["--sample-rate", "0.5"], "--sample-rate"),
    (["--use-ring-exchange-p2p"], "--use-ring-exchange-p2p"),
])
def test_unimplemented_flags_are_refused_with_one_line(flags, named):
    with pytest.raises(ArgumentError) as info:
        _validated(*flags)
    message = str(info.value)
    assert named in message and "\n" not in message


def test_family_flags_are_accepted_by_the_family_that_reads_them():
    args = _validated("--bert-no-binary-head", "--mask-prob", "0.2", defaults={"model_family": "bert"})
    assert args.bert_binary_head is False and args.mask_prob == 0.2


def test_architecture_flags_reach_the_config():
    args = _validated("--swiglu", "--use-rotary-position-embeddings", "--no-position-embedding", "--rotary-base",
                      "500000", "--rotary-percent", "0.5", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                      "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear", "--add-qkv-bias",
                      "--untie-embeddings-and-output-weights", "--apply-residual-connection-post-layernorm",
                      "--no-bias-gelu-fusion", "--kv-channels", "16", "--ffn-hidden-size", "96",
                      "--init-method-std", "0.01")
    c = core_transformer_config_from_args(args)
    assert (c.swiglu, c.position_embedding_type, c.rotary_base, c.rotary_percent) == (True, "rope", 500000.0, 0.5)
    assert (c.normalization, c.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert (c.group_query_attention, c.num_query_groups, c.add_bias_linear, c.add_qkv_bias) == (True, 2, False, True)
    assert c.share_embeddings_and_output_weights is False and c.apply_residual_connection_post_layernorm is True
    assert (c.bias_gelu_fusion, c.kv_channels, c.ffn_hidden_size, c.init_method_std) == (False, 16, 96, 0.01)


def test_megatron_defaults_reach_the_config():
    c = core_transformer_config_from_args(_validated())
    assert (c.position_embedding_type, c.normalization, c.bias_gelu_fusion, c.add_bias_linear) == (
        "learned_absolute", "LayerNorm", True, True)
    assert c.num_query_groups in (None, 4) and c.share_embeddings_and_output_weights is True
    onnx = core_transformer_config_from_args(_validated("--onnx-safe", "1"))
    assert onnx.bias_gelu_fusion is False  # Megatron's --onnx-safe MLP: erf GeLU, no fused (tanh) bias-GeLU


@pytest.mark.parametrize("flags, named", [
    (["--num-query-groups", "2"], "--group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    (["--rotary-percent", "0.5"], "--rotary-percent"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent"),
    (["--swiglu", "--squared-relu"], "--swiglu"),
    (["--position-embedding-type", "none", "--use-rotary-position-embeddings"], "--use-rotary-position-embeddings"),
])
def test_impossible_architecture_combinations_are_one_line_errors(flags, named):
    with pytest.raises(ArgumentError) as info:
        _validated(*flags)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_zero_shot_tasks_refuse_finetuning_flags(monkeypatch):
    sys.path.insert(0, str(REPO))
    from tasks.main import check_task_flags, get_tasks_args

    args = build_parser(get_tasks_args).parse_args([*BASE, "--task", "LAMBADA", "--epochs", "3"])
    args.rank = 1
    validate_args(args, {})  # accepted by the parser (MNLI/QQP/RACE read it) ...
    with pytest.raises(ArgumentError, match="--epochs"):
        check_task_flags(args)  # ... and refused with one line by the zero-shot tasks


@pytest.mark.slow  # starts the entry script
def test_entry_script_refuses_with_one_line_and_exit_code_1(tmp_path):
    import subprocess

    argv = [sys.executable, str(REPO / "pretrain_gpt.py"), *BASE, "--train-iters", "1", "--lr", "1e-4",
            "--data-path", str(tmp_path / "none"), "--standalone-embedding-stage"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: --standalone-embedding-stage is not implemented (the embedding shares the first pipeline stage); "
        "drop it"]


def test_deepspeed_mpi_needs_an_mpi_launch(monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    with pytest.raises(ArgumentError, match="--deepspeed_mpi needs an mpirun"):
        _validated("--deepspeed_mpi")
