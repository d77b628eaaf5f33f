"""The distributed optimizer (ZeRO-1) on 2 and 4 gloo ranks equals the regular optimizer on one process: fp32
params after several AdamW steps with grad clipping active (1e-6 relative), grad norms and zero counts equal; at DP=4
with bucketed --overlap-grad-reduce / --overlap-param-gather over two model chunks (as with virtual pipeline
stages); fp16 with a forced overflow on one rank (skipped on every rank); each rank holds ~1/DP of the fp32 main
params and Adam moments; the per-parameter checkpoint state saved at DP=2 reloads at DP=1 and DP=4.

Two spawns in all (DP=2 and DP=4) to keep the test time low; the DP=1 reload runs in the test process.
"""
import contextlib

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from tests.dist_utils import run_distributed

STEPS, MICRO = 5, 2
GLOBAL_MB = 4  # micro-batches of MICRO samples per global batch


def _chunks(dtype=torch.float32, split=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.LayerNorm(9), torch.nn.GELU(), torch.nn.Linear(9, 5),
                                torch.nn.Linear(5, 3)).to(dtype)
    return [model[:3], model[3:]] if split else [model]


def _batches(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(MICRO, 6, generator=g).to(dtype), torch.randn(MICRO, 3, generator=g))
             for _ in range(GLOBAL_MB)] for _ in range(STEPS)]


def _wrap(chunks, dp_group=None, distopt=False, overlap=False):
    return [DistributedDataParallel(c, dp_group=dp_group, accumulate_allreduce_grads_in_fp32=True,
                                    use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                                    overlap_param_gather=overlap and distopt, bucket_size=20 if overlap else None)
            for c in chunks]


def _train(ddps, opt, per_step, overflow_step=None, rank=0):
    results = []
    for step, micro_batches in enumerate(per_step):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.ExitStack() as stack:
                if not last:
                    for ddp in ddps:
                        stack.enter_context(ddp.no_sync())
                out = x
                for ddp in ddps:
                    out = ddp(out)
                loss = (out.float() - y).pow(2).mean() / len(micro_batches)
                if step == overflow_step and rank == 0 and i == 0:
                    loss = loss * float("inf")
                opt.scale_loss(loss).backward()
        launched = sum(b.launched for ddp in ddps for b in ddp.buckets)  # started during backward (overlap)
        finalize_model_grads(ddps, None)
        results.append(opt.step() + (launched,))
    for ddp in ddps:
        ddp.finish_param_sync()
    return results


def _params(ddps):
    return [p.detach().float().clone() for ddp in ddps for p in ddp.module.parameters()]


def _config(dtype, distopt):
    return OptimizerConfig(lr=1e-2, clip_grad=0.05, fp16=dtype == torch.float16, params_dtype=dtype,
                           initial_loss_scale=2.0**8, log_num_zeros_in_grad=True, use_distributed_optimizer=distopt)


def _case(rank, world_size, state, dtype, split, overlap, overflow_step):
    """Regular optimizer on the whole batch (this process alone) vs the distributed one on this rank's share."""
    ref = _wrap(_chunks(dtype, split))
    ref_opt = get_megatron_optimizer(ref, _config(dtype, False))
    ref_steps = _train(ref, ref_opt, _batches(dtype), overflow_step)
    ddps = _wrap(_chunks(dtype, split), state.dp_group, distopt=True, overlap=overlap)
    opt = get_megatron_optimizer(ddps, _config(dtype, True), state)
    assert isinstance(opt, DistributedOptimizer)
    per_rank = GLOBAL_MB // world_size
    mine = [mbs[rank * per_rank:(rank + 1) * per_rank] for mbs in _batches(dtype)]
    steps = _train(ddps, opt, mine, overflow_step, rank)
    return {"params": _params(ddps), "ref": _params(ref), "steps": steps, "ref_steps": ref_steps,
            "buckets": sum(len(d.buckets) for d in ddps), "numel": opt.state_numel(),
            "scale": float(opt.get_loss_scale())}


