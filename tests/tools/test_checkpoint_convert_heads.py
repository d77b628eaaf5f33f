"""Checkpoint conversion of finetuned BERT heads (tasks/: Classification, MultipleChoice): Megatron reshape with
tools/checkpoint/convert.py (TP/PP, vocabulary re-padding) and tools/merge_mp_partitions.py; the merged weights are
bitwise the source's and the scores equal (1e-5)."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import (
    ConversionError,
    Message,
    ModelMeta,
    architecture_of,
    messages_from_state_dict,
)
from megatron.checkpoint.conversion.megatron_format import write_megatron
from megatron.core.tensor_parallel import model_parallel_manual_seed
from tests.tools.checkpoint_convert_helpers import DIVISIBLE, TRUE_VOCAB, config, load_files

HEADS = {"classification": "classification_head", "multichoice": "multichoice_head"}


def _task_model(kind: str, cfg, state=None):
    from megatron.models.bert.classification import Classification
    from megatron.models.bert.multiple_choice import MultipleChoice

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
    wrong = "RACE" if kind == "classification" else "QQP"
    with pytest.raises(ConversionError, match="has no"):
        merge.main(["--model-type", wrong, "--tensor-model-parallel-size", "4", "--load", str(tmp_path / "tp4"),
                    "--save", str(tmp_path / "wrong")])
    back = _task_model(kind, cfg, load_files(str(tmp_path / "merged"))[(0, 0)]["model"])
    torch.testing.assert_close(_scores(back, kind), ref_scores, rtol=1e-5, atol=1e-5)
    merged_ref = back.state_dict()
    assert all(torch.equal(merged_ref[k], ref[k]) for k in ref if "word_embeddings" not in k)


# ------------------------------------------------------------------------------------------------------- T5
def _t5_config(padded: int = 64, **kw):
    from megatron.core.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, encoder_num_layers=2, decoder_num_layers=3, hidden_size=32,
                             num_attention_heads=4, ffn_hidden_size=48, max_position_embeddings=16,
                             padded_vocab_size=padded, hidden_dropout=0.0, attention_dropout=0.0,
                             bias_gelu_fusion=False, **kw)


def _t5(cfg, state=None, pp_state=None, seed: int = 7):
    from megatron.models.t5.model import T5Model

    model_parallel_manual_seed(seed, getattr(pp_state, "tp_rank", 0))
    model = T5Model(cfg, pp_state=pp_state, parallel_output=False).eval()
    if state is None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    else:
        model.load_state_dict(state, strict=True)
    return model


def _t5_inputs():
    g = torch.Generator().manual_seed(4)
    enc, dec = torch.randint(0, TRUE_VOCAB, (2, 10), generator=g), torch.randint(0, TRUE_VOCAB, (2, 6), generator=g)
    ev, dv = torch.ones(2, 10, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    ev[1, 7:] = 0
    dv[1, 4:] = 0
    return enc, dec, ev[:, :, None] * ev[:, None, :], torch.tril(dv[:, :, None] * dv[:, None, :]), \
        dv[:, :, None] * ev[:, None, :]


def _t5_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(*_t5_inputs())[..., :TRUE_VOCAB]


def _t5_tp2_worker(rank: int, world_size: int, folder: str, rows: int) -> list:
    import argparse
    import dataclasses

    from megatron.compat import load_checkpoint
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        cfg = dataclasses.replace(_t5_config(padded=rows), tensor_model_parallel_size=2)
        model = _t5(cfg, pp_state=state, seed=99)
        args = argparse.Namespace(load=folder, finetune=True, tensor_model_parallel_size=2,
                                  pipeline_model_parallel_size=1)
        assert load_checkpoint([model], None, None, args) == 0
        return _t5_logits(model).tolist()
    finally:
        destroy_model_parallel()


@pytest.mark.slow  # TP=2 processes
def test_t5_tensor_parallel_reshape(tmp_path):
    """T5 (unequal encoder/decoder depths): TP1 -> TP2 -> TP1 is bitwise with the padding rows kept; TP2 with
    --true-vocab-size re-pads the word embeddings and lm_head.bias, and a real TP=2 run (2 gloo processes,
    megatron.compat.load_checkpoint) gives the source's logits (1e-5); bad pipeline targets are one line."""
    from megatron.checkpoint.conversion.t5_format import T5Writer, read_t5
    from tests.dist_utils import run_distributed

    cfg = _t5_config()
    model = _t5(cfg)
    ref = model.state_dict()
    src = tmp_path / "src"
    meta = ModelMeta("T5", architecture_of(cfg), iteration=5, make_vocab_size_divisible_by=DIVISIBLE,
                     extra={"t5": {"encoder_num_layers": 2, "decoder_num_layers": 3}})
    flat = {k: v for k, v in ref.items() if not k.endswith("_extra_state")}

    T5Writer(meta, str(src), 1, 1, None).write(read_t5_stream(flat))
    sd = load_files(str(src))[(0, 0)]
    assert sorted(sd["model"]) == sorted(model.state_dict_for_save_checkpoint())
    assert sd["architecture"]["decoder_num_layers"] == 3
    t5 = ["--model-type", "T5"]
    flags = _convert(src, tmp_path / "tp2", *t5, "--target-tensor-parallel-size", "2")["flags"]
    assert "--encoder-num-layers 2 --decoder-num-layers 3 --tensor-model-parallel-size 2" in flags
    _convert(tmp_path / "tp2", tmp_path / "back", *t5, "--target-tensor-parallel-size", "1")
    back = _t5(cfg, load_files(str(tmp_path / "back"))[(0, 0)]["model"]).state_dict()
    assert all(torch.equal(back[k], ref[k]) for k in ref)
    meta2, messages = read_t5(str(tmp_path / "tp2"))
    assert meta2.extra["t5"] == {"encoder_num_layers": 2, "decoder_num_layers": 3}
    assert [m.name for m in messages][-3:] == ["decoder layer 2", "decoder final norm", "lm head"]

    _convert(src, tmp_path / "tp2v", *t5, "--target-tensor-parallel-size", "2", "--true-vocab-size",
             str(TRUE_VOCAB))
    files = load_files(str(tmp_path / "tp2v"))
    bias = torch.cat([files[(t, 0)]["model"]["lm_head"]["bias"] for t in range(2)])
    assert bias.numel() == 64 and torch.equal(bias[TRUE_VOCAB:], bias[TRUE_VOCAB - 1].expand(64 - TRUE_VOCAB))
    results = run_distributed(_t5_tp2_worker, 2, args=(str(tmp_path / "tp2v"), 64))
    for out in results:
        torch.testing.assert_close(torch.tensor(out), _t5_logits(model), rtol=1e-5, atol=1e-5)

    for bad, match in ((["--target-pipeline-parallel-size", "2"], "--target-pipeline-model-parallel-split-rank"),
                       (["--target-pipeline-parallel-size", "2", "--target-pipeline-model-parallel-split-rank", "2"],
                        "in 1..1"),
                       (["--target-pipeline-parallel-size", "3", "--target-pipeline-model-parallel-split-rank", "1"],
                        "3 layers do not split evenly over 2"),
                       (["--model-type", "GPT"], "pass --model-type T5")):
        with pytest.raises(ConversionError, match=match):
            _convert(src, tmp_path / "x", *t5, *bad)
        assert not (tmp_path / "x").exists()


