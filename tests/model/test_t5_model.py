"""T5 model: an independent encoder-decoder written here with plain torch.nn (same weights) gives the same logits
(1e-5) with padding in encoder and decoder and different encoder/decoder depths; decoder causality; Megatron's
checkpoint keys; the per-token loss equals cross entropy over the logits; pp > 1 is refused with one line.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt.model import flatten_checkpoint_state_dict
from megatron.models.t5.model import PP_SPLIT_MISSING, T5Model, t5_num_floating_point_operations

VOCAB, ENC, DEC, H, HEADS, TOL = 64, 12, 8, 32, 4, 1e-5


def t5_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=2, decoder_num_layers=3, hidden_size=H, num_attention_heads=HEADS,
                  padded_vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                  bias_gelu_fusion=False)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_t5(config: TransformerConfig, seed: int = 1234) -> T5Model:
    model_parallel_manual_seed(seed, 0)
    torch.manual_seed(seed)
    model = T5Model(config).eval()
    with torch.no_grad():  # a non-zero LM-head bias, so that the test sees it
        model.lm_head.bias.normal_(0, 0.5)
    return model


def t5_batch():
    """enc/dec tokens and Megatron's [b, sq, sk] masks (1 = attend): row 1 pads the encoder from 9, decoder from 5."""
    g = torch.Generator().manual_seed(0)
    enc = torch.randint(0, VOCAB, (2, ENC), generator=g)
    dec = torch.randint(0, VOCAB, (2, DEC), generator=g)
    enc_valid = torch.ones(2, ENC)
    enc_valid[1, 9:] = 0
    dec_valid = torch.ones(2, DEC)
    dec_valid[1, 5:] = 0
    enc_mask = enc_valid[:, :, None] * enc_valid[:, None, :]
    dec_mask = torch.tril(dec_valid[:, :, None] * dec_valid[:, None, :])
    enc_dec_mask = dec_valid[:, :, None] * enc_valid[:, None, :]
    return enc, dec, enc_mask.long(), dec_mask.long(), enc_dec_mask.long(), dec_valid


