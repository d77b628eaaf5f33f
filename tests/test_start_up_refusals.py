"""Bad flag values refused at start-up with one line naming the flag (issue #44): MoE values, sizes, blend weights,
output folders, --load of a plain file, and where the index cache goes when --data-cache-path is not writable."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from megatron.arguments import ArgumentError, parse_args, validate_args
from megatron.data.dataset_utils import first_writable_dir
from megatron.settings import path_checks

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3")
MOE = BASE + " --disable-bias-linear --num-experts 4"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def _validated(cmd: str) -> argparse.Namespace:
    args = parse_args(args=cmd.split())
    args.world_size = 1
    return validate_args(args)


def _refusal(cmd: str) -> str:
    with pytest.raises(ArgumentError) as info:
        _validated(cmd)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("extra, expected", [
    ("--num-experts 0", "--num-experts must be >= 1 (got 0)"),
    ("--moe-router-topk 5", "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
    ("--moe-router-topk 0", "--moe-router-topk (0) must be between 1 and --num-experts (4)"),
    ("--moe-expert-capacity-factor 0", "--moe-expert-capacity-factor must be a finite number > 0 (got 0.0)"),
    ("--moe-expert-capacity-factor -1", "--moe-expert-capacity-factor must be a finite number > 0 (got -1.0)"),
    ("--moe-expert-capacity-factor nan", "--moe-expert-capacity-factor must be a finite number > 0 (got nan)"),
    ("--moe-expert-capacity-factor inf", "--moe-expert-capacity-factor must be a finite number > 0 (got inf)"),
    ("--moe-layer-freq [1,1,1]", "--moe-layer-freq gives 3 layers but --num-layers is 2"),
    ("--moe-layer-freq [0,0]", "--moe-layer-freq has no MoE layer (all 0)"),
    ("--moe-layer-freq 0", "--moe-layer-freq must be >= 1"),
    ("--moe-ffn-hidden-size -8", "--moe-ffn-hidden-size must be positive (got -8)"),
    ("--moe-shared-expert-intermediate-size 0", "--moe-shared-expert-intermediate-size must be positive (got 0)"),
    ("--expert-model-parallel-size -1", "--expert-model-parallel-size must be positive (got -1)"),
    ("--expert-tensor-parallel-size 0", "--expert-tensor-parallel-size must be positive (got 0)"),
    ("--moe-aux-loss-coeff nan", "--moe-aux-loss-coeff must be a finite number >= 0 (got nan)"),
    ("--moe-aux-loss-coeff -0.1", "--moe-aux-loss-coeff must be a finite number >= 0 (got -0.1)"),
    ("--moe-z-loss-coeff nan", "--moe-z-loss-coeff must be a finite number >= 0 (got nan)"),
    ("--moe-z-loss-coeff inf", "--moe-z-loss-coeff must be a finite number >= 0 (got inf)"),
    ("--moe-router-pre-softmax --moe-router-topk-scaling-factor nan",
     "--moe-router-topk-scaling-factor must be a finite number > 0 (got nan)"),
    ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
])
def test_bad_moe_values_are_one_line(extra, expected):
    cmd = MOE.replace("--num-experts 4", "") if extra.startswith("--num-experts") else MOE
    assert expected in _refusal(f"{cmd} {extra}")


def test_good_moe_values_still_validate():
    args = _validated(f"{MOE} --moe-layer-freq [1,0] --moe-expert-capacity-factor 1.5 --moe-aux-loss-coeff 1e-2 "
                      "--moe-z-loss-coeff 1e-3")
    assert args.moe_layer_freq == [1, 0] and args.moe_expert_capacity_factor == 1.5
    assert args.moe_aux_loss_coeff == 1e-2 and args.moe_z_loss_coeff == 1e-3


@pytest.mark.parametrize("flag", ["--seq-length", "--ffn-hidden-size", "--kv-channels", "--max-position-embeddings"])
def test_zero_sizes_are_one_line(flag):
    cmd = BASE.replace("--seq-length 32", "") if flag == "--seq-length" else BASE
    cmd = cmd.replace("--max-position-embeddings 64", "") if flag == "--max-position-embeddings" else cmd
    assert _refusal(f"{cmd} {flag} 0") == f"{flag} must be positive (got 0)"


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path"])
def test_blend_weights_all_zero(flag):
    message = _refusal(f"{BASE} {flag} 0 a_text_document 0.0 b_text_document")
    assert message.startswith(f"{flag}: every blend weight is 0")


def test_blend_with_one_positive_weight_is_accepted():
    assert _validated(f"{BASE} --data-path 0 a_text_document 1 b_text_document").data_path[2] == "1"


def test_save_that_is_a_file(tmp_path):
    target = tmp_path / "ckpt"
    target.write_text("not a folder")
    assert _refusal(f"{BASE} --save {target} --save-interval 5") == \
        f"--save {target} is a file, not a folder; point --save at a folder you can write to"


def test_save_below_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    message = _refusal(f"{BASE} --save {tmp_path / 'f' / 'ckpt'} --save-interval 5")
    assert message.endswith(f"cannot be created: {tmp_path / 'f'} is a file, not a folder; point --save at a folder "
                            "you can write to")


def test_save_unwritable(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(path_checks.os, "access",  # root ignores permission bits: the check's own question
                        lambda p, mode: False if os.path.abspath(p) == str(locked) else real_access(p, mode))
    assert _refusal(f"{BASE} --save {locked / 'run1'} --save-interval 5") == \
        f"--save {locked / 'run1'} cannot be created: {locked} is not writable; point --save at a folder you can " \
        "write to"
    assert _refusal(f"{BASE} --save {locked} --save-interval 5").startswith(f"--save {locked} is not writable;")


def test_tensorboard_dir_that_is_a_file(tmp_path):
    target = tmp_path / "tb"
    target.write_text("x")
    assert _refusal(f"{BASE} --tensorboard-dir {target}") == \
        f"--tensorboard-dir {target} is a file, not a folder; point --tensorboard-dir at a folder you can write to"


def test_new_folders_are_accepted_and_not_created(tmp_path):
    args = _validated(f"{BASE} --save {tmp_path / 'a' / 'b'} --save-interval 5 --tensorboard-dir {tmp_path / 'tb'}")
    assert args.save == str(tmp_path / "a" / "b")
    assert sorted(os.listdir(tmp_path)) == []


def test_load_of_a_plain_file(tmp_path):
    target = tmp_path / "model_optim_rng.pt"
    target.write_bytes(b"x")
    message = _refusal(f"{BASE} --load {target}")
    assert message.startswith(f"--load {target} is a file, not a checkpoint folder;")


def test_unwritable_data_cache_path_says_where_the_cache_goes(tmp_path, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    chosen = first_writable_dir([blocker, tmp_path / "index-cache"], str(blocker))
    assert chosen == tmp_path / "index-cache" and chosen.is_dir()
    assert capsys.readouterr().out.strip() == (f"> note: --data-cache-path {blocker} is not a writable folder; the "
                                               f"dataset index cache goes to {tmp_path / 'index-cache'} instead")
    assert first_writable_dir([blocker, tmp_path / "index-cache"], str(blocker)) == chosen
    assert capsys.readouterr().out == ""  # once per folder, not once per split
    assert first_writable_dir([Path(tmp_path / "ok")], str(tmp_path / "ok")) == tmp_path / "ok"
    assert capsys.readouterr().out == ""


def test_refuse_random_weights_is_the_servers_opt_in(capsys):
    from megatron.text_generation.model_loading import InferenceLoadError, refuse_random_weights

    with pytest.raises(InferenceLoadError) as info:
        refuse_random_weights(None, False, "LAMBADA evaluation")
    assert str(info.value) == ("no --load: LAMBADA evaluation would run on random weights; pass --load CHECKPOINT_DIR "
                               "(a folder written by --save), or --allow-random-weights to use an untrained model")
    refuse_random_weights("ckpt", False, "generation")
    assert capsys.readouterr().out == ""
    refuse_random_weights(None, True, "generation")
    assert "WARNING: no --load given (--allow-random-weights): generation runs on randomly initialised weights" in \
        capsys.readouterr().out


def test_finetuning_refuses_the_random_weights_opt_in():
    from tasks.main import check_task_flags

    with pytest.raises(ArgumentError, match="--allow-random-weights is for evaluation"):
        check_task_flags(argparse.Namespace(task="MNLI", epochs=3, allow_random_weights=True))
    check_task_flags(argparse.Namespace(task="MNLI", epochs=0, allow_random_weights=True))


@pytest.mark.parametrize("extra, expected", [
    ("--moe-router-topk 1", "--moe-router-topk 1 needs --moe-router-pre-softmax"),
    ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.1",
     "--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff"),
    ("--moe-router-topk-scaling-factor 2", "--moe-router-topk-scaling-factor needs --moe-router-pre-softmax"),
    ("--moe-apply-probs-on-input", "--moe-apply-probs-on-input needs --moe-router-topk 1"),
])
def test_config_combinations_are_one_line_before_the_model(extra, expected):
    """TransformerConfig's own checks (run when the run's records are built, before the model) are ArgumentErrors,
    which the entry points print as one line, not a ValueError traceback."""
    from megatron.arguments import core_transformer_config_from_args

    args = _validated(f"{MOE} {extra}")
    with pytest.raises(ArgumentError) as info:
        core_transformer_config_from_args(args)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
