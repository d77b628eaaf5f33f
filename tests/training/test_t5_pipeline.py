"""pretrain_t5.py with pipeline parallelism under Megatron 23.06's --pipeline-model-parallel-split-rank R (stages
0..R-1 run the encoder, R..P-1 the decoder; decoder stages pass [decoder hidden states, encoder output] on and the
encoder-output gradient flows back across the split): PP=2 with R=1, PP=4 with R=2 and TP=2 (+SP) x PP=2 with R=1
train the serial curve (train and validation lm loss 1e-5 relative, grad norms 2e-3) of a tiny T5 (2 encoder + 2
decoder layers, hidden 64, enc 64 / dec 32 tokens, fp32, no dropout); saving PP=2 at iteration 4 and resuming
reproduces iterations 5..8 exactly; a missing or out-of-range split rank, layer counts that do not divide over their
stages and interleaved stages are refused with one line.

Megatron seeds every pipeline stage differently, so each run (the serial one too) starts from the full serial model's
weights: every rank builds it from the run's seed and copies its stage's slice (as tests/pipeline/_workers.py does for
GPT), including stage R's embedding copies and the last stage's copy of the word embeddings.
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.training._bert import session_bert_data
from tests.training.test_t5_training import parse_curve, run_t5, t5_argv

ITERS = 20
REL = 1e-5


def _serial_t5(args: Any, state: Any) -> torch.nn.Module:
    """The full, unsplit T5Model from the run's seed (this rank's TP layout), leaving every RNG untouched."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.core.tensor_parallel import get_rng_tracker
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.models.t5.model import T5Model

    config = dataclasses.replace(core_transformer_config_from_args(args), pipeline_model_parallel_size=1)
    tracker_states = get_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[]):
        model_parallel_manual_seed(args.seed, state.tp_rank)
        torch.manual_seed(args.seed)
        full = T5Model(config, tp_group=state.tp_group, parallel_output=True)
    get_rng_tracker().set_states(tracker_states)
    return full


def _copy_t5_stage(full: torch.nn.Module, stage: torch.nn.Module) -> None:
    """Copy the full model's parameters into a pipeline stage (encoder / decoder layers by their layer number)."""
    params = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if name == "word_embeddings.weight":  # the last stage's copy of the tied word embeddings
                src = params["language_model.embedding.word_embeddings.weight"]
            elif ".layers." in name:
                head, rest = name.split(".layers.", 1)
                local, tail = rest.split(".", 1)
                number = stage.get_submodule(head).layers[int(local)].layer_number
                src = params[f"{head}.layers.{number - 1}.{tail}"]
            else:
                src = params[name]
            param.copy_(src)


def _serial_init(provider: Callable) -> Callable:
    def model_provider(pre_process: bool = True, post_process: bool = True) -> Any:
        from megatron import global_vars
        from megatron.core import parallel_state as ps

        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        stage = provider(pre_process=pre_process, post_process=post_process)
        _copy_t5_stage(_serial_t5(global_vars.get_args(), state), stage)
        return stage

    return model_provider


def run_many(rank: int, world_size: int, runs: list) -> list[dict]:
    """pretrain_t5 runs one after another, every model starting from the serial weights."""
    from tests.harness import entry_providers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    provider = _serial_init(entry_providers("pretrain_t5").model_provider)
    return [run_t5(rank, world_size, argv, resume, model_provider=provider) for argv, resume in runs]


def argv(data: dict, *extra: str, iters: int = ITERS) -> list[str]:
    out = t5_argv(data, "--decoder-num-layers", "2", *extra, iters=iters)
    out[out.index("--eval-interval") + 1] = str(ITERS // 2)
    return out


def curve(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    return parse_curve(result["stdout"])


def assert_matches(got: dict, ref: dict, what: str) -> None:
    assert sorted(got["train"]) == list(range(1, ITERS + 1)), f"{what}: iterations {sorted(got['train'])}"
    for it, loss in ref["train"].items():
        assert math.isclose(got["train"][it], loss, rel_tol=REL), (what, it, got["train"][it], loss)
        assert math.isclose(got["grad_norm"][it], ref["grad_norm"][it], rel_tol=2e-3, abs_tol=2e-3), (what, it)
    assert [v[0] for v in got["val"]] == [v[0] for v in ref["val"]], f"{what}: validation points differ"
    for a, b in zip(got["val"], ref["val"]):
        assert math.isclose(a[1], b[1], rel_tol=REL), (what, a, b)


@pytest.fixture(scope="module")
def t5_data(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return session_bert_data(shared_data, tmp_path_factory)


@pytest.fixture(scope="module")
def serial(t5_data: dict) -> dict:
    ((res,),) = run_distributed(run_many, 1, args=([(argv(t5_data), None)],))
    ref = curve(res, "serial")
    assert sorted(ref["train"]) == list(range(1, ITERS + 1)), res["stdout"][-3000:]
    assert len(ref["val"]) == 3
    return ref


def test_pp2_split1_matches_serial_resumes_exactly_and_bad_splits_are_refused(serial: dict, t5_data: dict,
                                                                                tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    pp2 = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1"]
    refusals = {
        "needs --pipeline-model-parallel-split-rank": ["--pipeline-model-parallel-size", "2"],
        "--pipeline-model-parallel-split-rank (2)": ["--pipeline-model-parallel-size", "2",
                                                     "--pipeline-model-parallel-split-rank", "2"],
    }
    runs = [(argv(t5_data, *pp2, "--save", str(save), "--save-interval", str(ITERS // 2)), None),
            (argv(t5_data, *pp2, "--load", str(save)), (str(save), ITERS // 2))]
    runs += [(argv(t5_data, *extra, iters=3), None) for extra in refusals.values()]
    results = run_distributed(run_many, 2, args=(runs,))
    full, again = curve(results[1][0], "pp2"), curve(results[1][1], "pp2 resumed")
    assert_matches(full, serial, "PP=2, split rank 1")
    assert curve(results[0][0], "pp2 encoder stage")["train"] == {}  # only the last stage prints losses
    assert sorted(again["train"]) == list(range(ITERS // 2 + 1, ITERS + 1))
    for it in again["train"]:  # identical to the last printed digit
        assert again["train"][it] == full["train"][it], (it, full["train"][it], again["train"][it])
        assert again["grad_norm"][it] == full["grad_norm"][it]
    assert again["val"] == full["val"][1:]
    for res, named in zip(results[0][2:], refusals):
        assert res["error"] is not None and named in res["error"] and "\n" not in res["error"], (named, res["error"])


def test_pp4_split2_and_tp2_pp2_split1_match_serial(serial: dict, t5_data: dict) -> None:
    runs = [(argv(t5_data, "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2"), None),
            (argv(t5_data, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-split-rank", "1"), None),
            (argv(t5_data, "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2",
                  "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1", iters=3), None),
            (argv(t5_data, "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2",
                  "--num-layers", "3", iters=3), None)]
    results = run_distributed(run_many, 4, args=(runs,))
    assert_matches(curve(results[-1][0], "pp4"), serial, "PP=4, split rank 2")
    assert_matches(curve(results[-1][1], "tp2-sp-pp2"), serial, "TP=2 (+SP) x PP=2, split rank 1")
    for res, named in zip(results[0][2:], ("interleaved pipeline stages are not supported for T5",
                                           "--encoder-num-layers (3) must be divisible by its 2 pipeline stages")):
        assert res["error"] is not None and named in res["error"] and "\n" not in res["error"], (named, res["error"])
