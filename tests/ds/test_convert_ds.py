"""tools/convert_deepspeed_checkpoint.py: DeepSpeed checkpoints → Megatron layout → our loaders, and back.

The non-pipeline checkpoints are written here by `deepspeed.initialize` on our GPTModel (2 gloo processes, fp32,
torch AdamW) and `engine.save_checkpoint` with the client state of the DeepSpeed contract: ZeRO-1 and ZeRO-3 with
DP=2, and ZeRO-3 with TP=2 from examples/ds_config_gpt_tp4_zero3.json (legacy cpu_offload). The converted checkpoint
is loaded with megatron.text_generation.load_model_for_inference and must give the engine's logits (1e-6) and its
greedy continuation; the reverse conversion reproduces the DeepSpeed weights bitwise. The pipeline checkpoint comes
from pretrain_gpt --deepspeed with PP=2 (GPTModelPipe layer files); its converted PP=1 checkpoint must give the
DeepSpeed run's test loss (1e-6 relative) in the non-DeepSpeed pretrain_gpt.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_deepspeed_checkpoint.py"
SEQ = 32
ITERATION = 2


def _model_argv(shared: str, *extra: str) -> list[str]:
    owt = os.path.join(shared, "openwebtext-1000")
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(owt, "gpt2-tiny-vocab.json"),
            "--merge-file", os.path.join(owt, "gpt2-tiny-merges.txt"), "--seed", "1234", *extra]


def _batch(vocab: int, batch: int = 2, seed: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask, labels


PROMPT = [464, 318, 257, 1332]  # a few in-vocabulary ids (the tiny vocab has 5,000 entries)


def _save_ds_checkpoints(rank: int, world_size: int, shared: str, out_root: str, stages: list[int]) -> dict:
    """Train 2 steps and save global_step2 with ZeRO stage s (DP=2) under out_root/zero{s} for each s, then with the
    tutorial ZeRO-3 config at TP=2 under out_root/zero3_tp2; returns each engine's logits (+ greedy ids)."""
    from tests.ds._workers import ds_env

    ds_env(rank, world_size)
    import deepspeed

    import pretrain_gpt
    from megatron import global_vars
    from megatron.compat import CHECKPOINT_VERSION, args_to_save, get_rng_state
    from megatron.initialize import destroy_megatron, initialize_megatron
    from megatron.text_generation import generate

    args = initialize_megatron(args=_model_argv(shared, "--micro-batch-size", "2", "--global-batch-size",
                                                str(2 * world_size)))
    out = {}
    for stage in stages:
        torch.manual_seed(1234)
        model = pretrain_gpt.model_provider()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world_size,
                  "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(ITERATION):
            ids, pos, mask, labels = _batch(args.padded_vocab_size, seed=100 * step + rank)
            loss = engine(ids, pos, mask, labels=labels).mean()
            engine.backward(loss)
            engine.step()
        args.consumed_train_samples = ITERATION * 2 * world_size
        client = {"iteration": ITERATION, "args": args_to_save(args), "checkpoint_version": CHECKPOINT_VERSION,
                  "rng_state": get_rng_state()}
        engine.save_checkpoint(os.path.join(out_root, f"zero{stage}"), tag=f"global_step{ITERATION}",
                               client_state=client)
        engine.eval()
        ids, pos, mask, _ = _batch(args.padded_vocab_size, seed=99)
        with torch.no_grad():
            logits = engine(ids, pos, mask)
            plain = engine.module
            if stage == 3:  # generation reads the output weight directly: use a plain copy of the gathered weights
                plain = pretrain_gpt.model_provider().eval()
                with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                    plain.load_state_dict({n: p.detach().clone() for n, p in engine.module.named_parameters()})
            greedy = generate(plain, global_vars.get_tokenizer(), [PROMPT], 6, greedy=True)["tokens"][0]
        out[stage] = {"logits": logits.detach().clone(), "greedy": list(greedy)}
    destroy_megatron()

    # ZeRO-3 with tensor parallelism (TP=2, DP=1; DeepSpeed gets our mpu) from the widely copied tutorial config
    # (fp16 -> fp32 on CPU, legacy cpu_offload -> offload_optimizer): files zero_pp_rank_0_mp_rank_{00,01}_*.
    from megatron.core import parallel_state as ps
    from megatron.ds.mpu import get_mpu

    tutorial = str(REPO / "examples" / "ds_config_gpt_tp4_zero3.json")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        args = initialize_megatron(args=_model_argv(shared, "--micro-batch-size", "2", "--global-batch-size", "2",
                                                    "--tensor-model-parallel-size", "2", "--deepspeed",
                                                    "--deepspeed_config", tutorial))
    config = dict(args.deepspeed_config_dict, zero_force_ds_cpu_optimizer=False, steps_per_print=10**9)
    model = pretrain_gpt.model_provider()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=get_mpu())
    out["tutorial"] = {"stdout": buf.getvalue(), "config": config}
    for step in range(ITERATION):
        ids, pos, mask, labels = _batch(args.padded_vocab_size, seed=100 * step)
        engine.backward(engine(ids, pos, mask, labels=labels).mean())
        engine.step()
    client = {"iteration": ITERATION, "args": args_to_save(args), "checkpoint_version": CHECKPOINT_VERSION}
    engine.save_checkpoint(os.path.join(out_root, "zero3_tp2"), tag=f"global_step{ITERATION}", client_state=client)
    engine.eval()
    ids, pos, mask, _ = _batch(args.padded_vocab_size, seed=99)
    with torch.no_grad():
        shard = engine(ids, pos, mask).contiguous()  # vocab-parallel logits of this tensor rank
    shards = [torch.empty_like(shard) for _ in range(2)]
    torch.distributed.all_gather(shards, shard, group=ps.get_parallel_state().tp_group)
    out["3_tp2"] = {"logits": torch.cat(shards, dim=-1)}
    destroy_megatron()
    return out


