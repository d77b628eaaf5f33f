"""Auxiliary losses as named values: the MoE layers' model declares its router losses (Megatron-LM's names, order,
reduce group and number of MoE layers), every pipeline stage alike, and the training loop logs whatever a model
declares, with no MoE code of its own."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron import global_vars, training
from megatron.core import aux_losses
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.moe import router_losses
from megatron.models.gpt.model import GPTModel

ROOT = Path(__file__).resolve().parents[2]
MOE = dict(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, padded_vocab_size=64,
           max_position_embeddings=16, num_moe_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0, 1, 1],
           hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)


def test_router_losses_are_megatrons_names_in_its_order():
    group = object()
    config = TransformerConfig(**MOE, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    assert router_losses(config, group) == (
        aux_losses.AuxLoss("load_balancing_loss", 4, 3, True, group, None), aux_losses.AuxLoss("z_loss", 4, 3))
    seq = TransformerConfig(**MOE, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="seq_aux_loss",
                            moe_per_layer_logging=True)
    assert router_losses(seq, None) == (aux_losses.AuxLoss("seq_load_balancing_loss", 4, 3, True, None,
                                                           "moe/seq_load_balancing_loss"),)
    assert router_losses(TransformerConfig(**MOE), group) == ()  # no coefficient: no loss
    dense = {k: v for k, v in MOE.items() if k != "moe_layer_freq"}
    assert router_losses(TransformerConfig(**{**dense, "num_moe_experts": None}), group) == ()


def test_the_model_declares_its_losses_and_a_dense_model_none():
    config = TransformerConfig(**MOE, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    model = GPTModel(config)
    assert [loss.name for loss in aux_losses.declared_by([model])] == ["load_balancing_loss", "z_loss"]
    wrapped = torch.nn.Sequential(model)  # a wrapper (DDP, Float16Module, an engine) is walked through
    assert aux_losses.declared_by([wrapped, model]) == aux_losses.declared_by([model])
    dense = {k: v for k, v in MOE.items() if k not in ("num_moe_experts", "moe_layer_freq")}
    assert aux_losses.declared_by([GPTModel(TransformerConfig(**dense))]) == ()


def test_the_loop_logs_any_declared_loss_by_name(monkeypatch):
    """A loss the loop never heard of (a later MTP loss) is logged like the router's: mean over micro-batches and
    its recording layers; its per-layer values go to TensorBoard at the next iteration's step."""
    module = torch.nn.Linear(1, 1)
    module.aux_losses = (aux_losses.AuxLoss("mtp_loss", 2, 2, per_layer_key="mtp/mtp_loss"),)
    written = []
    monkeypatch.setattr(global_vars, "get_num_microbatches", lambda: 4)
    monkeypatch.setattr(global_vars, "get_tensorboard_writer",
                        lambda: SimpleNamespace(add_scalar=lambda *a: written.append(a)))
    aux_losses.clear()
    aux_losses.record("mtp_loss", torch.tensor(2.0), 1, 2)
    aux_losses.record("mtp_loss", torch.tensor(6.0), 2, 2)
    state = SimpleNamespace(pp_group=None, dp_group=None)
    assert training.named_aux_losses([module], state, iteration=6) == {"mtp_loss": 1.0}
    assert written == [("mtp/mtp_loss_layer_0", 0.5, 7), ("mtp/mtp_loss_layer_1", 1.5, 7)]
    assert training.named_aux_losses([torch.nn.Linear(1, 1)], state, iteration=7) == {}


def test_the_loop_has_no_moe_code():
    text = (ROOT / "megatron" / "training.py").read_text(encoding="utf-8")
    assert re.findall(r"moe|load_balancing|z_loss", text, flags=re.IGNORECASE) == []


def test_moe_per_layer_logging_reaches_the_declaration():
    from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args

    argv = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
            "--micro-batch-size 1 --disable-bias-linear --num-experts 4 --moe-aux-loss-coeff 1e-2 "
            "--moe-per-layer-logging").split()
    args = parse_args(args=argv)
    args.rank = 0
    config = core_transformer_config_from_args(validate_args(args, {}))
    assert config.moe_per_layer_logging is True
    assert [loss.per_layer_key for loss in router_losses(config, None)] == ["moe/load_balancing_loss"]
