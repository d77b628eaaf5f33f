"""Worker of tests/test_moe_parameter_report.py (module level so `run_distributed` can pickle it)."""
from __future__ import annotations

import argparse


def ep_parameter_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """This rank's parameter count of the GPT model of `args` under --expert-model-parallel-size `world_size`:
    (name, numel, is-expert) per parameter."""
    from megatron.core import parallel_state
    from megatron.models.gpt.model import GPTModel
    from megatron.theoretical_memory_usage import model_config

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world_size)
    model = GPTModel(model_config(args))
    return {name: (p.numel(), getattr(p, "allreduce", True) is False) for name, p in model.named_parameters()}
