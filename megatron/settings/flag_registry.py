"""Every command-line destination that is not a model-config field: where it is read, or why it is refused.

"Nothing accepted is ignored": each parser destination of each entry script is exactly one of
  * a source of a `TransformerConfig` field (megatron/settings/config_flags.py, `CONFIG_FIELDS`);
  * a run-time setting (`RUNTIME_SETTINGS`: dest -> the file that reads it; the every-flag test checks that the
    file mentions it);
  * a setting that only picks a kernel or communication variant in Megatron and gives the same numbers
    (`SAME_RESULT_VARIANTS`: dest -> why; we have one variant, so any value is honoured);
  * refused when set (`REFUSED`: dest -> (default, one-line reason)), or refused outside the model family that uses it
    (`FAMILY_ONLY`: dest -> (families, default)).
`refuse_unimplemented(args)` (called by validate_args) raises one line naming the first refused flag that is set.

The tables are derived from the settings' declarations (megatron/settings/: `setting(..., read_by=...)`,
``variant=``, ``refused=``, ``families=``, ``config=``), the entry scripts' own groups included. Adding a flag: one
`setting(...)` line in its group there, and read it. tests/test_every_flag.py names what is missing.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, Mapping, Tuple

from megatron.errors import ArgumentError
from megatron.settings import family_only, refused, runtime_settings, same_result_variants

# Destinations that no `setting(...)` declares: the two parse_args sets from the launcher's environment (and a flag
# an entry script adds with a plain add_argument: declare it in megatron/settings/ instead).
_NOT_DECLARED: Dict[str, str] = {
    "world_size": "megatron/arguments.py",
    "rank": "megatron/arguments.py",
}

# dest -> the file (repository-relative) that reads it. Settings checked and then folded into others by
# validate_args (aliases, deprecated spellings that are refused there) name megatron/arguments.py.
RUNTIME_SETTINGS: Dict[str, str] = {**runtime_settings(), **_NOT_DECLARED}

# In Megatron these only choose a kernel or a communication pattern; the numbers are the same. We have one variant.
SAME_RESULT_VARIANTS: Dict[str, str] = same_result_variants()

# dest -> (default, why it is refused when set to anything else). Implement a flag and give it `read_by` instead.
REFUSED: Dict[str, Tuple[Any, str]] = refused()

# dest -> (model families that read it, default). The entry script's family comes from its args_defaults
# ("model_family", default "gpt"); pretrain_bert.py is "bert" (it reads --bert-no-binary-head,
# --mask-prob, --short-seq-prob); pretrain_t5.py is "t5" (--decoder-seq-length, --encoder/--decoder-num-layers,
# --mask-prob, --short-seq-prob); the other entry scripts are GPT.
FAMILY_ONLY: Dict[str, Tuple[Tuple[str, ...], Any]] = family_only()

# Attributes validate_args / start-up set that are not flags (never parser destinations; listed so that a flag
# with one of these names is noticed).
DERIVED_ATTRIBUTES = frozenset({
    "data_parallel_size", "transformer_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "params_dtype", "padded_vocab_size", "consumed_train_samples", "consumed_valid_samples", "iteration",
    "model_family",
})


class UnsupportedFlagError(ArgumentError):
    """A flag that parses but is not implemented here (one line naming it)."""


def refuse_unimplemented(args: argparse.Namespace, flags: Mapping[str, Tuple[str, Any]],
                         missing_config_dests: Iterable[str] = ()) -> None:
    """Raise one line naming the first flag set to a non-default value that this build does not implement.

    `flags`: dest -> (option string, parser default) of the core parser; `missing_config_dests`: the sources of
    config fields the model's config class does not declare.
    """
    def name(dest: str) -> str:
        return flags[dest][0] if dest in flags else "--" + dest.replace("_", "-")

    for dest, (default, why) in REFUSED.items():
        if hasattr(args, dest) and getattr(args, dest) != default:
            raise UnsupportedFlagError(f"{name(dest)} {why}; drop it")
    family = getattr(args, "model_family", "gpt")
    for dest, (families, default) in FAMILY_ONLY.items():
        if family not in families and hasattr(args, dest) and getattr(args, dest) != default:
            raise UnsupportedFlagError(f"{name(dest)} is a {'/'.join(f.upper() for f in families)} setting that this "
                                       f"{family.upper()} entry point does not use: drop it (an entry point that "
                                       f"reads it passes args_defaults={{'model_family': '{families[0]}'}})")
    if family != "t5" and getattr(args, "encoder_num_layers", None) not in (None, getattr(args, "num_layers", None)):
        raise UnsupportedFlagError(f"--encoder-num-layers is a T5 setting; this {family.upper()} entry point uses "
                                   "--num-layers: drop it")
    for dest in missing_config_dests:
        if dest in flags and getattr(args, dest, flags[dest][1]) != flags[dest][1]:
            raise UnsupportedFlagError(f"{name(dest)} is not implemented by this model (no config field reads it); "
                                       "drop it")
