"""Packed rows (megatron/core/packed_seq_params.py): documents of lengths 5, 17 and 42 in one row of 64 give the
logits and gradients of their three separate forwards, do not see each other, and equal the
--reset-attention-mask --reset-position-ids path; for GPT (learned positions), Llama (RoPE, GQA, SwiGLU), a sliding
window and multi-latent attention."""
from __future__ import annotations

import pytest
import torch

from megatron.core.packed_seq_params import from_cu_seqlens, from_eod
from megatron.layers import attention
from megatron.layers.inference_params import InferenceParams
from megatron.utils import get_ltor_masks_and_position_ids
from tests.model.helpers import build_gpt, tiny_config

LENGTHS = (5, 17, 42)
SEQ = sum(LENGTHS)
VOCAB = 64
EOD = VOCAB - 1

LLAMA = dict(num_attention_heads=8, group_query_attention=True, num_query_groups=4, ffn_hidden_size=24, swiglu=True,
             normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=True,
             share_embeddings_and_output_weights=False, init_method_std=0.1)
MLA = dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope",
           add_bias_linear=False, swiglu=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6)
FAMILIES = {
    "gpt": {},
    "llama": LLAMA,
    "window": dict(LLAMA, window_size=(6, 0)),
    "mla": MLA,
}


def _model(family: str):
    return build_gpt(tiny_config(max_position_embeddings=SEQ, **FAMILIES[family]), seed=11)


def _documents(seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, EOD, (n,), generator=g) for n in LENGTHS]
    for d in docs:
        d[-1] = EOD  # each document ends with EOD (the --reset-attention-mask case)
    return docs


def _packed(docs):
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(LENGTHS), 0).tolist(), dtype=torch.int32)
    return torch.cat(docs).unsqueeze(0), from_cu_seqlens(cu, torch.tensor(max(LENGTHS)))


def _separate(model, docs, labels=None):
    out = []
    for i, d in enumerate(docs):
        n = d.numel()
        pos = torch.arange(n).unsqueeze(0)
        mask = torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)
        out.append(model(d.unsqueeze(0), pos, mask, labels=None if labels is None else labels[i].unsqueeze(0)))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_row_equals_separate_forwards(family):
    model = _model(family)
    docs = _documents()
    ids, packed = _packed(docs)
    logits = model(ids, None, None, packed_seq_params=packed)
    torch.testing.assert_close(logits, _separate(model, docs), rtol=0, atol=1e-6)

    labels = [torch.roll(d, -1) for d in docs]
    model.zero_grad()
    model(ids, None, None, labels=torch.cat(labels).unsqueeze(0), packed_seq_params=packed).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _separate(model, docs, labels).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_changing_one_document_leaves_the_others_bitwise(family):
    model = _model(family).eval()
    docs = _documents()
    ids, packed = _packed(docs)
    changed = [d.clone() for d in docs]
    changed[1][:-1] = (changed[1][:-1] + 7) % EOD
    ids2, packed2 = _packed(changed)
    with torch.no_grad():
        a = model(ids, None, None, packed_seq_params=packed)
        b = model(ids2, None, None, packed_seq_params=packed2)
    first, second = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    assert torch.equal(a[:, :first], b[:, :first]) and torch.equal(a[:, second:], b[:, second:])
    assert not torch.equal(a[:, first:second], b[:, first:second])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_equals_reset_attention_mask_and_position_ids(family):
    model = _model(family).eval()
    ids, packed = _packed(_documents())
    mask, _, pos = get_ltor_masks_and_position_ids(ids, EOD, True, True, False)
    from_tokens = from_eod(ids, EOD)
    assert from_tokens.cu_seqlens_q.tolist() == [[0, 5, 22, 64, 64]]
    assert torch.equal(from_tokens.position_ids(1, SEQ), pos)
    assert torch.equal(from_tokens.attention_mask(1, SEQ), mask)
    with torch.no_grad():
        reset = model(ids, pos, mask)
        torch.testing.assert_close(model(ids, None, None, packed_seq_params=packed), reset, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(ids, None, None, packed_seq_params=from_tokens), reset, rtol=0, atol=1e-6)


def test_cu_seqlens_forms_and_end_padding():
    p = from_cu_seqlens(torch.tensor([0, 2, 5]))  # tokens 5..7: end padding, a document of their own
    assert p.position_ids(1, 8).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    cu, longest = p.flat_cu_seqlens(1, 8)
    assert (cu.tolist(), cu.dtype, longest) == ([0, 2, 5, 8], torch.int32, 3)
    per_row = from_cu_seqlens(torch.tensor([[0, 3, 4], [0, 1, 1]]))
    flat = from_cu_seqlens(torch.tensor([0, 3, 4, 5, 8]))
    assert per_row.position_ids(2, 4).tolist() == flat.position_ids(2, 4).tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert torch.equal(per_row.attention_mask(2, 4), flat.attention_mask(2, 4))
    with pytest.raises(ValueError, match="does not end a document at every row end"):
        from_cu_seqlens(torch.tensor([0, 3, 6, 8])).position_ids(2, 4)


def test_kv_cache_decoding_with_packed_rows_is_refused_in_one_line():
    model = _model("llama").eval()
    ids, packed = _packed(_documents())
    with pytest.raises(ValueError, match="KV-cache decoding"):
        model(ids, None, None, packed_seq_params=packed, inference_params=InferenceParams(1, SEQ))


def _fake_varlen(calls: list):
    """flash_attn_varlen_func's contract in torch: causal attention inside each [cu[i], cu[i+1]) of the flattened
    tokens, fewer K/V heads repeated (GQA), records its arguments."""

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1)):
        calls.append(dict(cu=cu_q.tolist(), max=max_q, causal=causal, window=window_size, dtype=cu_q.dtype))
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal,
                scale=softmax_scale).transpose(0, 1)
        return out

    return flash_attn_varlen_func


def test_flash_varlen_and_per_document_paths_equal_the_document_mask_path(monkeypatch):
    model = _model("llama").eval()
    core = model.language_model.encoder.layers[0].self_attention.core_attention
    calls: list = []
    monkeypatch.setitem(attention._FLASH_ATTN, "varlen", _fake_varlen(calls))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, 2, 8, 4, generator=g)
    k, v = (torch.randn(SEQ, 2, 4, 4, generator=g) for _ in range(2))
    packed = from_cu_seqlens(torch.tensor([[0, 5, 22, 64], [0, 40, 60, 60]]))
    via_flash = core.flash_varlen(q, k, v, packed)
    via_mask = core(q, k, v, packed.attention_mask(2, SEQ))
    torch.testing.assert_close(via_flash, via_mask, rtol=1e-5, atol=1e-6)
    assert core.runs_per_document(recompute=False) and not core.runs_per_document(recompute=True)
    torch.testing.assert_close(core.per_document(q, k, v, packed), via_mask, rtol=1e-5, atol=1e-6)  # the CPU path
    assert calls == [dict(cu=[0, 5, 22, 64, 104, 124, 128], max=42, causal=True, window=(-1, -1),
                          dtype=torch.int32)]
