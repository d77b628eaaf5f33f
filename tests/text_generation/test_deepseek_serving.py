"""A DeepSeek-V3 model (multi-latent attention with its latent KV cache, YaRN, grouped sigmoid routing with the expert
bias, a shared expert) converted from a Hugging Face DeepseekV3ForCausalLM folder is served and evaluated as any GPT
model: the REST server's greedy answer is HF generate()'s, and the lm-eval adapter's log-likelihoods are HF's."""
from __future__ import annotations

import os

import pytest
import torch

from megatron.checkpoint.conversion.hf_format import read_hf
from megatron.checkpoint.conversion.interchange import state_dict_from_messages
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.models.gpt.model import GPTModel
from megatron.text_generation.server import build_server
from tests.text_generation.test_server_http import CONTEXT, put, tiny_tokenizer

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from tasks.eval_harness.adapter import MegatronLM  # noqa: E402
from tests.tasks.test_eval_harness import Req  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def twins(shared_data, tmp_path_factory):
    """(HF model, our model, tokenizer) from the same random weights (the tiny GPT-2 vocabulary's 5,000 rows)."""
    config = transformers.DeepseekV3Config(
        vocab_size=5000, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=CONTEXT, rope_parameters=YARN, tie_word_embeddings=False,
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("deepseek") / "hf"
    hf.save_pretrained(folder)
    meta, stream = read_hf(str(folder))
    model_parallel_manual_seed(1)
    model = GPTModel(meta.config(), parallel_output=False).eval()
    model.load_state_dict(state_dict_from_messages(stream))
    return hf, model, tiny_tokenizer(shared_data)


def test_server_greedy_request_equals_hf_generate(twins):
    hf, model, tokenizer = twins
    server = build_server(model, tokenizer, max_sequence_length=CONTEXT, max_tokens_to_generate=16, max_prompts=2,
                          max_request_bytes=4096, log=lambda line: None)
    address = server.start("127.0.0.1", 0)
    try:
        status, body = put(address, {"prompts": ["The quick brown fox"], "tokens_to_generate": 12,
                                     "temperature": 0})
    finally:
        server.shutdown()
    assert status == 200, body
    ids = tokenizer.tokenize("The quick brown fox")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert body["text"] == [tokenizer.detokenize(ref[0].tolist())]


def test_lm_eval_loglikelihood_equals_hf(twins):
    hf, model, tokenizer = twins
    pairs = [("The cat sat on the", " mat"), ("She opened the door and said", " hello there")]
    ours = MegatronLM(model, tokenizer, max_length=CONTEXT, batch_size=2, progress=False).loglikelihood(
        [Req(c, x) for c, x in pairs])
    for (context, continuation), (logp, _) in zip(pairs, ours):
        ctx, cont = tokenizer.tokenize(context), tokenizer.tokenize(context + continuation)[len(tokenizer.tokenize(
            context)):]
        with torch.no_grad():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([ctx + cont[:-1]])).logits[0].double(), -1)
        expected = float(ref[-len(cont):].gather(1, torch.tensor(cont)[:, None]).sum())
        assert logp == pytest.approx(expected, abs=1e-4)
