"""Any supported Hugging Face model in two commands (issue #38): ``convert.py --loader hf`` then ``pretrain_gpt.py
--load X --use-checkpoint-args`` with data and training flags only, then back to Hugging Face.

Proof: a tiny HF Qwen3 (per-head q/k norms, head_dim 16 != hidden / heads, YaRN rope scaling, a sliding window of 8
on its second layer through use_sliding_window / max_window_layers) and its GPT-2-style tokenizer (both built
offline) converts; the
checkpoint's args hold every architecture flag and the tokenizer (HuggingFaceTokenizer over the copied files), so
the generation server's start-up with only --load X --use-checkpoint-args serves HF's logits (1e-5) with HF's token
ids, and pretraining continues for 10 iterations with no model or tokenizer flag (the loss falls); the trained checkpoint
exports with ``--saver hf`` (the padded vocabulary, as Megatron trains it, without --true-vocab-size) and
transformers loads it: its loss on a batch equals ours from the Megatron checkpoint (1e-5).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from tests.dist_utils import run_distributed
from tests.training._workers import run_pretrain

transformers = pytest.importorskip("transformers")
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 8.0}


def _hf_folder(folder: Path, shared_data: Path) -> None:
    owt = shared_data / "openwebtext-1000"
    folder.mkdir()
    shutil.copyfile(owt / "gpt2-tiny-vocab.json", folder / "vocab.json")
    shutil.copyfile(owt / "gpt2-tiny-merges.txt", folder / "merges.txt")
    tokenizer = transformers.GPT2TokenizerFast.from_pretrained(str(folder))
    (folder / "vocab.json").unlink()
    (folder / "merges.txt").unlink()
    tokenizer.save_pretrained(str(folder))  # tokenizer.json + tokenizer_config.json: a HuggingFaceTokenizer folder
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64, rope_theta=10000.0, rope_scaling=YARN,
                                      use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # q/k norm weights away from HF's ones, so a dropped or swapped norm shows
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))


def _convert(*argv: str) -> dict:
    return convert(parse_args(["--model-type", "GPT", *argv]))


def _our_loss(load: str, ids: torch.Tensor) -> torch.Tensor:
    from megatron.compat import load_checkpoint
    from megatron.models.gpt.model import GPTModel

    meta = _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", load,
                    "--save-dir", load + "_release", "--no-save-optim")["meta"]
    model = GPTModel(meta.config()).eval()
    load_checkpoint([model], None, None, argparse.Namespace(load=load + "_release", finetune=True,
                                                            tensor_model_parallel_size=1,
                                                            pipeline_model_parallel_size=1))
    seq = ids.size(1) - 1
    pos = torch.arange(seq).unsqueeze(0).expand(ids.size(0), seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    with torch.no_grad():
        logits = model(ids[:, :-1], pos, mask)  # over the padded vocabulary, as training's loss and the export
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))


def _serve(rank: int, world_size: int, load: str, ids: torch.Tensor) -> dict:
    """tools/run_text_generation_server.py's start-up with --load X --use-checkpoint-args only: its tokenizer and
    the logits of the model it would serve."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import run_text_generation_server as server

    from megatron.global_vars import get_tokenizer
    from megatron.initialize import initialize_megatron
    from megatron.text_generation import load_model_for_inference

    args = initialize_megatron(extra_args_provider=server.add_server_args, args=["--load", load, "--use-checkpoint-args"],
                               args_defaults={"tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1,
                                              "no_load_rng": True, "no_load_optim": True})
    model = load_model_for_inference(args)
    seq = ids.size(1)
    with torch.no_grad():
        logits = model(ids, torch.arange(seq).unsqueeze(0), torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1))
    return {"tokenizer": type(get_tokenizer()).__name__, "ids": get_tokenizer().tokenize("The cat sat."),
            "logits": logits}


def test_hf_qwen3_converts_trains_with_checkpoint_args_and_exports(gpt_data: dict, shared_data: Path,
                                                                   tmp_path: Path) -> None:
    hf_dir, meg, trained, back = (tmp_path / n for n in ("hf", "meg", "trained", "back"))
    _hf_folder(hf_dir, shared_data)
    out = _convert("--loader", "hf", "--saver", "megatron", "--load-dir", str(hf_dir), "--save-dir", str(meg))
    flags = out["flags"]  # the printed flags say it too
    assert "--rope-type yarn --rotary-scaling-factor 2.0" in flags and "--qk-layernorm" in flags
    assert "--kv-channels 16" in flags and "--window-size" in flags
    original = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).float().eval()
    prompt = torch.tensor([[464, 3797, 3332, 319, 262, 2603, 13, 383, 3290, 1310, 509, 11, 290, 262, 4252, 4940]])
    (served,) = run_distributed(_serve, 1, args=(str(meg), prompt))
    with torch.no_grad():
        torch.testing.assert_close(served["logits"][..., :5000], original(input_ids=prompt).logits,
                                   rtol=1e-5, atol=1e-5)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert served["tokenizer"] == "HuggingFaceTokenizer" and served["ids"] == hf_tokenizer("The cat sat.")["input_ids"]
    train_flags = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-3",
                   "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--data-path", gpt_data["prefix"],
                   "--split", "100,0,0", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                   "--seed", "7", "--save", str(trained), "--save-interval", "10"]
    (run,) = run_distributed(run_pretrain, 1, args=([*train_flags, "--load", str(meg), "--use-checkpoint-args"],))
    assert run["error"] is None, run["error"]
    stdout = run["stdout"]
    assert "HuggingFaceTokenizer" in stdout and run["result"]["iteration"] == 10
    losses = [run["result"]["train_losses"][i]["lm loss"] for i in range(1, 11)]
    assert losses[-1] < losses[0]  # it trained

    _convert("--loader", "megatron", "--saver", "hf", "--load-dir", str(trained), "--save-dir", str(back))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(back)).float().eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.head_dim == 16
    assert hf.config.rope_parameters["rope_type"] == "yarn" and hf.config.rope_parameters["factor"] == 2.0
    assert hf.config.layer_types == ["full_attention", "sliding_attention"] and hf.config.sliding_window == 8
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(back))
    text = "The cat sat on the mat while the dog barked at the moon over the quiet town square."
    ids = torch.tensor([tokenizer(text)["input_ids"][:17]] * 2)  # 16 positions: past the window of 8
    with torch.no_grad():
        theirs = hf(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(_our_loss(str(trained), ids), theirs, rtol=1e-5, atol=1e-5)


def test_what_the_config_asks_that_we_cannot_do_is_one_line_naming_the_field(tmp_path: Path) -> None:
    from megatron.checkpoint.conversion.interchange import ConversionError

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=64,
                                      rope_scaling={**YARN, "attention_factor": 1.5})
    transformers.LlamaForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConversionError) as info:
        _convert("--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "meg"))
    assert "attention_factor" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "meg").exists()
