"""No code runs from a checkpoint: a crafted pickle that would create a file is refused with one line by every
loader and entry point (training, generation, the REST server, evaluation, the DeepSpeed engine and converter), and
the explicit opt-in (--trust-checkpoint / MEGATRON_TRUST_CHECKPOINT=1) loads it. Real checkpoints of every layout we
write (Megatron; DeepSpeed ZeRO 1-3, fp32/bf16/fp16) load under the allow-list."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.integrity import write_manifest
from megatron.checkpoint.safe_load import (
    CheckpointFileError,
    UnsafeCheckpointError,
    guarded_torch_load,
    safe_torch_load,
)
from tests.reliability.helpers import MODEL, assert_one_line_error, run, train_argv


class _CreateFile:
    """Unpickling this calls open(path, 'w'): the file appears only if the pickle's code runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _poison(path: Path, marker: Path, iter_dir: Path) -> None:
    sd = safe_torch_load(path)
    sd["payload"] = _CreateFile(str(marker))
    torch.save(sd, path)
    write_manifest(str(iter_dir))  # the attacker rewrites the manifest too: only the safe loader stands in the way


@pytest.fixture(scope="module")
def poisoned(tiny_ckpt: Path, tiny_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A Megatron checkpoint and a DeepSpeed one (converted from it) whose model file carries the payload."""
    work = tmp_path_factory.mktemp("poisoned")
    meg = work / "meg"
    shutil.copytree(tiny_ckpt, meg)
    ds = work / "ds"
    proc = run("tools/convert_deepspeed_checkpoint.py", "--to-deepspeed", "--input-folder", str(tiny_ckpt),
               "--output-folder", str(ds), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = work / "PWNED"
    _poison(meg / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", marker, meg / "iter_0000002")
    _poison(ds / "global_step2" / "mp_rank_00_model_states.pt", marker, ds / "global_step2")
    (work / "prompts.txt").write_text("Hello\n")
    (work / "wiki.txt").write_text(" = Title = \n\n Some text for the model to score , and more text here .\n")
    (work / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
                                              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}))
    return {"dir": work, "meg": meg, "ds": ds, "marker": marker, "data": tiny_data}


def _refused(proc, marker: Path, name: str) -> None:
    line = assert_one_line_error(proc, "refusing to load", name, "--trust-checkpoint", "MEGATRON_TRUST_CHECKPOINT")
    assert "open" in line, line  # the offending global is named
    assert not marker.exists(), "the payload ran"


def test_unit_refuses_and_opt_in_loads(poisoned: dict, tmp_path: Path, monkeypatch) -> None:
    path = poisoned["meg"] / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    marker = tmp_path / "marker"
    bad = tmp_path / "bad.pt"
    torch.save({"x": _CreateFile(str(marker))}, bad)
    with pytest.raises(UnsafeCheckpointError, match="bad.pt.*'builtins.open'|bad.pt.*'io.open'"):
        safe_torch_load(bad)
    with guarded_torch_load():  # what DeepSpeed's internal torch.load(..., weights_only=False) meets
        with pytest.raises(UnsafeCheckpointError):
            torch.load(bad, weights_only=False)
    assert not marker.exists()
    monkeypatch.setenv("MEGATRON_TRUST_CHECKPOINT", "1")
    assert safe_torch_load(bad)["x"] is not None and marker.exists()
    monkeypatch.delenv("MEGATRON_TRUST_CHECKPOINT")
    marker.unlink()
    with guarded_torch_load(trust=True):
        torch.load(bad)
    assert marker.exists()
    assert torch.load is not None and "patched" not in torch.load.__name__
    # damaged files are a one-line CheckpointFileError, not a raw reader traceback
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes(path.read_bytes()[:1000])
    for f in (empty, truncated, tmp_path / "missing.pt"):
        with pytest.raises(CheckpointFileError, match=f.name):
            safe_torch_load(f)


def test_real_checkpoints_load_under_the_allow_list(tiny_ckpt: Path, poisoned: dict) -> None:
    sd = safe_torch_load(tiny_ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    assert sd["iteration"] == 2 and sd["args"].num_layers == 2 and len(sd["rng_state"]) == 1


def test_deepspeed_checkpoints_resume_under_the_allow_list(tiny_data: dict, tmp_path: Path) -> None:
    """DeepSpeed 0.19 writes loss scalers, ZeRO enums and fragment addresses into its optimizer files (bf16, ZeRO-2
    here): every file loads weights-only and the engine resumes through the guarded torch.load."""
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True}, "steps_per_print": 10**9}))
    common = ["--deepspeed", "--deepspeed_config", "ds.json", "--bf16", "--save-interval", "2"]
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *common, "--save", "ds_ckpt", "--exit-interval", "2", iters=3),
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted((tmp_path / "ds_ckpt" / "global_step2").glob("*.pt"))
    assert len(files) == 2 and any("optim_states" in f.name for f in files)
    needed = set()
    for f in files:
        needed |= set(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        assert isinstance(safe_torch_load(f), dict)
    assert {"argparse.Namespace", "deepspeed.runtime.fp16.loss_scaler.LossScaler"} <= needed, needed
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, *common, "--load", "ds_ckpt", iters=3), cwd=tmp_path)
    assert proc.returncode == 0 and "iteration        3/       3" in proc.stdout, proc.stderr[-3000:]


def test_pretrain_load_refused_and_trusted(poisoned: dict) -> None:
    work, marker = poisoned["dir"], poisoned["marker"]
    argv = train_argv(poisoned["data"], "--load", str(poisoned["meg"]), "--override-opt_param-scheduler", iters=3)
    _refused(run("pretrain_gpt.py", *argv, cwd=work), marker, "model_optim_rng.pt")
    proc = run("pretrain_gpt.py", *argv, "--trust-checkpoint", cwd=work)
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-3000:]
    assert "iteration        3/       3" in proc.stdout
    marker.unlink()


def test_generation_server_and_eval_refuse(poisoned: dict) -> None:
    work, marker, meg = poisoned["dir"], poisoned["marker"], str(poisoned["meg"])
    tok = poisoned["data"]["tokenizer"]
    _refused(run("tools/generate_samples_gpt.py", *MODEL, *tok, "--load", meg, "--sample-input-file", "prompts.txt",
                 "--out-seq-length", "4", "--greedy", cwd=work), marker, "model_optim_rng.pt")
    _refused(run("tools/run_text_generation_server.py", *MODEL, *tok, "--load", meg, "--port", "0", cwd=work),
             marker, "model_optim_rng.pt")
    _refused(run("tasks/main.py", "--task", "WIKITEXT103", "--valid-data", "wiki.txt", *MODEL, *tok, "--load", meg,
                 "--micro-batch-size", "1", cwd=work), marker, "model_optim_rng.pt")
    proc = run("tools/generate_samples_gpt.py", *MODEL, *tok, "--load", meg, "--sample-input-file", "prompts.txt",
               "--out-seq-length", "4", "--greedy", cwd=work, env={"MEGATRON_TRUST_CHECKPOINT": "1"})
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-3000:]
    marker.unlink()


def test_deepspeed_engine_and_converter_refuse(poisoned: dict) -> None:
    work, marker, ds = poisoned["dir"], poisoned["marker"], str(poisoned["ds"])
    argv = train_argv(poisoned["data"], "--deepspeed", "--deepspeed_config", "ds.json", "--load", ds, "--finetune",
                      iters=1)
    _refused(run("pretrain_gpt.py", *argv, cwd=work), marker, "mp_rank_00_model_states.pt")
    conv = ["tools/convert_deepspeed_checkpoint.py", "--input-folder", ds, "--output-folder", str(work / "conv")]
    _refused(run(*conv, cwd=work), marker, "mp_rank_00_model_states.pt")
    proc = run(*conv, "--trust-checkpoint", cwd=work)
    assert proc.returncode == 0 and marker.exists(), proc.stderr[-3000:]
    marker.unlink()


class _EnumByName:
    """What Python 3.11.0-3.11.4 (Debian 12's python3) pickle for an enum member: ``getattr(EnumClass, 'name')``."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name

    def __reduce__(self):
        return (getattr, (self.cls, self.name))


def test_enum_members_pickled_by_name_load_and_other_getattr_is_refused(tmp_path: Path) -> None:
    import argparse

    from megatron.layers.enums import ModelType

    ok, bad = tmp_path / "ok.pt", tmp_path / "bad.pt"
    torch.save({"args": argparse.Namespace(model_type=_EnumByName(ModelType, "encoder_or_decoder"))}, ok)
    assert safe_torch_load(ok)["args"].model_type is ModelType.encoder_or_decoder
    for target in (_EnumByName(argparse.Namespace, "__init__"), _EnumByName(ModelType, "__class__")):
        torch.save({"x": target}, bad)
        with pytest.raises(UnsafeCheckpointError, match="getattr"):
            safe_torch_load(bad)