def _save_or_load(rank, world_size, state, path, save):
    """3 steps then save (DP=2), or load; then 2 more steps. Returns the final params."""
    ddps = _wrap(_chunks(), state.dp_group if state else None, distopt=True)
    opt = get_megatron_optimizer(ddps, _config(torch.float32, True), state)
    per_rank = GLOBAL_MB // world_size
    batches = [mbs[rank * per_rank:(rank + 1) * per_rank] for mbs in _batches()]
    if save:
        _train(ddps, opt, batches[:3])
        full = opt.get_parameter_state()
        if rank == 0:
            torch.save({"param_state": full, "model": ddps[0].module.state_dict(), "common": opt.state_dict()}, path)
        if world_size > 1:
            torch.distributed.barrier()
    else:
        saved = torch.load(path, weights_only=False)
        ddps[0].module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["common"])
        opt.load_parameter_state(saved["param_state"])
    _train(ddps, opt, batches[3:])
    return _params(ddps)


def _body(rank, world_size, path):
    from megatron.core.parallel_state import initialize_model_parallel

    state = initialize_model_parallel()
    out = {}
    if world_size == 2:
        out["fp32"] = _case(rank, world_size, state, torch.float32, False, False, None)
        out["fp16"] = _case(rank, world_size, state, torch.float16, False, False, 2)
        out["resumed"] = _save_or_load(rank, world_size, state, path, save=True)
    else:
        out["fp32"] = _case(rank, world_size, state, torch.float32, True, True, None)
        out["resumed"] = _save_or_load(rank, world_size, state, path, save=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("distopt") / "state.pt")
    return {2: run_distributed(_body, 2, args=(path,)), 4: run_distributed(_body, 4, args=(path,)), "path": path}


@pytest.mark.parametrize("world_size", [2, 4], ids=["dp2", "dp4-overlap-2chunks"])
def test_fp32_equals_regular_optimizer(runs, world_size):
    total = sum(p.numel() for p in _chunks()[0].parameters())
    for rank_out in runs[world_size]:
        r = rank_out["fp32"]
        assert r["buckets"] > 2 if world_size == 4 else r["buckets"] == 1
        for p, ref in zip(r["params"], r["ref"]):
            torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
        norms = [s[1] for s in r["steps"]]
        ref_norms = [s[1] for s in r["ref_steps"]]
        assert max(ref_norms) > 0.05, "clipping must be active"
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert [s[2] for s in r["steps"]] == [s[2] for s in r["ref_steps"]]  # num zeros counted once over shards
        assert all(s[3] == (r["buckets"] if world_size == 4 else 0) for s in r["steps"])  # async launches
        # ~1/DP of the fp32 main params and of the Adam moments on each rank (bucket padding < DP per bucket).
        held = r["numel"]["main_params"]
        assert abs(held - total / world_size) <= r["buckets"] * world_size
        assert r["numel"]["optimizer_state"] == 2 * held
    assert sum(o["fp32"]["numel"]["main_params"] for o in runs[world_size]) == total


def test_fp16_overflow_skipped_on_every_rank(runs):
    results = [o["fp16"] for o in runs[2]]
    for r in results:
        oks = [s[0] for s in r["steps"]]
        assert oks == [s[0] for s in r["ref_steps"]]
        assert oks[2] is False and all(oks[:2]) and all(oks[3:])  # rank 0's inf skips the step on both ranks
        assert r["numel"]["main_param_copies"] == r["numel"]["main_params"]  # fp32 copies of the fp16 shard
        for p, ref in zip(r["params"], r["ref"]):
            torch.testing.assert_close(p, ref, rtol=2e-3, atol=2e-3)
    assert results[0]["scale"] == results[1]["scale"] == 2.0**8  # hysteresis 2: one overflow keeps the scale
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_parameter_state_reloads_at_another_dp_size(runs):
    """Saved after 3 steps at DP=2; continuing there == reloading at DP=4 (and DP=1) and continuing."""
    base = runs[2][0]["resumed"]
    for p, ref in zip(runs[4][0]["resumed"], base):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
    from megatron.core import parallel_state as ps

    single = _save_or_load(0, 1, ps.ParallelState.single(), runs["path"], save=False)
    for p, ref in zip(single, base):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)
