"""Zero-shot GPT evaluation loop (Megatron's tasks/zeroshot_gpt/evaluate.py): loss / accuracy and result lines.

WIKITEXT103 sums the vocab-parallel cross entropy of the scored tokens; LAMBADA counts examples whose scored tokens
are all predicted greedily (argmax of the gathered logits). Sums are all-reduced over the data-parallel group; the
examples are split over data-parallel ranks without duplication (under expert parallelism the ranks of one expert
group take the same share, as their MoE layers exchange tokens, and the sum is divided by the group's size). Under pipeline parallelism each micro-batch runs
forward-only through the stages (P2PCommunicator), the last stage computes the loss / correct count, and the sums
are all-reduced over the pipeline group (the other stages contribute 0), so every rank holds the result.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Optional

import torch

from megatron import global_vars
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.pipelined import tensor_shape_for
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.errors import MegatronUserError
from megatron.text_generation.model_loading import load_model_for_inference, refuse_random_weights
from megatron.utils import get_ltor_masks_and_position_ids, print_rank_0
from tasks.zeroshot_gpt.datasets import LMWindowDataset, build_lambada_dataset, build_wikitext_dataset

TASK_METRICS = {"WIKITEXT103": "loss", "LAMBADA": "accuracy"}


class TaskError(MegatronUserError, ValueError):
    """Bad --task / --valid-data combination."""


def _state() -> ps.ParallelState:
    return ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()


def _device(args: argparse.Namespace) -> torch.device:
    if torch.cuda.is_available() and getattr(args, "distributed_backend", None) != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_batch(batch: dict, args: argparse.Namespace, eod: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """tokens, labels, attention_mask, position_ids, loss_mask of one micro-batch."""
    tokens_ = batch["text"].long().to(device)
    labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    loss_mask = batch["pad_mask"].long().to(device)
    return tokens, labels, attention_mask, position_ids, loss_mask


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _pipeline_forward(model: torch.nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor, state: ps.ParallelState) -> Optional[torch.Tensor]:
    """Forward of one micro-batch through the pipeline: the logits on the last stage, None on the others."""
    inner = _unwrapped(model)
    config = inner.config
    dtype = torch.float32 if getattr(config, "fp32_residual_connection", False) else config.params_dtype
    p2p = P2PCommunicator(state, tensor_shape_for(inner, tokens.size(1), tokens.size(0)), dtype, tokens.device)
    inner.set_input_tensor(None if state.is_pipeline_first_stage() else p2p.communicate(recv_prev=True)[0])
    output = model(tokens, position_ids, attention_mask)
    if state.is_pipeline_last_stage():
        return output
    p2p.communicate(send_next=output.to(dtype))
    return None


def batch_output(model: torch.nn.Module, batch: dict, eval_metric: str, args: argparse.Namespace, eod: int,
                 tp_group: Any, state: Optional[ps.ParallelState] = None) -> torch.Tensor:
    """Summed scored-token loss (loss) or number of fully correct examples (accuracy) of one micro-batch.

    With a pipeline-parallel `state` every stage must call this for the same micro-batch; only the last stage
    returns the real value, the others return 0.
    """
    tokens, labels, attention_mask, position_ids, loss_mask = process_batch(batch, args, eod, _device(args))
    if state is not None and state.pp_size > 1:
        output = _pipeline_forward(model, tokens, position_ids, attention_mask, state)
        if output is None:
            return torch.zeros((), device=tokens.device)
    else:
        output = model(tokens, position_ids, attention_mask)
    if eval_metric == "loss":
        losses = vocab_parallel_cross_entropy(output.float(), labels, tp_group)
        return torch.sum(losses.view(-1) * loss_mask.view(-1).float())
    correct = (torch.argmax(output, -1) == labels).float()
    correct[(1 - loss_mask).bool()] = 1
    return correct.prod(-1).sum()


def evaluate(dataset: torch.utils.data.Dataset, model: torch.nn.Module, eval_metric: str, args: argparse.Namespace,
             eod: int, state: Optional[ps.ParallelState] = None, progress: bool = True) -> float:
    """Sum of `batch_output` over this data-parallel rank's share of `dataset`, all-reduced over data parallel."""
    state = state or _state()
    shard, shards = state.forward_only_shard()  # under EP the ranks of one expert group run the same batches
    indices = list(range(shard, len(dataset), shards))
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=args.micro_batch_size,
                                         shuffle=False, drop_last=False, num_workers=args.num_workers)
    if progress and state.global_rank == 0:
        from tasks.zeroshot_gpt.progress import progress as progress_lines

        loader = progress_lines(loader, total=len(loader), desc="evaluating")
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=_device(args))
    with torch.no_grad():
        for batch in loader:
            total += batch_output(model, batch, eval_metric, args, eod, state.tp_group, state).double()
    if state.pp_size > 1:
        _unwrapped(model).set_input_tensor(None)
        torch.distributed.all_reduce(total, group=state.pp_group)  # only the last stage's sum is non-zero
    if torch.distributed.is_initialized() and state.dp_size > 1:
        torch.distributed.all_reduce(total, group=state.dp_group)
        total /= state.dp_size // shards  # each shard was summed by that many ranks
    return float(total.item())


