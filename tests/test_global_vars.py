"""megatron/global_vars.py: accessors, micro-batch calculator, tokenizer, tensorboard writer, signal handler."""
from __future__ import annotations

import os
import signal

import pytest

import megatron.global_vars as gv
from megatron.arguments import parse_args, validate_args
from megatron.timers import Timers

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
    "--micro-batch-size 2 --lr 1e-3"
)


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    gv.unset_global_variables()
    yield
    gv.unset_global_variables()


def _args(extra: str, world_size: int = 1):
    args = parse_args(args=(BASE + " " + extra).split())
    args.world_size = world_size
    return validate_args(args)


def test_accessors_before_init_raise():
    for getter in (gv.get_args, gv.get_timers, gv.get_num_microbatches, gv.get_current_global_batch_size):
        with pytest.raises(RuntimeError, match="initialize_megatron"):
            getter()
    assert gv.get_tokenizer() is None and gv.get_tensorboard_writer() is None


def test_set_and_unset_without_tokenizer(tmp_path):
    args = _args(f"--train-iters 5 --global-batch-size 8 --vocab-size 1000 --timing-log-level 1 "
                 f"--tensorboard-dir {tmp_path / 'tb'} --tensorboard-queue-size 5")
    gv.set_global_variables(args)
    assert gv.get_args() is args
    assert gv.get_num_microbatches() == 4 and gv.get_current_global_batch_size() == 8
    assert args.padded_vocab_size == 1024 and gv.get_tokenizer() is None
    timers = gv.get_timers()
    assert isinstance(timers, Timers) and isinstance(timers("t", 1), type(timers("u", 0)))
    writer = gv.get_tensorboard_writer()
    assert writer is not None and writer.max_queue == 5
    writer.add_scalar("loss", 1.0, 1)
    with pytest.raises(RuntimeError, match="already initialized"):
        gv.set_global_variables(args)
    gv.unset_global_variables()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    with pytest.raises(RuntimeError):
        gv.get_args()


def test_tensorboard_writer_only_on_last_rank(tmp_path):
    args = _args(f"--train-iters 5 --tensorboard-dir {tmp_path}", world_size=2)
    args.rank = 0
    gv.set_global_variables(args, build_tokenizer=False)
    assert gv.get_tensorboard_writer() is None


def test_rampup_microbatches():
    args = _args("--train-samples 1000 --global-batch-size 16 --rampup-batch-size 4 4 96")
    gv.set_global_variables(args, build_tokenizer=False)
    assert gv.get_current_global_batch_size() == 4 and gv.get_num_microbatches() == 2
    gv.update_num_microbatches(1000)
    assert gv.get_current_global_batch_size() == 16 and gv.get_num_microbatches() == 8


def test_builds_gpt2_tokenizer(shared_data, capsys):
    bpe = shared_data / "gpt2-bpe"
    args = _args(f"--train-iters 5 --tokenizer-type GPT2BPETokenizer --vocab-file {bpe / 'gpt2-vocab.json'} "
                 f"--merge-file {bpe / 'gpt2-merges.txt'}")
    gv.set_global_variables(args)
    tokenizer = gv.get_tokenizer()
    assert tokenizer.vocab_size == 50257 and args.padded_vocab_size == 50304
    assert tokenizer.detokenize(tokenizer.tokenize("Hello world")) == "Hello world"
    assert "padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)" in capsys.readouterr().out


def test_signal_handler_records_sigterm():
    args = _args("--train-iters 5 --exit-signal-handler")
    before = signal.getsignal(signal.SIGTERM)
    gv.set_global_variables(args, build_tokenizer=False)
    handler = gv.get_signal_handler()
    assert handler.signals_received() == [False]
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.signals_received() == [True]
    gv.unset_global_variables()
    assert signal.getsignal(signal.SIGTERM) == before
