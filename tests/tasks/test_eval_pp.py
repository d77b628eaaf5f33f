"""Zero-shot evaluation under pipeline parallelism: PP=2 gives the PP=1 WIKITEXT103 / LAMBADA numbers.

The PP=2 checkpoints (mp_rank_00_000 / mp_rank_00_001) are cut from the same flat weights as the PP=1 one; rank 0
(the first stage) prints Megatron's result lines with the numbers the last stage computed.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.tasks import helpers as H
from tests.text_generation.test_generate_pp import stage_state_dict

WIKI_LINES, LAMBADA_LINES, STRIDE, MBS, ITERATION = 20, 24, 32, 8, 10


def save_pp_checkpoint(flat: dict, directory: Path, pp: int) -> Path:
    """Megatron's PP layout: iter_XXXXXXX/mp_rank_00_{pp:03d}/model_optim_rng.pt, one file per stage."""
    for rank in range(pp):
        path = directory / f"iter_{ITERATION:07d}" / f"mp_rank_00_{rank:03d}" / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        shard = stage_state_dict(flat, H.tiny_config(), pp, rank)
        torch.save({"model": shard, "iteration": ITERATION, "checkpoint_version": 3.0}, path)
    (directory / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    return directory


@pytest.fixture(scope="module")
def setup(shared_data, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("zeroshot_pp")
    flat = H.random_state_dict(seed=0)
    # always predicts ' the' (final LayerNorm weight 0, bias = embedding of ' the'): a non-trivial LAMBADA accuracy
    const = {k: v.clone() for k, v in flat.items()}
    the_id = json.loads((shared_data / "openwebtext-1000" / "gpt2-tiny-vocab.json").read_text())["\u0120the"]
    const["language_model.encoder.final_layernorm.weight"].zero_()
    const["language_model.encoder.final_layernorm.bias"].copy_(
        const["language_model.embedding.word_embeddings.weight"][the_id])
    return {"pp1": H.save_megatron_checkpoint(flat, d / "pp1"), "pp2": save_pp_checkpoint(flat, d / "pp2", 2),
            "const1": H.save_megatron_checkpoint(const, d / "const1"),
            "const2": save_pp_checkpoint(const, d / "const2", 2),
            "wiki": H.write_wikitext_slice(shared_data, d / "wiki.test.tokens", WIKI_LINES),
            "lambada": H.write_lambada_slice(shared_data, d / "lambada_test.jsonl", LAMBADA_LINES),
            "synthetic": H.write_jsonl(["She walked to the door and opened the", "He looked at the dog",
                                        "They sat down near the", "It was all about the"],
                                       d / "lambada_synthetic.jsonl")}


def _runs(setup: dict, shared_data: Path, suffix: str, pp: int) -> list[list[str]]:
    def argv(task: str, data: str, ckpt: str, extra: tuple = ()) -> list[str]:
        return (["--task", task, "--valid-data", str(setup[data]), "--micro-batch-size", str(MBS),
                 "--pipeline-model-parallel-size", str(pp)]
                + H.model_flags(shared_data, setup[ckpt + suffix]) + list(extra))

    return [argv("WIKITEXT103", "wiki", "pp", ("--overlapping-eval", str(STRIDE))),
            argv("LAMBADA", "lambada", "pp", ("--strict-lambada",)),
            argv("LAMBADA", "synthetic", "const")]


def _run_in_process(argv: list[str]) -> tuple[dict, str]:
    from megatron.initialize import destroy_megatron
    from tasks.main import main

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            return main(argv), out.getvalue()
    finally:
        destroy_megatron()


def _dist_body(rank: int, world_size: int, runs: list) -> list:
    return [_run_in_process(argv) for argv in runs]


def _result_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(" validation results on "))


def test_pp2_equals_pp1(setup, shared_data):
    """2 ranks (PP=2); 4 ranks (PP=2 x DP=2) pass too but are left out of CI for time (4 ranks on 2 cores)."""
    world_size = 2
    reference = [_run_in_process(argv) for argv in _runs(setup, shared_data, "1", 1)]
    assert reference[2][0]["number_correct"] == 3  # the ' the' predictor: 3 of 4
    per_rank = run_distributed(_dist_body, world_size=world_size, args=(_runs(setup, shared_data, "2", 2),))
    for rank, rank_results in enumerate(per_rank):
        for (res, stdout), (ref, ref_stdout) in zip(rank_results, reference):
            for key, value in ref.items():
                assert res[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rank, key)
            if rank == 0:  # Megatron's result line, printed by rank 0 (first stage) only
                assert _result_line(stdout) == _result_line(ref_stdout)
            else:
                assert "validation results" not in stdout
