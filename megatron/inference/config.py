"""The inference engine's settings from the parsed flags (Megatron-LM's --inference-dynamic-batching-* and
--enable-chunked-prefill; megatron/settings/logs.py declares them)."""
from __future__ import annotations

import argparse
from typing import Optional

from megatron.errors import ArgumentError
from megatron.inference.types import EngineConfig
from megatron.settings.values import Settings


def engine_config_from_args(args: argparse.Namespace) -> Optional[EngineConfig]:
    """The EngineConfig of --inference-dynamic-batching (None without it); a bad value raises ArgumentError."""
    settings = Settings.from_args(args)  # a namespace without these flags reads their declared defaults
    if not settings.value("inference_dynamic_batching"):
        return None
    buffer_gb = float(settings.value("inference_dynamic_batching_buffer_size_gb"))
    block_size = int(settings.value("inference_dynamic_batching_block_size"))
    max_requests = settings.value("inference_dynamic_batching_max_requests")
    max_tokens = settings.value("inference_dynamic_batching_max_tokens")
    if buffer_gb <= 0:
        raise ArgumentError(f"--inference-dynamic-batching-buffer-size-gb must be > 0, got {buffer_gb}")
    if block_size < 1:
        raise ArgumentError(f"--inference-dynamic-batching-block-size must be >= 1, got {block_size}")
    if max_requests is not None and max_requests < 1:
        raise ArgumentError(f"--inference-dynamic-batching-max-requests must be >= 1, got {max_requests}")
    if max_tokens is not None and max_tokens < 1:
        raise ArgumentError(f"--inference-dynamic-batching-max-tokens must be >= 1, got {max_tokens}")
    return EngineConfig(buffer_size_gb=buffer_gb, block_size=block_size, max_requests=max_requests,
                        max_tokens=max_tokens if max_tokens is not None else EngineConfig.max_tokens,
                        chunked_prefill=not settings.value("disable_chunked_prefill"))
