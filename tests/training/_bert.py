"""The tiny BERT of the training tests: its data, its serial reference curve and in-process pretrain_bert runs.

Data: 60 OpenWebText documents split into sentences with a 1,000-entry lower-case WordPiece vocabulary trained on
them with the `tokenizers` library (a small vocabulary keeps the LM head cheap; padded to 1,024 at TP 1, 2 and 4). Model: 2 layers (4 for the pipeline
layouts' shared reference), hidden 64, 4 heads, seq 64, fp32, no dropout, erf GeLU, binary head; 12 steps of 8
samples (micro-batch 2), validation at 6 and 12. Every layout starts from the serial model's weights (pipeline
stages copy their slice; tests/pipeline/_workers.py), so the curves must equal the serial one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megatron.presets import get_preset
from tests.log_lines import iteration_values, validation_values

ITERS = 20
REL = 1e-5
NUM_DOCS = 60
_SERIAL: dict = {}


def make_bert_data(shared_data: Path, out_dir: Path) -> dict:
    """Train a WordPiece vocabulary on NUM_DOCS documents and preprocess them with --split-sentences."""
    from tokenizers import BertWordPieceTokenizer

    from megatron.data import preprocessing

    src = out_dir / "owt.jsonl"
    with open(shared_data / "openwebtext-1000" / "openwebtext-1000.jsonl", encoding="utf-8") as f:
        lines = [f.readline() for _ in range(NUM_DOCS)]
    src.write_text("".join(lines), encoding="utf-8")
    text = out_dir / "owt.txt"
    text.write_text("\n".join(json.loads(line)["text"] for line in lines), encoding="utf-8")
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train([str(text)], vocab_size=1000, min_frequency=1, show_progress=False)
    vocab = wordpiece.save_model(str(out_dir))[0]
    argv = ["--input", str(src), "--output-prefix", str(out_dir / "owt"), "--tokenizer-type",
            "BertWordPieceLowerCase", "--vocab-file", vocab, "--split-sentences"]
    assert preprocessing.main(preprocessing.run, argv) == 0
    return {"prefix": str(out_dir / "owt_text_sentence"), "vocab": vocab, "dir": out_dir}


def session_bert_data(shared_data: Path, tmp_path_factory: Any) -> dict:
    """make_bert_data once per pytest session (every BERT test module shares it)."""
    out = tmp_path_factory.getbasetemp() / "bert_data_shared"
    if not (out / "done").exists():
        out.mkdir(exist_ok=True)
        data = make_bert_data(shared_data, out)
        (out / "done").write_text("")
    else:
        data = {"prefix": str(out / "owt_text_sentence"), "vocab": str(out / "vocab.txt"), "dir": out}
    return data


def bert_argv(data: dict, *extra: str, iters: int = ITERS, layers: int = 2) -> list[str]:
    return [
        *get_preset("bert_test").argv(), *(["--num-layers", str(layers)] if layers != 2 else []),
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "2e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--no-bias-gelu-fusion", "--vocab-file", data["vocab"], "--data-path", data["prefix"],
        "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "6", "--eval-iters", "2",
        "--num-workers", "0", "--seed", "1234", *extra,
    ]


def parse_curve(text: str) -> dict:
    """{'train': {it: (lm, sop)}, 'grad_norm': {it: norm}, 'val': [(prefix, lm, sop)]} from the printed log."""
    lm, sop, norm = (iteration_values(text, key) for key in ("lm loss", "sop loss", "grad norm"))
    both = [it for it in lm if it in sop and it in norm]
    val = [(where, a, b) for (where, a), (_, b) in zip(validation_values(text, "lm loss value"),
                                                        validation_values(text, "sop loss value"))]
    return {"train": {it: (lm[it], sop[it]) for it in both}, "grad_norm": {it: norm[it] for it in both}, "val": val}


def _serial_bert(args: Any, state: Any) -> torch.nn.Module:
    """The full, unsplit BertModel from the run's seed (this rank's TP layout), leaving every RNG untouched."""
    from megatron.arguments import core_transformer_config_from_args
    from megatron.core.tensor_parallel import get_rng_tracker
    from megatron.core.tensor_parallel.random import model_parallel_manual_seed
    from megatron.models.bert.model import BertModel

    config = dataclasses.replace(core_transformer_config_from_args(args), pipeline_model_parallel_size=1)
    tracker_states = get_rng_tracker().get_states()
    with torch.random.fork_rng(devices=[]):
        model_parallel_manual_seed(args.seed, state.tp_rank)
        torch.manual_seed(args.seed)
        binary = bool(args.bert_binary_head)
        full = BertModel(config, tp_group=state.tp_group, num_tokentypes=2 if binary else 0, add_binary_head=binary)
    get_rng_tracker().set_states(tracker_states)
    return full


def _serial_init(provider: Callable) -> Callable:
    def model_provider(pre_process: bool = True, post_process: bool = True) -> Any:
        from megatron import global_vars
        from megatron.core import parallel_state as ps
        from tests.pipeline._workers import _copy_stage_weights

        state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
        stage = provider(pre_process=pre_process, post_process=post_process)
        _copy_stage_weights(_serial_bert(global_vars.get_args(), state), stage)
        return stage

    return model_provider


def run_bert(rank: int, world_size: int, argv: list[str], resume_from: Optional[tuple[str, int]] = None) -> dict:
    """pretrain_bert.py's pretrain() in this process (tests/harness.py; serial-init weights), stdout captured;
    errors come back as text.

    `resume_from` = (save dir, iteration): point its tracker file at that iteration first (a run that stopped there).
    """
    from megatron.errors import MegatronUserError
    from tests.ds._workers import _reset_megatron, ds_env
    from tests.harness import entry_providers, pretrain_run

    ds_env(rank, world_size)
    if resume_from is not None:
        if rank == 0:
            Path(resume_from[0], "latest_checkpointed_iteration.txt").write_text(str(resume_from[1]))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    provider = _serial_init(entry_providers("pretrain_bert").model_provider)
    buf, error, result = io.StringIO(), None, None
    with contextlib.redirect_stdout(buf):
        try:
            result = pretrain_run(argv, "pretrain_bert", model_provider=provider)
        except (MegatronUserError, RuntimeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            _reset_megatron()
    return {"stdout": buf.getvalue(), "result": result, "error": error}


def run_many(rank: int, world_size: int, runs: list[tuple[list[str], Optional[tuple[str, int]]]]) -> list[dict]:
    """Several pretrain_bert runs one after another in one process group."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return [run_bert(rank, world_size, argv, resume) for argv, resume in runs]


