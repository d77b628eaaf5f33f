"""The DeepSeek-V3 family as a whole trains the serial 20-step curve (training and validation losses within 1e-5
relative, grad norms) under TP=2 + SP, PP=2 (the MTP block on the last stage), EP=2 and DP=2 with the distributed
optimizer: multi-latent attention with q-lora and YaRN, a first dense layer, 8 experts in 4 groups with the sigmoid
router, its expert bias (updated after every step from the global token counts) and weight scaling, a shared expert,
one MTP layer. One 2-process job runs the four layouts one after another (the serial reference: one process).
Exact resume: the DP=2 distributed-optimizer run saved at iteration 10 and resumed there gives iterations 11-20 equal
to its uninterrupted run's (printed losses, and every tensor of the iteration-20 checkpoints bit for bit); the expert
bias saved by both EP ranks is the same tensor, and the serial run's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.log_lines import iteration_values
from tests.training._llama import assert_matches, curve_of, run_many
from tests.training._workers import checkpoint_at, tiny_gpt_argv

ITERS, HALF = 20, 10
BIAS = [f"layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)]  # the first layer is dense
DEEPSEEK = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--micro-batch-size", "2", "--eval-interval", "10", "--lr", "3e-3", "--min-lr", "3e-4",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "24", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
            "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
            "--yarn-original-max-position-embeddings", "16",
            "--num-experts", "8", "--moe-layer-freq", "([0]+[1]*3)", "--moe-ffn-hidden-size", "32",
            "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "1",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "1e-3",
            "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]


def deepseek_argv(data: dict, *extra: str) -> list[str]:
    return tiny_gpt_argv(data, *DEEPSEEK, *extra, iters=ITERS)


def _checkpoint(ckpt: Path, folder: str = "mp_rank_00") -> dict:
    """The iteration-20 legacy checkpoint file of `folder` (its model: language_model's encoder, MTP block...)."""
    return torch.load(ckpt / f"iter_{ITERS:07d}" / folder / "model_optim_rng.pt", weights_only=False)


def _biases(ckpt: Path, folder: str = "mp_rank_00") -> list:
    encoder = _checkpoint(ckpt, folder)["model"]["language_model"]["encoder"]
    return [encoder[key] for key in BIAS]


def _flat(tree, prefix: str = "") -> dict:
    """Every leaf (tensor, number, string) of a nested checkpoint dict / list by its dotted path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}.{i}").items()}
    return {prefix: tree}


def _same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.slow
def test_two_process_layouts_match_serial_and_resume(gpt_data: dict, tmp_path: Path) -> None:
    save = ("--save-interval", str(HALF), "--save")
    ((res,),) = run_distributed(run_many, 1, args=([("stage", deepseek_argv(gpt_data, *save, str(tmp_path / "serial")))],))
    serial = curve_of(res, "serial")
    assert sorted(serial["train"]) == list(range(1, ITERS + 1))
    assert serial["train"][ITERS] < serial["train"][1] - 0.1, f"the tiny DeepSeek should learn: {serial['train']}"
    runs = {
        "tp2-sp": deepseek_argv(gpt_data, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "pp2": deepseek_argv(gpt_data, "--pipeline-model-parallel-size", "2"),
        "ep2": deepseek_argv(gpt_data, "--expert-model-parallel-size", "2", *save, str(tmp_path / "ep2")),
        "dp2-distopt": deepseek_argv(gpt_data, "--use-distributed-optimizer", *save, str(tmp_path / "dp2")),
    }
    at_half = checkpoint_at(tmp_path / "dp2", HALF, tmp_path)  # the link is followed once the run above saved
    runs["resumed"] = deepseek_argv(gpt_data, "--use-distributed-optimizer", "--load", str(at_half), *save,
                                    str(at_half))
    results = run_distributed(run_many, 2, args=([("stage", argv) for argv in runs.values()],))
    for i, name in enumerate(list(runs)[:-1]):
        assert_matches(curve_of(results[-1][i], name), serial, name)
    # exact resume: the printed values of 11-20 and the iteration-20 checkpoint (model, distributed optimizer
    # state, expert biases, MTP block) bit for bit
    whole, resumed = (results[-1][i]["stdout"] for i in (3, 4))
    for key in ("lm loss", "mtp_1 loss"):
        again = iteration_values(resumed, key, as_text=True)
        assert sorted(again) == list(range(HALF + 1, ITERS + 1)), (key, sorted(again))
        assert again == {it: v for it, v in iteration_values(whole, key, as_text=True).items() if it > HALF}, key
    for name, part in (("model_optim_rng.pt", "model"), ("distrib_optim.pt", None)):  # the latter: step, moments
        want, got = (torch.load(root / f"iter_{ITERS:07d}" / "mp_rank_00" / name, weights_only=False)
                     for root in (tmp_path / "dp2", at_half))
        want, got = (_flat(d[part] if part else d) for d in (want, got))
        assert len(want) > 50 and sorted(want) == sorted(got), name
        assert all(_same(t, got[k]) for k, t in want.items()), [k for k, t in want.items() if not _same(t, got[k])]
    # the expert bias moved, and is the same tensor on both EP ranks and in the serial run
    serial_bias = _biases(tmp_path / "serial")
    assert all(b.abs().max() > 0 for b in serial_bias)
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        assert all(torch.equal(a, b) for a, b in zip(_biases(tmp_path / "ep2", folder), serial_bias)), folder
