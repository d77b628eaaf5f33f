"""Megatron-LM's own SFTDataset (core_v0.16.1) as an oracle, run in a subprocess against megatron-core 0.16.1.

Megatron's `megatron/training/datasets/sft_dataset.py` and its tokenizer files are not in the megatron-core package:
they are read from the Megatron-LM mirror (git show core_v0.16.1:PATH) into the oracle's temporary folder and loaded
by path under their own module names (the `megatron.training` packages around them stubbed, LLaVA's two constants
given). Its SFTTokenizer calls `apply_chat_template(...)[0]` as transformers 4 returned it; under transformers 5 the
tokenizer is wrapped so that `apply_chat_template` returns ids (return_dict=False), nothing else changes.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.mcore_oracle import run_oracle

MIRROR = Path(os.environ.get("MEGATRON_LM_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo"))
TAG = "core_v0.16.1"
FILES = {"sft_dataset.py": "megatron/training/datasets/sft_dataset.py",
         "sft_tokenizer.py": "megatron/training/tokenizer/sft_tokenizer.py",
         "multimodal_tokenizer.py": "megatron/training/tokenizer/multimodal_tokenizer.py"}

SCRIPT = r'''
import importlib.util, json, sys, types
import numpy as np, torch, transformers

configs = json.load(open("cfg.json"))
for name in ("megatron.training", "megatron.training.datasets", "megatron.training.tokenizer"):
    pkg = types.ModuleType(name); pkg.__path__ = []; sys.modules[name] = pkg
llava = types.ModuleType("megatron.core.models.multimodal.llava_model")
llava.IGNORE_INDEX, llava.IMAGE_TOKEN = -100, "<image>"
sys.modules["megatron.core.models.multimodal.llava_model"] = llava

def load(name, file):
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod

sft = load("megatron.training.datasets.sft_dataset", "sft_dataset.py")
load("megatron.training.tokenizer.multimodal_tokenizer", "multimodal_tokenizer.py")
sft_tok = load("megatron.training.tokenizer.sft_tokenizer", "sft_tokenizer.py")

class Ids:  # transformers 5: apply_chat_template(tokenize=True) returns a BatchEncoding unless return_dict=False
    def __init__(self, tok): self._tok = tok
    def __getattr__(self, name): return getattr(self._tok, name)
    def __len__(self): return len(self._tok)
    def apply_chat_template(self, *a, **k):
        if k.get("tokenize", True): k["return_dict"] = False
        return self._tok.apply_chat_template(*a, **k)

real = transformers.AutoTokenizer.from_pretrained
transformers.AutoTokenizer.from_pretrained = lambda *a, **k: Ids(real(*a, **k))

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
results = {}
for case, cfg in configs.items():
    tokenizer = sft_tok.SFTTokenizer(cfg["tokenizer"], cfg["prompt_format"])
    config = GPTDatasetConfig(random_seed=1234, sequence_length=cfg["seq_length"], blend=cfg.get("blend"),
                              blend_per_split=cfg.get("blend_per_split"), split=cfg.get("split"),
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False, context_parallel_size=cfg["cp"])
    datasets = BlendedMegatronDatasetBuilder(sft.SFTDataset, cfg["sizes"], lambda: True, config).build()
    out = results[case] = {}
    for name, ds in zip(("train", "valid", "test"), datasets):
        if ds is not None:
            out[name] = [{k: v.tolist() for k, v in ds[i].items() if k != "dataset_id"} for i in range(len(ds))]
json.dump(results, open("out.json", "w"))
'''


def megatron_sft_samples(workdir: Path, tokenizer_dir: Path, configs: dict) -> dict:
    """{case: {split name: [sample dicts as lists]}} from Megatron-LM's SFTDataset through its
    BlendedMegatronDatasetBuilder; configs: {case: dict(prompt_format, seq_length, sizes, cp, blend, split,
    blend_per_split)} (Megatron's GPTDatasetConfig fields)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for local, path in FILES.items():
        try:
            text = subprocess.run(["git", "-C", str(MIRROR), "show", f"{TAG}:{path}"], capture_output=True,
                                  text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            pytest.fail(f"the Megatron-LM mirror {MIRROR} (tag {TAG}) is needed for this oracle: set "
                        "MEGATRON_LM_MIRROR to a clone of NVIDIA/Megatron-LM")
        (workdir / local).write_text(text)
    configs = {case: dict(cfg, tokenizer=str(tokenizer_dir)) for case, cfg in configs.items()}
    (workdir / "cfg.json").write_text(json.dumps(configs))
    run_oracle(SCRIPT, workdir)
    return json.loads((workdir / "out.json").read_text())
