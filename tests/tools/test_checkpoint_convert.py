"""tools/checkpoint/convert.py, Megatron <-> Megatron: any TP/PP/virtual-PP layout to any other.

Proof: A -> B -> A is bitwise (every tensor of every file); the reshape matrix TP 1/2/4 x PP 1/2/4 (+ virtual PP)
gives the source's logits (1e-5) with the vocabulary re-padded for the target (padding rows repeat the last row,
output layer too), merged here independently of the converter's reader and run as a TP=1 model; old
checkpoint_version QKV orders and release checkpoints load; bad input is one line and writes nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import ConversionError, state_dict_from_messages
from megatron.checkpoint.conversion.megatron_format import read_megatron
from megatron.checkpoint.integrity import write_manifest
from tests.tools.checkpoint_convert_helpers import (
    DIVISIBLE,
    TRUE_VOCAB,
    build,
    config,
    inputs,
    load_files,
    logits,
    merge_independently,
    save_source,
)

REPO = Path(__file__).resolve().parents[2]


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def source(request, tmp_path_factory):
    family = request.param
    cfg = config(family)
    model = build(cfg)
    folder = tmp_path_factory.mktemp(f"src_{family}")
    save_source(model, cfg, str(folder), 1, 1)
    return family, cfg, model, folder


def _assert_files_equal(a, b):
    fa, fb = load_files(str(a)), load_files(str(b))
    assert sorted(fa) == sorted(fb)

    def walk(x, y, path):
        if isinstance(x, dict):
            assert sorted(x) == sorted(y), path
            for k in x:
                walk(x[k], y[k], f"{path}.{k}")
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), path
    for key in fa:
        for part in ("model", "model0", "model1"):
            if part in fa[key]:
                walk(fa[key][part], fb[key][part], f"{key}/{part}")


@pytest.mark.parametrize("a,b", [((2, 2, None), (1, 4, None)), ((4, 1, None), (2, 2, 1)), ((2, 2, 1), (4, 4, None))])
def test_reshard_a_b_a_is_bitwise(source, tmp_path, a, b):
    family, cfg, model, src = source
    # A keeps the source's padding rows (no --true-vocab-size): everything, padding included, round-trips exactly
    first = tmp_path / "a"
    flags = lambda s: ["--target-tensor-parallel-size", str(s[0]), "--target-pipeline-parallel-size", str(s[1])] + (  # noqa: E731
        ["--target-num-layers-per-virtual-pipeline-stage", str(s[2])] if s[2] else [])
    save_source(model, cfg, str(first), *a)
    _convert(first, tmp_path / "b", *flags(b))
    _convert(tmp_path / "b", tmp_path / "a2", *flags(a))
    _assert_files_equal(first, tmp_path / "a2")
    full = merge_independently(str(tmp_path / "b"), cfg)
    ref = model.state_dict()
    assert sorted(full) == sorted(ref)
    assert all(torch.equal(full[k], ref[k]) for k in ref)


LAYOUTS = [(t, p, None) for t in (1, 2, 4) for p in (1, 2, 4)] + [(2, 2, 1), (1, 2, 1)]


def test_reshape_matrix_gives_source_logits(source, tmp_path):
    family, cfg, model, src = source
    ref = logits(model)[..., :TRUE_VOCAB]
    assert ref.abs().max() > 0.5
    for tp, pp, vl in LAYOUTS:
        out = tmp_path / f"t{tp}p{pp}v{vl}"
        extra = ["--target-num-layers-per-virtual-pipeline-stage", str(vl)] if vl else []
        _convert(src, out, "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
                 "--true-vocab-size", str(TRUE_VOCAB), *extra)
        full = merge_independently(str(out), cfg)
        rows = full["language_model.embedding.word_embeddings.weight"].size(0)
        assert rows == -(-TRUE_VOCAB // (DIVISIBLE * tp)) * DIVISIBLE * tp
        for name in ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"):
            if name in full:  # Megatron's re-padding: the padding rows repeat the last real row
                assert torch.equal(full[name][TRUE_VOCAB:], full[name][TRUE_VOCAB - 1].expand(rows - TRUE_VOCAB, -1))
        import dataclasses

        got = logits(build(dataclasses.replace(cfg, padded_vocab_size=rows), full))[..., :TRUE_VOCAB]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"TP{tp} PP{pp} VP{vl}")
        sd = load_files(str(out))[(0, 0)]
        assert sd["args"].tensor_model_parallel_size == tp and sd["args"].pipeline_model_parallel_size == pp
        assert sd["iteration"] == 7 and sd["consumed_train_samples"] == 96 and sd["checkpoint_version"] == 3.0
        assert sd["architecture"]["padded_vocab_size"] == rows


def test_loaded_by_megatron_checkpointing(source, tmp_path):
    """The converted checkpoint loads with megatron.compat.load_checkpoint (architecture check included)."""
    import argparse

    from megatron.compat import load_checkpoint

    family, cfg, model, src = source
    _convert(src, tmp_path / "out", "--true-vocab-size", str(TRUE_VOCAB))
    fresh = build(cfg, seed=99)
    args = argparse.Namespace(load=str(tmp_path / "out"), finetune=True, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, no_load_optim=True, no_load_rng=True)
    assert load_checkpoint([fresh], None, None, args) == 0
    torch.testing.assert_close(logits(fresh)[..., :TRUE_VOCAB], logits(model)[..., :TRUE_VOCAB], rtol=0, atol=0)


def _old_checkpoint(folder, version, args, release=False, qkv_order=None):
    cfg = config("gpt2", padded=64)
    model = build(cfg)
    sd = model.state_dict_for_save_checkpoint()
    nh, hd = cfg.num_attention_heads, cfg.kv_channels
    enc = sd["language_model"]["encoder"]
    for key in list(enc):
        if "query_key_value" in key and version < 2.0:
            t = enc[key]
            rest = t.shape[1:]
            cur = t.reshape(nh, 3, hd, *rest)  # [heads, 3, d] (version >= 2)
            old = cur.permute(1, 0, 2, *range(3, 3 + len(rest))) if version == 0 else \
                cur.permute(0, 2, 1, *range(3, 3 + len(rest)))
            enc[key] = old.reshape(t.shape).contiguous()
    if "transformer" == qkv_order:
        sd["language_model"]["transformer"] = sd["language_model"].pop("encoder")
    sub = "release" if release else "iter_0000003"
    os.makedirs(folder / sub / "mp_rank_00")
    torch.save({"model": sd, "checkpoint_version": version, "args": args, "iteration": 3},
               folder / sub / "mp_rank_00" / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text("release" if release else "3")
    return cfg, model


@pytest.mark.parametrize("version", [0, 1.0])
def test_old_qkv_orders_and_release_with_namespace_args(tmp_path, version):
    import argparse

    args = argparse.Namespace(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                              max_position_embeddings=16)
    cfg, model = _old_checkpoint(tmp_path / "old", version, args, release=True, qkv_order="transformer")
    meta, stream = read_megatron(str(tmp_path / "old"))
    full = state_dict_from_messages(stream)
    ref = model.state_dict()
    assert meta.iteration is None  # release
    assert all(torch.equal(full[k], ref[k]) for k in ref)


def test_simplenamespace_args_model_fields_only(tmp_path):
    args = types.SimpleNamespace(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                 max_position_embeddings=16)
    cfg, model = _old_checkpoint(tmp_path / "ns", 3.0, args)
    _convert(tmp_path / "ns", tmp_path / "out", "--target-tensor-parallel-size", "2")
    full = merge_independently(str(tmp_path / "out"), cfg)
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())


# ----------------------------------------------------------------------------------------------- bad input
def _bad(tmp_path, load, *extra):
    out = tmp_path / "target"
    with pytest.raises(ConversionError) as exc:
        _convert(load, out, *extra)
    assert "\n" not in str(exc.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if "converting" in p]
    return str(exc.value)


def test_bad_input_one_line_nothing_written(source, tmp_path):
    family, cfg, model, src = source
    (tmp_path / "empty").mkdir()
    assert "is not a Megatron checkpoint" in _bad(tmp_path, tmp_path / "empty")
    save_source(model, cfg, str(tmp_path / "two"), 2, 2)
    os.remove(tmp_path / "two" / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert "model_optim_rng.pt" in _bad(tmp_path, tmp_path / "two")
    os.rmdir(tmp_path / "two" / "iter_0000007" / "mp_rank_01_001")
    assert "mp_rank_01_001/model_optim_rng.pt is missing" in _bad(tmp_path, tmp_path / "two")  # the manifest
    os.remove(tmp_path / "two" / "iter_0000007" / "manifest.json")  # unverified: the layout check names it
    assert "missing rank file" in _bad(tmp_path, tmp_path / "two")
    # mismatched shards: tensor rank 1 of another model with a different layer count
    save_source(model, cfg, str(tmp_path / "m"), 2, 1)
    other = config(family, num_layers=2)
    save_source(build(other), other, str(tmp_path / "o"), 2, 1)
    os.replace(tmp_path / "o" / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt",
               tmp_path / "m" / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt")
    assert "mp_rank_01/model_optim_rng.pt has" in _bad(tmp_path, tmp_path / "m")  # not the file its manifest lists
    write_manifest(str(tmp_path / "m" / "iter_0000007"))  # re-signed by hand: the shard check still finds it
    assert "mismatched shards" in _bad(tmp_path, tmp_path / "m")
    assert "--target-tensor-parallel-size 3" in _bad(tmp_path, src, "--target-tensor-parallel-size", "3")
    assert "pass --model-type GPT" in _bad(tmp_path, src, "--model-type", "BERT")
    assert "not a T5 checkpoint" in _bad(tmp_path, src, "--model-type", "T5")


def test_cli_one_line_error_and_flags(tmp_path):
    family, cfg = "llama", config("llama")
    model, src = build(cfg), tmp_path / "src"
    save_source(model, cfg, str(src), 1, 1)
    tool = [sys.executable, str(REPO / "tools" / "checkpoint" / "convert.py"), "--model-type", "GPT"]
    bad = subprocess.run(tool + ["--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "error:" in bad.stderr
    helps = subprocess.run(tool[:2] + ["--saver", "hf", "--help"], capture_output=True, text=True, cwd=REPO)
    assert helps.returncode == 0 and "--max-shard-size" in helps.stdout and "--target-tensor-parallel-size" in \
        helps.stdout
    ok = subprocess.run(tool + ["--load-dir", str(src), "--save-dir", str(tmp_path / "o"),
                                "--target-tensor-parallel-size", "2", "--megatron-path", "/nowhere"],
                        capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    flags = ok.stdout.strip().splitlines()[-1]
    assert "--tensor-model-parallel-size 2" in flags
    if family == "llama":  # the printed flags build the model
        for f in ("--swiglu", "--normalization RMSNorm", "--group-query-attention --num-query-groups 4",
                  "--rotary-base 50000", "--untie-embeddings-and-output-weights", "--disable-bias-linear"):
            assert f in flags


# ----------------------------------------------------------------------------------------------- --load compatibility
@pytest.mark.parametrize("version,file_name", [(0, "model_optim_rng.pt"), (1.0, "model_rng.pt"),
                                               (3.0, "model_rng.pt")])
def test_load_checkpoint_reads_other_tools_checkpoints(tmp_path, version, file_name):
    """megatron.compat.load_checkpoint (training/inference --load) reads a release checkpoint with
    SimpleNamespace args (model fields only), old QKV orders, Megatron-LM's model_rng.pt and a dummy optimizer."""
    import argparse

    from megatron.compat import load_checkpoint

    ns = types.SimpleNamespace(num_layers=4, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
    cfg, model = _old_checkpoint(tmp_path / "ck", version, ns, release=True)
    path = tmp_path / "ck" / "release" / "mp_rank_00"
    sd = torch.load(path / "model_optim_rng.pt", weights_only=False)
    sd["optimizer"] = {"dummy": True}
    os.remove(path / "model_optim_rng.pt")
    torch.save(sd, path / file_name)
    fresh = build(cfg, seed=42)
    args = argparse.Namespace(load=str(tmp_path / "ck"), num_layers=4, hidden_size=32, num_attention_heads=4,
                              kv_channels=8, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    assert load_checkpoint([fresh], None, None, args) == 0
    ref = model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in fresh.state_dict().items())


def test_megatron_lm_module_paths():
    from megatron.core import package_info
    from megatron.tokenizer.tokenizer import _vocab_size_with_padding

    assert package_info.__version__.count(".") == 2
    ns = types.SimpleNamespace(make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, rank=1)
    assert _vocab_size_with_padding(50257, ns) == 50432


@pytest.mark.parametrize("pp,vl", [(2, 1), (4, None), (2, None)])
def test_pipeline_files_load_strictly_into_the_real_stage_models(tmp_path, pp, vl):
    """Each converted (virtual) stage loads strictly into the GPTModel chunk Megatron builds for that stage
    (layer offsets of megatron.layers.transformer), and chaining the chunks gives the source's logits exactly."""
    import dataclasses

    from megatron.models.gpt.model import GPTModel

    cfg = config("llama")
    model = build(cfg)
    save_source(model, cfg, str(tmp_path / "src"), 1, 1)
    extra = ["--target-num-layers-per-virtual-pipeline-stage", str(vl)] if vl else []
    _convert(tmp_path / "src", tmp_path / "out", "--target-pipeline-parallel-size", str(pp), *extra)
    files = load_files(str(tmp_path / "out"))
    vp = cfg.num_layers // pp // vl if vl else 1
    staged = dataclasses.replace(cfg, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp if vl else None)
    ids, pos, mask = inputs()
    hidden = None
    for v in range(vp):
        for p in range(pp):
            state = types.SimpleNamespace(pp_size=pp, pp_rank=p, virtual_pp_size=vp if vl else None,
                                          virtual_pp_rank=v, tp_group=None)
            chunk = GPTModel(staged, pp_state=state, pre_process=p == 0 and v == 0,
                             post_process=p == pp - 1 and v == vp - 1).eval()
            chunk.load_state_dict(files[(0, p)]["model" if not vl else f"model{v}"], strict=True)
            with torch.no_grad():
                if hidden is not None:
                    chunk.set_input_tensor(hidden)
                hidden = chunk(ids if hidden is None else None, pos, mask)
    torch.testing.assert_close(hidden, logits(model), rtol=0, atol=0)


def test_checkpoint_written_by_save_checkpoint_converts(tmp_path):
    """A checkpoint written by megatron.compat.save_checkpoint (full args, architecture, optimizer, RNG) of a
    Llama-style model built from flags converts to TP2xPP2 and back to the same weights; the result loads with the
    real loader under the same flags."""
    import argparse

    from megatron.arguments import build_parser, core_transformer_config_from_args, validate_args
    from megatron.compat import load_checkpoint, save_checkpoint

    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--ffn-hidden-size", "24",
             "--seq-length", "16", "--max-position-embeddings", "16", "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "4",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", str(TRUE_VOCAB), "--make-vocab-size-divisible-by",
             "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    args = build_parser().parse_args(flags)
    args.rank, args.world_size = 0, 1
    validate_args(args, {})
    args.true_vocab_size, args.padded_vocab_size = TRUE_VOCAB, 64
    cfg = core_transformer_config_from_args(args)
    model = build(cfg)
    save_checkpoint(3, [model], torch.optim.Adam(model.parameters()), None, args, str(tmp_path / "ck"))
    _convert(tmp_path / "ck", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2")
    _convert(tmp_path / "tp2pp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    fresh = build(cfg, seed=77)
    load = argparse.Namespace(**vars(args))
    load.load, load.finetune = str(tmp_path / "tp1"), True
    assert load_checkpoint([fresh], None, None, load) == 0
    ref = model.state_dict()
    for k, v in fresh.state_dict().items():  # vocabulary rows past the true size: re-padded with the last row
        rows = TRUE_VOCAB if "word_embeddings" in k or "output_layer" in k else None
        assert torch.equal(v[:rows], ref[k][:rows]), k
        if rows:
            assert torch.equal(v[rows:], ref[k][rows - 1].expand(64 - rows, -1)), k


def test_bert_megatron_reshape(tmp_path):
    """BERT (token types, pooler, LM head with its vocab-parallel bias, binary head): TP2xPP2 -> TP1 is bitwise with
    the padding kept; TP1 -> TP4 with --true-vocab-size re-pads the LM-head bias too and gives the same scores."""
    from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of, messages_from_state_dict
    from megatron.checkpoint.conversion.megatron_format import write_megatron
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.bert.model import BertModel

    cfg = config("gpt2")

    def bert(state=None):
        model_parallel_manual_seed(5)
        m = BertModel(cfg, num_tokentypes=2, add_binary_head=True).eval()
        if state is not None:
            m.load_state_dict(state, strict=True)
        return m

    model = bert()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    meta = ModelMeta("BERT", architecture_of(cfg), iteration=3, make_vocab_size_divisible_by=DIVISIBLE,
                     extra={"bert": {"num_tokentypes": 2, "add_binary_head": True}})
    write_megatron(meta, messages_from_state_dict(model.state_dict(), cfg.num_layers), str(tmp_path / "src"), 2, 2)
    bert_flags = ["--model-type", "BERT"]
    _convert(tmp_path / "src", tmp_path / "tp1", *bert_flags, "--target-tensor-parallel-size", "1",
             "--target-pipeline-parallel-size", "1")
    sd = load_files(str(tmp_path / "tp1"))[(0, 0)]
    assert sd["args"].bert_binary_head is True
    saved = model.state_dict_for_save_checkpoint()  # the nesting BertModel itself writes
    assert sorted(sd["model"]) == sorted(saved)
    assert sorted(sd["model"]["language_model"]) == sorted(saved["language_model"])
    assert sorted(sd["model"]["lm_head"]) == sorted(saved["lm_head"])
    ref = model.state_dict()
    merged = bert(sd["model"]).state_dict()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)
    _convert(tmp_path / "tp1", tmp_path / "tp4", *bert_flags, "--target-tensor-parallel-size", "4",
             "--true-vocab-size", str(TRUE_VOCAB))
    files = load_files(str(tmp_path / "tp4"))
    bias = torch.cat([files[(t, 0)]["model"]["lm_head"]["bias"] for t in range(4)])
    assert bias.numel() == 64 and torch.equal(bias[TRUE_VOCAB:], bias[TRUE_VOCAB - 1].expand(64 - TRUE_VOCAB))
    assert torch.equal(bias[:TRUE_VOCAB], ref["lm_head.bias"][:TRUE_VOCAB])
    with pytest.raises(ConversionError, match="pass --model-type BERT"):
        _convert(tmp_path / "tp1", tmp_path / "x")


def _tp2_load_worker(rank: int, world_size: int, folder: str, rows: int) -> list:
    import argparse
    import dataclasses

    from megatron.compat import load_checkpoint
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.models.gpt.model import GPTModel

    state = initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        cfg = dataclasses.replace(config("llama", padded=rows), tensor_model_parallel_size=2)
        model_parallel_manual_seed(99, state.tp_rank)
        model = GPTModel(cfg, pp_state=state, parallel_output=False).eval()
        args = argparse.Namespace(load=folder, finetune=True, tensor_model_parallel_size=2,
                                  pipeline_model_parallel_size=1)
        assert load_checkpoint([model], None, None, args) == 0
        with torch.no_grad():
            return model(*inputs())[..., :TRUE_VOCAB].tolist()
    finally:
        destroy_model_parallel()


@pytest.mark.slow  # a real TP=2 run
def test_converted_tp2_checkpoint_loads_in_a_real_tp2_run(tmp_path):
    """2 gloo processes: a TP=2 model built from the config loads the converted checkpoint with
    megatron.compat.load_checkpoint (this rank's mp_rank_0X file) and gives the TP=1 source's logits."""
    from tests.dist_utils import run_distributed

    cfg = config("llama")
    model = build(cfg)
    save_source(model, cfg, str(tmp_path / "src"), 1, 1)
    _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2", "--true-vocab-size",
             str(TRUE_VOCAB))
    rows = load_files(str(tmp_path / "tp2"))[(0, 0)]["padded_vocab_size"]
    results = run_distributed(_tp2_load_worker, 2, args=(str(tmp_path / "tp2"), rows))
    ref = logits(model)[..., :TRUE_VOCAB]
    for out in results:
        torch.testing.assert_close(torch.tensor(out), ref, rtol=1e-5, atol=1e-5)
