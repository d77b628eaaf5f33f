"""megatron/presets.py is the one declaration of the named model presets.

- examples/presets/ holds exactly the shell files the module writes (same names, same bytes), so the example scripts,
  the tests and the benchmarks read the same shapes;
- bash sourcing those files gives the flags `Preset.argv` gives (one bash process for all of them), SEQ_LENGTH
  included;
- every preset parses with Megatron's flags; an unknown name is refused naming the choices.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron.presets import PRESETS, get_preset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "presets"


def test_example_preset_files_are_the_modules_output() -> None:
    examples = {name: p for name, p in PRESETS.items() if p.example}
    assert sorted(f.stem for f in EXAMPLES.glob("*.sh")) == sorted(examples)
    for name, preset in examples.items():
        assert (EXAMPLES / f"{name}.sh").read_text() == preset.shell(), \
            f"examples/presets/{name}.sh differs: run python -m megatron.presets --write examples/presets"
    assert {"gpt_tiny", "gpt_345m", "llama_tiny", "llama2_7b", "mixtral_tiny", "mixtral_8x7b", "bert_tiny",
            "bert_345m", "t5_tiny", "t5_220m"} <= set(examples)


def test_bash_sees_the_same_flags() -> None:
    examples = [p for p in PRESETS.values() if p.example]
    script = "".join(f'(source "{EXAMPLES}/{p.name}.sh"; echo "${p.family.upper()}_MODEL_ARGS")\n'
                     f'(SEQ_LENGTH=64; source "{EXAMPLES}/{p.name}.sh"; echo "${p.family.upper()}_MODEL_ARGS")\n'
                     for p in examples)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]}).stdout.splitlines()
    for i, preset in enumerate(examples):
        assert out[2 * i].split() == preset.argv(), preset.name
        shorter = preset.argv(64) if preset.seq_length else preset.argv()
        assert out[2 * i + 1].split() == shorter, preset.name


def test_presets_parse_and_unknown_names_are_refused() -> None:
    from megatron.arguments import parse_args

    for preset in PRESETS.values():
        args = parse_args(args=preset.argv())
        assert args.num_layers == int(preset.value("--num-layers")) and args.hidden_size > 0, preset.name
    assert get_preset("llama2_7b").argv(seq_length=2048)[get_preset("llama2_7b").argv().index("--seq-length") + 1] \
        == "2048"
    with pytest.raises(ValueError, match="unknown preset 'gpt_huge': use one of gpt_tiny"):
        get_preset("gpt_huge")
    with pytest.raises(ValueError, match="fixed sequence length"):
        get_preset("gpt_345m").argv(seq_length=64)
