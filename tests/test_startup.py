"""megatron/startup.py: the start-up pipeline's steps return values and leave their inputs alone; the args record is
assembled once, in Megatron's key order, and is read-only for our code but writable for users' scripts."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from megatron import global_vars, startup
from megatron.arguments import validate_args, validated_args
from megatron.errors import MegatronUserError
from megatron.initialize import initialize_megatron
from megatron.presets import get_preset
from megatron.startup import ArgsReadOnlyError, StartupArgs

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
               "OMPI_COMM_WORLD_RANK")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    global_vars.unset_global_variables()
    yield
    global_vars.unset_global_variables()


def _argv(*extra: str) -> list:
    return [*get_preset("gpt_test").argv(), "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", *extra]


def test_each_step_returns_a_value_and_leaves_its_input_alone() -> None:
    parsed = startup.parse(argv=_argv())
    before = dict(vars(parsed))
    restored = startup.restore_checkpoint_args(parsed, {})
    assert restored is parsed  # no --use-checkpoint-args: nothing to restore
    validated = startup.validate(restored, {})
    assert validated is not parsed and vars(parsed) == before
    assert (validated.data_parallel_size, validated.params_dtype, validated.ffn_hidden_size, validated.kv_channels) \
        == (1, torch.float, 4 * parsed.hidden_size, parsed.hidden_size // parsed.num_attention_heads)
    validated_before = dict(vars(validated))
    tokenizer, padded = startup.tokenizer(validated)
    assert (tokenizer.vocab_size, padded) == (101, 128) and vars(validated) == validated_before
    args = startup.records(validated, padded, startup.placement(validated))
    assert isinstance(args, StartupArgs) and vars(validated) == validated_before
    assert (args.padded_vocab_size, args.rank, args.world_size, args.local_rank, args.distributed_backend) \
        == (128, 0, 1, 0, "gloo" if not torch.cuda.is_available() else "nccl")


def test_records_keep_megatrons_key_order_and_values() -> None:
    """What Megatron's start-up leaves on args (validate_args in place, then the tokenizer's padded_vocab_size, then
    the process group's placement) is what the pipeline assembles: the same keys, order and values (checkpoints
    pickle this namespace)."""
    validated = startup.validate(startup.parse(argv=_argv()), {})
    _, padded = startup.tokenizer(validated)
    placed = startup.placement(validated)
    assembled = startup.records(validated, padded, placed)
    in_place = validate_args(startup.parse(argv=_argv()))
    in_place.padded_vocab_size = padded
    for key, value in placed.items():
        setattr(in_place, key, value)
    assert list(vars(assembled)) == list(vars(in_place)) and vars(assembled) == vars(in_place)


def test_restore_needs_load() -> None:
    with pytest.raises(ValueError, match="--use-checkpoint-args needs --load"):
        startup.restore_checkpoint_args(startup.parse(argv=_argv("--use-checkpoint-args")), {})


def test_validation_calls_the_deepspeed_step_where_megatron_deepspeed_settles_the_config() -> None:
    seen = {}

    def step(args: argparse.Namespace) -> dict:
        seen.update(global_batch_size=args.global_batch_size, has_params_dtype=hasattr(args, "params_dtype"))
        return {"clip_grad": 0.5, "fp16": False, "bf16": True, "zero_stage": 1, "deepspeed_config_dict": {"x": 1}}

    parsed = startup.parse(argv=_argv("--deepspeed"))
    validated = validated_args(parsed, {}, step)
    assert seen == {"global_batch_size": 2, "has_params_dtype": False}  # after the batch sizes, before precision
    assert (validated.bf16, validated.params_dtype, validated.accumulate_allreduce_grads_in_fp32) \
        == (True, torch.bfloat16, True)  # precision follows the settled values
    assert (validated.zero_stage, validated.clip_grad, validated.deepspeed_config_dict) == (1, 0.5, {"x": 1})
    assert not parsed.bf16 and not hasattr(parsed, "deepspeed_config_dict")


def _write(args: StartupArgs, statement: str, module: str, path: str = "<test>") -> None:
    """Run `statement` as code of the module named `module` in the file `path` (what StartupArgs looks at)."""
    exec(compile(statement, path, "exec"), {"__name__": module, "args": args})  # noqa: S102 - constant statements


@pytest.mark.parametrize("statement", ["args.seed = 2", "setattr(args, 'seed', 2)", "args.seed += 1",
                                       "del args.seed"])
@pytest.mark.parametrize("module", ["megatron.training", "tasks.finetune_utils"])
def test_our_code_cannot_write_the_args(statement: str, module: str) -> None:
    args = startup.read_only_args({"seed": 1})
    with pytest.raises(ArgsReadOnlyError) as exc:
        _write(args, statement, module)
    message = str(exc.value)
    assert "args.seed" in message and "\n" not in message and isinstance(exc.value, MegatronUserError)
    assert args.seed == 1


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "tools/generate_samples_gpt.py", "tasks/main.py"])
def test_our_entry_scripts_cannot_write_the_args(script: str) -> None:
    args = startup.read_only_args({"seed": 1})
    with pytest.raises(ArgsReadOnlyError):
        _write(args, "args.seed = 2", "__main__", str(ROOT / script))


def test_users_scripts_and_megatrons_set_up_records_may_write() -> None:
    args = startup.read_only_args({"seed": 1, "train_iters": None})
    _write(args, "args.seed = 2; args.my_value = 'x'", "__main__", str(ROOT / "my_pretrain_gpt.py"))  # a user's
    _write(args, "args.train_iters = 10; args.model_type = 'encoder_or_decoder'", "megatron.model_setup")
    assert (args.seed, args.my_value, args.train_iters, args.model_type) == (2, "x", 10, "encoder_or_decoder")
    args.seed = 3  # this test module is a user's module too
    assert args.seed == 3


def test_initialize_megatron_installs_the_read_only_record() -> None:
    initialize_megatron(args=_argv(), skip_mpu_initialization=True)
    args = global_vars.get_args()
    assert isinstance(args, StartupArgs) and args.padded_vocab_size == 128
    assert global_vars.get_tokenizer().vocab_size == 101 and global_vars.get_num_microbatches() == 1
    with pytest.raises(ArgsReadOnlyError):
        _write(args, "args.lr = 1.0", "megatron.training")
