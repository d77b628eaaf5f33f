"""The ``architecture`` record a checkpoint stores: the `TransformerConfig` fields that decide the weights' shapes or
the forward computation (`ARCHITECTURE_FIELDS`, each declaration's ``arch`` position in megatron/settings/: the order
fixes the checkpoint's bytes), computed from the flags through the table the model config is built from
(megatron/settings/config_flags.py). The checkpoint code compares and restores it (megatron/checkpoint/args.py); this
module only builds it, so the records never import checkpoint code.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Tuple

from megatron.settings import architecture_fields
from megatron.settings.config_flags import CONFIG_FIELDS

# TransformerConfig fields that change the weights' shapes or what the forward pass computes with given weights, in
# the record's order; the kinds first (a different kind also changes derived sizes, e.g. --swiglu the FFN width:
# name the cause). The router's loss coefficients are training settings, not architecture.
ARCHITECTURE_FIELDS: Tuple[str, ...] = architecture_fields()


def plain_value(value: Any) -> Any:
    """Python scalars only (the checkpoint loads weights-only)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)  # --moe-layer-freq as a 0/1 pattern, --window-size (W, R)
    return str(value)


def architecture_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """{field: value} for `ARCHITECTURE_FIELDS` computed from (validated) args; fields it cannot compute are left out."""
    out: Dict[str, Any] = {}
    for name in ARCHITECTURE_FIELDS:
        _dests, getter = CONFIG_FIELDS[name]
        try:
            out[name] = plain_value(getter(args))
        except AttributeError:  # a namespace from an older version lacks the flag
            continue
    return out
