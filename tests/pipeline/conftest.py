"""Fixtures for the pipeline tests: reuse the training tests' small preprocessed GPT corpus."""
from tests.training.conftest import gpt_data  # noqa: F401
