"""Each setting is declared once (megatron/settings/): the declaration count of tools/count_setting_declarations.py,
the declared types against the defaults, the architecture record's order (checkpoint bytes), and typed settings
built from parsed flags."""
from __future__ import annotations

import dataclasses
import importlib.util
import shlex
import typing
from pathlib import Path
from typing import Any, Union

import torch

from megatron.arguments import build_parser, parse_args
from megatron.checkpoint.args import ARCHITECTURE_FIELDS
from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of, model_flags
from megatron.core.transformer_config import TransformerConfig
from megatron.optimizer.optimizer_config import OptimizerConfig, optimizer_config_from_args
from megatron.settings import (
    CORE_GROUPS,
    ENTRY_GROUPS,
    LAST_GROUPS,
    all_settings,
    flag_spelling,
    from_args,
    kept_fields,
    optimizer_fields,
)
from megatron.settings.model import NetworkSizeSettings
from megatron.settings.moe import MoESettings
from megatron.settings.values import Settings

REPO = Path(__file__).resolve().parents[1]


def _counter() -> Any:
    spec = importlib.util.spec_from_file_location("count_setting_declarations",
                                                  REPO / "tools" / "count_setting_declarations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_is_declared_once():
    places = _counter().count(REPO)
    twice = {dest: sorted(p) for dest, p in places.items() if len(p) != 1}
    assert not twice, ("settings declared in more than one place (declare a flag once, as a setting(...) field in "
                       f"megatron/settings/; an entry script adds its group with add_group): {twice}")
    core = {action.dest for action in build_parser()._actions} - {"help"}
    declared = {dest for dest, _default, _spec in all_settings()}
    assert core <= declared and all(next(iter(places[dest])).endswith(": setting") for dest in declared)


def test_the_counter_sees_a_second_declaration(tmp_path):
    (tmp_path / "megatron" / "settings").mkdir(parents=True)
    (tmp_path / "megatron" / "settings" / "g.py").write_text(
        'class G:\n    swiglu: bool = setting("--swiglu", help="x", default=False)\n')
    (tmp_path / "megatron" / "registry.py").write_text('RUNTIME_SETTINGS = {"swiglu": "a.py", "seed": "b.py"}\n'
                                                      'ARCHITECTURE_FIELDS = ("swiglu",)\n')
    (tmp_path / "megatron" / "arguments.py").write_text('p.add_argument("--seed", type=int)\n'
                                                        'p.add_argument("--no-x", dest="x_on")\n')
    counter = _counter()
    places = counter.count(tmp_path)
    assert {dest: len(p) for dest, p in places.items()} == {"swiglu": 3, "seed": 2, "x_on": 1}
    assert counter.summary(places) == (3, {1: 1, 2: 1, 3: 1})


def _conforms(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def test_each_default_has_the_declared_type():
    wrong = []
    for group in CORE_GROUPS + LAST_GROUPS + ENTRY_GROUPS:
        hints = typing.get_type_hints(group)
        for field in dataclasses.fields(group):
            if not _conforms(field.default, hints[field.name]):
                wrong.append(f"{group.__name__}.{field.name}: {field.default!r} is not {hints[field.name]}")
    assert not wrong, wrong


def test_the_architecture_record_keeps_its_order():
    # The order of the checkpoint's `architecture` record (hence its bytes): the `arch` positions of the declarations
    # must give exactly this sequence; a new architecture field takes the next position.
    assert ARCHITECTURE_FIELDS[:34] == (
        "normalization", "layernorm_epsilon", "apply_layernorm_1p", "apply_residual_connection_post_layernorm",
        "openai_gelu", "squared_relu", "swiglu", "glu_activation", "embed_layernorm", "add_bias_linear",
        "add_qkv_bias", "bias_gelu_fusion", "position_embedding_type", "rotary_base", "rotary_percent",
        "group_query_attention", "num_query_groups", "rotary_seq_len_interpolation_factor", "use_rope_scaling",
        "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
        "rope_scaling_original_max_position_embeddings", "share_embeddings_and_output_weights", "num_layers",
        "encoder_num_layers", "decoder_num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
        "kv_channels", "max_position_embeddings", "padded_vocab_size", "num_moe_experts")
    assert ARCHITECTURE_FIELDS[34:48] == (
        "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_score_function",
        "moe_router_topk_scaling_factor", "moe_router_load_balancing_type", "moe_router_dtype",
        "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
        "moe_apply_probs_on_input")
    assert ARCHITECTURE_FIELDS[48:56] == (  # YaRN (--rope-type yarn)
        "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
        "beta_fast", "beta_slow", "yarn_correction_range_round_to_int")
    assert ARCHITECTURE_FIELDS[56:57] == ("qk_layernorm",)
    assert ARCHITECTURE_FIELDS[57:63] == ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                          "qk_pos_emb_head_dim", "v_head_dim")  # issue #37
    assert ARCHITECTURE_FIELDS[63:64] == ("mtp_num_layers",)  # issue #37's multi-token prediction
    assert ARCHITECTURE_FIELDS[64:66] == ("window_size", "window_attn_skip_freq")  # issue #38
    assert ARCHITECTURE_FIELDS[66:69] == ("moe_router_num_groups", "moe_router_group_topk",
                                          "moe_router_enable_expert_bias")  # issue #37's router: converted models
    # issue #38 (GPT-OSS): attention sinks and the clamped GLU
    assert ARCHITECTURE_FIELDS[69:73] == ("softmax_type", "quick_geglu", "glu_linear_offset",
                                          "activation_func_clamp_value")


def test_typed_settings_from_parsed_flags():
    args = parse_args(args=["--num-layers", "3", "--hidden-size", "64", "--swiglu", "--disable-bias-linear",
                            "--norm-epsilon", "1e-6", "--num-experts", "4", "--moe-layer-freq", "[1,0,1]"])
    model = from_args(NetworkSizeSettings, args)
    assert (model.num_layers, model.hidden_size, model.swiglu, model.add_bias_linear) == (3, 64, True, False)
    assert model.layernorm_epsilon == 1e-6 and model.normalization == "LayerNorm"
    moe = from_args(MoESettings, args)
    assert (moe.num_experts, moe.moe_layer_freq, moe.moe_router_topk) == (4, [1, 0, 1], 2)


def test_the_converter_keeps_the_declared_architecture():
    """tools/checkpoint/convert.py's architecture (`kept_fields`, generated from `setting(..., kept=N)`) is the
    architecture record's fields less T5's layer counts (they travel in the T5 stream's own message), plus the MoE
    loss coefficients a converted MoE model trains on with; its order is a converted checkpoint's bytes."""
    kept = kept_fields()
    assert set(kept) == (set(ARCHITECTURE_FIELDS) - {"encoder_num_layers", "decoder_num_layers"}
                         | {"moe_aux_loss_coeff", "moe_z_loss_coeff"})
    assert kept[:7] == ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                        "max_position_embeddings", "padded_vocab_size")  # the order the hand list had
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert tuple(architecture_of(config)) == kept


