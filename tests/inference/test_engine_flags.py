"""The engine's flags (Megatron-LM's --inference-dynamic-batching-* and --enable-chunked-prefill): parsed into an
EngineConfig, off by default, bad values and the CUDA-graph / unified-memory ones refused in one line."""
from __future__ import annotations

import pytest

from megatron.arguments import parse_args, validate_args
from megatron.errors import MegatronUserError
from megatron.inference import EngineConfig, engine_config_from_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--vocab-size", "64", "--tokenizer-type",
        "NullTokenizer"]


def _args(*extra: str):
    args = parse_args(args=BASE + list(extra))
    args.world_size = 1
    return validate_args(args)


def test_off_by_default_and_parsed_when_on():
    assert engine_config_from_args(_args()) is None
    config = engine_config_from_args(_args(
        "--inference-dynamic-batching", "--inference-dynamic-batching-buffer-size-gb", "0.5",
        "--inference-dynamic-batching-block-size", "16", "--inference-dynamic-batching-max-requests", "8",
        "--inference-dynamic-batching-max-tokens", "512", "--enable-chunked-prefill"))
    assert config == EngineConfig(buffer_size_gb=0.5, block_size=16, max_requests=8, max_tokens=512,
                                  chunked_prefill=True)
    defaults = engine_config_from_args(_args("--inference-dynamic-batching", "--disable-chunked-prefill"))
    assert defaults == EngineConfig()  # Megatron-LM's defaults: 40 GiB, blocks of 256, 16384 tokens, no chunking


@pytest.mark.parametrize("flags,message", [
    (("--inference-dynamic-batching-block-size", "0"), "block-size must be >= 1"),
    (("--inference-dynamic-batching-buffer-size-gb", "0"), "buffer-size-gb must be > 0"),
    (("--inference-dynamic-batching-max-tokens", "0"), "max-tokens must be >= 1"),
])
def test_bad_values_are_refused_in_one_line(flags, message):
    with pytest.raises(MegatronUserError, match=message):
        engine_config_from_args(_args("--inference-dynamic-batching", *flags))


@pytest.mark.parametrize("flags", [("--inference-dynamic-batching-num-cuda-graphs", "4"),
                                   ("--inference-dynamic-batching-unified-memory-level", "1"),
                                   ("--inference-dynamic-batching-paused-buffer-size-gb", "1")])
def test_cuda_graph_unified_memory_and_pausing_flags_are_refused(flags):
    with pytest.raises(MegatronUserError, match=flags[0]):
        _args("--inference-dynamic-batching", *flags)
