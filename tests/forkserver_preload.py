"""What `run_distributed`'s fork server (tests/dist_utils.py) imports once, before it forks any rank, so that no rank
pays for it: torch and torch.distributed (~2 CPU s a rank), torch._dynamo (~1.7 CPU s: torch's optimizers import it,
with sympy and triton, when a rank builds its first optimizer) and megatron's training stack (`megatron.training`,
~0.9 CPU s). The server only imports these modules; it runs no training code and starts no thread.

`SET_BY_IMPORTS` holds the environment variables these imports set (megatron/ds/engine.py names DeepSpeed's CPU
accelerator when DS_ACCELERATOR is unset): a rank puts them back under the test's own environment, so it ends with
the environment it would have had importing the modules itself.
"""
from __future__ import annotations

import importlib
import os

MODULES = ("torch", "torch.distributed", "torch._dynamo", "megatron.training")

_before = dict(os.environ)
for _name in MODULES:
    importlib.import_module(_name)
SET_BY_IMPORTS = {key: value for key, value in os.environ.items() if _before.get(key) != value}
