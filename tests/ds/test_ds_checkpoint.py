"""DeepSpeed checkpoints: save at iteration 10, resume to 20 == the uninterrupted run (exact log strings).

One 2-process job (DP=2, dropout on so the restored RNG matters) runs for ZeRO-1 and ZeRO-3: the uninterrupted
20 iterations, a run that saves at 10 and exits (--exit-interval), and the resume from it; plus a --finetune run from
the ZeRO-1 checkpoint (weights only: iteration and consumed samples start again from 0), and resumes with
--no-load-optim (fresh Adam moments) and --no-load-rng (other dropout masks).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.ds._workers import run_pretrain_ds, tiny_gpt_argv, write_ds_config
from tests.log_lines import iteration_values, validation_values

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _log(stdout: str) -> dict:
    cols = [iteration_values(stdout, key, as_text=True) for key in ("consumed samples", "lm loss", "grad norm")]
    train = {it: tuple(col[it] for col in cols) for it in cols[1] if all(it in col for col in cols)}
    val = [(where, v) for where, v in validation_values(stdout, as_text=True) if where.startswith("iteration ")]
    return {"train": train, "val": val}


def _runs(rank: int, world_size: int, runs: list[list[str]]) -> list[dict]:
    return [run_pretrain_ds(rank, world_size, argv) for argv in runs]


@pytest.fixture(scope="module")
def job(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ds_ckpt")
    runs, names = [], []
    for stage in (1, 3):
        cfg = write_ds_config(str(tmp / f"zero{stage}.json"), zero_optimization={"stage": stage})
        base = ["--deepspeed", "--deepspeed_config", cfg, *DROPOUT]
        ckpt = str(tmp / f"ckpt{stage}")
        runs += [tiny_gpt_argv(gpt_data, *base),
                 tiny_gpt_argv(gpt_data, *base, "--save", ckpt, "--save-interval", "10", "--exit-interval", "10"),
                 tiny_gpt_argv(gpt_data, *base, "--save", ckpt + "_resumed", "--save-interval", "10", "--load", ckpt)]
        names += [f"full{stage}", f"first{stage}", f"resume{stage}"]
    runs.append(tiny_gpt_argv(gpt_data, "--deepspeed", "--deepspeed_config", str(tmp / "zero1.json"), *DROPOUT,
                              "--load", str(tmp / "ckpt1"), "--finetune", "--lr-warmup-iters", "1", iters=3))
    names.append("finetune")
    for flag in ("--no-load-optim", "--no-load-rng"):
        runs.append(tiny_gpt_argv(gpt_data, "--deepspeed", "--deepspeed_config", str(tmp / "zero1.json"), *DROPOUT,
                                  "--load", str(tmp / "ckpt1"), flag))
        names.append(flag)
    results = run_distributed(_runs, 2, args=(runs,))
    out = {}
    for name, res in zip(names, results[1]):
        assert res["error"] is None, f"{name}: {res['error']}"
        out[name] = {"log": _log(res["stdout"]), "stdout": res["stdout"]}
    out["dir"] = tmp
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_equals_uninterrupted(job: dict, stage: int) -> None:
    full, first, resume = (job[f"{k}{stage}"]["log"] for k in ("full", "first", "resume"))
    assert sorted(full["train"]) == list(range(1, 21))
    assert sorted(first["train"]) == list(range(1, 11)), "--exit-interval 10 should stop at iteration 10"
    assert sorted(resume["train"]) == list(range(11, 21)), "the resume should continue at iteration 11"
    for it in range(1, 11):
        assert first["train"][it] == full["train"][it]
    for it in range(11, 21):  # consumed samples, loss and grad norm strings identical
        assert resume["train"][it] == full["train"][it], f"ZeRO-{stage} iteration {it}"
    assert resume["val"] == [v for v in full["val"] if v[0] == "iteration 20"]


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_layout(job: dict, stage: int) -> None:
    ckpt: Path = job["dir"] / f"ckpt{stage}"
    resumed: Path = job["dir"] / f"ckpt{stage}_resumed"
    assert (ckpt / "latest").read_text().strip() == "global_step10"
    assert (resumed / "latest").read_text().strip() == "global_step20"
    # ZeRO-3 writes one model-states file per data-parallel rank (the parameters are partitioned).
    model_file = "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert (ckpt / "global_step10" / model_file).is_file() and (resumed / "global_step20" / model_file).is_file()
    sd = torch.load(ckpt / "global_step10" / model_file, map_location="cpu", weights_only=False)
    assert sd["iteration"] == 10 and sd["checkpoint_version"] == 3.0
    assert sd["args"].consumed_train_samples == 80 and sd["consumed_train_samples"] == 80
    assert len(sd["rng_state"]) == 2, "one RNG state per data-parallel rank"
    assert sd["opt_param_scheduler"]["num_steps"] == 80
    optim_files = sorted(p.name for p in (ckpt / "global_step10").glob("*optim_states.pt"))
    assert len(optim_files) == 2, optim_files  # ZeRO partitions: one per data-parallel rank
    if stage == 1:  # ZeRO-3 keeps the parameters partitioned in the optimizer files
        assert any(k.startswith("language_model.embedding.word_embeddings") for k in sd["module"])
        assert "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight" in sd["module"]


def test_finetune_loads_weights_only(job: dict) -> None:
    log = job["finetune"]["log"]
    assert sorted(log["train"]) == [1, 2, 3]
    assert log["train"][1][0] == "8", "--finetune restarts the consumed samples"
    fresh = float(job["full1"]["log"]["train"][1][1])
    assert float(log["train"][1][1]) < fresh - 0.2, "--finetune should start from the trained weights"


def test_no_load_optim_and_no_load_rng(job: dict) -> None:
    full = job["full1"]["log"]["train"]
    no_optim, no_rng = job["--no-load-optim"]["log"]["train"], job["--no-load-rng"]["log"]["train"]
    assert sorted(no_optim) == sorted(no_rng) == list(range(11, 21))
    # Same weights, data and dropout masks at iteration 11; the first update then differs (Adam restarts).
    assert no_optim[11][1] == full[11][1] and no_optim[12][1] != full[12][1]
    # Same weights and data, other dropout masks: iteration 11 already differs, but only slightly.
    assert no_rng[11][0] == full[11][0] and no_rng[11][1] != full[11][1]
    assert abs(float(no_rng[11][1]) - float(full[11][1])) < 0.1
    # The fp32 ZeRO partitions follow the loaded weights (no fall-back to the initial weights after an update).
    assert max(float(v[1]) for v in no_optim.values()) < float(full[1][1]) - 0.2
