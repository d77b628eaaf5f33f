"""The Hugging Face adapter registry (megatron/models/registry.py): every architecture name has exactly one adapter,
the saver picks the family from the stored architecture, and the refusals name what would be accepted."""
from __future__ import annotations

import pytest

from megatron.checkpoint.conversion import hf_format
from megatron.checkpoint.conversion.interchange import ConversionError, ModelMeta
from megatron.models import registry


def test_each_architecture_has_one_adapter_and_the_loader_lists_them_all():
    names = registry.supported_architectures()
    assert len(names) == len(set(names))
    assert hf_format.SUPPORTED == names
    expect = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama_moe",
              "Qwen2MoeForCausalLM": "llama_moe", "BloomForCausalLM": "bloom", "MegatronBertForPreTraining": "bert",
              "MegatronBertForMultipleChoice": "bert"}
    assert {n: registry.adapter_for_architecture(n).name for n in expect} == expect
    assert registry.adapter_for_architecture("T5ForConditionalGeneration") is None
    assert registry.model_types() == ("GPT", "BERT")


GPT2 = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm"}
LLAMA = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope"}
BLOOM = {"position_embedding_type": "alibi", "embed_layernorm": True, "normalization": "LayerNorm"}


@pytest.mark.parametrize("model_type,architecture,family", [
    ("GPT", GPT2, "gpt2"), ("GPT", LLAMA, "llama"), ("GPT", {**LLAMA, "num_moe_experts": 4}, "llama_moe"),
    ("GPT", BLOOM, "bloom"), ("BERT", GPT2, "bert"),
    ("GPT", {**LLAMA, "num_moe_experts": 4, "multi_latent_attention": True}, "deepseek_v3"),
    ("GPT", {"normalization": "RMSNorm", "position_embedding_type": "rope", "softmax_type": "learnable",
             "quick_geglu": True, "num_moe_experts": 4}, "gpt_oss")])
def test_the_saver_picks_the_family_from_the_architecture(model_type, architecture, family):
    assert hf_format.hf_adapter_for(ModelMeta(model_type, architecture)).name == family


def test_the_saver_refuses_with_one_line_naming_the_accepted_families():
    with pytest.raises(ConversionError) as refused:
        hf_format.hf_adapter_for(ModelMeta("GPT", {**GPT2, "position_embedding_type": "rope"}))
    assert str(refused.value) == (  # the MoE members' adapter is Llama-family too: named once
        "--saver hf: this architecture is neither GPT-2 (learned positions, LayerNorm, GeLU) nor DeepSeek-V3 "
        "(--multi-latent-attention) nor Llama-family "
        "(--swiglu --normalization RMSNorm --position-embedding-type rope) nor GPT-OSS (--softmax-type learnable "
        "--quick-geglu with experts, RMSNorm, RoPE) nor BLOOM (--position-embedding-type alibi --embed-layernorm)")
    with pytest.raises(ConversionError, match="^--saver hf converts GPT and BERT models, not T5$"):
        hf_format.hf_adapter_for(ModelMeta("T5", GPT2))


def test_the_shared_hf_code_names_no_family():
    """Adding a family stays 'one module in its folder + one registry line': the shared HF folder code holds no
    architecture name and no model-type branch."""
    from pathlib import Path

    from megatron.checkpoint.conversion import hf_decoder

    for module in (hf_format, hf_decoder):
        text = Path(module.__file__).read_text(encoding="utf-8")
        assert "model_type ==" not in text, module.__name__
        assert [n for n in registry.supported_architectures() if n in text] == [], module.__name__
    for adapter in registry.ADAPTERS:
        assert adapter.accepts.__module__.startswith("megatron.models."), adapter.name
