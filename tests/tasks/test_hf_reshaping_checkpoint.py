"""A checkpoint in the shape Hugging Face's Megatron tool writes loads and evaluates to HF's perplexity.

transformers' `models/megatron_gpt2/checkpoint_reshaping_and_interoperability.py` (4.46) writes a `release`
checkpoint whose `args` is a `types.SimpleNamespace` of 16 fields: no `kv_channels`, `ffn_hidden_size` taken from
GPT-2's `n_inner` (None = Megatron's default 4h), nested `model.language_model.{embedding,encoder}` dicts and the
head as `model.word_embeddings_for_head`. Megatron compares only the fields a checkpoint records, after filling its
derived defaults; so must we (a regression refused it with advice that could not work).
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.args import ArchitectureMismatchError, saved_architecture
from megatron.compat import check_architecture
from tests.tasks import helpers as H
from tests.tasks.test_zeroshot_gpt import _run_in_process, hf_wikitext

tokenizers = pytest.importorskip("tokenizers")


def _hf_tool_args(**overrides) -> types.SimpleNamespace:
    fields = dict(orig_vocab_size=5000, max_position_embeddings=H.SEQ, hidden_size=H.HIDDEN, num_layers=H.LAYERS,
                  num_attention_heads=H.HEADS, ffn_hidden_size=None, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1, data_parallel_size=1, make_vocab_size_divisible_by=128, rank=0,
                  tokenizer_type="GPT2BPETokenizer", bias_gelu_fusion=False, openai_gelu=True,  # GPT-2 gelu_new
                  params_dtype=torch.float32, padded_vocab_size=H.PADDED_VOCAB)
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def save_hf_tool_checkpoint(flat: dict, directory: Path, margs: types.SimpleNamespace) -> Path:
    """The tool's layout at TP1/PP1: latest_checkpointed_iteration.txt = 'release', nested model dicts."""
    prefix = "language_model."
    emb = {"word_embeddings": {"weight": flat[prefix + "embedding.word_embeddings.weight"]},
           "position_embeddings": {"weight": flat[prefix + "embedding.position_embeddings.weight"]}}
    encoder = {k[len(prefix + "encoder."):]: v for k, v in flat.items() if k.startswith(prefix + "encoder.")}
    model = {"language_model": {"embedding": emb, "encoder": encoder},
             "word_embeddings_for_head": {"weight": flat[prefix + "embedding.word_embeddings.weight"].clone()}}
    optimizer = {"step": 0, "param_groups": [{"lr": 0.0, "beta1": 0.0, "beta2": 0.0, "eps": 0.0,
                                              "weight_decay": 0.0, "correct_bias": False, "params": []}]}
    path = directory / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": model, "checkpoint_version": 3.0, "args": margs, "optimizer": optimizer}, path)
    (directory / "latest_checkpointed_iteration.txt").write_text("release")
    return directory


@pytest.mark.slow  # the HF tool's checkpoint runs in processes
def test_hf_tool_checkpoint_evaluates_to_hf_perplexity(shared_data, tmp_path):
    flat = H.random_state_dict(seed=3)
    ckpt = save_hf_tool_checkpoint(flat, tmp_path / "hf_tool", _hf_tool_args())
    assert len(vars(_hf_tool_args())) == 16
    wiki = H.write_wikitext_slice(shared_data, tmp_path / "wiki.test.tokens", 20)
    owt = shared_data / "openwebtext-1000"
    hf_tok = tokenizers.ByteLevelBPETokenizer(str(owt / "gpt2-tiny-vocab.json"), str(owt / "gpt2-tiny-merges.txt"))
    ref = hf_wikitext(flat, hf_tok, wiki, H.SEQ, 32)
    for extra in ((), ("--use-checkpoint-args",)):
        argv = (["--task", "WIKITEXT103", "--valid-data", str(wiki), "--micro-batch-size", "4", "--overlapping-eval", "32"]
                + H.model_flags(shared_data, ckpt) + list(extra))
        got = _run_in_process(argv)
        assert got["ppl"] == pytest.approx(ref["ppl"], rel=1e-4), extra
        assert got["avg_loss"] == pytest.approx(ref["avg_loss"], rel=1e-4)


def _run_args(**overrides):
    from megatron.arguments import parse_args, validate_args

    argv = ["--num-layers", str(H.LAYERS), "--hidden-size", str(H.HIDDEN), "--num-attention-heads", str(H.HEADS),
            "--seq-length", str(H.SEQ), "--max-position-embeddings", str(H.SEQ), "--micro-batch-size", "1"]
    for k, v in overrides.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    args = parse_args(args=argv)
    args = validate_args(args)
    args.padded_vocab_size = H.PADDED_VOCAB
    return args


def test_derived_defaults_filled_and_none_never_blocks():
    args = _run_args()
    saved = saved_architecture(None, _hf_tool_args())
    assert saved["ffn_hidden_size"] == 4 * H.HIDDEN and saved["kv_channels"] == H.HIDDEN // H.HEADS
    check_architecture(saved, args, "ckpt")  # None/absent fields are filled or skipped
    check_architecture(saved_architecture(None, _hf_tool_args(kv_channels=None, num_layers=None)), args, "ckpt")
    # a recorded difference is still refused, with advice that names a working flag value
    with pytest.raises(ArchitectureMismatchError, match=r"--ffn-hidden-size 100 to match"):
        check_architecture(saved_architecture(None, _hf_tool_args(ffn_hidden_size=100)), args, "ckpt")
    with pytest.raises(ArchitectureMismatchError, match=r"--num-layers 3 to match"):
        check_architecture(saved_architecture(None, _hf_tool_args(num_layers=3)), args, "ckpt")


def test_every_advised_flag_parses():
    import re

    from megatron.arguments import build_parser
    from megatron.checkpoint.args import _ACTIVATION_FIX, ARCHITECTURE_FIELDS, _fix

    options = {opt for action in build_parser()._actions for opt in action.option_strings}
    advice = [_fix(name, value) for name in ARCHITECTURE_FIELDS for value in (True, False, 3, "rope")]
    flags = {flag for text in advice + list(_ACTIVATION_FIX.values()) for flag in re.findall(r"--[a-z0-9-]+", text)}
    assert flags and flags <= options, flags - options
