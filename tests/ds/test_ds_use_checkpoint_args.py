"""--use-checkpoint-args from a DeepSpeed checkpoint: the architecture comes from the client state of
global_stepN/mp_rank_00_model_states.pt; evaluating it with no model flags gives the training run's validation loss."""
from __future__ import annotations

from pathlib import Path

from tests.dist_utils import run_distributed
from tests.ds._workers import run_pretrain_ds, write_ds_config

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu",
         "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--seq-length", "32"]


def _common(data: dict, cfg: str) -> list[str]:
    return ["--deepspeed", "--deepspeed_config", cfg, "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-3", "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--data-path", data["prefix"], "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "100",
            "--eval-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]


def _both(rank: int, world_size: int, runs: list[list[str]]) -> list[dict]:
    return [run_pretrain_ds(rank, world_size, argv) for argv in runs]


def test_use_checkpoint_args_reads_the_deepspeed_client_state(gpt_data: dict, tmp_path: Path) -> None:
    cfg = write_ds_config(str(tmp_path / "ds.json"))
    ckpt = str(tmp_path / "ckpt")
    runs = [[*MODEL, *_common(gpt_data, cfg), "--save", ckpt, "--save-interval", "2"],
            [*_common(gpt_data, cfg), "--load", ckpt, "--use-checkpoint-args", "--skip-train"]]
    ((train, evaluate),) = run_distributed(_both, 1, args=(runs,))
    assert train["error"] is None, train["error"]
    assert evaluate["error"] is None, evaluate["error"]
    assert evaluate["result"]["val_loss"]["lm loss"] == train["result"]["val_loss"]["lm loss"]
