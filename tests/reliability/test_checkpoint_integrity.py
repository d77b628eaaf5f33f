"""Damaged checkpoints are detected and skipped: each iteration has a manifest (sizes + CRC-32, written last); a
truncated, zero-byte or bit-flipped latest checkpoint (our layout and DeepSpeed's global_stepN) makes --load fall back
to the previous intact iteration with one line, and the resumed losses equal the original run's; with
--no-checkpoint-fallback it is a one-line error. Temp files of crashed writes are removed at the next save, checkpoints
without a manifest still load (with a note), and --keep-last-n-checkpoints deletes only after a newer one verified."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron.checkpoint import integrity
from tests.log_lines import iteration_values
from tests.reliability.helpers import assert_one_line_error, run, train_argv


def _losses(stdout: str) -> dict[int, str]:
    return iteration_values(stdout, as_text=True)


def _damage(path: Path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif kind == "zero-byte":
        path.write_bytes(b"")
    else:  # same size, one bit flipped in the middle
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0x10
        path.write_bytes(bytes(flipped))


@pytest.fixture(scope="module")
def megatron_run(tiny_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """6-iteration schedule, checkpoints at 2 and 4, stopped at 4 (--exit-interval)."""
    work = tmp_path_factory.mktemp("integrity")
    argv = train_argv(tiny_data, "--save-interval", "2", iters=6)
    proc = run("pretrain_gpt.py", *argv, "--save", "ckpt", "--exit-interval", "4", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"dir": work, "argv": argv, "losses": _losses(proc.stdout)}


@pytest.mark.parametrize("kind", ["truncated", "zero-byte", "bit-flip"])
def test_damaged_latest_falls_back(megatron_run: dict, kind: str) -> None:
    work = megatron_run["dir"]
    ckpt = work / f"ckpt_{kind}"
    shutil.copytree(work / "ckpt", ckpt)
    assert integrity.verify(str(ckpt / "iter_0000004")) is None
    _damage(ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", kind)
    assert integrity.verify(str(ckpt / "iter_0000004")) is not None
    stale = ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt.tmp.99999"
    stale.write_bytes(b"x" * 1000)  # left by a crashed write
    proc = run("pretrain_gpt.py", *megatron_run["argv"], "--load", ckpt.name, "--save", ckpt.name,
               "--exit-interval", "4", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if "skipped damaged checkpoint" in line]
    assert len(skipped) == 1 and "iteration(s) 4 (mp_rank_00/model_optim_rng.pt" in skipped[0], skipped
    assert "loading iteration 2" in skipped[0]
    resumed = _losses(proc.stdout)
    assert sorted(resumed) == [3, 4] and all(resumed[i] == megatron_run["losses"][i] for i in (3, 4))
    assert not stale.exists() and "removed 1 temporary file(s)" in proc.stdout
    assert integrity.verify(str(ckpt / "iter_0000004")) is None  # rewritten intact


def test_no_fallback_is_one_line(megatron_run: dict) -> None:
    work = megatron_run["dir"]
    ckpt = work / "ckpt_strict"
    shutil.copytree(work / "ckpt", ckpt)
    _damage(ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", "bit-flip")
    proc = run("pretrain_gpt.py", *megatron_run["argv"], "--load", ckpt.name, "--no-checkpoint-fallback", cwd=work)
    assert_one_line_error(proc, "checkpoint iteration 4 in ckpt_strict is damaged",
                          "mp_rank_00/model_optim_rng.pt has checksum", "--no-checkpoint-fallback")


def test_no_intact_checkpoint_and_legacy(megatron_run: dict, tmp_path: Path) -> None:
    work = megatron_run["dir"]
    ckpt = work / "ckpt_legacy"
    shutil.copytree(work / "ckpt", ckpt)
    for it in (2, 4):  # saved before manifests existed
        (ckpt / f"iter_{it:07d}" / "manifest.json").unlink()
    proc = run("pretrain_gpt.py", *megatron_run["argv"], "--load", ckpt.name, "--exit-interval", "5", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iter_0000004 has no manifest.json (saved before integrity checks)" in proc.stdout
    assert _losses(proc.stdout)[5] is not None
    # every iteration damaged: one line naming both
    for it in (2, 4):
        _damage(ckpt / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt", "truncated")
    proc = run("pretrain_gpt.py", *megatron_run["argv"], "--load", ckpt.name, cwd=work)
    assert_one_line_error(proc, "no intact checkpoint in --load ckpt_legacy: 4 (", "; 2 (", "truncated or damaged")


def test_keep_last_n_deletes_only_after_verification(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for it in (1, 2, 3, 4):
        d = root / f"iter_{it:07d}" / "mp_rank_00"
        d.mkdir(parents=True)
        (d / "model_optim_rng.pt").write_bytes(bytes([it]) * 100)
        integrity.write_manifest(str(d.parent))
    _damage(root / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", "bit-flip")
    assert integrity.prune(str(root), 2, 4) == []  # the newest does not verify: keep everything
    assert integrity.iterations(str(root)) == [4, 3, 2, 1]
    assert integrity.prune(str(root), 2, 3) == [1]  # keeps 3 and 2; never touches anything newer than 3
    assert integrity.iterations(str(root)) == [4, 3, 2]
    manifest = json.loads((root / "iter_0000003" / "manifest.json").read_text())
    assert manifest["files"]["mp_rank_00/model_optim_rng.pt"]["size"] == 100


def test_deepspeed_layout_falls_back(tiny_data: dict, tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
                                                  "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}))
    argv = train_argv(tiny_data, "--deepspeed", "--deepspeed_config", "ds.json", "--save-interval", "2", iters=6)
    first = run("pretrain_gpt.py", *argv, "--save", "ds", "--exit-interval", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "ds" / "latest").read_text().strip() == "global_step4"
    assert integrity.verify(str(tmp_path / "ds" / "global_step4")) is None
    _damage(next((tmp_path / "ds" / "global_step4").glob("*optim_states.pt")), "truncated")
    strict = run("pretrain_gpt.py", *argv, "--load", "ds", "--no-checkpoint-fallback", cwd=tmp_path)
    assert_one_line_error(strict, "checkpoint global_step4 in ds is damaged", "optim_states.pt has")
    proc = run("pretrain_gpt.py", *argv, "--load", "ds", "--exit-interval", "4", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped damaged checkpoint(s) global_step4 (" in proc.stdout and "loading global_step2" in proc.stdout
    resumed, original = _losses(proc.stdout), _losses(first.stdout)
    assert sorted(resumed) == [3, 4] and all(resumed[i] == original[i] for i in (3, 4))