def _load_converted(rank: int, world_size: int, shared: str, load_dirs: list[str]) -> list[dict]:
    """Load Megatron checkpoints the way the inference tools do; logits on the test batch + greedy ids for each."""
    from megatron import global_vars
    from megatron.initialize import destroy_megatron, initialize_megatron
    from megatron.text_generation import generate, load_model_for_inference

    out = []
    for load_dir in load_dirs:
        args = initialize_megatron(args=_model_argv(shared, "--load", load_dir, "--micro-batch-size", "1"),
                                   args_defaults={"no_load_rng": True, "no_load_optim": True})
        model = load_model_for_inference(args)
        ids, pos, mask, _ = _batch(args.padded_vocab_size, seed=99)
        with torch.no_grad():
            logits = model(ids, pos, mask)
            greedy = generate(model, global_vars.get_tokenizer(), [PROMPT], 6, greedy=True)["tokens"][0]
        out.append({"logits": logits.detach().clone(), "greedy": list(greedy)})
        destroy_megatron()
    return out


@pytest.fixture(scope="module")
def ds_checkpoints(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ds_ckpts")
    results = run_distributed(_save_ds_checkpoints, 2, (str(shared_data), str(root), [1, 3]))
    return {"root": root, "ref": results[0]}


def _tool():
    """tools/convert_deepspeed_checkpoint.py as a module (tools/ is not a package)."""
    import importlib.util

    if "convert_deepspeed_checkpoint" not in sys.modules:
        spec = importlib.util.spec_from_file_location("convert_deepspeed_checkpoint", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["convert_deepspeed_checkpoint"] = module
        spec.loader.exec_module(module)
    return sys.modules["convert_deepspeed_checkpoint"]


def _convert(*argv: str) -> dict:
    return _tool().main(list(argv))


def test_converted_checkpoints_match_the_engines(ds_checkpoints: dict, shared_data: Path, tmp_path: Path) -> None:
    """ZeRO-1 (module weights) and ZeRO-3 (fp32 partitions via zero_to_fp32) → Megatron → load_model_for_inference."""
    outs = []
    for stage in (1, 3):
        src = ds_checkpoints["root"] / f"zero{stage}"
        assert (src / "latest").read_text().strip() == f"global_step{ITERATION}"
        out = tmp_path / f"megatron{stage}"
        result = _convert("--input-folder", str(src), "--output-folder", str(out))
        assert result["layout"] == ("module" if stage == 1 else "zero3")
        assert (out / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
        saved = torch.load(out / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
        assert saved["iteration"] == ITERATION and saved["checkpoint_version"] == 3.0
        assert saved["args"].consumed_train_samples == ITERATION * 4
        assert saved["consumed_train_samples"] == ITERATION * 4
        assert saved["consumed_train_tokens"] == getattr(saved["args"], "consumed_train_tokens", 0)  # what checkpointing reads
        assert set(saved["model"]) == {"language_model"}
        assert set(saved["model"]["language_model"]) == {"embedding", "encoder"}
        assert "rng_state" in saved and result["rng"]  # same TP/PP layout: the RNG states carry over
        outs.append(str(out))
    loaded = run_distributed(_load_converted, 1, (str(shared_data), outs))[0]
    for stage, got in zip((1, 3), loaded):
        ref = ds_checkpoints["ref"][stage]
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-6, atol=1e-6)
        assert got["greedy"] == ref["greedy"]
        assert got["greedy"][:len(PROMPT)] == PROMPT and len(got["greedy"]) > len(PROMPT)
    # ZeRO-1 and ZeRO-3 trained the same steps: their logits agree too (only reduction order differs)
    torch.testing.assert_close(loaded[0]["logits"], loaded[1]["logits"], rtol=1e-4, atol=1e-4)


def test_zero3_tensor_parallel_checkpoint_merges_to_tp1(ds_checkpoints: dict, shared_data: Path,
                                                        tmp_path: Path) -> None:
    """TP=2 ZeRO-3 (tutorial config, CPU offload): each tensor rank is consolidated from its own partitions and
    --target-tp 1 merges the shards into a model with the engine's logits."""
    src = ds_checkpoints["root"] / "zero3_tp2"
    same = _convert("--input-folder", str(src), "--output-folder", str(tmp_path / "tp2"))
    assert (same["layout"], same["tp"], same["pp"]) == ("zero3", 2, 1)
    # the source (written by DeepSpeed itself) has no manifest: read unverified, so the output is not signed
    assert sorted(os.listdir(tmp_path / "tp2" / f"iter_{ITERATION:07d}")) == ["mp_rank_00", "mp_rank_01"]
    merged = _convert("--input-folder", str(src), "--output-folder", str(tmp_path / "tp1"), "--target-tp", "1")
    assert (merged["tp"], merged["rng"]) == (1, False)
    saved = torch.load(tmp_path / "tp1" / f"iter_{ITERATION:07d}" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=False)
    assert saved["args"].tensor_model_parallel_size == 1 and "rng_state" not in saved
    tutorial = ds_checkpoints["ref"]["tutorial"]
    assert "legacy zero_optimization.cpu_offload=true is mapped to" in tutorial["stdout"]
    assert tutorial["config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert tutorial["config"]["zero_optimization"]["stage"] == 3
    if not torch.cuda.is_available():
        assert not tutorial["config"].get("fp16", {}).get("enabled"), tutorial["config"]
    (got,) = run_distributed(_load_converted, 1, (str(shared_data), [str(tmp_path / "tp1")]))[0]
    torch.testing.assert_close(got["logits"], ds_checkpoints["ref"]["3_tp2"]["logits"], rtol=1e-6, atol=1e-6)


def test_reverse_round_trip_is_bitwise(ds_checkpoints: dict, tmp_path: Path) -> None:
    src = ds_checkpoints["root"] / "zero1"
    meg, back, meg2 = tmp_path / "meg", tmp_path / "ds", tmp_path / "meg2"
    _convert("--input-folder", str(src), "--output-folder", str(meg))
    (meg / "latest_checkpointed_iteration.txt").write_text("7")  # --iteration picks iter_0000002 over the tracker
    reverse = _convert("--to-deepspeed", "--iteration", str(ITERATION), "--input-folder", str(meg),
                       "--output-folder", str(back))
    assert (reverse["tag"], reverse["tp"], reverse["pp"]) == (f"global_step{ITERATION}", 1, 1)
    _convert("--input-folder", str(back), "--output-folder", str(meg2))
    assert (back / "latest").read_text() == f"global_step{ITERATION}"
    name = f"global_step{ITERATION}/mp_rank_00_model_states.pt"
    original = torch.load(src / name, weights_only=False)
    roundtrip = torch.load(back / name, weights_only=False)
    assert list(roundtrip["module"]) == list(original["module"])
    for key, value in original["module"].items():
        assert torch.equal(roundtrip["module"][key], value), key
    assert roundtrip["iteration"] == ITERATION and roundtrip["args"].num_layers == 2
    for key in ("consumed_train_samples", "consumed_train_tokens"):  # what megatron.ds reads on --load
        assert roundtrip[key] == getattr(original["args"], key, 0), key
    rank = f"iter_{ITERATION:07d}/mp_rank_00/model_optim_rng.pt"
    first, second = (torch.load(d / rank, weights_only=False)["model"] for d in (meg, meg2))
    from megatron.layers import flatten_checkpoint_state_dict

    a, b = flatten_checkpoint_state_dict(first), flatten_checkpoint_state_dict(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pipeline_split_and_tp_reshard_keep_the_weights(ds_checkpoints: dict, tmp_path: Path) -> None:
    """--target-pp 2 / --target-tp 2 write Megatron's stage and shard names; converting back merges them exactly."""
    from megatron.layers import flatten_checkpoint_state_dict

    src = ds_checkpoints["root"] / "zero1"
    out = tmp_path / "meg_pp2_tp2"
    result = _convert("--input-folder", str(src), "--output-folder", str(out), "--target-pp", "2", "--target-tp", "2")
    assert (result["tp"], result["pp"]) == (2, 2) and not result["rng"]
    it_dir = out / f"iter_{ITERATION:07d}"
    assert sorted(os.listdir(it_dir)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                         "mp_rank_01_001"]  # no manifest: the source (DeepSpeed's own) had none
    last = torch.load(it_dir / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert last["args"].tensor_model_parallel_size == 2 and last["args"].pipeline_model_parallel_size == 2
    assert "word_embeddings_for_head" in last["model"] and "rng_state" not in last
    stage_keys = set(flatten_checkpoint_state_dict(last["model"]))
    assert "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight" in stage_keys
    assert not any(k.startswith("language_model.embedding.") for k in stage_keys)
    back = tmp_path / "ds_back"
    _convert("--to-deepspeed", "--input-folder", str(out), "--output-folder", str(back), "--target-pp", "1",
             "--target-tp", "1")
    name = f"global_step{ITERATION}/mp_rank_00_model_states.pt"
    original = torch.load(src / name, weights_only=False)["module"]
    merged = torch.load(back / name, weights_only=False)["module"]
    assert merged.keys() == original.keys() and all(torch.equal(merged[k], original[k]) for k in original)


def test_one_line_errors(ds_checkpoints: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ConvertCheckpointError = _tool().ConvertCheckpointError

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConvertCheckpointError, match="no 'latest' file .* pass --iteration N"):
        _convert("--input-folder", str(tmp_path / "empty"), "--output-folder", str(tmp_path / "o1"))
    with pytest.raises(ConvertCheckpointError, match="global_step7 does not exist"):
        _convert("--input-folder", str(ds_checkpoints["root"] / "zero1"), "--iteration", "7",
                 "--output-folder", str(tmp_path / "o2"))
    (tmp_path / "odd" / "global_step1").mkdir(parents=True)
    (tmp_path / "odd" / "latest").write_text("global_step1")
    torch.save({}, tmp_path / "odd" / "global_step1" / "weights.pt")
    with pytest.raises(ConvertCheckpointError, match="not a DeepSpeed checkpoint of a known layout"):
        _convert("--input-folder", str(tmp_path / "odd"), "--output-folder", str(tmp_path / "o3"))
    with pytest.raises(ConvertCheckpointError, match=r"--target-pp 3: 2 layers do not split into 3 pipeline stage"):
        _convert("--input-folder", str(ds_checkpoints["root"] / "zero1"), "--output-folder", str(tmp_path / "o4"),
                 "--target-pp", "3")
    with pytest.raises(ConvertCheckpointError, match="is a DeepSpeed checkpoint .* drop --to-deepspeed"):
        _convert("--to-deepspeed", "--input-folder", str(ds_checkpoints["root"] / "zero1"), "--output-folder",
                 str(tmp_path / "o7"))
    bad = tmp_path / "bad_tp"
    shutil.copytree(ds_checkpoints["root"] / "zero1", bad)
    step = bad / f"global_step{ITERATION}"
    shutil.copy(step / "mp_rank_00_model_states.pt", step / "mp_rank_01_model_states.pt")
    with pytest.raises(ConvertCheckpointError, match="holds 2 tensor-parallel shards but its args say "
                                                     "--tensor-model-parallel-size 1"):
        _convert("--input-folder", str(bad), "--output-folder", str(tmp_path / "o6"))
    # The CLI prints the one-line error and exits 1 (no traceback); --help lists the reverse direction.
    from megatron.errors import exit_on_user_error

    with pytest.raises(SystemExit) as exc:
        exit_on_user_error(_tool().main, ["--input-folder", str(tmp_path / "nope"), "--output-folder",
                                          str(tmp_path / "o5")])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 1 and err.startswith("error: --input-folder") and "\n" not in err
    with pytest.raises(SystemExit) as exc:
        _convert("--help")
    assert exc.value.code == 0 and "--to-deepspeed" in capsys.readouterr().out


def test_pipe_checkpoint_converts_to_the_same_test_loss(gpt_data: dict, tmp_path: Path) -> None:
    """pretrain_gpt --deepspeed with PP=2 (GPTModelPipe, ZeRO-1) saves layer files; the converted PP=1 Megatron
    checkpoint evaluated by the non-DeepSpeed pretrain_gpt (--skip-train) gives the engine's test loss (1e-6)."""
    from tests.ds._workers import run_pretrain_ds, tiny_gpt_argv, write_ds_config

    config = write_ds_config(str(tmp_path / "ds.json"), zero_optimization={"stage": 1})
    common = ["--split", "90,5,5", "--eval-iters", "2", "--eval-interval", "100"]
    ds_argv = tiny_gpt_argv(gpt_data, *common, "--deepspeed", "--deepspeed_config", config,
                            "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ds"),
                            "--save-interval", "4", iters=4)
    ds_runs = run_distributed(run_pretrain_ds, 2, args=(ds_argv,))
    assert all(r["error"] is None for r in ds_runs), [r["error"] for r in ds_runs]
    ds_test = ds_runs[-1]["result"]["test_loss"]
    step = tmp_path / "ds" / "global_step4"
    assert sorted(f for f in os.listdir(step) if f.startswith("layer_")) == [
        f"layer_{i:02d}-model_00-model_states.pt" for i in range(4)]

    result = _convert("--input-folder", str(tmp_path / "ds"), "--output-folder", str(tmp_path / "meg"),
                      "--target-pp", "1")
    assert (result["layout"], result["pp"], result["rng"]) == ("pipe", 1, False)
    meg_argv = tiny_gpt_argv(gpt_data, *common, "--load", str(tmp_path / "meg"), "--no-load-optim",
                             "--no-load-rng", "--skip-train", iters=4)
    (meg_run,) = run_distributed(run_pretrain_ds, 1, args=(meg_argv,))
    assert meg_run["error"] is None, meg_run["error"]
    assert " loading checkpoint from " in meg_run["stdout"] and "at iteration 4" in meg_run["stdout"]
    meg_test = meg_run["result"]["test_loss"]
    assert ds_test and meg_test and set(ds_test) == set(meg_test)
    for key, value in ds_test.items():
        assert abs(float(meg_test[key]) - float(value)) <= 1e-6 * abs(float(value)), (key, meg_test, ds_test)

    # The pipe layout round-trips bitwise through Megatron → DeepSpeed layer files.
    _convert("--to-deepspeed", "--input-folder", str(tmp_path / "meg"), "--output-folder", str(tmp_path / "back"),
             "--target-pp", "2")
    for name in sorted(os.listdir(step)):
        if name.startswith("layer_"):
            a = torch.load(step / name, weights_only=False)
            b = torch.load(tmp_path / "back" / "global_step4" / name, weights_only=False)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (tmp_path / "back" / "global_step4" / "mp_rank_01_model_states.pt").is_file()
