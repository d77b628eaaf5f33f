"""The inference engine (issue #42): continuous batching over a paged KV cache, chunked prefill, prefix sharing."""
from megatron.inference.block_pool import BlockPool, prefix_hashes
from megatron.inference.config import engine_config_from_args
from megatron.inference.engine import InferenceEngine, kv_bytes_per_token
from megatron.inference.types import EngineConfig, EngineStats, RequestRejected, SamplingParams, StepOutput

__all__ = [
    "BlockPool",
    "EngineConfig",
    "EngineStats",
    "InferenceEngine",
    "RequestRejected",
    "SamplingParams",
    "StepOutput",
    "engine_config_from_args",
    "kv_bytes_per_token",
    "prefix_hashes",
]
