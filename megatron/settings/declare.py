"""How a setting is declared: `setting(...)` makes a dataclass field whose metadata says everything about it.

A settings group is a dataclass (one per ``--help`` group, fields in ``--help`` order) whose fields are settings. The
field's name is the parser destination, its default the flag's default, its annotation the value's type (the argparse
``type`` comes from it unless given). The metadata (`Spec`) carries the flag name(s), the help text, the argparse
details (action, choices, nargs) and where the value goes, which is exactly what the "nothing accepted is ignored"
rule asks (tests/test_every_flag.py):

* `config`: the `TransformerConfig` field(s) it feeds (`ConfigField`: name, how it is computed when not a copy, its
  position in the checkpoint's ``architecture`` record when it is part of the architecture); `feeds`: config fields
  another setting computes partly from this one;
* `optimizer_config`: it is the `OptimizerConfig` field of the same name (megatron/optimizer/optimizer_config.py);
* `read_by`: the repository file that reads it (a run-time setting);
* `variant`: why any value gives the same numbers here (Megatron picks a kernel or communication pattern with it);
* `refused`: why a value other than the default is refused at start-up; `families`: the model families that read it
  (other entry points refuse it).

Derived from these declarations: the parser (`add_group`), `config_flags.CONFIG_FIELDS`,
`checkpoint.args.ARCHITECTURE_FIELDS` and the tables of `megatron.settings.flag_registry`.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

Getter = Callable[[argparse.Namespace], Any]
_META = "megatron_setting"


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """A `TransformerConfig` field fed by a setting.

    name: the field (None: the setting's own name); compute: how it is computed from validated args (None: a copy of
    the setting); arch: its position in the checkpoint's ``architecture`` record (None: not architecture; the
    positions fix the record's order, hence the checkpoint's bytes); kept: its position in the architecture a
    converted model keeps (the converter's `interchange.KEPT_FIELDS`; None: not kept; the positions fix the order of a
    converted checkpoint's ``architecture``); hint: what to pass for it in a mismatch message (default
    ``--field-name``); restore: (destination, value from the saved field value) pairs that
    --use-checkpoint-args sets (default: the field's own name, unchanged).
    """

    name: Optional[str] = None
    compute: Optional[Getter] = None
    arch: Optional[int] = None
    kept: Optional[int] = None
    hint: Optional[str] = None
    restore: Optional[Tuple[Tuple[str, Callable[[Any], Any]], ...]] = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything about one setting except its name, type and default (the dataclass field's)."""

    flags: Tuple[str, ...]
    help: str
    parser_kwargs: Dict[str, Any]
    also: Tuple[Tuple[Tuple[str, ...], Dict[str, Any]], ...] = ()
    config: Tuple[ConfigField, ...] = ()
    feeds: Tuple[str, ...] = ()
    optimizer_config: bool = False
    read_by: Optional[str] = None
    variant: Optional[str] = None
    refused: Optional[str] = None
    families: Tuple[str, ...] = ()
    restore_if_unset: bool = False


def setting(*flags: str, help: str, default: Any = None, action: Optional[str] = None, type: Any = None,
            choices: Any = None, nargs: Optional[str] = None, required: Optional[bool] = None,
            also: Tuple[Tuple[Tuple[str, ...], Dict[str, Any]], ...] = (),
            config: Union[bool, str, ConfigField, Tuple[Union[str, ConfigField], ...]] = (), arch: Optional[int] = None,
            kept: Optional[int] = None, feeds: Tuple[str, ...] = (), optimizer_config: bool = False,
            read_by: Optional[str] = None, variant: Optional[str] = None,
            refused: Optional[str] = None, families: Tuple[str, ...] = (),
            restore_if_unset: bool = False) -> Any:
    """A settings-group field: the flag(s) `flags` and everything the parser and the tables need (see module doc).

    `also`: further ((flags...), argparse kwargs) actions writing the same destination (a --no- form); `config=True`:
    feeds the config field of the same name; `arch` / `kept`: that field's position in the architecture record / in
    the architecture a converted model keeps;
    `restore_if_unset`: --use-checkpoint-args takes the checkpoint's value when the flag is left at its default.
    """
    if config is True:
        config = (ConfigField(),)
    elif isinstance(config, (str, ConfigField)):
        config = (config,)
    fields = tuple(ConfigField(c) if isinstance(c, str) else c for c in (config or ()))
    if arch is not None:
        fields = (dataclasses.replace(fields[0], arch=arch),) + fields[1:]
    if kept is not None:
        fields = (dataclasses.replace(fields[0], kept=kept),) + fields[1:]
    kwargs = {k: v for k, v in (("action", action), ("type", type), ("choices", choices), ("nargs", nargs),
                                ("required", required)) if v is not None}
    spec = Spec(flags=tuple(flags), help=help, parser_kwargs=kwargs, also=tuple(also), config=fields,
                feeds=tuple(feeds), optimizer_config=optimizer_config, read_by=read_by, variant=variant,
                refused=refused, families=tuple(families),
                restore_if_unset=restore_if_unset)
    return dataclasses.field(default=default, metadata={_META: spec})


def extra_flag(*flags: str, **kwargs: Any) -> Tuple[Tuple[str, ...], Dict[str, Any]]:
    """A further action writing the same destination, for `setting(also=...)` (e.g. the --no- form of a flag)."""
    return flags, kwargs


def spec_of(field: dataclasses.Field) -> Spec:
    return field.metadata[_META]


def flags_of(group: type, name: str) -> Tuple[str, ...]:
    """The option strings of setting `name` of a group (for a pre-parser that looks for one flag)."""
    return next(spec_of(f).flags for f in dataclasses.fields(group) if f.name == name)


def settings_of(group: type) -> Iterator[Tuple[str, Any, Spec]]:
    """(name, default, spec) of each setting of a group, in declaration (--help) order."""
    for field in dataclasses.fields(group):
        yield field.name, field.default, spec_of(field)


def _argparse_type(hint: Any) -> Any:
    """int/float/str from an annotation (Optional[...] and List[...] unwrapped); None when it names none of them."""
    if typing.get_origin(hint) is Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) != 1:
            return None
        hint = rest[0]
    if typing.get_origin(hint) is list:
        hint = typing.get_args(hint)[0]
    return hint if hint in (int, float, str) else None


