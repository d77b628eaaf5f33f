"""Megatron checkpoints of a model with multi-token prediction (--mtp-num-layers): the MTP block (Megatron Core's
``mtp.layers.N.*``, its MoE layer's experts included) is the "mtp" message of the conversion stream, saved on the last
pipeline stage with the embedding copy it reads there; TP=2 x PP=2 x EP=2 and back gives the same tensors bitwise,
and the converted architecture keeps --mtp-num-layers."""
from __future__ import annotations

import torch

from megatron.checkpoint.conversion.interchange import (
    ModelMeta,
    architecture_of,
    messages_from_state_dict,
    state_dict_from_messages,
)
from megatron.checkpoint.conversion.megatron_format import read_megatron, write_megatron
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer_config import TransformerConfig
from megatron.models.gpt.model import GPTModel

CONFIG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, max_position_embeddings=32,
              padded_vocab_size=64, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
              add_bias_linear=False, bias_gelu_fusion=False, share_embeddings_and_output_weights=False,
              hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=4, moe_ffn_hidden_size=16,
              moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=1)


def test_mtp_block_converts_over_tp2_pp2_ep2_and_back_bitwise(tmp_path):
    config = TransformerConfig(**CONFIG)
    model_parallel_manual_seed(3)
    flat = GPTModel(config).state_dict()
    assert "mtp.layers.0.transformer_layer.mlp.experts.weight1" in flat
    meta = ModelMeta(model_type="GPT", architecture=architecture_of(config), true_vocab_size=64, source="test")
    assert meta.architecture["mtp_num_layers"] == 1 and meta.config().mtp_num_layers == 1
    write_megatron(meta, messages_from_state_dict(flat, 4), str(tmp_path / "meg"), tp=2, pp=2, ep=2)
    last = torch.load(tmp_path / "meg" / "release" / "mp_rank_01_001_001" / "model_optim_rng.pt", weights_only=False)
    assert last["model"]["mtp"]["layers.0.transformer_layer.mlp.experts.weight1"].shape[0] == 2  # experts 2, 3
    assert "word_embeddings_for_head" in last["model"]  # the MTP block's embedding input on the last stage
    read_meta, stream = read_megatron(str(tmp_path / "meg"))
    assert read_meta.config().mtp_num_layers == 1
    back = state_dict_from_messages(stream)
    assert sorted(back) == sorted(flat)
    for name, tensor in flat.items():
        assert torch.equal(back[name], tensor), name
