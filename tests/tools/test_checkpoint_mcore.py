"""Checkpoints of today's Megatron-LM against megatron-core 0.16.1 itself (tests/mcore_oracle.py).

One oracle run (2 gloo processes, tests/tools/mcore_oracle_checkpoints.py) builds a tiny GPT and a tiny Llama in
Megatron Core (local layer spec), saves per-rank `torch` files (Core names) and `torch_dist` folders at TP1, TP2 and
PP2, and loads our torch_dist output into its own models. Here: every one of them loads with `--load` into our model
at another layout and gives Megatron Core's logits (<= 1e-5); ours saved as torch_dist gives the same logits in
Megatron Core; convert.py reads both (`--loader mcore`); damaged or missing shards are one line naming the file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.model import GPTModel
from tests.mcore_oracle import ORACLE_CPU_PRELUDE, run_oracle

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 128, 16
BASE = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--auto-detect-ckpt-format"]
FLAGS = {"gpt": ["--no-bias-gelu-fusion"],
         "llama": ["--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
                   "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights"]}
TOL = dict(rtol=1e-5, atol=1e-5)


def tokens():
    g = torch.Generator().manual_seed(7)  # the oracle script's tokens
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def run_args(family: str, load: Path, *extra: str):
    args = parse_args(args=[*BASE, *FLAGS[family], "--load", str(load), *extra])
    args.rank = 1  # quiet argument dump
    validate_args(args, {})
    args.padded_vocab_size = VOCAB
    return args


def our_model(args, state=None, **kw) -> GPTModel:
    config = core_transformer_config_from_args(args)
    return GPTModel(config, pp_state=state, parallel_output=False, **kw)


def load_logits(family: str, load: Path, *extra: str) -> torch.Tensor:
    """Our TP1 model loaded from `load` (single process), its logits on the oracle's tokens."""
    from megatron.checkpointing import load_checkpoint

    args = run_args(family, load, "--finetune", *extra)
    model = our_model(args)
    assert load_checkpoint([model], None, None, args) == 0
    with torch.no_grad():
        return model(*tokens())


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The oracle's checkpoints and logits; it also loads ours (written here first) as torch_dist."""
    from megatron.checkpoint_conversion.interchange import ModelMeta, architecture_of, messages_from_state_dict
    from megatron.checkpoint_conversion.torch_dist import write_torch_dist

    root = tmp_path_factory.mktemp("mcore")
    job = {"families": ["gpt", "llama"], "ours": {}}
    for family in job["families"]:
        args = run_args(family, root / "none")
        torch.manual_seed(11)
        model = our_model(args)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        with torch.no_grad():
            torch.save(model(*tokens()), root / f"ours_{family}_logits.pt")
        meta = ModelMeta(model_type="GPT", architecture=architecture_of(model.config), iteration=3)
        iter_dir = root / "ours" / family / "iter_0000003"
        iter_dir.parent.mkdir(parents=True)
        write_torch_dist(meta, messages_from_state_dict(model.state_dict(), LAYERS), str(iter_dir))
        job["ours"][family] = str(iter_dir)
    (root / "job.json").write_text(json.dumps(job))
    script = ORACLE_CPU_PRELUDE + (Path(__file__).parent / "mcore_oracle_checkpoints.py").read_text()
    run_oracle(script, root, nproc=2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_core_checkpoints_load_at_tp1_with_core_logits(oracle, family):
    ref = torch.load(oracle / "out" / family / "logits.pt")
    for name in ("torch_tp2", "torch_pp2", "dist_tp1", "dist_tp2", "dist_pp2"):
        got = load_logits(family, oracle / "out" / family / name)
        torch.testing.assert_close(got, ref, **TOL, msg=f"{family} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_ours_as_torch_dist_gives_the_same_logits_in_megatron_core(oracle, family):
    ours = torch.load(oracle / f"ours_{family}_logits.pt")
    for name in ("ours_logits_tp1.pt", "ours_logits_tp2.pt"):
        torch.testing.assert_close(torch.load(oracle / "out" / family / name), ours, **TOL, msg=name)