def test_the_converters_model_flags_parse_back_to_the_architecture():
    """Every option string model_flags prints comes from the settings' declarations and parses to the value."""
    arch = dict(num_layers=3, hidden_size=64, num_attention_heads=8, ffn_hidden_size=100, kv_channels=16,
                max_position_embeddings=128, normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
                apply_layernorm_1p=True, add_qkv_bias=True, bias_gelu_fusion=False, position_embedding_type="rope",
                rotary_base=500000.0, rotary_percent=0.5, use_rope_scaling=True, rope_scaling_factor=32.0,
                group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                share_embeddings_and_output_weights=False, num_moe_experts=4, moe_router_topk=1, moe_layer_freq=2,
                moe_ffn_hidden_size=32, moe_router_pre_softmax=True, moe_router_score_function="sigmoid",
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    meta = ModelMeta("GPT", arch, tokenizer={"type": "GPT2BPETokenizer", "vocab_file": "v.json", "merge_file": "m"},
                     make_vocab_size_divisible_by=64)
    flags = model_flags(meta, tp=2, pp=1, vp_layers=1)
    ns = build_parser().parse_args(shlex.split(flags))
    assert flag_spelling("layernorm_epsilon") == "--norm-epsilon" and "--norm-epsilon 1e-06" in flags
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                 "max_position_embeddings", "normalization", "layernorm_epsilon", "swiglu", "apply_layernorm_1p",
                 "add_qkv_bias", "position_embedding_type", "rotary_base", "rotary_percent",
                 "use_rope_scaling", "rope_scaling_factor", "group_query_attention", "num_query_groups",
                 "add_bias_linear", "moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size",
                 "moe_router_pre_softmax", "moe_router_score_function", "moe_z_loss_coeff"):
        assert getattr(ns, dest) == arch[dest], dest
    assert ns.num_experts == 4 and ns.untie_embeddings_and_output_weights and ns.moe_aux_loss_coeff == [0.01]
    assert (ns.tensor_model_parallel_size, ns.num_layers_per_virtual_pipeline_stage) == (2, 1)
    assert (ns.tokenizer_type, ns.vocab_file, ns.merge_file, ns.make_vocab_size_divisible_by) == (
        "GPT2BPETokenizer", "v.json", "m", 64)


def test_the_optimizer_config_is_fed_from_the_declarations():
    """`OptimizerConfig`'s fields are the settings declared with ``optimizer_config=True`` plus the derived
    params_dtype, and optimizer_config_from_args carries each flag's value."""
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert set(optimizer_fields()) | {"params_dtype"} == fields and len(optimizer_fields()) == len(fields) - 1
    args = build_parser().parse_args(["--lr", "3e-4", "--adam-beta2", "0.95", "--clip-grad", "0.5", "--bf16",
                                      "--optimizer", "sgd", "--sgd-momentum", "0.8", "--hysteresis", "3"])
    config = optimizer_config_from_args(args)
    assert (config.lr, config.adam_beta2, config.clip_grad, config.bf16, config.optimizer, config.sgd_momentum,
            config.hysteresis, config.params_dtype) == (3e-4, 0.95, 0.5, True, "sgd", 0.8, 3, torch.bfloat16)
    assert config.loss_scale is None and config.weight_decay == 0.01


def test_settings_holds_every_group_once():
    """`Settings.from_args` instantiates every settings group once; a value is read and changed by its name."""
    args = build_parser().parse_args(["--num-layers", "3", "--swiglu", "--save", "/tmp/x"])
    settings = Settings.from_args(args)
    assert [type(getattr(settings, f.name)) for f in dataclasses.fields(Settings)] == list(
        CORE_GROUPS + LAST_GROUPS + ENTRY_GROUPS)
    assert settings.network_size.num_layers == settings.value("num_layers") == 3 and settings.value("swiglu")
    assert settings.checkpointing.save == "/tmp/x" and settings.value("lr") is None
    changed = settings.with_values(num_layers=5, lr=0.1)
    assert (changed.value("num_layers"), changed.value("lr"), settings.value("num_layers")) == (5, 0.1, 3)
    assert Settings.from_args(None) == Settings.from_args(build_parser().parse_args([]))
