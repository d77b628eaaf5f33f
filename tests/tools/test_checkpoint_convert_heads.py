"""Checkpoint conversion of finetuned BERT heads (tasks/: Classification, MultipleChoice): Megatron reshape with
tools/checkpoint/convert.py (TP/PP, vocabulary re-padding) and tools/merge_mp_partitions.py; the merged weights are
bitwise the source's and the scores equal (1e-5)."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint_conversion.driver import convert, parse_args
from megatron.checkpoint_conversion.interchange import ModelMeta, architecture_of, messages_from_state_dict
from megatron.checkpoint_conversion.megatron_format import write_megatron
from megatron.core.tensor_parallel import model_parallel_manual_seed
from tests.tools.checkpoint_convert_helpers import DIVISIBLE, TRUE_VOCAB, config, load_files

HEADS = {"classification": "classification_head", "multichoice": "multichoice_head"}


def _task_model(kind: str, cfg, state=None):
    from megatron.model.classification import Classification
    from megatron.model.multiple_choice import MultipleChoice

    model_parallel_manual_seed(5)
    model = (Classification(cfg, num_classes=3) if kind == "classification" else MultipleChoice(cfg)).eval()
    if state is None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    else:
        model.load_state_dict(state, strict=True)
    return model


def _scores(model, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (2, 7) if kind == "classification" else (2, 3, 7)
    tokens = torch.randint(0, TRUE_VOCAB, shape, generator=g)
    pad = torch.ones(shape, dtype=torch.long)
    pad[..., 5:] = 0
    types = (torch.arange(7) >= 3).long().expand(shape).contiguous()
    with torch.no_grad():
        return model(tokens, pad, types)


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "BERT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


@pytest.mark.parametrize("kind", ["classification", "multichoice"])
def test_task_head_megatron_reshape(tmp_path, kind):
    """TP2xPP2 -> TP1 is bitwise (head, pooler, token types, padding rows); TP1 -> TP4 with --true-vocab-size and
    back to TP1 gives the same scores; merge_mp_partitions --model-type MNLI/RACE reads the TP4 checkpoint."""
    import importlib.util
    from pathlib import Path

    cfg = config("gpt2")
    model = _task_model(kind, cfg)
    ref, ref_scores = model.state_dict(), _scores(model, kind)
    meta = ModelMeta("BERT", architecture_of(cfg), iteration=3, make_vocab_size_divisible_by=DIVISIBLE,
                     extra={"bert": {"num_tokentypes": 2, "add_binary_head": False}})
    write_megatron(meta, messages_from_state_dict(ref, cfg.num_layers), str(tmp_path / "src"), 2, 2)
    _convert(tmp_path / "src", tmp_path / "tp1", "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    sd = load_files(str(tmp_path / "tp1"))[(0, 0)]
    head = HEADS[kind]
    assert sorted(sd["model"]) == sorted(model.state_dict_for_save_checkpoint())
    assert sd["model"][head]["weight"].shape == ((3 if kind == "classification" else 1), cfg.hidden_size)
    merged = _task_model(kind, cfg, sd["model"]).state_dict()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)

    _convert(tmp_path / "tp1", tmp_path / "tp4", "--target-tensor-parallel-size", "4", "--true-vocab-size",
             str(TRUE_VOCAB))
    files = load_files(str(tmp_path / "tp4"))
    assert all(torch.equal(files[(t, 0)]["model"][head]["weight"], ref[f"{head}.weight"]) for t in range(4))
    word = torch.cat([files[(t, 0)]["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
                      for t in range(4)])
    assert torch.equal(word[TRUE_VOCAB:], word[TRUE_VOCAB - 1].expand(64 - TRUE_VOCAB, -1))

    spec = importlib.util.spec_from_file_location("merge_mp", Path(__file__).resolve().parents[2] / "tools" /
                                                  "merge_mp_partitions.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    task = "MNLI" if kind == "classification" else "RACE"
    merge.main(["--model-type", task, "--tensor-model-parallel-size", "4", "--load", str(tmp_path / "tp4"),
                "--save", str(tmp_path / "merged"), "--num-layers", str(cfg.num_layers)])
    back = _task_model(kind, cfg, load_files(str(tmp_path / "merged"))[(0, 0)]["model"])
    torch.testing.assert_close(_scores(back, kind), ref_scores, rtol=1e-5, atol=1e-5)
    merged_ref = back.state_dict()
    assert all(torch.equal(merged_ref[k], ref[k]) for k in ref if "word_embeddings" not in k)
