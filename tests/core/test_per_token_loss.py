"""--calculate-per-token-loss (Megatron-LM's rule) in one process: the schedule back-propagates the micro-batches'
loss sums undivided, counts their tokens, and finalize_model_grads divides the grads by the global batch's tokens,
so the gradient is that of sum(token losses) / sum(tokens) over the whole global batch however it is split into
micro-batches; the logged loss is the same ratio, computed by hand here from the logits. Without the flag a
three-value loss function is divided per micro-batch (Megatron's default)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.arguments import ArgumentError, parse_args, validate_args
from megatron.backend.megatron import reduce_logged_losses
from megatron.core.distributed import finalize_model_grads
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.losses import micro_batch_loss
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.model.helpers import VOCAB, build_gpt, tiny_config

ROWS, SEQ = 4, 8


def _data():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    mask = (torch.rand(ROWS, SEQ, generator=g) < 0.6).float()  # uneven token counts per row
    mask[0, :] = 1.0
    mask[3, :6] = 0.0
    return tokens[:, :-1], tokens[:, 1:], mask


def _forward_step(micro_batches):
    it = iter(micro_batches)

    def step(_, model):
        ids, labels, mask = next(it)
        pos = torch.arange(SEQ).expand(ids.size(0), SEQ)
        out = model(ids, pos, None, labels=labels)

        def loss_func(output):
            total = torch.sum(output.view(-1) * mask.view(-1))
            count = mask.sum()
            return total, count.long(), {"lm loss": torch.stack([total.detach(), count])}

        return out, loss_func

    return step


def _split(ids, labels, mask, per_micro):
    return [(ids[i:i + per_micro], labels[i:i + per_micro], mask[i:i + per_micro]) for i in range(0, ROWS, per_micro)]


def test_grads_and_logged_loss_do_not_depend_on_the_micro_batch_split():
    ids, labels, mask = _data()
    model = build_gpt(tiny_config(max_position_embeddings=SEQ), seed=2)
    logits = model(ids, torch.arange(SEQ).expand(ROWS, SEQ), None).detach()
    by_hand = (F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
               * mask.reshape(-1)).sum() / mask.sum()
    model.zero_grad()
    (model(ids, torch.arange(SEQ).expand(ROWS, SEQ), None, labels=labels) * mask).sum().div(mask.sum()).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}

    for per_micro in (4, 2, 1):
        model.zero_grad()
        micro = _split(ids, labels, mask, per_micro)
        num_tokens = torch.zeros((), dtype=torch.long)
        logged = forward_backward_no_pipelining(_forward_step(micro), None, model, len(micro),
                                                calculate_per_token_loss=True, num_tokens=num_tokens)
        assert int(num_tokens) == int(mask.sum())
        finalize_model_grads([model], None, num_tokens=num_tokens)
        loss = reduce_logged_losses(logged, ParallelState.single())["lm loss"]
        assert loss == pytest.approx(float(by_hand), rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, reference[name], rtol=1e-6, atol=1e-7, msg=f"{per_micro}: {name}")


def test_three_value_loss_without_the_flag_is_the_mean_of_micro_batch_means():
    total, count = torch.tensor(6.0), torch.tensor(3)
    loss, logged = micro_batch_loss((total, count, {"lm loss": torch.tensor([6.0, 3.0])}), 2, False, None)
    assert float(loss) == 1.0  # 6 / 3 tokens / 2 micro-batches
    with pytest.raises(ValueError, match="--calculate-per-token-loss needs a loss function returning"):
        micro_batch_loss((total, {}), 2, True, None)


def test_deepspeed_is_refused_in_one_line(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --deepspeed --calculate-per-token-loss").split()
    args = parse_args(args=argv)
    args.world_size = 1
    with pytest.raises(ArgumentError, match="^--calculate-per-token-loss is not implemented with --deepspeed") as info:
        validate_args(args)
    assert "\n" not in str(info.value)


def test_bert_and_t5_are_refused_in_one_line(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --calculate-per-token-loss").split()
    args = parse_args(args=argv)
    args.world_size = 1
    with pytest.raises(ArgumentError, match="^--calculate-per-token-loss is implemented for pretrain_gpt.py"):
        validate_args(args, defaults={"model_family": "bert"})
