"""--use-checkpoint-args end to end: a Llama-style GPT trained by pretrain_gpt.py is evaluated from its checkpoint
with no model flags at all, and gives the training run's validation loss exactly; a model flag that contradicts the
checkpoint stops the run with one line."""
from __future__ import annotations

from pathlib import Path

from tests.dist_utils import run_distributed
from tests.training._workers import run_pretrain

LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96", "--normalization", "RMSNorm",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "32"]


def _common(data: dict) -> list[str]:
    return ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
            "--vocab-file", data["vocab"], "--merge-file", data["merges"], "--data-path", data["prefix"],
            "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--seed", "7"]


def test_use_checkpoint_args_rebuilds_the_trained_model(gpt_data: dict, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    (train,) = run_distributed(run_pretrain, 1, args=([*LLAMA, *_common(gpt_data), "--lr", "1e-3",
                                                       "--save", ckpt, "--save-interval", "2"],))
    assert train["error"] is None, train["error"]
    (evaluate,) = run_distributed(run_pretrain, 1, args=([*_common(gpt_data), "--load", ckpt, "--use-checkpoint-args",
                                                          "--skip-train", "--lr", "1e-3"],))
    assert evaluate["error"] is None, evaluate["error"]
    assert evaluate["result"]["iteration"] == 2
    assert evaluate["result"]["val_loss"]["lm loss"] == train["result"]["val_loss"]["lm loss"]

    (wrong,) = run_distributed(run_pretrain, 1, args=([*LLAMA[:-2], "--seq-length", "32", "--num-query-groups", "4",
                                                       *_common(gpt_data), "--load", ckpt, "--skip-train", "--lr", "1e-3"],))
    assert wrong["error"] is not None and "\n" not in wrong["error"]
    assert "has num_query_groups=2 but this run's flags give num_query_groups=4" in wrong["error"], wrong["error"]