def test_t5_pipeline_reshape(tmp_path):
    """T5 under --pipeline-model-parallel-split-rank: TP1 -> TP2xPP2 (R=1) -> TP1 and TP1 -> PP4 (R=1) -> TP1 are
    bitwise; each PP4 rank file loads strictly into the real stage model (encoder stage with its final norm, decoder
    stages, stage R's embedding copy, the last stage's head copy and lm_head); PP4 -> PP4 keeps the split rank."""
    import dataclasses

    from megatron.core.parallel_state import ParallelState

    cfg = _t5_config()
    model = _t5(cfg)
    ref = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    meta = ModelMeta("T5", architecture_of(cfg), iteration=5, make_vocab_size_divisible_by=DIVISIBLE,
                     extra={"t5": {"encoder_num_layers": 2, "decoder_num_layers": 3}})
    from megatron.checkpoint.conversion.t5_format import T5Writer, read_t5

    T5Writer(meta, str(tmp_path / "src"), 1, 1, None).write(read_t5_stream(ref))
    t5 = ["--model-type", "T5"]
    for name, layout in (("tp2pp2", ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                                     "--target-pipeline-model-parallel-split-rank", "1"]),
                         ("pp4", ["--target-pipeline-parallel-size", "4",
                                  "--target-pipeline-model-parallel-split-rank", "1"])):
        _convert(tmp_path / "src", tmp_path / name, *t5, *layout)
        _convert(tmp_path / name, tmp_path / f"{name}_back", *t5, "--target-tensor-parallel-size", "1",
                 "--target-pipeline-parallel-size", "1")
        back = _t5(cfg, load_files(str(tmp_path / f"{name}_back"))[(0, 0)]["model"]).state_dict()
        assert all(torch.equal(back[k], ref[k]) for k in ref), name
    files = load_files(str(tmp_path / "pp4"))
    assert sorted(files) == [(0, p) for p in range(4)]
    assert all(f["args"].pipeline_model_parallel_split_rank == 1 for f in files.values())
    stage_cfg = dataclasses.replace(cfg, pipeline_model_parallel_size=4)
    from megatron.models.t5.model import T5Model

    for p in range(4):
        st = ParallelState(pp_size=4, pp_rank=p, pipeline_split_rank=1, pp_ranks=list(range(4)))
        stage = T5Model(stage_cfg, pp_state=st)
        stage.load_state_dict(files[(0, p)]["model"], strict=True)
    assert torch.equal(files[(0, 1)]["model"]["language_model"]["embedding"]["word_embeddings"]["weight"],
                       ref["language_model.embedding.word_embeddings.weight"])
    assert torch.equal(files[(0, 3)]["model"]["word_embeddings_for_head"]["weight"],
                       ref["language_model.embedding.word_embeddings.weight"])
    _convert(tmp_path / "pp4", tmp_path / "pp4b", *t5)  # same layout: the source's split rank
    assert load_files(str(tmp_path / "pp4b"))[(0, 2)]["args"].pipeline_model_parallel_split_rank == 1
    meta2, _ = read_t5(str(tmp_path / "pp4"))
    assert meta2.extra["t5"] == {"encoder_num_layers": 2, "decoder_num_layers": 3}


