"""Data parallelism: local DDP (contiguous buffer and bucketed) and torch DDP with DP=2 and gradient accumulation
reproduce a single process on the same global batch; post-backward embedding / sequence-parallel reductions."""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, TorchDistributedDataParallel, finalize_model_grads
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.dist_utils import run_distributed

STEPS, MICRO, GLOBAL_MB = 3, 2, 4  # micro-batch size 2; 4 micro-batches per global batch of 8 samples


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.LayerNorm(7), torch.nn.Linear(7, 2))


def _global_batches():
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 2, generator=g)) for _ in range(GLOBAL_MB)]
            for _ in range(STEPS)]


def _train(wrapped, microbatches_per_step, parallel_state=None):
    opt = get_megatron_optimizer([wrapped], OptimizerConfig(lr=1e-2, clip_grad=1.0), parallel_state)
    norms = []
    for micro_batches in microbatches_per_step:
        wrapped.zero_grad_buffer()
        opt.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            ctx = wrapped.no_sync() if not last else torch.enable_grad()
            with ctx:
                loss = (wrapped(x) - y).pow(2).mean() / len(micro_batches)
                loss.backward()
        finalize_model_grads([wrapped], parallel_state)
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    return [p.detach().clone() for p in wrapped.module.parameters()], norms


def _wrap(kind, model, dp_group):
    if kind == "torch":
        return TorchDistributedDataParallel(model, dp_group=dp_group)
    return DistributedDataParallel(model, dp_group=dp_group, accumulate_allreduce_grads_in_fp32=True,
                                   use_contiguous_buffers=(kind == "local"))


def _dp_body(rank, world_size):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel()
    assert state.dp_size == 2
    mine = [mbs[rank * 2:(rank + 1) * 2] for mbs in _global_batches()]  # this rank's half of each global batch
    return {kind: _train(_wrap(kind, _model(), state.dp_group), mine, state) for kind in ("local", "bucketed", "torch")}


def test_dp2_equals_serial():
    serial = {kind: _train(_wrap(kind, _model(), None), _global_batches()) for kind in ("local", "bucketed", "torch")}
    ref_params, ref_norms = serial["local"]
    for kind in ("bucketed", "torch"):
        assert all(torch.equal(a, b) for a, b in zip(serial[kind][0], ref_params))
    results = run_distributed(_dp_body, world_size=2)
    for rank_result in results:
        for kind, (ps, norms) in rank_result.items():
            assert norms == pytest.approx(ref_norms, rel=1e-5), kind
            for a, b in zip(ps, ref_params):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the two data-parallel replicas are identical
    for kind in results[0]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][kind][0], results[1][kind][0]))


def test_local_ddp_buffer_layout_and_accumulation():
    model = _model()
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True)
    buf = ddp.grad_buffers[torch.float32]
    assert buf.numel == sum(p.numel() for p in model.parameters())
    assert all(p.main_grad.data_ptr() >= buf.data.data_ptr() for p in model.parameters())
    x, y = _global_batches()[0][0]
    (ddp(x) - y).pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())  # moved into main_grad by the hook
    once = [p.main_grad.clone() for p in model.parameters()]
    (ddp(x) - y).pow(2).mean().backward()
    for p, g in zip(model.parameters(), once):
        torch.testing.assert_close(p.main_grad, 2 * g)
    ddp.zero_grad_buffer()
    assert torch.count_nonzero(buf.data) == 0
    # passthrough of module attributes and state dict without a "module." prefix
    model.custom_attribute = 5
    assert ddp.module is model and ddp.custom_attribute == 5
    assert set(ddp.state_dict()) == set(model.state_dict())


def test_half_params_fp32_buffer():
    model = _model().half()
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True)
    assert list(ddp.grad_buffers) == [torch.float32]
    ddp16 = DistributedDataParallel(_model().half(), accumulate_allreduce_grads_in_fp32=False)
    assert list(ddp16.grad_buffers) == [torch.float16]


class _Tied(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.word = torch.nn.Parameter(torch.zeros(3, 2))
        self.norm = torch.nn.Parameter(torch.zeros(2))
        self.norm.sequence_parallel = True
        self.word.grad = torch.full((3, 2), value)
        self.norm.grad = torch.full((2,), value)

    def shared_embedding_or_output_weight(self):
        return self.word


def _finalize_body(rank, world_size):
    from megatron.core.parallel_state import destroy_model_parallel, initialize_model_parallel

    out = {}
    state = initialize_model_parallel(pipeline_model_parallel_size=2)  # stage 0 and stage 1 share the embedding
    model = _Tied(float(rank + 1))
    finalize_model_grads([model], state, sequence_parallel=False)
    out["pp_word"], out["pp_norm"] = model.word.grad.clone(), model.norm.grad.clone()
    destroy_model_parallel()
    state = initialize_model_parallel(tensor_model_parallel_size=2)
    model = _Tied(float(rank + 1))
    finalize_model_grads([model], state, sequence_parallel=True)
    out["sp_word"], out["sp_norm"] = model.word.grad.clone(), model.norm.grad.clone()
    return out


def test_finalize_embedding_and_sequence_parallel_grads():
    for rank, out in enumerate(run_distributed(_finalize_body, world_size=2)):
        assert torch.all(out["pp_word"] == 3.0)  # 1 + 2 over the embedding group
        assert torch.all(out["pp_norm"] == rank + 1)  # untouched without sequence parallelism
        assert torch.all(out["sp_word"] == rank + 1)  # PP=1: no embedding reduction
        assert torch.all(out["sp_norm"] == 3.0)  # summed over the TP group
