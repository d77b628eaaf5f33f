"""tools/checkpoint/convert.py with Hugging Face and DeepSpeed, and tools/merge_mp_partitions.py.

Proof: HF Llama/Mistral (GQA, untied, rope_theta) -> Megatron TP2 gives HF's logits (1e-5) and greedy generation
equal to HF generate; Megatron -> HF gives our logits in transformers (1e-5), GPT-2 with each GeLU flavour;
Megatron -> HF -> Megatron and HF -> Megatron -> HF are bitwise; Megatron -> DeepSpeed (PP1 and the pipeline
engine's layer files) -> Megatron is bitwise; merge_mp_partitions merges TP2xPP2 into TP1.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.conversion.interchange import ConversionError
from tests.tools.checkpoint_convert_helpers import (
    TRUE_VOCAB,
    build,
    config,
    inputs,
    load_files,
    logits,
    merge_independently,
    save_source,
)

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "checkpoint"))  # the DeepSpeed plugins, as when convert.py runs
sys.path.insert(0, str(REPO / "tools"))


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


def _hf_llama(family="llama_gqa", seed=0):
    from tests.model.hf_llama_helpers import hf_model

    return hf_model(family, seed=seed)


def _repeat_padding(model):
    """Padding rows equal to the last real row, as Megatron's converters write them (so round trips are exact)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("word_embeddings" in name or "output_layer" in name) and ".norm." not in name:
                p[TRUE_VOCAB:] = p[TRUE_VOCAB - 1]
    return model


@pytest.mark.parametrize("family", ["llama_gqa", "mistral_gqa"])
def test_hf_to_megatron_logits_and_tokenizer(tmp_path, family):
    hf = _hf_llama(family)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded, with the index file
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"sentencepiece model bytes")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    out = _convert(tmp_path / "hf", tmp_path / "meg", "--loader", "hf", "--target-tensor-parallel-size", "2")
    meta = out["meta"]
    cfg = meta.config()
    theta = (getattr(hf.config, "rope_parameters", None) or {}).get("rope_theta") or hf.config.rope_theta
    assert cfg.rotary_base == theta and cfg.num_query_groups == hf.config.num_key_value_heads
    full = merge_independently(str(tmp_path / "meg"), cfg)
    rows = full["language_model.embedding.word_embeddings.weight"].size(0)
    ours = logits(build(dataclasses.replace(cfg, padded_vocab_size=rows), full))
    with torch.no_grad():
        theirs = hf(input_ids=inputs()[0]).logits
    torch.testing.assert_close(ours[..., :theirs.size(-1)], theirs, rtol=1e-5, atol=1e-5)
    tok = tmp_path / "meg" / "tokenizer" / "tokenizer.model"
    assert tok.read_bytes() == b"sentencepiece model bytes"
    assert f"--tokenizer-type Llama2Tokenizer --tokenizer-model {tok}" in out["flags"]
    assert f"--rotary-base {theta:g}" in out["flags"]