def curve_of(result: dict, what: str) -> dict:
    assert result["error"] is None, f"{what}: {result['error']}"
    return parse_curve(result["stdout"])


def serial_curve(data: dict, layers: int = 2) -> dict:
    """The serial run's curve (once per session and depth)."""
    key = (data["prefix"], layers)
    if key not in _SERIAL:
        from tests.dist_utils import run_distributed

        ((res,),) = run_distributed(run_many, 1, args=([(bert_argv(data, layers=layers), None)],))
        curve = curve_of(res, "serial")
        assert sorted(curve["train"]) == list(range(1, ITERS + 1)) and len(curve["val"]) >= 2, res["stdout"][-3000:]
        lm = [curve["train"][it][0] for it in range(1, ITERS + 1)]
        assert sum(lm[-3:]) / 3 < sum(lm[:3]) / 3 - 0.15, f"the tiny BERT's lm loss should go down: {lm}"
        _SERIAL[key] = curve
    return _SERIAL[key]


def assert_matches(curve: dict, ref: dict, what: str, iters: Any = None) -> None:
    """lm and sop losses (validation and grad norms on full runs) equal the serial run's within REL."""
    iters = list(iters or range(1, ITERS + 1))
    assert sorted(curve["train"]) == iters, f"{what}: iterations {sorted(curve['train'])}"
    for it in iters:
        for a, b, name in zip(curve["train"][it], ref["train"][it], ("lm", "sop")):
            assert math.isclose(a, b, rel_tol=REL), f"{what}: iteration {it} {name} loss: {a} vs serial {b}"
    if len(iters) == ITERS:
        assert [v[0] for v in curve["val"]] == [v[0] for v in ref["val"]], f"{what}: validation points differ"
        for a, b in zip(curve["val"], ref["val"]):
            assert all(math.isclose(x, y, rel_tol=REL) for x, y in zip(a[1:], b[1:])), f"{what}: {a} vs {b}"
        for it in iters:
            a, b = curve["grad_norm"][it], ref["grad_norm"][it]
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-3), f"{what}: grad norm at {it}: {a} vs {b}"
