"""Evaluate a GPT checkpoint with EleutherAI's lm-evaluation-harness (the bigscience fork's entry point and flags).

    python tasks/eval_harness/evaluate.py --load CKPT <model and tokenizer flags> \
        --task_list lambada_openai,hellaswag --results_path results.json \
        [--include_path DIR] [--num_fewshot K] [--limit N] [--bootstrap_iters N] [--adaptive_seq_len] \
        [--micro-batch-size B] [--micro_bs_multiplier M] [--eval_fp32] [--intermed_results]

One process or `torchrun` with TP / PP / DP (see tasks/eval_harness/adapter.py). Offline clusters: pass
`--include_path tasks/eval_harness/local_tasks --task_list local_tasks` (or your own YAML tasks over JSON files).
Rank 0 prints lm-eval's table and writes the results JSON the way lm-eval's CLI does (no per-sample logs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir)))

from megatron.errors import MegatronUserError, exit_on_user_error  # noqa: E402
from megatron.settings import EvalHarnessSettings, RandomWeightsSettings, add_group  # noqa: E402
from tasks.eval_harness import require_lm_eval  # noqa: E402

RESULT_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
               "n-samples")


class EvalHarnessArgsError(MegatronUserError, ValueError):
    """Bad evaluation-harness flags (unknown task, bad limit, ...)."""


def get_eval_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The bigscience fork's evaluation flags (underscore names, as there) plus --include_path/--num_fewshot/--limit
    (declared in megatron/settings/tasks.py) and the random-weights opt-in."""
    return add_group(add_group(parser, EvalHarnessSettings), RandomWeightsSettings)


def check_eval_args(args: argparse.Namespace) -> list[str]:
    """The task names, after checking the flags."""
    tasks = [t.strip() for t in args.task_list.split(",") if t.strip()]
    if not tasks:
        raise EvalHarnessArgsError("--task_list is empty; name at least one lm-eval task, e.g. lambada_openai")
    if args.micro_bs_multiplier < 1:
        raise EvalHarnessArgsError(f"--micro_bs_multiplier must be >= 1 (got {args.micro_bs_multiplier})")
    if args.limit is not None and args.limit <= 0:
        raise EvalHarnessArgsError(f"--limit must be positive (got {args.limit})")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise EvalHarnessArgsError(f"--num_fewshot must be >= 0 (got {args.num_fewshot})")
    if args.bootstrap_iters < 0:
        raise EvalHarnessArgsError(f"--bootstrap_iters must be >= 0 (got {args.bootstrap_iters})")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise EvalHarnessArgsError(f"--include_path {args.include_path} is not a folder of task YAMLs")
    return tasks


def task_manager(include_path: Optional[str], tasks: Optional[list[str]] = None) -> Any:
    """lm-eval's TaskManager. When every task in `tasks` is in --include_path, only that folder is indexed (lm-eval's
    own index of ~14,700 task files takes ~14 s per process on a 2-core machine; a task of that folder takes
    precedence over a stock one of the same name either way); otherwise lm-eval's tasks and the folder's."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], manager: Any) -> None:
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        raise EvalHarnessArgsError(f"unknown lm-eval task(s) {', '.join(missing)}; check --task_list, or point "
                                   "--include_path at the folder holding their YAML files")


def run_tasks(lm: Any, tasks: list[str], manager: Any, *, num_fewshot: Optional[int] = None,
              limit: Optional[float] = None, bootstrap_iters: int = 100000, seed: int = 1234) -> dict:
    """lm_eval.simple_evaluate with our LM object; lm-eval's result dict without per-sample logs, on every rank.

    lm-eval builds the result dict only where LOCAL_RANK is 0; global rank 0's copy is broadcast to all ranks.
    """
    import lm_eval
    import torch.distributed as dist

    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                  bootstrap_iters=bootstrap_iters, task_manager=manager, log_samples=False,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed)
    if out is not None:
        out = dict(out)
        out.pop("samples", None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    if out is None:
        raise RuntimeError("lm-eval returned no results on global rank 0 (is its LOCAL_RANK 0?)")
    return out


def merge_results(total: Optional[dict], part: dict) -> dict:
    """Fold the result dict of one more task into the running one (--intermed_results)."""
    if total is None:
        return part
    for key in RESULT_KEYS:
        if key in part:
            total.setdefault(key, {}).update(part[key])
    return total


def results_json(results: dict) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def evaluate(args: argparse.Namespace) -> dict:
    """Load the model of this rank, run the tasks, print and write the results on rank 0; returns the results."""
    import torch

    from megatron import global_vars
    from megatron.checkpoint.atomic_io import atomic_write_text
    from megatron.core import parallel_state as ps
    from megatron.inference import InferenceEngine, engine_config_from_args
    from megatron.text_generation.model_loading import load_model_for_inference, refuse_random_weights
    from tasks.eval_harness.adapter import MegatronLM

    refuse_random_weights(args.load, args.allow_random_weights, "evaluation")
    tasks = check_eval_args(args)
    manager = task_manager(args.include_path, tasks)
    check_tasks(tasks, manager)
    if args.eval_fp32 and (args.fp16 or args.bf16):  # a copy: the args start-up assembled stay as they are
        args = argparse.Namespace(**{**vars(args), "fp16": False, "bf16": False, "params_dtype": torch.float32})
    state = ps.get_parallel_state() if ps.model_parallel_is_initialized() else ps.ParallelState.single()
    model = load_model_for_inference(args, state, parallel_output=False)
    engine_config = engine_config_from_args(args)  # --inference-dynamic-batching: generate_until on the engine
    engine = (InferenceEngine(model, engine_config, eod=int(global_vars.get_tokenizer().eod), state=state)
              if engine_config is not None else None)
    lm = MegatronLM(model, global_vars.get_tokenizer(), max_length=args.seq_length,
                    batch_size=args.micro_batch_size * args.micro_bs_multiplier, max_gen_toks=args.max_gen_toks,
                    state=state, adaptive_seq_len=args.adaptive_seq_len, seed=args.seed, engine=engine)
    kwargs = dict(num_fewshot=args.num_fewshot, limit=args.limit, bootstrap_iters=args.bootstrap_iters,
                  seed=args.seed)
    rank0 = state.global_rank == 0
    results: Optional[dict] = None
    for group in ([[t] for t in tasks] if args.intermed_results else [tasks]):
        part = run_tasks(lm, group, manager, **kwargs)
        results = merge_results(results, part)
        if rank0:
            from lm_eval.utils import make_table

            print(make_table(part), flush=True)
            atomic_write_text(args.results_path, results_json(results))
    assert results is not None
    if rank0:
        print(f"> results written to {args.results_path}", flush=True)
    return results


def main(argv: Optional[list[str]] = None) -> dict:
    require_lm_eval()
    from megatron.initialize import initialize_megatron

    args = initialize_megatron(extra_args_provider=get_eval_args, args=argv,
                               args_defaults={"tokenizer_type": "GPT2BPETokenizer", "micro_batch_size": 1,
                                              "no_load_rng": True, "no_load_optim": True})
    return evaluate(args)


if __name__ == "__main__":
    if not sys.stderr.isatty():  # a redirected log: no '\r' progress bars (lm-eval's, read when tqdm is imported)
        os.environ.setdefault("TQDM_DISABLE", "1")
    exit_on_user_error(main)
