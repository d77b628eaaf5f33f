"""The start-up parameter report of the DeepSeek presets (megatron/theoretical_memory_usage.py with multi-latent
attention and the MTP block): DeepSeek-V3 671B gives the published 671B total and 37B activated parameters (HF
DeepseekV3ForCausalLM's exact counts, which hold no MTP layer), DeepSeek-V2-Lite its 15.7B; the tiny preset's count
is its model's numel."""
from __future__ import annotations

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.model import GPTModel
from megatron.theoretical_memory_usage import count_parameters, model_config, mtp_parameters
from tests.test_moe_parameter_report import _preset_args


def _without_mtp(name: str, vocab: int) -> tuple[int, int]:
    args = _preset_args(name, vocab)
    counts = count_parameters(args)
    mtp = mtp_parameters(model_config(args))
    return counts.total - counts.mtp, counts.active - (mtp.split + mtp.replicated + mtp.active_experts)


def test_deepseek_v3_671b_has_the_published_counts():
    # HF DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=129280)) on the meta device: 671,026,404,352 parameters,
    # 37,552,282,624 of them active (8 of the 256 routed experts in each of the 58 MoE layers)
    total, active = _without_mtp("deepseek_v3_671b", 129280)
    assert (total, active) == (671_026_404_352, 37_552_282_624)
    assert (total // 10**9, active // 10**9) == (671, 37)  # published: 671B total, 37B activated


def test_deepseek_v2_lite_has_the_published_count():
    # HF's count of the same shape: 15,706,484,224 (2,661,150,208 active with 6 of 64 experts)
    assert _without_mtp("deepseek_v2_lite", 102400) == (15_706_484_224, 2_661_150_208)


def test_deepseek_v3_tiny_count_is_the_models_numel():
    args = _preset_args("deepseek_v3_tiny", 512)
    model_parallel_manual_seed(1)
    model = GPTModel(model_config(args))
    assert count_parameters(args).total == sum(p.numel() for p in model.parameters())
