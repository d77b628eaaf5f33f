"""BigScience's DeepSpeed pipeline layout (Megatron-DeepSpeed's GPTModelPipe numbering, in which BLOOM was written:
``global_stepN/layer_XX-model_YY-model_states.pt``, embedding layer_01, transformer layers layer_03.., final norm
layer_{L+4}): convert.py writes it at any TP/PP and reads it back bitwise; an independent reader following Hugging
Face's convert_bloom_original_checkpoint_to_pytorch.py rules (layer number - 3, ``word_embeddings.norm`` ->
``word_embeddings_layernorm``, bare ``weight``/``bias`` -> ``ln_f``, TP shards concatenated or averaged) gives the
same HF weights as our direct conversion; our DeepSpeed pipeline checkpoint -> HF through the BigScience layout
equals the direct conversion."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from megatron.checkpoint.safe_load import safe_torch_load
from tests.tools.checkpoint_convert_helpers import TRUE_VOCAB, build, config, merge_independently, save_source

transformers = pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "checkpoint"))
sys.path.insert(0, str(REPO / "tools"))

# HF's script: these are TP-replicated (averaged over shards); row-parallel weights concatenate on dim 1
_AVERAGED = ("word_embeddings_layernorm.weight", "word_embeddings_layernorm.bias", "input_layernorm.weight",
             "input_layernorm.bias", "post_attention_layernorm.weight", "post_attention_layernorm.bias",
             "self_attention.dense.bias", "mlp.dense_4h_to_h.bias", "ln_f.weight", "ln_f.bias")
_ROW_PARALLEL = ("mlp.dense_4h_to_h.weight", "self_attention.dense.weight")


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


def _hf_names_from_bigscience(tag_dir: Path) -> dict:
    """HF BloomModel weights from the layer files alone, by the rules of HF's BLOOM conversion script."""
    files = sorted(n for n in os.listdir(tag_dir) if n.startswith("layer_"))
    tp = len({re.match(r"layer_\d+-model_(\d+)", n).group(1) for n in files})
    out: dict = {}
    for name in sorted({n.split("-model_")[0] for n in files}):
        shards = [safe_torch_load(str(tag_dir / f"{name}-model_{t:02d}-model_states.pt")) for t in range(tp)]
        number = int(re.match(r"layer_(\d+)", name).group(1))
        for key in shards[0]:
            rename = {"word_embeddings.weight": "word_embeddings.weight",
                      "word_embeddings.norm.weight": "word_embeddings_layernorm.weight",
                      "word_embeddings.norm.bias": "word_embeddings_layernorm.bias",
                      "weight": "ln_f.weight", "bias": "ln_f.bias"}
            hf = rename.get(key, f"h.{number - 3}.{key}")
            parts = [s[key] for s in shards]
            if hf.endswith(_AVERAGED):
                out[hf] = sum(parts) / tp
            else:
                out[hf] = torch.cat(parts, dim=1 if hf.endswith(_ROW_PARALLEL) else 0)
    return out


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 1)])
def test_bigscience_layout_both_ways_and_hf_rules(tmp_path: Path, tp: int, pp: int) -> None:
    cfg = config("bloom")
    model = build(cfg)
    with torch.no_grad():  # padding rows equal to the last real row, as the converters write them
        w = model.language_model.embedding.word_embeddings.weight
        w[TRUE_VOCAB:] = w[TRUE_VOCAB - 1]
    save_source(model, cfg, str(tmp_path / "src"), 2, 1, true_vocab=TRUE_VOCAB)
    out = _convert(tmp_path / "src", tmp_path / "bs", "--saver", "deepspeed", "--bigscience-layout",
                   "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp))
    tag = tmp_path / "bs" / (tmp_path / "bs" / "latest").read_text().strip()
    layers = sorted({n.split("-model_")[0] for n in os.listdir(tag) if n.startswith("layer_")})
    assert layers == ["layer_01", "layer_03", "layer_04", "layer_05", "layer_06", "layer_08"]  # 4 layers
    assert len([n for n in os.listdir(tag) if n.startswith("layer_")]) == 6 * tp
    assert sorted(n for n in os.listdir(tag) if n.startswith("mp_rank")) == [
        f"mp_rank_{r:02d}_model_states.pt" for r in range(tp * pp)]
    assert out["flags"].count("--embed-layernorm") == 1
    # HF's script rules on the layer files == our direct Megatron -> HF conversion
    _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf")
    direct = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    by_rules = _hf_names_from_bigscience(tag)
    for name, value in by_rules.items():
        ref = direct["transformer." + name]
        value = value[:TRUE_VOCAB] if name == "word_embeddings.weight" else value
        assert torch.equal(value, ref), name
    assert len(by_rules) == len([k for k in direct if k != "lm_head.weight"])
    # and back: BigScience layout -> Megatron TP1, bitwise
    _convert(tmp_path / "bs", tmp_path / "back", "--loader", "deepspeed", "--target-tensor-parallel-size", "1")
    back = merge_independently(str(tmp_path / "back"), cfg)
    ref = model.state_dict()
    assert sorted(back) == sorted(ref) and all(torch.equal(back[k], ref[k]) for k in ref)


def test_our_deepspeed_pipeline_checkpoint_to_hf_through_bigscience_equals_direct(tmp_path: Path) -> None:
    cfg = config("bloom")
    model = build(cfg)
    save_source(model, cfg, str(tmp_path / "src"), 2, 2, true_vocab=TRUE_VOCAB)
    _convert(tmp_path / "src", tmp_path / "ds", "--saver", "deepspeed", "--target-pipeline-parallel-size", "2")
    tag = tmp_path / "ds" / (tmp_path / "ds" / "latest").read_text().strip()
    assert any(n.startswith("layer_00-") for n in os.listdir(tag))  # our GPTModelPipe numbering
    _convert(tmp_path / "ds", tmp_path / "hf_direct", "--loader", "deepspeed", "--saver", "hf")
    _convert(tmp_path / "ds", tmp_path / "bs", "--loader", "deepspeed", "--saver", "deepspeed", "--bigscience-layout",
             "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "4")
    _convert(tmp_path / "bs", tmp_path / "hf_bs", "--loader", "deepspeed", "--saver", "hf")
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_direct").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bs").state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_bigscience_client_state_with_megatron_deepspeed_enums(tmp_path: Path) -> None:
    """BigScience's mp_rank files pickle args whose position_embedding_type is Megatron-DeepSpeed's enum member
    (``megatron.enums.PositionEmbeddingType.alibi``) and carry no ``architecture``: read with the safe loader, the
    architecture comes from those args and the conversion to HF equals the direct one."""
    import argparse

    from megatron.enums import AttnMaskType, PositionEmbeddingType

    cfg = config("bloom")
    save_source(build(cfg), cfg, str(tmp_path / "src"), 1, 1, true_vocab=TRUE_VOCAB)
    _convert(tmp_path / "src", tmp_path / "bs", "--saver", "deepspeed", "--bigscience-layout",
             "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    tag = tmp_path / "bs" / (tmp_path / "bs" / "latest").read_text().strip()
    args = argparse.Namespace(num_layers=4, hidden_size=48, num_attention_heads=6, ffn_hidden_size=192, kv_channels=8,
                              seq_length=16, max_position_embeddings=16,
                              position_embedding_type=PositionEmbeddingType.alibi, attn_mask_type=AttnMaskType.causal,
                              embed_layernorm=True, glu_activation=None,
                              tensor_model_parallel_size=2, pipeline_model_parallel_size=2, layernorm_epsilon=1e-5,
                              bias_gelu_fusion=True, openai_gelu=False, apply_residual_connection_post_layernorm=False,
                              make_vocab_size_divisible_by=4, padded_vocab_size=64, params_dtype=torch.bfloat16,
                              tokenizer_type="PretrainedFromHF", tokenizer_name_or_path="bigscience/tokenizer")
    for name in os.listdir(tag):
        if name.startswith("mp_rank_"):
            state = safe_torch_load(str(tag / name))
            state.pop("architecture", None)
            state["args"] = args
            torch.save(state, tag / name)
    (tag / "manifest.json").unlink()  # BigScience's folders have no integrity manifest (ours would flag the rewrite)
    out = _convert(tmp_path / "bs", tmp_path / "hf_bs", "--loader", "deepspeed", "--saver", "hf",
                   "--true-vocab-size", str(TRUE_VOCAB))
    assert out["meta"].architecture["position_embedding_type"] == "alibi"
    _convert(tmp_path / "src", tmp_path / "hf", "--saver", "hf")
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_bs").state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
