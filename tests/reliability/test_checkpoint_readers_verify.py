"""Every reader of checkpoints verifies the manifest as --load does (issue 30, must-fix 2).

A checkpoint whose newest model_optim_rng.pt has 64 flipped bytes no longer matches its manifest.json. convert.py
(megatron and deepspeed loaders), merge_mp_partitions.py, convert_deepspeed_checkpoint.py, --finetune and
inference fall back to the newest intact iteration with one line, or refuse an explicitly named damaged iteration
with one line; a source without a manifest converts with a note and its output is not signed (no manifest.json):
nothing re-signs bytes that were never verified.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpoint import integrity
from megatron.checkpoint.conversion import driver
from megatron.checkpoint.conversion.interchange import ConversionError
from megatron.errors import MegatronUserError
from tests.reliability.helpers import MODEL, assert_one_line_error, run, train_argv

NEWEST = Path("iter_0000004") / "mp_rank_00" / "model_optim_rng.pt"


def flip_64_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def two_saves(tiny_data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ckpt/ with intact iterations 2 and 4 (--save-interval 2)."""
    work = tmp_path_factory.mktemp("readers_verify")
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, "--save-interval", "2", iters=4), "--save", "ckpt", cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "ckpt"


def _damaged_copy(two_saves: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "damaged"
    shutil.copytree(two_saves, ckpt)
    flip_64_bytes(ckpt / NEWEST)
    assert integrity.verify(str(ckpt / "iter_0000004")) is not None
    return ckpt


def _weights(ckpt_file: Path) -> dict:
    from megatron.models.gpt.model import flatten_checkpoint_state_dict

    return flatten_checkpoint_state_dict(torch.load(ckpt_file, map_location="cpu", weights_only=False)["model"])


def test_convert_skips_damaged_newest_and_signs_only_what_it_verified(two_saves: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    ckpt = _damaged_copy(two_saves, tmp_path)
    out = tmp_path / "out"
    driver.main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", str(ckpt),
                 "--save-dir", str(out)])
    warnings = [line for line in capsys.readouterr().out.splitlines() if "skipped damaged checkpoint" in line]
    assert len(warnings) == 1 and "iter_0000004 (mp_rank_00/model_optim_rng.pt has checksum" in warnings[0]
    assert "converting iter_0000002 instead" in warnings[0]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (out / "iter_0000004").exists() and integrity.verify(str(out / "iter_0000002")) is None
    written, source = _weights(out / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"), \
        _weights(ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    assert sorted(written) == sorted(source) and all(torch.equal(written[k], source[k]) for k in source)


def test_convert_refuses_a_damaged_named_iteration_and_publishes_nothing(two_saves: Path, tmp_path: Path) -> None:
    ckpt = _damaged_copy(two_saves, tmp_path)
    with pytest.raises(ConversionError) as exc:
        driver.main(["--model-type", "GPT", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"),
                     "--iteration", "4"])
    message = str(exc.value)
    assert "\n" not in message and "iter_0000004 is damaged: mp_rank_00/model_optim_rng.pt has checksum" in message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.converting.*"))
    (ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")  # nothing intact left
    with pytest.raises(ConversionError, match="no intact checkpoint in .*iter_0000004 .*; iter_0000002 "):
        driver.main(["--model-type", "GPT", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out")])


def test_convert_of_a_checkpoint_without_manifest_writes_none(two_saves: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    ckpt = tmp_path / "legacy"
    shutil.copytree(two_saves, ckpt)
    for it in (2, 4):
        (ckpt / f"iter_{it:07d}" / "manifest.json").unlink()
    driver.main(["--model-type", "GPT", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out")])
    assert "converted without verifying it, and the output is not signed either" in capsys.readouterr().out
    assert (tmp_path / "out" / "iter_0000004").is_dir()
    assert integrity.verify(str(tmp_path / "out" / "iter_0000004")) == integrity.NO_MANIFEST


def test_merge_mp_partitions_skips_damaged_newest(two_saves: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("merge_mp_partitions",
                                                  Path(__file__).parents[2] / "tools" / "merge_mp_partitions.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    ckpt = _damaged_copy(two_saves, tmp_path)
    merge.main(["--model-type", "GPT", "--tensor-model-parallel-size", "1", "--load", str(ckpt),
                "--save", str(tmp_path / "merged")])
    out = capsys.readouterr().out
    assert out.count("skipped damaged checkpoint iter_0000004") == 1, out
    assert (tmp_path / "merged" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert integrity.verify(str(tmp_path / "merged" / "iter_0000002")) is None


def test_deepspeed_converter_verifies_both_directions(two_saves: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_ds",
                                                  Path(__file__).parents[2] / "tools" / "convert_deepspeed_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ckpt = _damaged_copy(two_saves, tmp_path)
    tool.main(["--input-folder", str(ckpt), "--output-folder", str(tmp_path / "ds"), "--to-deepspeed"])
    assert "converting iter_0000002 instead" in capsys.readouterr().out
    assert (tmp_path / "ds" / "latest").read_text().strip() == "global_step2"
    assert integrity.verify(str(tmp_path / "ds" / "global_step2")) is None  # verified source: signed output
    flip_64_bytes(next((tmp_path / "ds" / "global_step2").glob("*model_states.pt")))
    with pytest.raises(MegatronUserError) as exc:  # the only tag is damaged: nothing to fall back to
        tool.main(["--input-folder", str(tmp_path / "ds"), "--output-folder", str(tmp_path / "back")])
    assert "\n" not in str(exc.value) and "no intact checkpoint in" in str(exc.value)
    assert "global_step2 (mp_rank_00_model_states.pt has checksum" in str(exc.value)
    assert not (tmp_path / "back").exists()


@pytest.mark.slow
def test_finetune_and_inference_skip_damaged_newest(two_saves: Path, tiny_data: dict, tmp_path: Path) -> None:
    ckpt = _damaged_copy(two_saves, tmp_path)
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, iters=1), "--load", str(ckpt), "--finetune", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped damaged checkpoint iteration(s) 4 (mp_rank_00/model_optim_rng.pt has checksum" in proc.stdout
    (tmp_path / "prompts.txt").write_text("Hello\n")
    proc = run("tools/generate_samples_gpt.py", *MODEL, *tiny_data["tokenizer"], "--load", str(ckpt),
               "--sample-input-file", "prompts.txt", "--out-seq-length", "4", "--greedy", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped damaged checkpoint iteration(s) 4" in proc.stdout and "loading iteration 2" in proc.stdout
    proc = run("pretrain_gpt.py", *train_argv(tiny_data, iters=1), "--load", str(ckpt), "--finetune",
               "--no-checkpoint-fallback", cwd=tmp_path)
    assert_one_line_error(proc, "checkpoint iteration 4 in", "is damaged", "--no-checkpoint-fallback")
