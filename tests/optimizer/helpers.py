"""Tiny models and training loops shared by the optimizer tests."""
import copy

import torch


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 3)
    )
    return model.to(dtype)


def batches(n: int, seed: int = 1, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 3, generator=g)) for _ in range(n)]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def params(model: torch.nn.Module):
    return [p.detach().clone() for p in model.parameters()]
