"""Finetuning a small file with the example scripts' defaults (issue 29 item 5): examples/finetune_common.sh lowers
the micro-batch to fit (saying so) or stops before launching, and under megatron.quiet_torchrun a user error prints
one line, once, with exit code 1 and no torch elastic crash report, while a crash keeps the full report. The
pretraining example scripts launch through it too (issue 43 item 6): their user errors are one line, two of them at
once do not collide on a port, and a busy MASTER_PORT is one line naming it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron import quiet_torchrun
from megatron.presets import get_preset
from tests.dist_utils import free_port
from tests.interpreter import path_with_this_python
from tests.reliability.helpers import build_corpus

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
MNLI = FIX / "mnli-sample"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PATH=path_with_this_python(env.get("PATH", "")), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


@pytest.mark.parametrize("gpus,expected", [("2", "--micro-batch-size 3 "), ("8", None)])
def test_mnli_script_fits_the_micro_batch_to_a_small_file(gpus: str, expected: str | None) -> None:
    env = _env(DRY_RUN="1", PRESET="tiny", GPUS_PER_NODE=gpus, TRAIN_DATA=str(MNLI / "train.tsv"))
    proc = subprocess.run(["bash", str(REPO / "examples" / "finetune_mnli_distributed.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    if expected:
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr
        assert "note: --train-data has 6 examples, fewer than one batch of 16" in proc.stderr
    else:
        assert proc.returncode == 1 and not proc.stdout, proc.stdout
        assert "error: --train-data has 6 examples, fewer than the 8 processes" in proc.stderr


@pytest.mark.slow
def test_user_error_under_torchrun_is_one_line(tmp_path: Path) -> None:
    argv = ["--task", "MNLI", "--train-data", str(MNLI / "train.tsv"), "--valid-data", str(MNLI / "dev_matched.tsv"),
            *get_preset("gpt_micro_test").argv(), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
            str(FIX / "bert-wordpiece" / "bert-base-uncased-vocab.txt"), "--epochs", "1", "--micro-batch-size", "8",
            "--lr", "1e-4", "--distributed-backend", "gloo"]
    launch = [sys.executable, "-m", "megatron.quiet_torchrun", "--nproc_per_node", "2", "--master_port"]
    proc = subprocess.run([*launch, str(free_port()), str(REPO / "tasks" / "main.py"), *argv], env=_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["error: --train-data has 6 examples, fewer than one batch of 16: lower "
                                        "--micro-batch-size or pass --keep-last"], proc.stderr[-3000:]
    crash = tmp_path / "crash.py"
    crash.write_text("import os\nraise RuntimeError('boom on rank ' + os.environ['RANK'])\n")
    proc = subprocess.run([*launch, str(free_port()), str(crash)], env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "RuntimeError: boom on rank" in proc.stderr
    assert "ChildFailedError" in proc.stderr  # torchrun's report, kept for a crash


@pytest.mark.parametrize("codes, expected", [({0: -15, 1: 1}, True), ({0: 1, 1: 1}, True), ({0: 1, 1: -9}, False),
                                             ({0: -15, 1: -15}, False)])
def test_ranks_stopped_by_the_agent_after_a_user_error_keep_it_one_line(codes: dict, expected: bool) -> None:
    """Torch elastic SIGTERMs the other ranks after the first failure: a rank stopped that way before it reached the
    error (exit -15, no line) is not a crash. Rank 1 left the user error's line; rank 0 too when its code is 1."""
    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
                for rank, code in codes.items()}
    errors = {rank: "error: x" for rank, code in codes.items() if code == 1}
    assert quiet_torchrun.only_user_errors(failures, errors) is expected


def test_busy_master_port_is_one_line(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before launching; and if another process takes the port after the check, torch's EADDRINUSE from the
    rendezvous store is the same line (the launcher's own SIGTERM handler is undone on return)."""
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--nproc-per-node", "1", "--master-port", str(port), "never_started.py"]
        before = signal.getsignal(signal.SIGTERM)
        assert quiet_torchrun.main(argv) == 1
        monkeypatch.setattr(quiet_torchrun, "port_in_use", lambda port: False)
        assert quiet_torchrun.main(argv) == 1
        assert signal.getsignal(signal.SIGTERM) == before and quiet_torchrun.ERROR_DIR_ENV not in os.environ
    line = quiet_torchrun.port_clash_line(port)
    assert capsys.readouterr().err.splitlines() == [line, line]
    assert line.startswith(f"error: --master-port {port} (MASTER_PORT in the example scripts) is already in use")


@pytest.fixture(scope="module")
def tiny_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_corpus(shared_data, tmp_path_factory.mktemp("owt"))


def _example_env(data: dict, tmp_path: Path, **extra: str) -> dict:
    return _env(DATA_PATH=data["prefix"], VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"],
                CHECKPOINT_PATH=str(tmp_path / "ckpt"), **extra)


def _not_notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("note: ")]


@pytest.mark.slow
def test_example_script_user_error_is_one_line_and_two_runs_do_not_collide(tiny_data: dict, tmp_path: Path) -> None:
    """examples/pretrain_gpt_distributed.sh (2 ranks on the CPU) twice at once, MASTER_PORT unset: each picks a free
    port (no EADDRINUSE) and says its user error in one line, rank 0's, without torchrun's report."""
    script = [str(REPO / "examples" / "pretrain_gpt_distributed.sh"), "--context-parallel-size", "2",
              "--seq-length", "30", "--num-workers", "0"]
    procs = [subprocess.Popen(["bash", *script], env=_example_env(tiny_data, tmp_path / str(i)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [(proc.communicate(timeout=300), proc.returncode) for proc in procs]
    for (_, stderr), rc in results:
        assert rc == 1 and _not_notes(stderr) == [
            "error: --seq-length (30) must be divisible by 4 (2 x --context-parallel-size 2): each context-parallel "
            "rank holds 2 of 4 equal chunks"], stderr[-3000:]


@pytest.mark.slow
def test_example_script_busy_master_port_is_one_line(tiny_data: dict, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt_distributed.sh")], cwd=tmp_path,
                              env=_example_env(tiny_data, tmp_path, MASTER_PORT=str(port)), capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 1 and _not_notes(proc.stderr) == [quiet_torchrun.port_clash_line(port)], proc.stderr


@pytest.mark.slow
def test_finetune_script_passes_a_master_port_only_when_set() -> None:
    env = _env(DRY_RUN="1", PRESET="tiny", GPUS_PER_NODE="1", TRAIN_DATA=str(MNLI / "train.tsv"))
    script = ["bash", str(REPO / "examples" / "finetune_mnli_distributed.sh")]
    free = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    chosen = subprocess.run(script, env={**env, "MASTER_PORT": "6123"}, capture_output=True, text=True, timeout=120)
    assert free.returncode == chosen.returncode == 0, free.stderr + chosen.stderr
    assert "--master_port" not in free.stdout and "megatron.quiet_torchrun" in free.stdout
    assert "--master_port 6123 " in chosen.stdout


def test_sigterm_summary_names_each_workers_exit_code() -> None:
    forwarder = quiet_torchrun.SigtermForwarder()
    forwarder.codes = {}
    assert forwarder.summary().startswith("error: SIGTERM before the workers started")
    forwarder.codes = {12: -15, 11: 0}
    assert forwarder.summary() == ("error: SIGTERM forwarded to the 2 workers of this node; exit codes {11: 0, 12: -15} "
                                   "(-15: stopped by the signal; pass --exit-signal-handler to save and exit 0)")
