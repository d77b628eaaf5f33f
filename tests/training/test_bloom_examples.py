"""examples/pretrain_bloom.sh and the BLOOM presets: valid bash, BLOOM-560M's published shape, vocabulary rows and
parameter count, and a CPU DeepSpeed run of the tiny preset on data preprocessed with PretrainedFromHF from a local
tokenizer.json folder."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.presets import get_preset
from tests.log_lines import iteration_lines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REPO = EXAMPLES.parent


def _preset_args(name: str) -> list:
    """The preset's model flags (megatron/presets.py; examples/presets/NAME.sh is written from it)."""
    return get_preset(name).argv()


def _validated(name: str, *extra: str, world_size: int = 1):
    from megatron.arguments import parse_args, validate_args

    argv = _preset_args(name) + ["--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", *extra]
    args = parse_args(args=argv)
    args.world_size = world_size
    return validate_args(args)


def test_pretrain_bloom_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLES / "pretrain_bloom.sh")], check=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_bloom_560m_preset_is_the_published_model(tp: int) -> None:
    """24 layers, hidden 1024, 16 heads, ALiBi, embedding LayerNorm; BLOOM's 250,680-token vocabulary padded to
    250,880 rows; 559,214,592 parameters (HF bigscience/bloom-560m)."""
    from megatron.theoretical_memory_usage import count_parameters
    from megatron.tokenizer.tokenizer import _vocab_size_with_padding

    args = _validated("bloom_560m", "--vocab-size", "250679", "--tensor-model-parallel-size", str(tp), world_size=tp)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (24, 1024, 16, 4096)
    assert args.position_embedding_type == "alibi" and args.embed_layernorm
    assert not args.untie_embeddings_and_output_weights
    args.padded_vocab_size = _vocab_size_with_padding(250680, args)  # NullTokenizer adds one eod to --vocab-size
    assert args.padded_vocab_size == 250880
    if tp == 1:
        assert count_parameters(args).total == 559_214_592


def test_bloom_tiny_preset() -> None:
    args = _validated("bloom_tiny", "--vocab-size", "100")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (4, 96, 6)
    assert args.position_embedding_type == "alibi" and args.embed_layernorm


@pytest.mark.slow
def test_pretrain_bloom_sh_runs_tiny_under_deepspeed(shared_data: Path, tmp_path: Path) -> None:
    """PRESET=bloom_tiny trains 2 iterations (DeepSpeed, ZeRO-1) from a local tokenizer.json folder via
    PretrainedFromHF, on data preprocessed with the same tokenizer; DRY_RUN shows the PP/TP command."""
    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer.gpt2_bpe import _HFEngine, load_merges, load_vocab

    d = shared_data / "openwebtext-1000"
    engine = _HFEngine(load_vocab(str(d / "gpt2-tiny-vocab.json")), load_merges(str(d / "gpt2-tiny-merges.txt")))
    PreTrainedTokenizerFast(tokenizer_object=engine._tok, eos_token="<|endoftext|>").save_pretrained(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    prefix = tmp_path / "data"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                           str(d / "openwebtext-1000.jsonl"), "--output-prefix", str(prefix), "--tokenizer-type",
                           "PretrainedFromHF", "--tokenizer-name-or-path", str(tmp_path / "tok"), "--append-eod",
                           "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = dict(os.environ, PRESET="bloom_tiny", DATA_PATH=str(prefix) + "_text_document",
               TOKENIZER_NAME_OR_PATH=str(tmp_path / "tok"), CHECKPOINT_PATH=str(tmp_path / "ckpt"), SEQ_LENGTH="64",
               MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4", ZERO_STAGE="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # the same python
    flags = ["--train-iters", "2", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "1",
             "--num-workers", "0"]
    proc = subprocess.run(["bash", str(EXAMPLES / "pretrain_bloom.sh"), *flags], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " iteration        2/       2 |" in proc.stdout
    losses = [loss for _, loss in iteration_lines(proc.stdout)]
    assert len(losses) >= 2 and all(7.5 < x < 9.5 for x in losses[:2])  # ~ln(5120) at initialisation
    config = (tmp_path / "ckpt" / "ds_config.json").read_text()
    assert '"stage": 1' in config and '"train_batch_size": 4' in config
    dry = subprocess.run(["bash", str(EXAMPLES / "pretrain_bloom.sh")], env=dict(env, DRY_RUN="1", TP="2", PP="2",
                         NPROC="4", CHECKPOINT_PATH=str(tmp_path / "dry")), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "--pipeline-model-parallel-size 2" in dry.stdout and "--position-embedding-type alibi" in dry.stdout
    assert "--deepspeed_config" in dry.stdout and "torchrun" in dry.stdout
