"""The model architecture a checkpoint was trained with: stored in it, checked on load, restored on request.

Every checkpoint holds ``architecture``: the `TransformerConfig` fields that decide the weights' shapes or the forward
computation (`ARCHITECTURE_FIELDS`), computed from the flags through the same table the model config is built from
(megatron/settings/config_flags.py). Loading compares it with this run's flags and stops with one line naming the field and
both values; ``--use-checkpoint-args`` restores all of it (plus the sequence length and tokenizer settings when
their flags are not given). Checkpoints written before ``architecture`` existed fall back to the ``args`` namespace
saved in them (fields that namespace lacks are neither checked nor restored).

Functions here take records (the architecture as a mapping, the flags' values as a mapping) and return values; the
record is built by megatron/run_configs/architecture.py, and Megatron's ``args``-taking forms (``check_architecture``,
``use_checkpoint_args``, ``restore_architecture``) are megatron/compat.py's. The flags' defaults come from their
declarations (megatron/settings/), not from the parser.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron.checkpoint.integrity import read_pointer_file
from megatron.errors import MegatronUserError
from megatron.run_configs.architecture import ARCHITECTURE_FIELDS, architecture_from_args
from megatron.settings import add_core_groups, add_last_groups, filled_if_unset, flag_hints, restore_rules

__all__ = ["ARCHITECTURE_FIELDS", "FILLED_IF_UNSET", "ArchitectureMismatchError", "architecture_changes",
           "architecture_from_args", "checkpoint_flag_values", "compare_architecture", "deepspeed_state_file",
           "fill_derived_defaults", "flag_defaults", "saved_architecture"]


class ArchitectureMismatchError(MegatronUserError, RuntimeError):
    """The checkpoint's architecture differs from this run's flags (one line: field, both values, the flag)."""


# Restored by --use-checkpoint-args only when the flag is left at its default (Megatron's rule for these).
FILLED_IF_UNSET: Tuple[str, ...] = filled_if_unset()

# The flag(s) to pass for a field, where it is not simply --field-name.
_FLAG_OF_FIELD: Dict[str, str] = flag_hints()

# field -> [(parser destination, value of that destination for a saved field value)] for --use-checkpoint-args.
_RESTORE: Dict[str, List[Tuple[str, Callable[[Any], Any]]]] = restore_rules()


def fill_derived_defaults(arch: Dict[str, Any], ckpt_args: Any = None) -> Dict[str, Any]:
    """Fill the sizes Megatron derives when a flag is left unset (`None` or absent in saved args): ffn_hidden_size
    4h (SwiGLU: 2/3 of that, rounded down to 64), kv_channels h/heads, encoder_num_layers num_layers, the padded
    vocabulary from `orig_vocab_size`; fields still unknown are dropped (an unknown field is never compared)."""
    if arch.get("bias_gelu_fusion") is None and getattr(ckpt_args, "bias_activation_fusion", None) is not None:
        arch["bias_gelu_fusion"] = bool(ckpt_args.bias_activation_fusion)  # Megatron Core's name for the fusion
    h, heads = arch.get("hidden_size"), arch.get("num_attention_heads")
    if arch.get("ffn_hidden_size") is None and h:
        arch["ffn_hidden_size"] = int((4 * h * 2 / 3) / 64) * 64 if arch.get("swiglu") else 4 * h
    if arch.get("kv_channels") is None and h and heads:
        arch["kv_channels"] = h // heads
    if arch.get("encoder_num_layers") is None and arch.get("num_layers"):
        arch["encoder_num_layers"] = arch["num_layers"]
    if not arch.get("padded_vocab_size") and ckpt_args is not None:
        vocab, multiple = getattr(ckpt_args, "orig_vocab_size", None), getattr(ckpt_args, "make_vocab_size_divisible_by", None)
        if vocab and multiple:
            step = multiple * (getattr(ckpt_args, "tensor_model_parallel_size", None) or 1)
            arch["padded_vocab_size"] = -(-vocab // step) * step
    return {k: v for k, v in arch.items() if v is not None or k == "num_query_groups"}


def saved_architecture(architecture: Optional[Mapping[str, Any]],
                       ckpt_args: Optional[argparse.Namespace]) -> Dict[str, Any]:
    """The checkpoint's stored architecture, or (older and third-party checkpoints) the one computed from its saved
    args with Megatron's derived defaults filled in."""
    if architecture:
        return dict(architecture)
    return fill_derived_defaults(architecture_from_args(ckpt_args), ckpt_args) if ckpt_args is not None else {}


