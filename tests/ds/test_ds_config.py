"""Unit tests of megatron.ds.config.resolve_deepspeed_config and the --deepspeed flag validation (no deepspeed
import): batch-size derivation and mismatch errors, ZeRO stage flag vs config, legacy cpu_offload, precision both
ways (fp16 on a CPU machine falls back to fp32 with a notice), gradient clipping, and the start-up refusals
(ZeRO-2/3 with pipeline parallelism, --use-distributed-optimizer, a missing or broken config). Every error is one line.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.arguments import ArgumentError, build_parser, validate_args
from megatron.ds.config import resolve_deepspeed_config
from megatron.errors import MegatronUserError
from megatron.presets import get_preset

REPO = Path(__file__).resolve().parents[2]


def _args(tmp_path: Path, *extra: str, config: dict | None = None, world_size: int = 2,
          validate: bool = True, cuda: bool = False, monkeypatch: pytest.MonkeyPatch | None = None):
    argv = [*get_preset("gpt_test").argv(), "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", "10", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--deepspeed", *extra]
    if config is not None:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(config))
        argv += ["--deepspeed_config", str(path)]
    args = build_parser().parse_args(argv)
    args.rank, args.world_size = 0, world_size
    if validate:
        if monkeypatch is not None:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        validate_args(args)
    return args


def _one_line_error(exc_info: pytest.ExceptionInfo) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and isinstance(exc_info.value, MegatronUserError), message
    return message


def test_batch_sizes_derived(tmp_path: Path) -> None:
    args = _args(tmp_path, config={"zero_optimization": {"stage": 1}}, world_size=4)
    cfg = args.deepspeed_config_dict
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"], cfg["gradient_accumulation_steps"]) \
        == (2, 16, 2)
    assert args.zero_stage == 1 and cfg["gradient_clipping"] == 1.0
    assert "fp16" not in cfg and "bf16" not in cfg and args.params_dtype == torch.float


def test_batch_consistent_config_accepted_and_default_stage(tmp_path: Path) -> None:
    args = _args(tmp_path, config={"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                   "gradient_accumulation_steps": 4}, world_size=2)
    assert args.zero_stage == 0 and args.deepspeed_config_dict["zero_optimization"]["stage"] == 0


@pytest.mark.parametrize("config, words", [
    ({"train_batch_size": 32}, ["train_batch_size=32", "--global-batch-size is 16"]),
    ({"train_micro_batch_size_per_gpu": 4}, ["train_micro_batch_size_per_gpu=4", "--micro-batch-size is 2"]),
    ({"gradient_accumulation_steps": 3}, ["gradient_accumulation_steps=3", "--global-batch-size 16"]),
])
def test_batch_mismatch_errors(tmp_path: Path, config: dict, words: list) -> None:
    with pytest.raises(ArgumentError) as exc:
        _args(tmp_path, config=config)
    message = _one_line_error(exc)
    assert all(w in message for w in words), message


def test_zero_stage_flag_vs_config(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError) as exc:
        _args(tmp_path, "--zero-stage", "2", config={"zero_optimization": {"stage": 3}})
    message = _one_line_error(exc)
    assert "--zero-stage 2" in message and "zero_optimization.stage=3" in message
    assert _args(tmp_path, "--zero-stage", "2", config={}).deepspeed_config_dict["zero_optimization"]["stage"] == 2
    assert _args(tmp_path, config={"zero_optimization": {"stage": 3}}).zero_stage == 3  # config wins without flag
    args = _args(tmp_path, "--zero-stage", "1", "--zero-reduce-bucket-size", "5e8", "--zero-contigious-gradients",
                 config={})
    zero = args.deepspeed_config_dict["zero_optimization"]
    assert zero == {"stage": 1, "reduce_bucket_size": 500000000, "contiguous_gradients": True}


def test_legacy_cpu_offload_mapped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tutorial = {"fp16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
        "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True, "cpu_offload": True}}
    args = _args(tmp_path, "--tensor-model-parallel-size", "2", config=tutorial, world_size=4)
    zero = args.deepspeed_config_dict["zero_optimization"]
    assert "cpu_offload" not in zero and zero["offload_optimizer"] == {"device": "cpu"} and zero["stage"] == 3
    out = capsys.readouterr().out
    assert "cpu_offload" in out and "offload_optimizer" in out


def test_fp16_on_cpu_falls_back_to_fp32(tmp_path: Path, capsys: pytest.CaptureFixture,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(tmp_path, "--fp16", config={"fp16": {"enabled": True, "loss_scale": 0}}, cuda=False,
                 monkeypatch=monkeypatch)
    assert not args.fp16 and "fp16" not in args.deepspeed_config_dict and args.params_dtype == torch.float
    notice = [line for line in capsys.readouterr().out.splitlines() if "fp16" in line and "fp32" in line]
    assert len(notice) == 1 and "CUDA" in notice[0]


def test_precision_both_ways(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(tmp_path, "--fp16", "--initial-loss-scale", "4096", config={}, cuda=True, monkeypatch=monkeypatch)
    fp16 = args.deepspeed_config_dict["fp16"]
    assert fp16["enabled"] and fp16["initial_scale_power"] == 12 and fp16["loss_scale"] == 0
    args = _args(tmp_path, config={"fp16": {"enabled": True}}, cuda=True, monkeypatch=monkeypatch)
    assert args.fp16 and args.params_dtype == torch.half
    args = _args(tmp_path, config={"bf16": {"enabled": True}}, cuda=False, monkeypatch=monkeypatch)
    assert args.bf16 and args.params_dtype == torch.bfloat16
    with pytest.raises(ArgumentError) as exc:
        _args(tmp_path, "--bf16", config={"fp16": {"enabled": True}}, cuda=True, monkeypatch=monkeypatch)
    assert "--bf16" in _one_line_error(exc)


def test_gradient_clipping_both_ways(tmp_path: Path) -> None:
    args = _args(tmp_path, config={"gradient_clipping": 0.5})
    assert args.clip_grad == 0.5
    assert _args(tmp_path, "--clip-grad", "2.0", config={}).deepspeed_config_dict["gradient_clipping"] == 2.0
    with pytest.raises(ArgumentError) as exc:
        _args(tmp_path, "--clip-grad", "2.0", config={"gradient_clipping": 0.5})
    assert "--clip-grad 2.0" in _one_line_error(exc)


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_with_zero_2_3_refused(tmp_path: Path, stage: int) -> None:
    with pytest.raises(ArgumentError) as exc:
        _args(tmp_path, "--pipeline-model-parallel-size", "2", config={"zero_optimization": {"stage": stage}})
    message = _one_line_error(exc)
    assert f"ZeRO stage {stage}" in message and "supports only ZeRO stage 0/1" in message
    assert _args(tmp_path, "--pipeline-model-parallel-size", "2", "--zero-stage", "1", config={}).zero_stage == 1


@pytest.mark.parametrize("extra, config, words", [
    ([], None, "--deepspeed needs --deepspeed_config"),
    (["--use-distributed-optimizer"], {}, "--use-distributed-optimizer cannot be combined with --deepspeed"),
    (["--deepspeed_config", "/nonexistent/ds.json"], None, "file not found"),
    (["--pipeline-model-parallel-size", "2", "--no-pipeline-parallel"], {}, "--no-pipeline-parallel needs"),
])
def test_startup_refusals(tmp_path: Path, extra: list, config, words: str) -> None:
    with pytest.raises(MegatronUserError) as exc:
        _args(tmp_path, *extra, config=config)
    assert words in _one_line_error(exc)


def test_invalid_json_and_flags_without_deepspeed(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 16,\n "zero_optimization": }')
    args = _args(tmp_path, "--deepspeed_config", str(bad), validate=False)
    with pytest.raises(MegatronUserError) as exc:
        validate_args(args)
    assert "invalid JSON at line 2" in _one_line_error(exc)
    args = _args(tmp_path, "--zero-stage", "1", validate=False)
    args.deepspeed = False
    with pytest.raises(ArgumentError) as exc:
        validate_args(args)
    assert "--zero-stage needs --deepspeed" in _one_line_error(exc)


def test_dict_config_and_deepscale_alias(tmp_path: Path) -> None:
    args = _args(tmp_path, validate=False)
    args.deepspeed_config = {"zero_optimization": {"stage": 2}, "train_batch_size": 16}
    args.data_parallel_size = 2
    config = resolve_deepspeed_config(args, cuda_available=False)
    assert config["gradient_accumulation_steps"] == 4 and args.zero_stage == 2
    path = tmp_path / "c.json"
    path.write_text("{}")
    args = _args(tmp_path, "--deepscale", "--deepscale_config", str(path))
    assert args.deepspeed and args.deepspeed_config == str(path)


def test_arguments_do_not_import_deepspeed(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("{}")
    code = ("import sys; from megatron.arguments import build_parser, validate_args; "
            f"a = build_parser().parse_args(['--num-layers', '2', '--hidden-size', '64', '--num-attention-heads', '4',"
            f" '--seq-length', '64', '--max-position-embeddings', '64', '--micro-batch-size', '2', '--lr', '1e-3',"
            f" '--train-iters', '1', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '100', '--deepspeed',"
            f" '--deepspeed_config', {str(path)!r}]); a.rank, a.world_size = 0, 1; validate_args(a); "
            "import megatron.ds.engine, megatron.ds.mpu; assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_mpirun_environment_detected() -> None:
    # --deepspeed_mpi / mpirun: OpenMPI's variables give rank and world size (before SLURM's, which mpirun inherits).
    from megatron.initialize import detect_launcher_env

    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "MASTER_ADDR": "node0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    got = detect_launcher_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.master_addr) == ("mpi", 3, 4, 1, "node0")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_launcher_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_provider_with_deepspeeds_own_flags() -> None:
    # Scripts written for Megatron-DeepSpeed pass deepspeed.add_config_arguments as (part of) extra_args_provider.
    def provider(parser):
        group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
        group.add_argument("--deepspeed", default=False, action="store_true")
        group.add_argument("--deepspeed_config", default=None, type=str)
        return parser

    args = build_parser(provider).parse_args(["--deepspeed", "--deepspeed_config", "x.json", "--zero-stage", "2"])
    assert args.deepspeed and args.deepspeed_config == "x.json" and args.zero_stage == 2


def test_reconcile_reads_args_and_apply_to_writes_the_settled_values(tmp_path: Path) -> None:
    """reconcile_deepspeed_config leaves the namespace alone; its record's apply_to is the one write (config, ZeRO
    stage, --clip-grad from the config, --fp16 off without CUDA)."""
    from megatron.ds.config import reconcile_deepspeed_config

    args = _args(tmp_path, validate=False)
    args.deepspeed_config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5, "fp16": {"enabled": True}}
    args.data_parallel_size = 2
    before = dict(vars(args))
    resolved = reconcile_deepspeed_config(args, cuda_available=False)
    assert vars(args) == before
    assert (resolved.zero_stage, resolved.clip_grad, resolved.fp16, resolved.bf16) == (2, 0.5, False, False)
    resolved.apply_to(args)
    assert (args.zero_stage, args.clip_grad, args.fp16, args.bf16) == (2, 0.5, False, False)
    assert args.deepspeed_config_dict is resolved.config and "fp16" not in resolved.config
