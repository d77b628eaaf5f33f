"""Finetuning accuracy (Megatron's tasks/eval_utils.py): per --valid-data set, forward-only through the pipeline
schedule, correct/total reduced over the data-parallel ranks with every example counted once (Megatron's padded
DistributedSampler counts duplicates), Megatron's two accuracy lines, and predictions for submission files.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional, Sequence

import torch

from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.utils import print_rank_0


def batch_tensors(batch: dict, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """tokens, types, padding_mask, labels (int64; on the GPU unless gloo)."""
    out = tuple(torch.as_tensor(batch[k]).long() for k in ("text", "types", "padding_mask", "label"))
    if torch.cuda.is_available() and args.distributed_backend != "gloo":
        device = torch.cuda.current_device()
        out = tuple(t.cuda(device, non_blocking=True) for t in out)
    return out


def _eval_forward_step(args: argparse.Namespace) -> Callable:
    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
        batch = next(data_iterator)
        tokens, types, padding_mask, labels = batch_tensors(batch, args)
        uids = [int(u) for u in batch["uid"]]
        logits = model(tokens, padding_mask, tokentype_ids=types)

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> tuple[torch.Tensor, dict]:
            preds = output.float().argmax(dim=-1)
            return torch.zeros((), device=output.device), {
                "correct": int((preds == labels).sum().item()), "total": int(labels.numel()),
                "predictions": list(zip(uids, preds.tolist()))}

        return logits, loss_func

    return forward_step


def accuracy(dataset: Any, model: list, args: argparse.Namespace, state: ps.ParallelState,
             batch_size: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(correct, total, [(uid, predicted class)] sorted by uid) over the whole dataset, the same on every rank."""
    indices = list(range(state.dp_rank, len(dataset), state.dp_size))  # every example once over the DP ranks
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=batch_size,
                                         shuffle=False, drop_last=False)
    multiplier = getattr(dataset, "sample_multiplier", 1)
    schedule = get_forward_backward_func(args.pipeline_model_parallel_size,
                                         getattr(args, "virtual_pipeline_model_parallel_size", None))
    step = _eval_forward_step(args)
    correct = total = 0
    preds: list[tuple[int, int]] = []
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        for batch in loader:
            b = len(batch["label"])
            outs = schedule(forward_step_func=step, data_iterator=iter([batch]), model=model, num_microbatches=1,
                            forward_only=True, seq_length=args.seq_length, micro_batch_size=b * multiplier,
                            parallel_state=state)
            if state.is_pipeline_last_stage(ignore_virtual=True) and state.tp_rank == 0:
                for d in outs or []:
                    correct += d["correct"]
                    total += d["total"]
                    preds.extend(d["predictions"])
    for chunk in model:
        chunk.train()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        counts = torch.tensor([correct, total], dtype=torch.float64)
        torch.distributed.all_reduce(counts)  # only last-stage TP-rank-0 ranks contribute: each example once
        correct, total = int(counts[0].item()), int(counts[1].item())
        gathered: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, preds)
        preds = [p for part in gathered for p in part]
    return correct, total, sorted(preds)


def accuracy_lines(epoch: int, name: str, correct: int, total: int, seconds: float) -> str:
    return (f" > |epoch: {epoch}| metrics for {name}: correct / total = {correct} / {total} = "
            f"{correct / max(1, total) * 100.0:.4f} %, elapsed time (sec): {seconds:.3f}")


def evaluate_datasets(datasets: Sequence[Any], model: list, args: argparse.Namespace, state: ps.ParallelState,
                      epoch: int, batch_size: int,
                      write_predictions: Optional[Callable[[Any, list], None]] = None) -> dict:
    """Megatron's accuracy callback: one line per dataset and the overall line; returns {name: (correct, total)}."""
    results: dict = {}
    all_correct = all_total = 0
    for ds in datasets:
        start = time.time()
        correct, total, preds = accuracy(ds, model, args, state, batch_size)
        if write_predictions is not None:
            write_predictions(ds, preds)
        if not getattr(ds, "has_labels", True):  # a test file: its labels are placeholders, an accuracy would lie
            print_rank_0(f" > |epoch: {epoch}| {ds.dataset_name}: {total} predictions (no gold labels in the file, "
                         f"so no accuracy), elapsed time (sec): {time.time() - start:.3f}")
            continue
        print_rank_0(accuracy_lines(epoch, ds.dataset_name, correct, total, time.time() - start))
        results[ds.dataset_name] = (correct, total)
        all_correct += correct
        all_total += total
    if results:
        print_rank_0(f" >> |epoch: {epoch}| overall: correct / total = {all_correct} / {all_total} = "
                     f"{all_correct / max(1, all_total) * 100.0:.4f} %")
    return results
