"""Local DDP buckets (in process, no spawn): --ddp-bucket-size splits the buffer in backward order, each bucket's
reduction is started by the grad hook during the last micro-batch's backward (not under no_sync()), the tied
embedding gets a bucket of its own with the distributed optimizer, and bad combinations are refused in one line.
The multi-rank numerics are in tests/optimizer/test_distrib_optimizer.py and tests/training/test_distopt_training.py.
"""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))


def test_buckets_follow_backward_order_and_bucket_size():
    model = _model()
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True, overlap_grad_reduce=True,
                                  bucket_size=12)
    params = list(model.parameters())
    assert len(ddp.buckets) > 2
    assert ddp.buckets[0].start == 0 and ddp.param_index_map[params[-1]][1] == 0  # last param first in the buffer
    for a, b in zip(ddp.buckets, ddp.buckets[1:]):
        assert a.end == b.start  # contiguous, no padding without the distributed optimizer
    assert sorted(id(p) for b in ddp.buckets for p in b.params) == sorted(id(p) for p in params)
    for bucket in ddp.buckets[:-1]:
        assert bucket.numel >= 12 and bucket.numel - bucket.params[-1].numel() < 12
    one_bucket = DistributedDataParallel(_model(), accumulate_allreduce_grads_in_fp32=True)
    assert len(one_bucket.buckets) == 1  # without overlap: one collective per buffer, as before


def test_reduction_starts_in_the_last_microbatch_backward():
    model = _model()
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True, overlap_grad_reduce=True,
                                  bucket_size=12)
    x = torch.randn(3, 4)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert not any(b.launched for b in ddp.buckets)
    ddp(x).sum().backward()
    assert all(b.launched for b in ddp.buckets)  # every bucket started by the hook, before finish_grad_sync
    ddp.finish_grad_sync()
    assert not any(b.launched for b in ddp.buckets)
    ref = _model()
    (ref(x).sum() * 2).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, r.grad)


def test_tied_embedding_gets_its_own_bucket_and_params_live_in_the_buffer():
    model = _model()
    model[2].weight.shared_embedding = True
    ddp = DistributedDataParallel(model, accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=True)
    weight = model[2].weight
    own = [b for b in ddp.buckets if any(p is weight for p in b.params)]
    assert len(own) == 1 and len(own[0].params) == 1 and len(ddp.buckets) == 3
    buffer = ddp.param_buffers[torch.float32]
    with torch.no_grad():
        buffer.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())  # params are views of the buffer


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="contiguous gradient buffers"):
        DistributedDataParallel(_model(), use_contiguous_buffers=False, overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="--overlap-param-gather needs --use-distributed-optimizer"):
        DistributedDataParallel(_model(), overlap_param_gather=True)
    with pytest.raises(ValueError, match="--ddp-bucket-size must be positive"):
        DistributedDataParallel(_model(), overlap_grad_reduce=True, bucket_size=0)
