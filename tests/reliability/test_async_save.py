"""--async-save (megatron/checkpoint/async_save.py).

In-process: the same state saved synchronously and asynchronously gives the same files bit for bit (legacy `torch`
and `torch_dist`), although training changes the parameters while the background write runs; nothing is published
(no tracker, no manifest) before `maybe_finalize`; a failed background write is raised by the finalize and leaves
the previous checkpoint the latest; with the background copy held back until the optimizer step asks for it, the
step (and the expert-bias update) waits and the files still equal the synchronous save's; the flag's start-up
rules (DeepSpeed refused in one line; torch_dist without --use-persistent-ckpt-worker turned off with Megatron-LM's
warning).
Two subprocess runs: TP2 x DP2 / PP2 x DP2 on 4 gloo processes (folders equal the synchronous run's, exit publishes,
resume exact) and a SIGKILL in the middle of the background write (the previous checkpoint is the one loaded).
Megatron Core's resume from our asynchronous torch_dist save is in tests/tools/test_checkpoint_mcore.py.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.checkpoint import async_save
from megatron.checkpoint.paths import TRACKER_FILENAME
from megatron.checkpoint.saving import write_checkpoint
from megatron.compat import args_to_save
from megatron.core import saved_state
from megatron.core.step_updates import apply_step_updates
from megatron.errors import MegatronUserError
from megatron.models.gpt.model import GPTModel
from megatron.optimizer import get_megatron_optimizer
from megatron.optimizer.optimizer_config import OptimizerConfig
from megatron.run_configs.architecture import architecture_from_args
from megatron.run_configs.checkpoint import CheckpointSettings
from megatron.training_state import TrainingState
from tests.dist_utils import run_distributed
from tests.log_lines import iteration_values
from tests.reliability._dist_workers import run_sequence
from tests.reliability.helpers import REPO, train_argv

SEQ, VOCAB = 16, 128
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
        "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-bias-gelu-fusion"]


def _args(*extra: str) -> argparse.Namespace:
    args = parse_args(args=[*TINY, *extra])
    args.rank = 1  # quiet argument dump
    validate_args(args, {})
    args.padded_vocab_size = VOCAB
    return args


def _step(model: GPTModel, optimizer, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    optimizer.zero_grad()
    model(ids[:, :-1], pos, mask, labels=ids[:, 1:]).mean().backward()
    optimizer.step()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _model_and_optimizer(args: argparse.Namespace):
    torch.manual_seed(3)
    model = GPTModel(core_transformer_config_from_args(args), parallel_output=False)
    optimizer = get_megatron_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                                                              fp16=args.fp16, params_dtype=args.params_dtype))
    _step(model, optimizer, 0)
    return model, optimizer


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_async_save_writes_the_synchronous_bytes_while_training_goes_on(tmp_path: Path, fmt: str) -> None:
    args = _args("--save", str(tmp_path), "--ckpt-format", fmt, "--async-save", "--use-persistent-ckpt-worker")
    assert args.async_save
    model, optimizer = _model_and_optimizer(args)
    saved_args, arch, run = args_to_save(args), architecture_from_args(args), TrainingState.from_args(args)
    sync_args = copy.copy(args)
    sync_args.async_save = False
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    write_checkpoint(3, [model], optimizer, None, CheckpointSettings.from_args(sync_args), arch, saved_args, run,
                     save_dir=str(sync_dir))
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("query_key_value.weight")}
    assert before
    write_checkpoint(3, [model], optimizer, None, CheckpointSettings.from_args(args), arch, saved_args, run,
                     save_dir=str(async_dir))
    assert async_save.in_flight()
    for seed in (1, 2):  # training goes on while the files are written: the snapshot is what gets saved
        _step(model, optimizer, seed)
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items() if k.endswith("query_key_value.weight"))
    assert not (async_dir / TRACKER_FILENAME).exists()  # published only by the (collective) finalize
    assert not list(async_dir.rglob("manifest.json"))
    async_save.maybe_finalize(blocking=True)
    assert not async_save.in_flight()
    sync_files, async_files = _files(sync_dir), _files(async_dir)
    assert sorted(async_files) == sorted(sync_files) and "manifest.json" in {Path(k).name for k in sync_files}
    if fmt == "torch_dist":  # DCP's .metadata records a random save id (uuid4: two synchronous saves differ there too)
        meta = [k for k in sync_files if k.endswith(".metadata")]
        assert len(meta) == 1
        for files in (sync_files, async_files):
            files.pop(meta[0])
            files.pop(str(Path(meta[0]).parent / "manifest.json"))
    different = [k for k in sync_files if sync_files[k] != async_files[k]]
    assert not different, different


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_step_waits_for_the_background_copy_and_the_files_equal_the_synchronous_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """The worst timing: the background copy of the live state starts only when the step asks to change it. The
    optimizer step (fp32, and fp16's main params and grad scaler) waits for it; the parameters are then changed in
    place at once, and the files still equal the synchronous save's bit for bit."""
    args = _args("--save", str(tmp_path), "--async-save", *(["--fp16"] if precision == "fp16" else []))
    model, optimizer = _model_and_optimizer(args)
    saved_args, arch, run = args_to_save(args), architecture_from_args(args), TrainingState.from_args(args)
    sync_args = copy.copy(args)
    sync_args.async_save = False
    write_checkpoint(5, [model], optimizer, None, CheckpointSettings.from_args(sync_args), arch, saved_args, run,
                     save_dir=str(tmp_path / "sync"))
    gate, real_snapshot, real_wait = threading.Event(), async_save.snapshot, saved_state.wait_for_copies
    monkeypatch.setattr(async_save, "snapshot", lambda obj: (gate.wait(), real_snapshot(obj))[1])
    monkeypatch.setattr(saved_state, "wait_for_copies", lambda: (gate.set(), real_wait())[1])
    write_checkpoint(5, [model], optimizer, None, CheckpointSettings.from_args(args), arch, saved_args, run,
                     save_dir=str(tmp_path / "async"))
    try:
        assert saved_state.copies_pending() and not gate.is_set()  # the save returned before any tensor was copied
        _step(model, optimizer, 1)  # forward and backward run alongside the copy; the optimizer step waits for it
        copied_before_the_step = gate.is_set() and not saved_state.copies_pending()
        with torch.no_grad():  # as soon as allowed: every parameter and optimizer state tensor changed in place
            for tensor in [*model.parameters(), *(p for g in optimizer.param_groups for p in g["params"]),
                           *(v for s in optimizer.state.values() for v in s.values())]:
                tensor.add_(1.0)
            optimizer.get_loss_scale().add_(1.0)  # fp32: a constant 1; fp16: the grad scaler's scale
    finally:
        gate.set()  # (a step that did not wait has changed the state before the copy began)
        async_save.maybe_finalize(blocking=True)
    sync_files, async_files = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(async_files) == sorted(sync_files) and len(sync_files) == 3  # the file, manifest, tracker
    assert [k for k in sync_files if sync_files[k] != async_files[k]] == []
    assert copied_before_the_step


def test_the_expert_bias_update_waits_for_the_background_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE expert-bias update (finalize_model_grads, before the optimizer step) changes saved state: it waits for
    the background copy first."""
    order: list[str] = []

    class Router(torch.nn.Module):
        def step_counts(self) -> torch.Tensor:
            return torch.ones(2)

        def apply_step_update(self, global_counts: torch.Tensor) -> None:
            order.append("update")

    monkeypatch.setattr(saved_state, "wait_for_copies", lambda: order.append("wait"))
    apply_step_updates([Router()], ())
    assert order == ["wait", "update"]


def test_a_failed_background_write_is_raised_and_publishes_nothing(tmp_path: Path) -> None:
    args = _args("--save", str(tmp_path), "--async-save")
    model, optimizer = _model_and_optimizer(args)
    cfg = CheckpointSettings.from_args(args)
    saved_args, arch, run = args_to_save(args), architecture_from_args(args), TrainingState.from_args(args)
    write_checkpoint(1, [model], optimizer, None, cfg, arch, saved_args, run)
    async_save.maybe_finalize(blocking=True)
    assert (tmp_path / TRACKER_FILENAME).read_text() == "1"
    blocker = tmp_path / "iter_0000002"
    blocker.write_text("a file where the iteration's folder goes")  # the background write cannot create its folder
    write_checkpoint(2, [model], optimizer, None, cfg, arch, saved_args, run)
    with pytest.raises(OSError):
        async_save.maybe_finalize(blocking=True)
    assert not async_save.in_flight()
    assert (tmp_path / TRACKER_FILENAME).read_text() == "1"
    os.remove(blocker)


def test_async_save_start_up_rules(capsys, tmp_path: Path) -> None:
    args = _args("--ckpt-format", "torch_dist", "--async-save", "--save", "/tmp/x")
    assert args.async_save is False  # Megatron-LM's rule: torch_dist needs the persistent worker
    args = parse_args(args=[*TINY, "--ckpt-format", "torch_dist", "--async-save", "--save", "/tmp/x"])
    validate_args(args, {})
    assert "--async-save is not supported without --use-persistent-ckpt-worker. Disabling --async-save." in \
        capsys.readouterr().out
    assert _args("--async-save", "--save", "/tmp/x").async_save is True  # the legacy layout: on
    validate_args(parse_args(args=[*TINY, "--ckpt-fully-parallel-save"]), {})  # Megatron-LM's deprecated spelling
    assert "--ckpt-fully-parallel-save flag is deprecated and has no effect." in capsys.readouterr().out
    with pytest.raises(MegatronUserError, match="^--async-save cannot be used with --deepspeed"):
        (tmp_path / "ds.json").write_text("{}")
        _args("--async-save", "--save", "/tmp/x", "--deepspeed", "--deepspeed_config", str(tmp_path / "ds.json"))


def _same(a, b) -> bool:
    """Equal values: tensors bit for bit (dtype, shape, bytes), containers entry by entry."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _same_checkpoint(ref: Path, got: Path) -> None:
    """Every file of iteration folder `got` equals `ref`'s bit for bit, except those recording the run's own flags
    (``args``: --async-save, --load, --exit-interval; their other entries equal) and what lists those (manifest.json,
    DCP's .metadata with its random save id)."""
    ref_files, got_files = _files(ref), _files(got)
    assert sorted(ref_files) == sorted(got_files)
    for rel, data in ref_files.items():
        name = Path(rel).name
        if name in ("manifest.json", ".metadata"):
            continue
        if name in ("common.pt", "model_optim_rng.pt"):
            a, b = (torch.load(p / rel, weights_only=False) for p in (ref, got))
            assert _same({k: v for k, v in a.items() if k != "args"}, {k: v for k, v in b.items() if k != "args"}), rel
            continue
        assert got_files[rel] == data, rel


def test_async_save_at_tp2_dp2_and_pp2_dp2_resumes_exactly(tiny_data: dict, tmp_path: Path) -> None:
    """4 gloo processes, five runs: TP2 x DP2 with the distributed optimizer as torch_dist, synchronous (saves at 2,
    4, 6) and asynchronous (--exit-interval 4: the exit publishes its save), resumed asynchronously to 6; PP2 x DP2
    (distributed optimizer) in the legacy layout, synchronous and asynchronous (a writer per save). The asynchronous
    folders equal the synchronous ones; the resumed run's losses equal the uninterrupted run's."""
    out = {name: str(tmp_path / name) for name in ("ref", "async", "ref_pp", "async_pp")}
    tp = train_argv(tiny_data, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--global-batch-size",
                    "4", "--save-interval", "2", "--ckpt-format", "torch_dist", iters=6)
    pp = train_argv(tiny_data, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                    "--global-batch-size", "4", "--save-interval", "2", iters=2)
    on = ["--async-save", "--use-persistent-ckpt-worker"]
    runs = [[*tp, "--save", out["ref"]], [*tp, *on, "--save", out["async"], "--exit-interval", "4"],
            [*tp, *on, "--save", out["async"], "--load", out["async"]], [*pp, "--save", out["ref_pp"]],
            [*pp, "--async-save", "--save", out["async_pp"]]]
    results = run_distributed(run_sequence, 4, args=(runs,))
    assert all(r["error"] is None for ranks in results for r in ranks), [r["error"] for ranks in results for r in ranks]
    ref, first, resumed = (iteration_values(results[3][i]["stdout"], as_text=True) for i in range(3))
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [5, 6]
    assert {**first, **resumed} == ref
    assert f"successfully loaded checkpoint from {out['async']} at iteration 4" in results[0][2]["stdout"]
    assert "writing the checkpoint of iteration       4 in the background" in results[0][1]["stdout"]
    for name, last in (("async", 6), ("async_pp", 2)):
        assert (tmp_path / name / TRACKER_FILENAME).read_text() == str(last)
    for it in (2, 4, 6):
        _same_checkpoint(tmp_path / "ref" / f"iter_{it:07d}", tmp_path / "async" / f"iter_{it:07d}")
    _same_checkpoint(tmp_path / "ref_pp" / "iter_0000002", tmp_path / "async_pp" / "iter_0000002")
    assert sorted(p.name for p in (tmp_path / "async_pp" / "iter_0000002").iterdir()) == \
        ["manifest.json", "mp_rank_00_000", "mp_rank_00_001"]
    assert (tmp_path / "async_pp" / "iter_0000002" / "mp_rank_00_001" / "distrib_optim.pt").is_file()


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tiny_data: dict, tmp_path: Path) -> None:
    """One process (forked by the crash-test driver): --async-save SIGKILLed by the fault hook in the middle of the
    background write of iteration 4's file: the tracker stays on 2, the next run loads 2 and its losses, like the
    killed run's, equal the uninterrupted synchronous run's; at the end no temporary file is left."""
    common = train_argv(tiny_data, "--save-interval", "2", iters=4)
    ref, kill = str(tmp_path / "ref"), str(tmp_path / "kill")
    runs = [{"argv": [*common, "--save", ref], "save": ref},
            {"argv": [*common, "--async-save", "--save", kill, "--load", kill], "save": kill,
             "fault": "mid-write:model_optim_rng.pt@2"},
            {"argv": [*common, "--async-save", "--save", kill, "--load", kill], "save": kill}]
    (tmp_path / "plan.json").write_text(json.dumps({"work": str(tmp_path), "runs": runs}))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "tests.reliability._chaos_driver", str(tmp_path / "plan.json"),
                           str(tmp_path / "r.json")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, killed, resumed = json.loads((tmp_path / "r.json").read_text())
    reference = iteration_values(first["stdout"], as_text=True)
    assert sorted(reference) == [1, 2, 3, 4]
    assert killed["signal"] == signal.SIGKILL and killed["expected_resume"] is None
    assert [Path(p).name.split(".tmp.")[0] for p in killed["temps"]] == ["model_optim_rng.pt"]  # cut mid-write
    assert resumed["expected_resume"] == 2 and resumed["exit"] == 0, resumed["stdout"][-3000:]
    assert f"successfully loaded checkpoint from {kill} at iteration 2" in resumed["stdout"]
    for run in (killed, resumed):
        for it, loss in iteration_values(run["stdout"], as_text=True).items():
            assert loss == reference[it], (it, loss, reference[it])
    assert sorted(iteration_values(resumed["stdout"])) == [3, 4]
    assert (tmp_path / "kill" / TRACKER_FILENAME).read_text() == "4" and resumed["temps"] == []


def test_abandon_waits_for_the_writes_and_publishes_nothing() -> None:
    """--inprocess-restart's call: the saves in flight are written to the end (no thread writes into the restarted
    run) and never published; nothing is left in flight."""
    gate, written, published = threading.Event(), [], []

    def slow_save(obj: Any, path: str) -> None:
        gate.wait(10)
        written.append((path, obj["w"].clone()))

    state = {"w": torch.ones(3)}
    async_save.schedule(5, [(state, "a.pt")], slow_save, lambda: published.append(5), persistent=False)
    threading.Timer(0.05, gate.set).start()  # the write ends only after abandon() has started waiting
    assert async_save.abandon() == [5]
    assert [p for p, _ in written] == ["a.pt"] and torch.equal(written[0][1], torch.ones(3))
    assert published == [] and not async_save.in_flight()
    assert async_save.abandon() == []