# Megatron's defaults for the activation flags a third-party `args` may leave out.
_ACTIVATION_DEFAULTS = {"swiglu": False, "glu_activation": None, "squared_relu": False, "openai_gelu": False,
                        "bias_gelu_fusion": True, "add_bias_linear": True}
_ACTIVATION_FLAGS = ("swiglu", "glu_activation", "squared_relu", "openai_gelu", "bias_gelu_fusion")
_ACTIVATION_FIX = {"swiglu": "pass --swiglu", "squared_relu": "pass --squared-relu",
                   "tanh GeLU": "pass --openai-gelu (or drop --no-bias-gelu-fusion)",
                   "erf GeLU": "pass --no-bias-gelu-fusion and drop --openai-gelu"}


def _flag(arch: Mapping[str, Any], key: str) -> Any:
    """An activation flag's value, Megatron's default where `arch` does not record it."""
    value = arch.get(key)
    return _ACTIVATION_DEFAULTS[key] if value is None else value


def _activation(arch: Mapping[str, Any]) -> str:
    """What the MLP computes (the flags overlap: --openai-gelu and the fused bias-GeLU are both tanh GeLU)."""
    def get(key: str) -> Any:
        return _flag(arch, key)

    if get("swiglu"):
        return "swiglu"
    if get("glu_activation"):
        return "glu " + get("glu_activation")
    if get("squared_relu"):
        return "squared_relu"
    return "tanh GeLU" if get("openai_gelu") or (get("bias_gelu_fusion") and get("add_bias_linear")) else "erf GeLU"


def _fix(field: str, value: Any) -> str:
    """What to pass to get `value` for `field`."""
    if field in _FLAG_OF_FIELD:
        return "pass " + _FLAG_OF_FIELD[field]
    flag = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return f"pass {flag}" if value else f"drop {flag}"
    if isinstance(value, list):  # --moe-layer-freq / --window-attn-skip-freq / --window-size: one shell word
        value = "[" + ",".join(str(v) for v in value) + "]"
    return f"pass {flag} {value}"


def _check_activation(saved: Mapping[str, Any], current: Mapping[str, Any], path: str) -> None:
    """One line when the MLPs compute different activations (flags the checkpoint lacks take Megatron's default)."""
    if not any(saved.get(k) is not None for k in _ACTIVATION_FLAGS):
        return
    if not any(current.get(k) is not None for k in _ACTIVATION_FLAGS):
        return  # the loading side records no activation (a bare Namespace, as Megatron's tools pass): nothing to compare
    have, want = _activation(current), _activation(saved)
    if have == want:
        return
    name = next(k for k in _ACTIVATION_FLAGS + ("add_bias_linear",) if _flag(saved, k) != _flag(current, k))
    fix = (_fix(name, _flag(saved, name)) if name == "add_bias_linear"
           else _ACTIVATION_FIX.get(want) or f"pass --glu-activation {want[len('glu '):]}")
    raise ArchitectureMismatchError(
        f"checkpoint {path} has {name}={_flag(saved, name)!r} but this run's flags give "
        f"{name}={_flag(current, name)!r} (an MLP with {want}, not {have}): {fix} to match, "
        "or --use-checkpoint-args to take the architecture from the checkpoint")


