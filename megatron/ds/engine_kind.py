"""Which DeepSpeed engine a run holds: a leaf module, so that `ds/engine.py` and `ds/weights.py` can both ask."""
from __future__ import annotations

from typing import Any


def is_pipe_engine(engine: Any) -> bool:
    """True for DeepSpeed's PipelineEngine (GPTModelPipe under --pipeline-model-parallel-size > 1)."""
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:  # pragma: no cover
        return False
    return isinstance(engine, PipelineEngine)