def format_results(task: str, eval_metric: str, output: float, dataset: Any) -> tuple[str, dict[str, float]]:
    """Megatron's ' validation results on TASK | ...' line and the numbers in it."""
    string = f" validation results on {task} | "
    if eval_metric == "loss":
        num_tokenized = dataset.num_tokenized_tokens
        num_original = dataset.num_original_tokens
        val_loss = output / (num_tokenized - 1)
        ppl = math.exp(min(20, val_loss))
        token_ratio = (num_tokenized - 1) / (num_original - 1)
        adjusted_ppl = math.exp(min(20, val_loss * token_ratio))
        string += f"avg loss: {val_loss:.4E} | ppl: {ppl:.4E} | adjusted ppl: {adjusted_ppl:.4E} | "
        string += f"token ratio: {token_ratio} |"
        return string, {"avg_loss": val_loss, "ppl": ppl, "adjusted_ppl": adjusted_ppl, "token_ratio": token_ratio,
                        "num_tokenized_tokens": num_tokenized, "num_original_tokens": num_original}
    num_examples = len(dataset)
    acc = output / num_examples
    string += f"number correct: {output:.4E} | total examples: {num_examples:.4E} | avg accuracy: {acc:.4E}"
    return string, {"number_correct": output, "total_examples": num_examples, "accuracy": acc}


def build_dataset(task: str, args: argparse.Namespace, tokenizer: Any) -> Any:
    """The evaluation dataset of `task` from the single --valid-data file."""
    if not args.valid_data or len(args.valid_data) != 1:
        raise TaskError(f"--task {task} needs exactly one --valid-data file (got {len(args.valid_data or [])})")
    path = args.valid_data[0]
    if task == "WIKITEXT103":
        return build_wikitext_dataset(path, tokenizer, args.seq_length, args.overlapping_eval)
    return build_lambada_dataset(path, tokenizer, args.seq_length, args.strict_lambada)


def main(args: Optional[argparse.Namespace] = None) -> dict[str, float]:
    """Evaluate --task on --valid-data with the model from --load; print and return the results."""
    args = args or global_vars.get_args()
    if args.task not in TASK_METRICS:
        raise TaskError(f"--task {args.task} is not a zero-shot GPT task; use one of {', '.join(TASK_METRICS)}")
    eval_metric = TASK_METRICS[args.task]
    refuse_random_weights(args.load, args.allow_random_weights, f"{args.task} evaluation")
    state = _state()
    tokenizer = global_vars.get_tokenizer()
    dataset = build_dataset(args.task, args, tokenizer)
    # vocab-parallel logits for the loss; full-vocab logits (gathered over TP) for the greedy accuracy
    model = load_model_for_inference(args, state, parallel_output=eval_metric == "loss")
    if isinstance(dataset, LMWindowDataset):
        print_rank_0(f" > {args.task}: {dataset.num_tokenized_tokens} tokens ({dataset.num_original_tokens} original "
                     f"words) in {len(dataset)} windows of {dataset.seq_len}, stride {dataset.overlapping_eval}")
    else:
        print_rank_0(f" > {args.task}: {len(dataset)} examples (strict: {bool(args.strict_lambada)})")
    output = evaluate(dataset, model, eval_metric, args, tokenizer.eod, state)
    string, results = format_results(args.task, eval_metric, output, dataset)
    length = len(string) + 1
    print_rank_0("-" * length)
    print_rank_0(string)
    print_rank_0("-" * length)
    return results
