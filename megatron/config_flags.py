"""Which command-line flag becomes which `TransformerConfig` field: the one explicit bridge from flags to config.

Every field the model layers read is computed here from named parser destinations; nothing is copied "because the
name happens to match". `megatron.flag_registry` lists the other destinations (run-time settings read by training,
data, checkpointing, ...) and the flags that are refused; tests/test_every_flag.py checks that every destination of
every entry script is in one of the two places.

To add an architecture flag: add the field to `TransformerConfig` (megatron/core/transformer_config.py), the flag to
megatron/arguments.py, and one line to `CONFIG_FIELDS` below naming the field, its source destination(s) and, when
it is not a plain copy, how the value is computed.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Dict, Tuple

import torch

from megatron.enums import position_embedding_name

Getter = Callable[[argparse.Namespace], Any]


def _copy(dest: str) -> Tuple[Tuple[str, ...], Getter]:
    return (dest,), lambda args: getattr(args, dest)


def _num_query_groups(args: argparse.Namespace) -> Any:
    return args.num_query_groups if args.group_query_attention else None


def _init_method(args: argparse.Namespace) -> Any:
    return torch.nn.init.xavier_uniform_ if args.init_method_xavier_uniform else None


# field -> (parser destinations it is computed from, how). Derived values (params_dtype, position_embedding_type,
# ffn_hidden_size, kv_channels, ...) are those validate_args has filled in.
CONFIG_FIELDS: Dict[str, Tuple[Tuple[str, ...], Getter]] = {
    # parallel layout and numerics (ModelParallelConfig)
    "tensor_model_parallel_size": _copy("tensor_model_parallel_size"),
    "pipeline_model_parallel_size": _copy("pipeline_model_parallel_size"),
    "virtual_pipeline_model_parallel_size": (("num_layers_per_virtual_pipeline_stage",),
                                             lambda a: a.virtual_pipeline_model_parallel_size),
    "sequence_parallel": _copy("sequence_parallel"),
    "context_parallel_size": _copy("context_parallel_size"),
    "cp_comm_type": _copy("cp_comm_type"),
    "params_dtype": (("fp16", "bf16"), lambda a: getattr(a, "params_dtype", torch.float)),
    "fp16": _copy("fp16"),
    "bf16": _copy("bf16"),
    "use_cpu_initialization": (("use_cpu_initialization",),
                               lambda a: bool(a.use_cpu_initialization) or not torch.cuda.is_available()),
    "perform_initialization": _copy("perform_initialization"),
    "gradient_accumulation_fusion": _copy("gradient_accumulation_fusion"),
    "async_tensor_model_parallel_allreduce": _copy("async_tensor_model_parallel_allreduce"),
    "deterministic_mode": _copy("deterministic_mode"),
    # shape
    "num_layers": _copy("num_layers"),
    "encoder_num_layers": _copy("encoder_num_layers"),
    "decoder_num_layers": _copy("decoder_num_layers"),
    "hidden_size": _copy("hidden_size"),
    "num_attention_heads": _copy("num_attention_heads"),
    "ffn_hidden_size": _copy("ffn_hidden_size"),
    "kv_channels": _copy("kv_channels"),
    "max_position_embeddings": _copy("max_position_embeddings"),
    "padded_vocab_size": (("make_vocab_size_divisible_by",), lambda a: getattr(a, "padded_vocab_size", None) or 0),
    # attention
    "group_query_attention": _copy("group_query_attention"),
    "num_query_groups": (("num_query_groups", "group_query_attention"), _num_query_groups),
    "add_bias_linear": _copy("add_bias_linear"),
    "add_qkv_bias": _copy("add_qkv_bias"),
    "apply_query_key_layer_scaling": _copy("apply_query_key_layer_scaling"),
    "attention_softmax_in_fp32": _copy("attention_softmax_in_fp32"),
    "masked_softmax_fusion": _copy("masked_softmax_fusion"),
    "use_flash_attn": _copy("use_flash_attn"),
    "attention_dropout": _copy("attention_dropout"),
    # positions
    # (a Megatron-DeepSpeed checkpoint's args hold an enum member: megatron/enums.py names it)
    "position_embedding_type": (("position_embedding_type", "use_rotary_position_embeddings", "add_position_embedding"),
                                lambda a: position_embedding_name(a.position_embedding_type)),
    "rotary_base": _copy("rotary_base"),
    "embed_layernorm": _copy("embed_layernorm"),
    "rotary_percent": _copy("rotary_percent"),
    "rotary_seq_len_interpolation_factor": _copy("rotary_seq_len_interpolation_factor"),
    "use_rope_scaling": _copy("use_rope_scaling"),
    "rope_scaling_factor": _copy("rope_scaling_factor"),
    "rope_scaling_low_freq_factor": _copy("rope_scaling_low_freq_factor"),
    "rope_scaling_high_freq_factor": _copy("rope_scaling_high_freq_factor"),
    "rope_scaling_original_max_position_embeddings": _copy("rope_scaling_original_max_position_embeddings"),
    # normalization
    "normalization": _copy("normalization"),
    "layernorm_epsilon": _copy("layernorm_epsilon"),
    "apply_layernorm_1p": _copy("apply_layernorm_1p"),
    "apply_residual_connection_post_layernorm": _copy("apply_residual_connection_post_layernorm"),
    "fp32_residual_connection": _copy("fp32_residual_connection"),
    # MLP / activation
    "openai_gelu": _copy("openai_gelu"),
    "squared_relu": _copy("squared_relu"),
    "swiglu": _copy("swiglu"),
    "bias_swiglu_fusion": _copy("bias_swiglu_fusion"),
    "glu_activation": _copy("glu_activation"),
    # Megatron's MLP with --onnx-safe uses erf GeLU without the (tanh) fused bias-GeLU.
    "bias_gelu_fusion": (("bias_gelu_fusion", "onnx_safe"), lambda a: a.bias_gelu_fusion and not a.onnx_safe),
    "bias_dropout_fusion": _copy("bias_dropout_fusion"),
    "hidden_dropout": _copy("hidden_dropout"),
    # embeddings / output layer
    "share_embeddings_and_output_weights": (("untie_embeddings_and_output_weights",),
                                            lambda a: not a.untie_embeddings_and_output_weights),
    # initialization
    "init_method_std": _copy("init_method_std"),
    "init_method": (("init_method_xavier_uniform",), _init_method),
    "output_layer_init_method": (("init_method_xavier_uniform",), _init_method),
    # mixture of experts (megatron/moe_arguments.py)
    "num_moe_experts": _copy("num_experts"),
    "moe_ffn_hidden_size": _copy("moe_ffn_hidden_size"),
    "moe_router_topk": _copy("moe_router_topk"),
    "moe_router_load_balancing_type": _copy("moe_router_load_balancing_type"),
    "moe_aux_loss_coeff": _copy("moe_aux_loss_coeff"),
    "moe_z_loss_coeff": _copy("moe_z_loss_coeff"),
    "moe_router_pre_softmax": _copy("moe_router_pre_softmax"),
    "moe_router_score_function": _copy("moe_router_score_function"),
    "moe_router_topk_scaling_factor": _copy("moe_router_topk_scaling_factor"),
    "moe_router_dtype": _copy("moe_router_dtype"),
    "moe_expert_capacity_factor": _copy("moe_expert_capacity_factor"),
    "moe_token_drop_policy": _copy("moe_token_drop_policy"),
    "moe_pad_expert_input_to_capacity": _copy("moe_pad_expert_input_to_capacity"),
    "moe_layer_freq": _copy("moe_layer_freq"),
    "moe_shared_expert_intermediate_size": _copy("moe_shared_expert_intermediate_size"),
    "moe_shared_expert_gate": _copy("moe_shared_expert_gate"),
    "moe_apply_probs_on_input": _copy("moe_apply_probs_on_input"),
    "expert_model_parallel_size": _copy("expert_model_parallel_size"),
    "moe_token_dispatcher_type": _copy("moe_token_dispatcher_type"),
    # activation recomputation
    "recompute_granularity": (("recompute_granularity", "recompute_activations", "checkpoint_activations"),
                              lambda a: a.recompute_granularity),
    "recompute_method": _copy("recompute_method"),
    "recompute_num_layers": (("recompute_num_layers", "checkpoint_num_layers"), lambda a: a.recompute_num_layers),
    "distribute_saved_activations": _copy("distribute_saved_activations"),
}


def config_mapped_dests() -> Dict[str, str]:
    """Parser destination -> the config field(s) it feeds (for the every-flag test and error messages)."""
    out: Dict[str, str] = {}
    for name, (dests, _) in CONFIG_FIELDS.items():
        for dest in dests:
            out[dest] = f"{out[dest]}, {name}" if dest in out else name
    return out


def dests_without_config_field(config_cls: type) -> Tuple[str, ...]:
    """Destinations that feed only fields `config_cls` does not declare (set to a non-default value: refused)."""
    declared = {f.name for f in dataclasses.fields(config_cls)}
    feeding: Dict[str, bool] = {}
    for name, (dests, _) in CONFIG_FIELDS.items():
        for dest in dests:
            feeding[dest] = feeding.get(dest, False) or name in declared
    return tuple(dest for dest, used in feeding.items() if not used)


def config_kwargs_from_args(config_cls: type, args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of `config_cls` computed from validated `args` through `CONFIG_FIELDS`.

    Only fields `config_cls` declares are passed (so the table may name fields of a newer config); a getter that
    yields None, or reads a flag an older namespace (a checkpoint's saved args) does not have, leaves the field at
    its default.
    """
    declared = {f.name for f in dataclasses.fields(config_cls)}
    kwargs: Dict[str, Any] = {}
    for name, (_dests, getter) in CONFIG_FIELDS.items():
        if name not in declared:
            continue
        try:
            value = getter(args)
        except AttributeError:
            continue
        if value is not None:
            kwargs[name] = value
    return kwargs