def compare_architecture(saved: Mapping[str, Any], current: Mapping[str, Any], path: str) -> None:
    """One line naming the first field where the checkpoint's architecture (`saved`) and this run's (`current`, the
    record `architecture_from_args` builds) differ, with both values and the flag to pass."""
    for name in ARCHITECTURE_FIELDS:
        if name == ARCHITECTURE_FIELDS[0]:
            _check_activation(saved, current, path)
        if name not in saved or name not in current or name in _ACTIVATION_FLAGS:
            continue  # the activation flags are compared as what they compute together
        have, want = current[name], saved[name]
        if name in ("encoder_num_layers", "decoder_num_layers"):  # None: --num-layers (Megatron's default)
            have, want = have or current.get("num_layers"), want or saved.get("num_layers")
        if want is None and name != "num_query_groups":
            continue  # unknown in the checkpoint: never blocks a load
        if name == "padded_vocab_size" and not (have and want):
            continue  # not known on one side (before the tokenizer is built, or an old checkpoint)
        if name == "max_position_embeddings" and current.get("position_embedding_type") != "learned_absolute":
            continue  # no position-embedding table: the length limit is a run-time setting
        if have != want:
            raise ArchitectureMismatchError(
                f"checkpoint {path} has {name}={want!r} but this run's flags give {name}={have!r}: "
                f"{_fix(name, want)} to match, or --use-checkpoint-args to take the architecture from the checkpoint")


def architecture_changes(given: Mapping[str, Any], saved: Mapping[str, Any], ckpt_args: Optional[argparse.Namespace],
                         defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """--use-checkpoint-args: {flag destination: value} that makes validation rebuild the saved architecture, from
    the flags' values as parsed (`given`) and their defaults (`defaults`, `flag_defaults`).

    A flag given explicitly (not at its default) with a different value is an error naming it."""
    changes: Dict[str, Any] = {}
    for name in ARCHITECTURE_FIELDS:
        if name not in saved:
            continue
        for dest, convert in _RESTORE.get(name, [(name, lambda v: v)]):
            changes[dest] = convert(saved[name])
    if "num_query_groups" in changes and changes["num_query_groups"] is None:
        changes["group_query_attention"] = False
    for name in FILLED_IF_UNSET:
        if ckpt_args is not None and hasattr(ckpt_args, name) and given.get(name, None) == defaults.get(name, None):
            changes[name] = getattr(ckpt_args, name)
    for dest, value in changes.items():
        if dest not in defaults or dest not in given:
            continue
        current, default = given[dest], defaults[dest]
        if current != default and current != value and current is not None:
            raise ArchitectureMismatchError(
                f"--use-checkpoint-args: the checkpoint has {dest}={value!r} but the flags set {dest}={current!r}; "
                f"drop that flag (the checkpoint decides the architecture)")
    return changes


def flag_defaults() -> Dict[str, Any]:
    """dest -> default of every core flag, as argparse's action list gives it (for a destination two flags share, the
    last action's), from a parser of the declared groups (megatron/settings/)."""
    parser = add_last_groups(add_core_groups(argparse.ArgumentParser(allow_abbrev=False)))
    return {action.dest: action.default for action in parser._actions}


def checkpoint_flag_values(state_dict: Mapping[str, Any], given: Mapping[str, Any]) -> Dict[str, Any]:
    """--use-checkpoint-args from a loaded checkpoint file: the flag values restoring its whole architecture, for
    flags whose values as parsed are `given`."""
    ckpt_args = state_dict.get("args")
    saved = saved_architecture(state_dict.get("architecture"), ckpt_args)
    return architecture_changes(given, saved, ckpt_args, flag_defaults())


def deepspeed_state_file(load_dir: str, select_tag: Optional[Callable[[str], str]] = None) -> Optional[str]:
    """The file of a DeepSpeed checkpoint (``latest`` -> ``global_stepN/mp_rank_00_model_states.pt``) that holds
    Megatron's client state (args, architecture); None when `load_dir` has no DeepSpeed checkpoint.
    `select_tag(latest tag)` picks the tag actually loaded (the integrity fallback)."""
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    try:
        tag = read_pointer_file(latest)
    except ValueError as exc:
        raise MegatronUserError(str(exc)) from None
    if select_tag is not None:
        tag = select_tag(tag)
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    return path if os.path.isfile(path) else None
