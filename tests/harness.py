"""The one way tests run pretraining in-process: `pretrain_run` calls megatron.training.pretrain() with an entry
script's providers, any of them replaced by the caller, and returns pretrain()'s numbers.

    pretrain_run(argv)                                          # pretrain_gpt.py's providers
    pretrain_run(argv, "pretrain_t5", forward_step=my_step)     # T5's, with another forward step
    gpt = entry_providers("pretrain_gpt")                       # the originals, to wrap
    pretrain_run(argv, model_provider=serial_init_provider(gpt.model_provider))

Nothing is patched: the entry scripts (pretrain_gpt.py, pretrain_bert.py, pretrain_t5.py) only declare their
providers, ``MODEL_TYPE`` and ``ARGS_DEFAULTS``, and their ``main`` passes the same to pretrain(). The result is
pretrain()'s dict: ``train_losses`` {iteration: {name: value}}, ``valid_losses``, ``val_loss``, ``test_loss``,
``iteration`` and the run's ``skipped_iterations``/``nan_iterations`` totals (`history` is filled as the run goes).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional

ENTRY_SCRIPTS = ("pretrain_gpt", "pretrain_bert", "pretrain_t5")


@dataclasses.dataclass(frozen=True)
class Providers:
    """What an entry script passes to pretrain()."""

    datasets_provider: Callable
    model_provider: Callable
    model_type: Any
    forward_step: Callable
    args_defaults: dict


def entry_providers(script: str = "pretrain_gpt") -> Providers:
    """The providers, model type and flag defaults of one of `ENTRY_SCRIPTS`."""
    if script not in ENTRY_SCRIPTS:
        raise ValueError(f"unknown entry script {script!r}; choose from {', '.join(ENTRY_SCRIPTS)}")
    module = importlib.import_module(script)
    return Providers(module.train_valid_test_datasets_provider, module.model_provider, module.MODEL_TYPE,
                     module.forward_step, dict(module.ARGS_DEFAULTS))


def pretrain_run(argv: list[str], script: str = "pretrain_gpt", *, model_provider: Optional[Callable] = None,
                 forward_step: Optional[Callable] = None, datasets_provider: Optional[Callable] = None,
                 history: Optional[dict] = None) -> Optional[dict]:
    """pretrain() with `script`'s providers, the given ones instead where passed; returns pretrain()'s result."""
    from megatron.training import pretrain

    base = entry_providers(script)
    return pretrain(datasets_provider or base.datasets_provider, model_provider or base.model_provider,
                    base.model_type, forward_step or base.forward_step, args_defaults=base.args_defaults, argv=argv,
                    history=history)
