"""examples/pretrain_llama.sh and the Llama/Mistral presets: valid bash, the published shapes, and a CPU run of the
tiny preset on data preprocessed with the Llama2Tokenizer."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.interpreter import path_with_this_python
from tests.log_lines import iteration_lines
from tests.tokenizer.llama_files import train_llama_sentencepiece

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = EXAMPLES.parent
# name: layers, hidden, heads, ffn, query groups (None = MHA), rotary base, max positions
PRESETS = {"llama2_7b": (32, 4096, 32, 11008, None, 10000, 4096),
           "mistral_7b": (32, 4096, 32, 14336, 8, 1000000, 32768),
           "llama_tiny": (4, 128, 4, 352, 2, 10000, 256)}


def _preset_args(name: str) -> list:
    """The preset's model flags (megatron/presets.py; examples/presets/NAME.sh is written from it)."""
    return get_preset(name).argv()


def test_pretrain_llama_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "pretrain_llama.sh")], check=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_define_the_published_models(name: str) -> None:
    """Each preset parses into the published architecture (through the real flag parser and validation)."""
    from megatron.arguments import parse_args, validate_args

    layers, hidden, heads, ffn, groups, base, max_pos = PRESETS[name]
    argv = _preset_args(name) + ["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]
    args = validate_args(parse_args(args=argv))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (layers, hidden,
                                                                                                     heads, ffn)
    assert (args.normalization, args.swiglu, args.position_embedding_type, args.rotary_base) == ("RMSNorm", True,
                                                                                                "rope", base)
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert args.group_query_attention == (groups is not None)
    if groups is not None:
        assert args.num_query_groups == groups
    assert args.max_position_embeddings == max_pos and args.hidden_dropout == args.attention_dropout == 0.0


@pytest.mark.parametrize("name,vocab,params", [("llama2_7b", 32000, 6_738_415_616),
                                               ("mistral_7b", 32000, 7_241_732_096)])
def test_presets_have_the_published_parameter_count(name: str, vocab: int, params: int) -> None:
    """Hugging Face's Llama-2-7b-hf / Mistral-7B-v0.1 sizes, counted from the config the flags build."""
    from megatron.arguments import parse_args, validate_args
    from megatron.theoretical_memory_usage import count_parameters

    argv = _preset_args(name) + ["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                 str(vocab), "--make-vocab-size-divisible-by", "1"]
    args = validate_args(parse_args(args=argv))
    args.padded_vocab_size = vocab
    assert count_parameters(args).total == params


def test_pretrain_llama_sh_runs_tiny(shared_data: Path, tmp_path: Path) -> None:
    """PRESET=llama_tiny trains 2 iterations on CPU from a tokenizer.model and Llama2Tokenizer-preprocessed data."""
    model = train_llama_sentencepiece(tmp_path / "tok", shared_data)
    prefix = tmp_path / "data"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                           str(shared_data / "openwebtext-1000" / "openwebtext-1000.jsonl"), "--output-prefix",
                           str(prefix), "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(model),
                           "--append-eod", "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = dict(os.environ, PRESET="llama_tiny", DATA_PATH=str(prefix) + "_text_document", TOKENIZER_MODEL=str(model),
               CHECKPOINT_PATH=str(tmp_path / "ckpt"), SEQ_LENGTH="64", MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4")
    env["PATH"] = path_with_this_python(env["PATH"])  # `python` is this interpreter
    flags = ["--train-iters", "2", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "1",
             "--num-workers", "0"]
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_llama.sh"), *flags], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout
    losses = [loss for _, loss in iteration_lines(proc.stdout)]
    assert len(losses) >= 2 and all(7.0 < x < 8.5 for x in losses[:2])  # ~ln(2048) at initialisation
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_pretrain_llama_sh_clear_errors(tmp_path: Path) -> None:
    env = dict(os.environ, DATA_PATH=str(tmp_path / "nothing"), PRESET="llama_tiny")
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_llama.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "missing" in proc.stderr and "TOKENIZER_MODEL" in proc.stderr
    env["PRESET"] = "gpt_345m"
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_llama.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown PRESET=gpt_345m" in proc.stderr and "mistral_7b" in proc.stderr
