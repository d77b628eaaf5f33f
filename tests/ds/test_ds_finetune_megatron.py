"""``--deepspeed --finetune --load <Megatron checkpoint>`` under every ZeRO stage and the pipeline engine, and a
``--to-deepspeed`` checkpoint under ZeRO-3 (megatron/ds/weights.py).

One 2-process job (DeepSpeed imported once per process): a non-DeepSpeed run saves a Megatron checkpoint at
iteration 4 (TP=1, DP=2); rank 0 converts it to TP=2 (tools/checkpoint/convert.py) and to DeepSpeed's layout
(tools/convert_deepspeed_checkpoint.py --to-deepspeed). Then:

- reference: the non-DeepSpeed ``--finetune`` run from it (DP=2);
- ``--deepspeed --finetune`` from the Megatron checkpoint under ZeRO-0/1/2/3 (DP=2), the pipeline engine (PP=2,
  GPTModelPipe), TP=2 x ZeRO-1 from the TP=2 checkpoint (per-rank mp_rank_XX files) and TP=2 x ZeRO-3 from the TP=1
  checkpoint (split on load), and ZeRO-3 from the --to-deepspeed output and from convert.py --saver deepspeed at TP=2
  (no ZeRO-3 files in either; the latter merged to TP=1 on load): the first loss (the
  loaded weights, before any update) equals the reference's within 1e-6, every training loss and the final
  validation loss within 1e-5 — so the fp32 master copies followed the loaded weights;
- ``--no-load-optim --no-load-rng`` from the Megatron checkpoint (ZeRO-1) and from the --to-deepspeed output
  (ZeRO-3) continue at iteration 5 with the non-DeepSpeed run's curve of the same flags;
- random tiny Hugging Face models converted with convert.py --loader hf (release checkpoints): GPT2LMHeadModel
  under ZeRO-3 and PP=2, LlamaForCausalLM (GQA, SwiGLU, RMSNorm, rope, untied output layer) under PP=2 and TP=2 x
  ZeRO-3: their DeepSpeed --finetune curves equal the non-DeepSpeed ones (same tolerances);
- the ZeRO-3 run's global_step files (weights in the fp32 partitions) evaluated under ZeRO-1 give its final
  validation loss (1e-6);
- without --finetune (or those two flags) the Megatron checkpoint is refused in one line, and so are another
  --hidden-size and loading the optimizer state from weights-only DeepSpeed files.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed
from tests.ds._workers import run_pretrain_ds, tiny_gpt_argv, write_ds_config
from tests.training._workers import curve_from_result

REPO = Path(__file__).resolve().parents[2]
FT_ITERS = 5


def _convert(ckpt: str, tp2: str, ds: str) -> None:
    """Megatron TP=1 -> TP=2 (convert.py), -> DeepSpeed layout (--to-deepspeed) and -> DeepSpeed layout at TP=2
    (convert.py --saver deepspeed, into `ds`_saver_tp2), in this process."""
    import contextlib
    import io

    sys.path.insert(0, str(REPO / "tools"))
    sys.path.insert(0, str(REPO / "tools" / "checkpoint"))  # the DeepSpeed plugins, as when convert.py runs
    import convert_deepspeed_checkpoint as ds_tool

    from megatron.checkpoint.conversion.driver import main as convert_main

    with contextlib.redirect_stdout(io.StringIO()):
        convert_main(["--model-type", "GPT", "--loader", "megatron", "--saver", "megatron", "--load-dir", ckpt,
                      "--save-dir", tp2, "--target-tensor-parallel-size", "2"])
        ds_tool.main(["--to-deepspeed", "--input-folder", ckpt, "--output-folder", ds])
        convert_main(["--model-type", "GPT", "--loader", "megatron", "--saver", "deepspeed", "--load-dir", ckpt,
                      "--save-dir", ds + "_saver_tp2", "--target-tensor-parallel-size", "2"])


def _weights_vs_megatron(rank: int, world_size: int, argv: list[str], ref_load: str) -> float:
    """Max |engine weight - Megatron-loaded weight| after the engine's start-up load (ZeRO-3 gathered first); the
    reference is a plain GPTModel loaded by megatron.compat.load_checkpoint from `ref_load`."""
    import contextlib
    import io

    import deepspeed
    import torch

    import pretrain_gpt
    from megatron.compat import load_checkpoint
    from megatron.core import parallel_state as ps
    from megatron.initialize import initialize_megatron
    from megatron.layers.enums import ModelType
    from megatron.run_configs.bundle import RunConfigs
    from megatron.training import setup_model_and_optimizer
    from megatron.training_state import TrainingState
    from tests.ds._workers import _reset_megatron, ds_env

    ds_env(rank, world_size)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = initialize_megatron(args=argv, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
            model, _, _ = setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder,
                                                    RunConfigs.from_args(args), ps.get_parallel_state(),
                                                    TrainingState())
            ref = pretrain_gpt.model_provider()
            args.load = ref_load
            load_checkpoint([ref], None, None, args)
        ref_sd = ref.state_dict()
        module = model[0].module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            diffs = [float((p.detach() - ref_sd[n]).abs().max()) for n, p in module.named_parameters()]
        assert len(diffs) == len(ref_sd)
        return max(diffs)
    finally:
        _reset_megatron()
        torch.distributed.barrier()


def _job(rank: int, world_size: int, save: list[str], ckpts: tuple[str, str, str], runs: list[list[str]],
         compare: list[tuple[list[str], str]]) -> list:
    import torch

    first = run_pretrain_ds(rank, world_size, save)
    if rank == 0 and first["error"] is None:
        _convert(*ckpts)
    torch.distributed.barrier()
    out = [first] + [run_pretrain_ds(rank, world_size, argv) for argv in runs]
    return out + [[_weights_vs_megatron(rank, world_size, argv, ref) for argv, ref in compare]]


def _hf_to_megatron(folder: Path, kind: str, vocab_size: int) -> list[str]:
    """A random tiny HF GPT2LMHeadModel or LlamaForCausalLM (GQA, SwiGLU, RMSNorm, rope, untied; safetensors)
    converted by convert.py --loader hf into folder/{kind}_megatron; returns the model flags the tool prints."""
    import contextlib
    import io

    import torch
    import transformers

    from megatron.checkpoint.conversion.driver import main as convert_main

    torch.manual_seed(11)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5)
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(str(folder / kind))
    with contextlib.redirect_stdout(io.StringIO()):
        summary = convert_main(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron", "--load-dir",
                                str(folder / kind), "--save-dir", str(folder / f"{kind}_megatron")])
    return summary["flags"].split()


@pytest.fixture(scope="module")
def job(gpt_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ds_finetune")
    ckpt, tp2, ds, ds3 = str(tmp / "megatron"), str(tmp / "megatron_tp2"), str(tmp / "ds"), str(tmp / "ds_zero3")
    cfg = {s: write_ds_config(str(tmp / f"z{s}.json"), zero_optimization={"stage": s}) for s in (0, 1, 2, 3)}

    def ft(load: str, *extra: str, iters: int = FT_ITERS) -> list[str]:
        return tiny_gpt_argv(gpt_data, "--load", load, *extra, iters=iters)

    fine = ["--finetune", "--lr-warmup-iters", "1"]
    keep = ["--no-load-optim", "--no-load-rng"]
    tp = ["--tensor-model-parallel-size", "2"]
    named = {
        "ref": ft(ckpt, *fine),
        **{f"zero{s}": ft(ckpt, *fine, "--deepspeed", "--deepspeed_config", cfg[s]) for s in (0, 1, 2)},
        "zero3": ft(ckpt, *fine, "--deepspeed", "--deepspeed_config", cfg[3], "--save", ds3, "--save-interval",
                    str(FT_ITERS)),
        "pipe": ft(ckpt, *fine, "--deepspeed", "--deepspeed_config", cfg[1], "--pipeline-model-parallel-size", "2"),
        "tp2_zero1": ft(tp2, *fine, "--deepspeed", "--deepspeed_config", cfg[1], *tp),
        "tp2_zero3_split": ft(ckpt, *fine, "--deepspeed", "--deepspeed_config", cfg[3], *tp),
        "zero3_from_ds": ft(ds, *fine, "--deepspeed", "--deepspeed_config", cfg[3]),
        "zero3_from_saver_tp2": ft(ds + "_saver_tp2", *fine, "--deepspeed", "--deepspeed_config", cfg[3]),
        "keep_ref": ft(ckpt, *keep, iters=8),
        "keep_zero1": ft(ckpt, *keep, "--deepspeed", "--deepspeed_config", cfg[1], iters=8),
        "keep_zero3_from_ds": ft(ds, *keep, "--deepspeed", "--deepspeed_config", cfg[3], iters=8),
        "refused": ft(ckpt, "--deepspeed", "--deepspeed_config", cfg[1]),
        "refused_optim": ft(ds, "--deepspeed", "--deepspeed_config", cfg[3]),
        "wrong_arch": ft(ckpt, *fine, "--deepspeed", "--deepspeed_config", cfg[1], "--hidden-size", "128"),
        # the ZeRO-3 files (weights in the fp32 partitions) under ZeRO-1: consolidated, then loaded as module weights
        "zero1_from_zero3_files": ft(ds3, *fine, "--deepspeed", "--deepspeed_config", cfg[1], "--skip-train"),
    }
    # a Hugging Face model: HF -> Megatron (release checkpoint) -> finetuned with and without DeepSpeed
    hf_flags = _hf_to_megatron(tmp, "gpt2", 5000)
    hf = str(tmp / "gpt2_megatron")
    named["hf_ref"] = ft(hf, *fine, *hf_flags)
    named["hf_zero3"] = ft(hf, *fine, *hf_flags, "--deepspeed", "--deepspeed_config", cfg[3])
    named["hf_pipe"] = ft(hf, *fine, *hf_flags, "--deepspeed", "--deepspeed_config", cfg[1],
                          "--pipeline-model-parallel-size", "2")
    llama_flags = _hf_to_megatron(tmp, "llama", 5000)
    llama = str(tmp / "llama_megatron")
    named["llama_ref"] = ft(llama, *fine, *llama_flags)
    named["llama_pipe"] = ft(llama, *fine, *llama_flags, "--deepspeed", "--deepspeed_config", cfg[1],
                             "--pipeline-model-parallel-size", "2")
    named["llama_tp2_zero3"] = ft(llama, *fine, *llama_flags, "--deepspeed", "--deepspeed_config", cfg[3], *tp)
    save = tiny_gpt_argv(gpt_data, "--save", ckpt, "--save-interval", "4", iters=4)
    compare = [(named["zero3"], ckpt), (named["tp2_zero3_split"], tp2), (named["zero1"], ckpt)]
    results = run_distributed(_job, 2, args=(save, (ckpt, tp2, ds), list(named.values()), compare))
    last = results[1]  # the loss is logged (and returned) on the last rank
    assert last[0]["error"] is None, last[0]["error"]
    out = {name: dict(res, stdout0=r0["stdout"]) for name, res, r0 in zip(named, last[1:-1], results[0][1:-1])}
    out["weight_diffs"] = [results[0][-1], results[1][-1]]
    out["paths"] = {"megatron": ckpt, "tp2": tp2, "ds": ds}
    out["hf_flags"], out["llama_flags"] = hf_flags, llama_flags
    return out


def _curve(res: dict, name: str) -> dict:
    assert res["error"] is None, f"{name}: {res['error']}"
    return curve_from_result(res["result"])


def _assert_same(curve: dict, ref: dict, what: str, first_rel: float = 1e-6) -> None:
    assert sorted(curve["train"]) == sorted(ref["train"]), f"{what}: iterations {sorted(curve['train'])}"
    first = min(ref["train"])
    assert math.isclose(curve["train"][first], ref["train"][first], rel_tol=first_rel), \
        f"{what}: loaded weights give {curve['train'][first]} vs {ref['train'][first]}"
    for it, loss in ref["train"].items():
        assert math.isclose(curve["train"][it], loss, rel_tol=1e-5), f"{what}: iteration {it}: {curve['train'][it]} " \
                                                                     f"vs {loss}"
    assert [p for p, _ in curve["val"]] == [p for p, _ in ref["val"]] and ref["val"], what
    for (p, a), (_, b) in zip(curve["val"], ref["val"]):
        assert math.isclose(a, b, rel_tol=1e-5), f"{what}: validation at {p}: {a} vs {b}"


def test_layouts_written(job: dict) -> None:
    paths = job["paths"]
    assert sorted(os.listdir(os.path.join(paths["tp2"], "iter_0000004"))) == ["manifest.json", "mp_rank_00",
                                                                               "mp_rank_01"]
    step = os.listdir(os.path.join(paths["ds"], "global_step4"))
    assert "mp_rank_00_model_states.pt" in step and not any(n.startswith("zero_pp_rank") for n in step)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "pipe", "tp2_zero1", "tp2_zero3_split",
                                  "zero3_from_ds", "zero3_from_saver_tp2"])
def test_deepspeed_finetune_equals_megatron_finetune(job: dict, name: str) -> None:
    ref = _curve(job["ref"], "ref")
    assert sorted(ref["train"]) == list(range(1, FT_ITERS + 1))
    curve = _curve(job[name], name)
    _assert_same(curve, ref, name)
    log = job[name]["stdout0"]  # print_rank_0
    assert "successfully loaded checkpoint" in log and "at iteration 0" in log, log[:2000]


def test_loaded_weights_equal_megatron_load(job: dict) -> None:
    # ZeRO-3 (DP=2), TP=2 x ZeRO-3 (TP=1 checkpoint split on load vs the converter's TP=2 checkpoint), ZeRO-1
    for rank_diffs in job["weight_diffs"]:
        assert len(rank_diffs) == 3 and all(d <= 1e-6 for d in rank_diffs), job["weight_diffs"]


@pytest.mark.parametrize("name", ["hf_zero3", "hf_pipe", "llama_pipe", "llama_tp2_zero3"])
def test_hugging_face_model_finetunes_under_deepspeed(job: dict, name: str) -> None:
    family = name.split("_")[0]
    ref = _curve(job[f"{family}_ref"], f"{family}_ref")
    assert sorted(ref["train"]) == list(range(1, FT_ITERS + 1))
    _assert_same(_curve(job[name], name), ref, name)
    assert "successfully loaded checkpoint" in job[name]["stdout0"]
    if family == "llama":  # untied output layer (its own pipe layer), GQA query_key_value split for TP=2
        flags = " ".join(job["llama_flags"])
        assert "--untie-embeddings-and-output-weights" in flags and "--num-query-groups 2" in flags, flags


def test_no_load_optim_continues_the_iteration_count(job: dict) -> None:
    ref = _curve(job["keep_ref"], "keep_ref")
    assert sorted(ref["train"]) == [5, 6, 7, 8]
    for name in ("keep_zero1", "keep_zero3_from_ds"):
        _assert_same(_curve(job[name], name), ref, name)


def test_megatron_checkpoint_without_finetune_is_refused(job: dict) -> None:
    err = job["refused"]["error"]
    assert err is not None and "holds a Megatron checkpoint" in err and "--finetune" in err and "\n" not in err
    err = job["wrong_arch"]["error"]
    assert err is not None and "hidden_size=64" in err and "\n" not in err, err
    err = job["refused_optim"]["error"]  # weights-only DeepSpeed files under ZeRO-3, optimizer state requested
    assert err is not None and "--no-load-optim" in err and "\n" not in err, err


def test_zero3_checkpoint_loads_under_zero1(job: dict) -> None:
    saved = _curve(job["zero3"], "zero3")["val"]
    evaluated = _curve(job["zero1_from_zero3_files"], "zero1_from_zero3_files")["val"]
    assert saved and evaluated and saved[-1][0] == evaluated[0][0] == "the end of training for val data"
    assert math.isclose(evaluated[0][1], saved[-1][1], rel_tol=1e-6), (evaluated, saved)
    assert "zero3 layout" in job["zero1_from_zero3_files"]["stdout0"]
