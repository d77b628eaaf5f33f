"""tasks/main.py WIKITEXT103 (sliding windows) and LAMBADA on a BLOOM checkpoint (--position-embedding-type alibi
--embed-layernorm, 4 heads) equal a plain loop over Hugging Face BloomForCausalLM with the same weights."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron.models.gpt.hf_bloom import hf_bloom_to_megatron_state_dict, megatron_config_from_hf_bloom
from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer
from tests.tasks import helpers as H

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

STRIDE = 32
BLOOM_FLAGS = ["--position-embedding-type", "alibi", "--embed-layernorm"]


def _run(argv: list) -> dict:
    from megatron.initialize import destroy_megatron
    from tasks.main import main

    try:
        return main(argv)
    finally:
        destroy_megatron()


@pytest.mark.slow  # evaluation processes
def test_wikitext_and_lambada_of_bloom_equal_hf(shared_data, tmp_path):
    torch.manual_seed(0)
    hf = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=H.PADDED_VOCAB, hidden_size=H.HIDDEN, n_layer=H.LAYERS, n_head=H.HEADS, hidden_dropout=0.0,
        attention_dropout=0.0, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not ("layernorm" in name or "ln_f" in name):
                p.copy_(0.15 * torch.randn_like(p))
    config = megatron_config_from_hf_bloom(hf.config, max_position_embeddings=H.SEQ)
    ckpt = H.save_megatron_checkpoint(hf_bloom_to_megatron_state_dict(hf.state_dict(), config), tmp_path / "ckpt")
    wiki = H.write_wikitext_slice(shared_data, tmp_path / "wiki.test.tokens", 30)
    lambada = H.write_lambada_slice(shared_data, tmp_path / "lambada.jsonl", 30)
    flags = H.model_flags(shared_data, ckpt) + BLOOM_FLAGS + ["--micro-batch-size", "8"]
    owt = shared_data / "openwebtext-1000"
    tok = tokenizers.ByteLevelBPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))

    res = _run(["--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", str(STRIDE), *flags])
    ids = tok.encode(wikitext_detokenizer(wiki.read_text(encoding="utf-8"))).ids
    total = H.strided_window_loss(hf, ids, H.SEQ, STRIDE)
    assert res["avg_loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-4, abs=1e-4)
    assert res["ppl"] == pytest.approx(math.exp(total / (len(ids) - 1)), rel=1e-4)

    res = _run(["--task", "LAMBADA", "--valid-data", str(lambada), *flags])
    correct = 0
    texts = [json.loads(line)["text"] for line in lambada.read_text(encoding="utf-8").splitlines() if line.strip()]
    for text in texts:
        full = tok.encode(text).ids[-(H.SEQ + 1):]
        with torch.no_grad():
            correct += int(hf(input_ids=torch.tensor([full[:-1]])).logits[0, -1].argmax() == full[-1])
    assert res["accuracy"] == pytest.approx(correct / len(texts), abs=1e-9) and res["total_examples"] == 30
