"""The GPU tests share the training tests' tiny corpus fixture."""
from tests.training.conftest import gpt_data  # noqa: F401