def test_greedy_generation_of_converted_llama_equals_hf_generate(tmp_path):
    from megatron.compat import load_checkpoint
    from megatron.text_generation import generate

    hf = _hf_llama("llama_gqa", seed=1)
    hf.save_pretrained(tmp_path / "hf")
    meta = _convert(tmp_path / "hf", tmp_path / "meg", "--loader", "hf")["meta"]
    model = build(meta.config(), seed=5)  # random weights, then the real checkpoint loader
    args = argparse.Namespace(load=str(tmp_path / "meg"), finetune=True, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1)
    load_checkpoint([model], None, None, args)
    prompts = [[5, 17, 33], [9, 2, 60, 40, 3]]
    out = generate(model, None, prompts, 8, greedy=True, eod_id=TRUE_VOCAB - 1,
                   use_eod_token_for_early_termination=False)
    for prompt, row in zip(prompts, out["tokens"]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert row == ref[0].tolist()


@pytest.mark.parametrize("family,flags,act", [("llama", {}, None), ("bloom", {}, None), ("gpt2", {}, "gelu_new"),
                                              ("gpt2", {"bias_gelu_fusion": False}, "gelu"),
                                              ("gpt2", {"openai_gelu": True}, "gelu_new")])
def test_megatron_to_hf_logits_and_round_trips(tmp_path, family, flags, act):
    cfg = config(family, **flags)
    model = _repeat_padding(build(cfg))
    save_source(model, cfg, str(tmp_path / "src"), 2, 2, true_vocab=TRUE_VOCAB)
    _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf", "--max-shard-size", "40KB")
    files = os.listdir(tmp_path / "hf")
    assert "config.json" in files and "model.safetensors.index.json" in files
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    if act:
        assert hf.config.activation_function == act
    with torch.no_grad():
        theirs = hf(input_ids=inputs()[0]).logits
    assert theirs.size(-1) == TRUE_VOCAB
    torch.testing.assert_close(theirs, logits(model)[..., :TRUE_VOCAB], rtol=1e-5, atol=1e-5)
    # Megatron -> HF -> Megatron (TP2xPP2 again): every file bitwise equal to the source's tensors
    _convert(tmp_path / "hf", tmp_path / "back", "--loader", "hf", "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2", "--true-vocab-size", str(TRUE_VOCAB),
             "--make-vocab-size-divisible-by", "4")
    back = merge_independently(str(tmp_path / "back"), cfg)
    ref = model.state_dict()
    assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)
    # HF -> Megatron -> HF: bitwise
    _convert(tmp_path / "back", tmp_path / "hf2", "--saver", "hf")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    a, b = hf.state_dict(), hf2.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_hf_bloom_to_tp2_pp2_logits_and_back_bitwise(tmp_path):
    """HF BloomForCausalLM (12 heads) -> ours TP2 x PP2: logits equal HF; -> HF again: every tensor bitwise."""
    from tests.model.hf_bloom_helpers import hf_model

    hf = hf_model("bloom_12_heads", seed=2, n_layer=4)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    out = _convert(tmp_path / "hf", tmp_path / "meg", "--loader", "hf", "--target-tensor-parallel-size", "2",
                   "--target-pipeline-parallel-size", "2")
    cfg = out["meta"].config()
    assert cfg.position_embedding_type == "alibi" and cfg.embed_layernorm
    assert "--position-embedding-type alibi" in out["flags"] and "--embed-layernorm" in out["flags"]
    full = merge_independently(str(tmp_path / "meg"), cfg)
    assert "language_model.embedding.word_embeddings.norm.weight" in full
    rows = full["language_model.embedding.word_embeddings.weight"].size(0)
    ours = logits(build(dataclasses.replace(cfg, padded_vocab_size=rows), full))
    with torch.no_grad():
        theirs = hf(input_ids=inputs()[0]).logits
    torch.testing.assert_close(ours[..., :theirs.size(-1)], theirs, rtol=1e-5, atol=1e-5)
    _convert(tmp_path / "meg", tmp_path / "hf2", "--saver", "hf")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert type(hf2).__name__ == "BloomForCausalLM"
    a, b = hf.state_dict(), hf2.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_hf_architecture_one_line_nothing_written(tmp_path):
    (tmp_path / "falcon").mkdir()
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ConversionError) as exc:
        _convert(tmp_path / "falcon", tmp_path / "out", "--loader", "hf")
    assert "FalconForCausalLM" in str(exc.value) and "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["falcon"]
    # a Megatron model HF has no class for (squared ReLU) is refused before anything is written
    cfg = config("gpt2", squared_relu=True)
    save_source(build(cfg), cfg, str(tmp_path / "sq"), 1, 1)
    with pytest.raises(ConversionError):
        _convert(tmp_path / "sq", tmp_path / "out", "--saver", "hf")
    assert sorted(os.listdir(tmp_path)) == ["falcon", "sq"]


@pytest.mark.parametrize("pp", [1, 2])
def test_deepspeed_saver_and_loader_round_trip(tmp_path, pp):
    cfg = config("llama")
    model = build(cfg)
    save_source(model, cfg, str(tmp_path / "src"), 2, 1)
    _convert(tmp_path / "src", tmp_path / "ds", "--saver", "deepspeed", "--target-pipeline-parallel-size", str(pp))
    tag = (tmp_path / "ds" / "latest").read_text().strip()
    names = os.listdir(tmp_path / "ds" / tag)
    assert any(n.startswith("layer_") for n in names) == (pp > 1)
    _convert(tmp_path / "ds", tmp_path / "back", "--loader", "deepspeed", "--target-tensor-parallel-size", "1")
    back = merge_independently(str(tmp_path / "back"), cfg)
    ref = model.state_dict()
    assert all(torch.equal(back[k], ref[k]) for k in ref)
    assert load_files(str(tmp_path / "back"))[(0, 0)]["iteration"] == 7
    assert [p for p in os.listdir(tmp_path) if p.startswith(("ds_to", "megatron_to"))] == []


