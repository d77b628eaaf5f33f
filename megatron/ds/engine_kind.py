"""Which DeepSpeed engine a run holds: a leaf module, so that `ds/engine.py` and `ds/weights.py` can both ask."""
from __future__ import annotations

from typing import Any

from megatron import optional


def is_pipe_engine(engine: Any) -> bool:
    """True for DeepSpeed's PipelineEngine (GPTModelPipe under --pipeline-model-parallel-size > 1)."""
    try:
        pipe_engine = optional.deepspeed("runtime.pipe.engine")
    except ImportError:  # pragma: no cover
        return False
    return isinstance(engine, pipe_engine.PipelineEngine)
