"""Our expert-parallel MoE layer against NVIDIA megatron-core 0.16.1's `MoELayer` with expert parallelism 2 and its
alltoall token dispatcher (the oracle, 2 gloo processes under torchrun in a subprocess), from the same weights and
per-rank tokens: every rank's output, input and router gradients, its local experts' weight gradients, the
load-balancing loss and the z-loss (<= 1e-5). Stand-ins: CUDA streams and events are no-ops, all-to-all split sizes
are passed as lists (gloo), the RNG tracker's fork is a no-op; top-2 SwiGLU experts, no linear bias."""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.mcore_oracle import run_oracle
from tests.model._moe_ep_workers import EXPERTS, FFN, H, oracle_case_worker

pytestmark = pytest.mark.slow

ORACLE_SCRIPT = r'''
import contextlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
torch.cuda.current_device = lambda: "cpu"
torch.cuda.is_available = lambda: False


class _Event:
    def synchronize(self):
        pass


class _Stream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return _Event()

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


_STREAM = _Stream()
torch.cuda.Stream = lambda *a, **k: _STREAM
torch.cuda.current_stream = lambda *a, **k: _STREAM
torch.cuda.stream = lambda s: contextlib.nullcontext()
_a2a = dist.all_to_all_single


def _a2a_lists(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
    as_list = lambda s: None if s is None else [int(v) for v in s]
    return _a2a(output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw)


dist.all_to_all_single = _a2a_lists
dist.init_process_group("gloo")
rank = dist.get_rank()
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
from megatron.core.tensor_parallel import random as rnd


@contextlib.contextmanager
def _no_fork(self, name=None):
    yield


rnd.CudaRNGStatesTracker.fork = _no_fork
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe import moe_utils
moe_utils.te_general_gemm = None
W = torch.load("weights.pt")
cfg = TransformerConfig(num_layers=1, hidden_size=W["h"], num_attention_heads=4, ffn_hidden_size=W["ffn"],
                        num_moe_experts=W["experts"], moe_router_topk=2, moe_aux_loss_coeff=0.01,
                        moe_z_loss_coeff=1e-3, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True, hidden_dropout=0.0,
                        attention_dropout=0.0, expert_model_parallel_size=2)
layer = MoELayer(cfg, get_moe_module_spec(use_te=False, num_experts=W["experts"], moe_grouped_gemm=False).submodules,
                 layer_number=1)
local = layer.experts.local_experts
with torch.no_grad():
    layer.router.weight.copy_(W["router"])
    for i, expert in enumerate(local):
        expert.linear_fc1.weight.copy_(W["w1"][rank * len(local) + i].t())
        expert.linear_fc2.weight.copy_(W["w2"][rank * len(local) + i].t())
layer.train()
layer.router.set_layer_number(1)
x = W["xs"][rank].clone().requires_grad_(True)
out, _ = layer(x)
(out * W["gs"][rank]).sum().backward()
res = {"out": out.detach(), "dx": x.grad, "drouter": layer.router.weight.grad,
       "dw1": torch.stack([e.linear_fc1.weight.grad.t() for e in local]),
       "dw2": torch.stack([e.linear_fc2.weight.grad.t() for e in local])}
for key, value in moe_utils.get_moe_layer_wise_logging_tracker().items():
    res["loss_" + key] = value["values"][0].clone()
torch.save(res, f"out{rank}.pt")
'''


def test_expert_parallel_layer_equals_megatron_core_alltoall(tmp_path):
    g = torch.Generator().manual_seed(11)
    w = {"router": torch.randn(EXPERTS, H, generator=g) * 0.3,
         "w1": torch.randn(EXPERTS, H, 2 * FFN, generator=g) * 0.1,
         "w2": torch.randn(EXPERTS, FFN, H, generator=g) * 0.1,
         "xs": [torch.randn(16, 2, H, generator=g) for _ in range(2)],
         "gs": [torch.randn(16, 2, H, generator=g) for _ in range(2)]}
    torch.save({**w, "h": H, "ffn": FFN, "experts": EXPERTS}, tmp_path / "weights.pt")
    run_oracle(ORACLE_SCRIPT, tmp_path, nproc=2)
    ours = run_distributed(oracle_case_worker, 2, args=(w,))
    for rank in range(2):
        theirs = torch.load(tmp_path / f"out{rank}.pt")
        assert {"out", "dx", "drouter", "dw1", "dw2", "loss_load_balancing_loss", "loss_z_loss"} <= set(theirs)
        assert theirs["dw1"].abs().max() > 0 and theirs["out"].abs().max() > 0  # tokens reached both ranks' experts
        for key, value in theirs.items():
            diff = (ours[rank][key] - value).abs().max().item()
            assert diff <= 1e-5, f"rank {rank}: {key} differs from megatron-core's EP2 alltoall layer by {diff}"
