"""The model architecture a checkpoint was trained with: stored in it, checked on load, restored on request.

Every checkpoint holds ``architecture``: the `TransformerConfig` fields that decide the weights' shapes or the forward
computation (`ARCHITECTURE_FIELDS`), computed from the flags through the same table the model config is built from
(megatron/config_flags.py). Loading compares it with this run's flags and stops with one line naming the field and
both values; ``--use-checkpoint-args`` restores all of it (plus the sequence length and tokenizer settings when
their flags are not given). Checkpoints written before ``architecture`` existed fall back to the ``args`` namespace
saved in them (fields that namespace lacks are neither checked nor restored).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.arguments import build_parser
from megatron.config_flags import CONFIG_FIELDS
from megatron.errors import MegatronUserError


class ArchitectureMismatchError(MegatronUserError, RuntimeError):
    """The checkpoint's architecture differs from this run's flags (one line: field, both values, the flag)."""


# TransformerConfig fields that change the weights' shapes or what the forward pass computes with given weights;
# the kinds first (a different kind also changes derived sizes, e.g. --swiglu the FFN width: name the cause).
ARCHITECTURE_FIELDS: Tuple[str, ...] = (
    "normalization", "layernorm_epsilon", "apply_layernorm_1p", "apply_residual_connection_post_layernorm",
    "openai_gelu", "squared_relu", "swiglu", "add_bias_linear", "add_qkv_bias", "bias_gelu_fusion",
    "position_embedding_type", "rotary_base", "rotary_percent", "group_query_attention", "num_query_groups",
    "share_embeddings_and_output_weights",
    "num_layers", "encoder_num_layers", "decoder_num_layers", "hidden_size", "num_attention_heads",
    "ffn_hidden_size", "kv_channels", "max_position_embeddings", "padded_vocab_size",
)

# Restored by --use-checkpoint-args only when the flag is left at its default (Megatron's rule for these).
FILLED_IF_UNSET: Tuple[str, ...] = ("seq_length", "tokenizer_type", "make_vocab_size_divisible_by")

# The flag(s) to pass for a field, where it is not simply --field-name.
_FLAG_OF_FIELD: Dict[str, str] = {
    "padded_vocab_size": "the same vocab file and --make-vocab-size-divisible-by",
    "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights (or not)",
    "add_bias_linear": "--disable-bias-linear (or not)",
    "bias_gelu_fusion": "--no-bias-gelu-fusion (or not)",
    "layernorm_epsilon": "--norm-epsilon",
    "num_query_groups": "--group-query-attention --num-query-groups",
}

# field -> [(parser destination, value of that destination for a saved field value)] for --use-checkpoint-args.
_RESTORE: Dict[str, List[Tuple[str, Callable[[Any], Any]]]] = {
    "share_embeddings_and_output_weights": [("untie_embeddings_and_output_weights", lambda v: not v)],
    "position_embedding_type": [("position_embedding_type", lambda v: v),
                                ("use_rotary_position_embeddings", lambda v: v == "rope"),
                                ("add_position_embedding", lambda v: v == "learned_absolute")],
    "bias_gelu_fusion": [("bias_gelu_fusion", lambda v: v), ("onnx_safe", lambda v: None)],
}


def _plain(value: Any) -> Any:
    """Python scalars only (the checkpoint loads weights-only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def architecture_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """{field: value} for `ARCHITECTURE_FIELDS` computed from (validated) args; fields it cannot compute are left out."""
    out: Dict[str, Any] = {}
    for name in ARCHITECTURE_FIELDS:
        _dests, getter = CONFIG_FIELDS[name]
        try:
            out[name] = _plain(getter(args))
        except AttributeError:  # a namespace from an older version lacks the flag
            continue
    return out


def saved_architecture(architecture: Optional[Mapping[str, Any]],
                       ckpt_args: Optional[argparse.Namespace]) -> Dict[str, Any]:
    """The checkpoint's stored architecture, or (older checkpoints) the one computed from its saved args."""
    if architecture:
        return dict(architecture)
    return architecture_from_args(ckpt_args) if ckpt_args is not None else {}


def _fix(field: str, value: Any) -> str:
    """What to pass to get `value` for `field`."""
    if field in _FLAG_OF_FIELD:
        return "pass " + _FLAG_OF_FIELD[field]
    flag = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return f"pass {flag}" if value else f"drop {flag}"
    return f"pass {flag} {value}"


def check_architecture(saved: Mapping[str, Any], args: argparse.Namespace, path: str) -> None:
    """One line naming the first field where the checkpoint and this run's flags differ, with both values."""
    current = architecture_from_args(args)
    for name in ARCHITECTURE_FIELDS:
        if name not in saved or name not in current:
            continue
        have, want = current[name], saved[name]
        if name == "padded_vocab_size" and not (have and want):
            continue  # not known on one side (before the tokenizer is built, or an old checkpoint)
        if name == "max_position_embeddings" and current.get("position_embedding_type") != "learned_absolute":
            continue  # no position-embedding table: the length limit is a run-time setting
        if name == "bias_gelu_fusion" and not (current.get("add_bias_linear", True) and not any(
                current.get(k) for k in ("openai_gelu", "squared_relu", "swiglu"))):
            continue  # the fusion (tanh GeLU) only applies to a plain GeLU MLP with a bias
        if have != want:
            raise ArchitectureMismatchError(
                f"checkpoint {path} has {name}={want!r} but this run's flags give {name}={have!r}: "
                f"{_fix(name, want)} to match, or --use-checkpoint-args to take the architecture from the checkpoint")


def restore_architecture(args: argparse.Namespace, saved: Mapping[str, Any],
                         ckpt_args: Optional[argparse.Namespace], flag_defaults: Mapping[str, Any]) -> List[str]:
    """--use-checkpoint-args: set the flags' destinations so that validation rebuilds the saved architecture.

    A flag given explicitly (not at its parser default in `flag_defaults`) with a different value is an error naming
    it; returns the destinations that were set.
    """
    changes: Dict[str, Any] = {}
    for name in ARCHITECTURE_FIELDS:
        if name not in saved:
            continue
        for dest, convert in _RESTORE.get(name, [(name, lambda v: v)]):
            changes[dest] = convert(saved[name])
    if "num_query_groups" in changes and changes["num_query_groups"] is None:
        changes["group_query_attention"] = False
    for name in FILLED_IF_UNSET:
        if ckpt_args is not None and hasattr(ckpt_args, name) and \
                getattr(args, name, None) == flag_defaults.get(name, None):
            changes[name] = getattr(ckpt_args, name)
    for dest, value in changes.items():
        if dest not in flag_defaults or not hasattr(args, dest):
            continue
        given, default = getattr(args, dest), flag_defaults[dest]
        if given != default and given != value and given is not None:
            raise ArchitectureMismatchError(
                f"--use-checkpoint-args: the checkpoint has {dest}={value!r} but the flags set {dest}={given!r}; "
                f"drop that flag (the checkpoint decides the architecture)")
    for dest, value in changes.items():
        setattr(args, dest, value)
    return sorted(changes)


def flag_defaults() -> Dict[str, Any]:
    """dest -> parser default of every core flag."""
    return {action.dest: action.default for action in build_parser()._actions}


def use_checkpoint_args(args: argparse.Namespace, state_dict: Mapping[str, Any]) -> List[str]:
    """--use-checkpoint-args from a loaded checkpoint file: restore its whole architecture into `args`."""
    ckpt_args = state_dict.get("args")
    saved = saved_architecture(state_dict.get("architecture"), ckpt_args)
    return restore_architecture(args, saved, ckpt_args, flag_defaults())


def deepspeed_state_file(load_dir: str, select_tag: Optional[Callable[[str], str]] = None) -> Optional[str]:
    """The file of a DeepSpeed checkpoint (``latest`` -> ``global_stepN/mp_rank_00_model_states.pt``) that holds
    Megatron's client state (args, architecture); None when `load_dir` has no DeepSpeed checkpoint.
    `select_tag(latest tag)` picks the tag actually loaded (the integrity fallback)."""
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    from megatron.checkpoint_integrity import read_pointer_file

    try:
        tag = read_pointer_file(latest)
    except ValueError as exc:
        raise MegatronUserError(str(exc)) from None
    if select_tag is not None:
        tag = select_tag(tag)
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    return path if os.path.isfile(path) else None
