"""Fixtures for the DeepSpeed tests: reuse the tiny preprocessed GPT corpus of tests/training."""
from __future__ import annotations

from tests.training.conftest import gpt_data  # noqa: F401  (session fixture re-exported for tests/ds)