def _parser_kwargs(name: str, default: Any, spec: Spec, hint: Any) -> Dict[str, Any]:
    kwargs = dict(spec.parser_kwargs)
    if "action" not in kwargs and hint is bool:
        kwargs["action"] = "store_false" if default else "store_true"
    if "action" not in kwargs and "type" not in kwargs:
        kwargs["type"] = _argparse_type(hint)
    if callable(kwargs.get("choices")):
        kwargs["choices"] = kwargs["choices"]()  # computed when the parser is built (e.g. the tokenizer types)
    return dict(kwargs, dest=name, default=default, help=spec.help)


def add_group(parser: argparse.ArgumentParser, group: type, skip_existing: bool = False) -> argparse.ArgumentParser:
    """Add a settings group to `parser` as one argparse group titled ``group.TITLE`` (flags in declaration order).

    `skip_existing`: leave out an action whose option string the parser already has (DeepSpeed's group, which a
    provider may have added itself through deepspeed.add_config_arguments).
    """
    arg_group = parser.add_argument_group(title=group.TITLE, description=getattr(group, "DESCRIPTION", None))
    hints = typing.get_type_hints(group)
    for name, default, spec in settings_of(group):
        actions = ((spec.flags, _parser_kwargs(name, default, spec, hints[name])),)
        actions += tuple((flags, dict(kw, dest=name)) for flags, kw in spec.also)
        for flags, kwargs in actions:
            if skip_existing and any(flag in parser._option_string_actions for flag in flags):
                continue
            arg_group.add_argument(*flags, **kwargs)
    return parser


def from_args(group: type, args: argparse.Namespace) -> Any:
    """An instance of a settings group holding the values in `args` (defaults for destinations it lacks)."""
    return group(**{f.name: getattr(args, f.name) for f in dataclasses.fields(group) if hasattr(args, f.name)})
