"""The DeepSeek-V3 family as a whole trains the serial 20-step curve (training and validation losses within 1e-5
relative, grad norms) under TP=2 + SP, PP=2 (the MTP block on the last stage), EP=2 and DP=2 with the distributed
optimizer: multi-latent attention with q-lora and YaRN, a first dense layer, 8 experts in 4 groups with the sigmoid
router, its expert bias (updated after every step from the global token counts) and weight scaling, a shared expert,
one MTP layer. One 2-process job runs the four layouts one after another (the serial reference: one process)."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.training._llama import assert_matches, curve_of, run_many
from tests.training._workers import tiny_gpt_argv

ITERS = 20
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


@pytest.mark.slow
def test_two_process_layouts_match_serial(gpt_data: dict) -> None:
    ((res,),) = run_distributed(run_many, 1, args=([("stage", deepseek_argv(gpt_data))],))
    serial = curve_of(res, "serial")
    assert sorted(serial["train"]) == list(range(1, ITERS + 1))
    assert serial["train"][ITERS] < serial["train"][1] - 0.1, f"the tiny DeepSeek should learn: {serial['train']}"
    runs = {
        "tp2-sp": deepseek_argv(gpt_data, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "pp2": deepseek_argv(gpt_data, "--pipeline-model-parallel-size", "2"),
        "ep2": deepseek_argv(gpt_data, "--expert-model-parallel-size", "2"),
        "dp2-distopt": deepseek_argv(gpt_data, "--use-distributed-optimizer"),
    }
    results = run_distributed(run_many, 2, args=([("stage", argv) for argv in runs.values()],))
    for i, name in enumerate(runs):
        assert_matches(curve_of(results[-1][i], name), serial, name)