class RefAttention(nn.Module):
    """Multi-head attention with separate q/k/v Linear layers; masked scores are set to -10000 like Megatron."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x: torch.Tensor, mem: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, sq, _ = x.shape
        hn = H // HEADS

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.size(1), HEADS, hn).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(mem)), heads(self.v(mem))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hn)
        scores = scores.masked_fill(keep[:, None] < 0.5, -10000.0)
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, sq, H)
        return self.o(ctx)


class RefLayer(nn.Module):
    def __init__(self, cross: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = RefAttention()
        self.cross = RefAttention() if cross else None
        self.ln3 = nn.LayerNorm(H) if cross else None
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x, keep, mem=None, cross_keep=None):
        x = x + self.attn(self.ln1(x), self.ln1(x), keep)
        if self.cross is not None:
            x = x + self.cross(self.ln2(x), mem, cross_keep)
            return x + self.fc2(F.gelu(self.fc1(self.ln3(x))))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RefT5(nn.Module):
    """A straightforward pre-LN encoder-decoder: shared word + position embeddings, tied output + bias."""

    def __init__(self, enc_layers: int, dec_layers: int) -> None:
        super().__init__()
        self.word, self.pos = nn.Embedding(VOCAB, H), nn.Embedding(16, H)
        self.enc = nn.ModuleList(RefLayer(False) for _ in range(enc_layers))
        self.dec = nn.ModuleList(RefLayer(True) for _ in range(dec_layers))
        self.enc_ln, self.dec_ln = nn.LayerNorm(H), nn.LayerNorm(H)
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word(ids) + self.pos(torch.arange(ids.size(1)))[None]

    def forward(self, enc, dec, enc_mask, dec_mask, enc_dec_mask):
        x = self.embed(enc)
        for layer in self.enc:
            x = layer(x, enc_mask)
        mem = self.enc_ln(x)
        y = self.embed(dec)
        for layer in self.dec:
            y = layer(y, dec_mask, mem, enc_dec_mask)
        return self.dec_ln(y) @ self.word.weight.t() + self.bias

    @torch.no_grad()
    def load_megatron(self, sd: dict) -> None:
        """Copy the weights from T5Model's flat state dict (Megatron's fused [heads, (q, k, v), hn] rows)."""
        hn = H // HEADS
        lm = "language_model."
        self.word.weight.copy_(sd[lm + "embedding.word_embeddings.weight"])
        self.pos.weight.copy_(sd[lm + "embedding.position_embeddings.weight"])
        self.bias.copy_(sd["lm_head.bias"])

        def copy_ln(ln: nn.LayerNorm, key: str) -> None:
            ln.weight.copy_(sd[key + ".weight"])
            ln.bias.copy_(sd[key + ".bias"])

        def copy_lin(lin: nn.Linear, w: torch.Tensor, b: torch.Tensor) -> None:
            lin.weight.copy_(w)
            lin.bias.copy_(b)

        def split(key: str, parts: int) -> list:
            w = sd[key + ".weight"].view(HEADS, parts, hn, H)
            b = sd[key + ".bias"].view(HEADS, parts, hn)
            return [(w[:, i].reshape(H, H), b[:, i].reshape(H)) for i in range(parts)]

        def copy_layer(layer: RefLayer, p: str) -> None:
            copy_ln(layer.ln1, p + "input_layernorm")
            copy_ln(layer.ln2, p + "post_attention_layernorm")
            for lin, (w, b) in zip((layer.attn.q, layer.attn.k, layer.attn.v), split(p + "self_attention.query_key_value", 3)):
                copy_lin(lin, w, b)
            copy_lin(layer.attn.o, sd[p + "self_attention.dense.weight"], sd[p + "self_attention.dense.bias"])
            if layer.cross is not None:
                copy_lin(layer.cross.q, sd[p + "inter_attention.query.weight"], sd[p + "inter_attention.query.bias"])
                for lin, (w, b) in zip((layer.cross.k, layer.cross.v), split(p + "inter_attention.key_value", 2)):
                    copy_lin(lin, w, b)
                copy_lin(layer.cross.o, sd[p + "inter_attention.dense.weight"], sd[p + "inter_attention.dense.bias"])
                copy_ln(layer.ln3, p + "post_inter_attention_layernorm")
            copy_lin(layer.fc1, sd[p + "mlp.dense_h_to_4h.weight"], sd[p + "mlp.dense_h_to_4h.bias"])
            copy_lin(layer.fc2, sd[p + "mlp.dense_4h_to_h.weight"], sd[p + "mlp.dense_4h_to_h.bias"])

        for i, layer in enumerate(self.enc):
            copy_layer(layer, f"{lm}encoder.layers.{i}.")
        for i, layer in enumerate(self.dec):
            copy_layer(layer, f"{lm}decoder.layers.{i}.")
        copy_ln(self.enc_ln, lm + "encoder.final_layernorm")
        copy_ln(self.dec_ln, lm + "decoder.final_layernorm")


def test_logits_equal_an_independent_encoder_decoder() -> None:
    model = build_t5(t5_config())
    assert len(model.language_model.encoder.layers) == 2 and len(model.language_model.decoder.layers) == 3
    ref = RefT5(2, 3).eval()
    ref.load_megatron(model.state_dict())
    enc, dec, enc_mask, dec_mask, enc_dec_mask, _ = t5_batch()
    with torch.no_grad():
        ours = model(enc, dec, enc_mask, dec_mask, enc_dec_mask)
        theirs = ref(enc, dec, enc_mask.float(), dec_mask.float(), enc_dec_mask.float())
    assert ours.shape == (2, DEC, VOCAB)
    torch.testing.assert_close(ours, theirs, rtol=TOL, atol=TOL)
    # the encoder output matters: a different encoder token changes the decoder logits
    enc2 = enc.clone()
    enc2[0, 3] = (enc2[0, 3] + 1) % VOCAB
    with torch.no_grad():
        assert not torch.allclose(model(enc2, dec, enc_mask, dec_mask, enc_dec_mask)[0], ours[0])


def test_decoder_is_causal_and_loss_is_cross_entropy() -> None:
    model = build_t5(t5_config(decoder_num_layers=None))
    assert len(model.language_model.decoder.layers) == 2  # --decoder-num-layers defaults to --num-layers
    enc, dec, enc_mask, dec_mask, enc_dec_mask, dec_valid = t5_batch()
    later = dec.clone()
    later[:, 4:] = (later[:, 4:] + 7) % VOCAB
    with torch.no_grad():
        a = model(enc, dec, enc_mask, dec_mask, enc_dec_mask)
        b = model(enc, later, enc_mask, dec_mask, enc_dec_mask)
        assert torch.equal(a[:, :4], b[:, :4])  # earlier positions never see later decoder tokens
        assert not torch.allclose(a[0, 4:], b[0, 4:])
        labels = torch.randint(0, VOCAB, (2, DEC), generator=torch.Generator().manual_seed(3))
        labels[dec_valid == 0] = -1  # Megatron's T5 labels on padding
        loss = model(enc, dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=labels)
    keep = dec_valid == 1
    expected = F.cross_entropy(a[keep], labels[keep], reduction="none")
    assert loss.shape == (2, DEC) and torch.isfinite(loss).all()
    torch.testing.assert_close(loss[keep], expected, rtol=TOL, atol=TOL)


def test_checkpoint_keys_are_megatrons_and_load_back() -> None:
    model = build_t5(t5_config())
    nested = model.state_dict_for_save_checkpoint()
    assert sorted(nested) == ["language_model", "lm_head"]
    assert sorted(nested["language_model"]) == ["decoder", "embedding", "encoder"]
    assert sorted(nested["language_model"]["embedding"]) == ["position_embeddings", "word_embeddings"]
    assert list(nested["lm_head"]) == ["bias"]
    layer0 = {k for k in nested["language_model"]["decoder"] if k.startswith("layers.0.")}
    assert {"layers.0.inter_attention.query.weight", "layers.0.inter_attention.key_value.weight",
            "layers.0.inter_attention.dense.weight", "layers.0.post_inter_attention_layernorm.weight"} <= layer0
    other = build_t5(t5_config(), seed=99)
    other.load_state_dict(nested)
    flat = flatten_checkpoint_state_dict(nested)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in flat.items() if not k.endswith("_extra_state"))


def test_pipeline_is_refused_with_one_line() -> None:
    with pytest.raises(ValueError) as err:
        T5Model(t5_config(pipeline_model_parallel_size=2))
    assert str(err.value) == PP_SPLIT_MISSING and "\n" not in PP_SPLIT_MISSING
    assert "--pipeline-model-parallel-split-rank" in PP_SPLIT_MISSING


def test_flops_formula_counts_the_forward_matmuls() -> None:
    """The TFLOPs formula / 3 equals torch's count of one forward's matmul FLOPs (GQA and unequal depths)."""
    from torch.utils.flop_counter import FlopCounterMode

    config = t5_config(num_query_groups=2, group_query_attention=True, ffn_hidden_size=48)
    model = build_t5(config)
    for m in model.modules():  # the explicit softmax path: its bmm's are counted, CPU SDPA is not
        if hasattr(m, "allow_sdpa"):
            m.allow_sdpa = False
    enc, dec, enc_mask, dec_mask, enc_dec_mask, _ = t5_batch()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(enc, dec, enc_mask, dec_mask, enc_dec_mask)
    expected = t5_num_floating_point_operations(config, 2, ENC, DEC) / 3
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)


def test_t5_flags_reach_the_model_config() -> None:
    """--encoder-num-layers / --decoder-num-layers (default --num-layers), --encoder-seq-length, --decoder-seq-length
    and --short-seq-prob parse and validate for the t5 family and build the stacks they name."""
    from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--encoder-seq-length", "16",
            "--decoder-seq-length", "8", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--short-seq-prob", "0.2"]
    for extra, layers in (([], (2, 2)), (["--encoder-num-layers", "3", "--decoder-num-layers", "1"], (3, 1))):
        args = parse_args(args=[*base, *extra])
        args.rank = 1  # keep the argument dump quiet
        args = validate_args(args, {"model_family": "t5"})
        assert (args.seq_length, args.decoder_seq_length, args.short_seq_prob) == (16, 8, 0.2)
        config = core_transformer_config_from_args(args)
        config.padded_vocab_size = VOCAB
        model = T5Model(config)
        lm = model.language_model
        assert (len(lm.encoder.layers), len(lm.decoder.layers)) == layers