def test_merge_mp_partitions(tmp_path):
    import merge_mp_partitions as tool

    cfg = config("gpt2")
    model = build(cfg)
    save_source(model, cfg, str(tmp_path / "src"), 2, 2)
    tool.main(["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--num-layers", "4", "--load",
               str(tmp_path / "src"), "--save", str(tmp_path / "out"), "--target-pipeline-model-parallel-size", "2"])
    files = load_files(str(tmp_path / "out"))
    assert sorted(files) == [(0, 0), (0, 1)]
    merged = merge_independently(str(tmp_path / "out"), cfg)
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConversionError, match="saved with 2 tensor-parallel"):
        tool.main(["--model-type", "GPT", "--tensor-model-parallel-size", "4", "--load", str(tmp_path / "src"),
                   "--save", str(tmp_path / "x")])
    with pytest.raises(ConversionError, match="--num-layers 6"):
        tool.main(["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--num-layers", "6", "--load",
                   str(tmp_path / "src"), "--save", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2_qkv_bias"])
def test_printed_flags_build_the_checkpoint_architecture(tmp_path, family):
    """The flags the tool prints pass Megatron's argument validation and agree with the converted checkpoint's
    architecture under the loader's own check (megatron.checkpoint.args.check_architecture)."""
    import shlex

    from megatron.arguments import build_parser, validate_args
    from megatron.compat import check_architecture

    _hf_llama(family).save_pretrained(tmp_path / "hf")
    flags = _convert(tmp_path / "hf", tmp_path / "meg", "--loader", "hf")["flags"]
    from megatron.checkpoint.args import ArchitectureMismatchError

    saved = load_files(str(tmp_path / "meg"))[(0, 0)]["architecture"]
    for extra in ([], ["--rotary-base", "10000"]):  # the check is not vacuous: a different flag is caught
        args = build_parser().parse_args(shlex.split(flags) + ["--micro-batch-size", "1", "--tokenizer-type",
                                                               "NullTokenizer", "--vocab-size", "61", *extra])
        args.rank, args.world_size = 0, 1
        validate_args(args, {})
        if extra:
            with pytest.raises(ArchitectureMismatchError, match="rotary_base"):
                check_architecture(saved, args, str(tmp_path / "meg"))
        else:
            check_architecture(saved, args, str(tmp_path / "meg"))


def test_hf_saver_refuses_unmapped_tensors_unless_no_checking(tmp_path):
    from megatron.checkpoint.conversion.hf_format import write_hf
    from megatron.checkpoint.conversion.interchange import messages_from_state_dict
    from tests.tools.checkpoint_convert_helpers import meta_for

    cfg = config("llama")
    sd = dict(build(cfg).state_dict())
    sd["language_model.encoder.layers.1.self_attention.extra.weight"] = torch.ones(2)
    with pytest.raises(ConversionError, match="self_attention.extra.weight.*--no-checking"):
        write_hf(meta_for(cfg), messages_from_state_dict(sd, cfg.num_layers), str(tmp_path / "a"))
    write_hf(meta_for(cfg), messages_from_state_dict(sd, cfg.num_layers), str(tmp_path / "b"), checking=False)
    assert (tmp_path / "b" / "config.json").exists()


@pytest.mark.parametrize("act", ["erf", "openai-gelu"])
def test_bert_megatron_hf_both_ways(tmp_path, act):
    """Megatron BERT (TP2xPP2) -> MegatronBertForPreTraining: HF's prediction and sentence-order logits equal ours
    (1e-5); HF -> Megatron -> HF is bitwise; a vocab.txt is copied and named in the printed flags."""
    from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of, messages_from_state_dict
    from megatron.checkpoint.conversion.megatron_format import write_megatron
    from tests.model.test_bert_model import bert_batch, bert_config, build_bert

    cfg = bert_config(openai_gelu=act == "openai-gelu")
    model = build_bert(cfg, True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    meta = ModelMeta("BERT", architecture_of(cfg), iteration=3, extra={"bert": {"num_tokentypes": 2,
                                                                                "add_binary_head": True}})
    write_megatron(meta, messages_from_state_dict(model.state_dict(), cfg.num_layers), str(tmp_path / "src"), 2, 2)
    _convert(tmp_path / "src", tmp_path / "hf", "--model-type", "BERT", "--saver", "hf")
    hf = transformers.MegatronBertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.hidden_act == ("gelu_new" if act == "openai-gelu" else "gelu")
    tokens, pad, types, _ = bert_batch()
    with torch.no_grad():
        ours, sop = model(tokens, pad, tokentype_ids=types)
        out = hf(input_ids=tokens, attention_mask=pad, token_type_ids=types)
    keep = pad.bool()
    torch.testing.assert_close(out.prediction_logits[keep], ours[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, sop, rtol=1e-5, atol=1e-5)
    (tmp_path / "hf" / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    res = _convert(tmp_path / "hf", tmp_path / "meg", "--model-type", "BERT", "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    assert f"--tokenizer-type BertWordPieceLowerCase --vocab-file {tmp_path / 'meg' / 'tokenizer' / 'vocab.txt'}" \
        in res["flags"]
    _convert(tmp_path / "meg", tmp_path / "hf2", "--model-type", "BERT", "--saver", "hf")
    a = hf.state_dict()
    b = transformers.MegatronBertForPreTraining.from_pretrained(tmp_path / "hf2").state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf2" / "vocab.txt").read_text() == "[PAD]\n[UNK]\nhello\n"


def test_hf_pytorch_model_bin_folder(tmp_path):
    """An older HF folder with pytorch_model.bin (read through the safe loader) converts like safetensors."""
    hf = _hf_llama("llama_gqa", seed=2)
    (tmp_path / "hf").mkdir()
    hf.config.architectures = ["LlamaForCausalLM"]
    hf.config.save_pretrained(tmp_path / "hf")
    torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    meta = _convert(tmp_path / "hf", tmp_path / "meg", "--loader", "hf")["meta"]
    cfg = meta.config()
    full = merge_independently(str(tmp_path / "meg"), cfg)
    rows = full["language_model.embedding.word_embeddings.weight"].size(0)
    ours = logits(build(dataclasses.replace(cfg, padded_vocab_size=rows), full))
    with torch.no_grad():
        theirs = hf(input_ids=inputs()[0]).logits
    torch.testing.assert_close(ours[..., :theirs.size(-1)], theirs, rtol=1e-5, atol=1e-5)