def read_t5_stream(flat):
    """The T5 message stream of a flat TP=1 T5Model state dict."""
    emb = {k[len("language_model.embedding."):]: v for k, v in flat.items() if ".embedding." in k}
    yield Message("embeddings", emb)
    for part, n in (("encoder", 2), ("decoder", 3)):
        for i in range(n):
            p = f"language_model.{part}.layers.{i}."
            yield Message(f"{part} layer {i}", {k[len(p):]: v for k, v in flat.items() if k.startswith(p)})
        p = f"language_model.{part}."
        yield Message(f"{part} final norm", {k[len(p):]: v for k, v in flat.items()
                                             if k.startswith(p + "final_layernorm.")})
    yield Message("lm head", {"bias": flat["lm_head.bias"]})


@pytest.mark.parametrize("kind", ["classification", "multichoice"])
def test_task_head_hugging_face_round_trip(tmp_path, kind):
    """Megatron TP2 -> HF MegatronBertFor{SequenceClassification,MultipleChoice}: the HF scores equal ours (1e-5);
    HF -> Megatron TP1 is bitwise the source model."""
    import transformers

    cfg = config("gpt2", bias_gelu_fusion=False)  # erf GeLU: HF MegatronBert's "gelu"
    model = _task_model(kind, cfg)
    ref = model.state_dict()
    meta = ModelMeta("BERT", architecture_of(cfg), iteration=3, make_vocab_size_divisible_by=DIVISIBLE,
                     extra={"bert": {"num_tokentypes": 2, "add_binary_head": False}})
    write_megatron(meta, messages_from_state_dict(ref, cfg.num_layers), str(tmp_path / "src"), 2, 1)
    summary = _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf")
    cls = (transformers.MegatronBertForSequenceClassification if kind == "classification"
           else transformers.MegatronBertForMultipleChoice)
    assert summary["architecture"] == cls.__name__
    hf = cls.from_pretrained(tmp_path / "hf").eval()
    g = torch.Generator().manual_seed(3)
    shape = (2, 7) if kind == "classification" else (2, 3, 7)
    tokens = torch.randint(0, TRUE_VOCAB, shape, generator=g)
    pad = torch.ones(shape, dtype=torch.long)
    pad[..., 5:] = 0
    types = (torch.arange(7) >= 3).long().expand(shape).contiguous()
    with torch.no_grad():
        ours = model(tokens, pad, types)
        theirs = hf(input_ids=tokens, attention_mask=pad, token_type_ids=types).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    _convert(tmp_path / "hf", tmp_path / "back", "--loader", "hf", "--make-vocab-size-divisible-by", str(DIVISIBLE))
    back = _task_model(kind, cfg, load_files(str(tmp_path / "back"))[(0, 0)]["model"]).state_dict()
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_t5_checkpoint_written_by_save_checkpoint_converts(tmp_path):
    """A T5 checkpoint written by megatron.compat.save_checkpoint (pretrain_t5's flags, full args,
    architecture, optimizer) converts to TP2 and back, and the result loads with the real loader under the same
    flags (the architecture check included) with the source's weights."""
    import argparse

    from megatron.arguments import build_parser, core_transformer_config_from_args, validate_args
    from megatron.compat import load_checkpoint, save_checkpoint

    flags = ["--num-layers", "2", "--decoder-num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
             "--ffn-hidden-size", "48", "--encoder-seq-length", "10", "--decoder-seq-length", "6",
             "--max-position-embeddings", "16", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(TRUE_VOCAB), "--make-vocab-size-divisible-by", "4", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--no-bias-gelu-fusion"]
    args = build_parser().parse_args(flags)
    args.rank, args.world_size = 0, 1
    validate_args(args, {"model_family": "t5"})
    args.true_vocab_size, args.padded_vocab_size = TRUE_VOCAB, 64
    cfg = core_transformer_config_from_args(args)
    model = _t5(cfg)
    save_checkpoint(3, [model], torch.optim.Adam(model.parameters()), None, args, str(tmp_path / "ck"))
    t5 = ["--model-type", "T5"]
    _convert(tmp_path / "ck", tmp_path / "tp2", *t5, "--target-tensor-parallel-size", "2")
    _convert(tmp_path / "tp2", tmp_path / "tp1", *t5, "--target-tensor-parallel-size", "1")
    fresh = _t5(cfg, seed=77)
    load = argparse.Namespace(**vars(args))
    load.load, load.finetune = str(tmp_path / "tp1"), True
    assert load_checkpoint([fresh], None, None, load) == 0
    ref = model.state_dict()
    for k, v in fresh.state_dict().items():  # rows past the true vocabulary: re-padded with the last row
        rows = TRUE_VOCAB if "word_embeddings" in k or k == "lm_head.bias" else None
        assert torch.equal(v[:rows], ref[k][:rows]), k
