"""Flag parsing, Megatron defaults, derived values and every validation error of megatron/arguments.py."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.arguments import ArgumentError, core_transformer_config_from_args, parse_args, validate_args

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
    "--micro-batch-size 2 --train-iters 10 --lr 1e-3"
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                "SLURM_JOB_NODELIST", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _args(extra: str = "", world_size: int = 1, base: str = BASE) -> argparse.Namespace:
    args = parse_args(args=(base + " " + extra).split())
    args.world_size = world_size
    return args


def _validated(extra: str = "", world_size: int = 1, **kw) -> argparse.Namespace:
    return validate_args(_args(extra, world_size, **kw))


def test_typical_gpt_command_defaults(capsys):
    cmd = (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 1024 "
        "--num-attention-heads 16 --micro-batch-size 4 --global-batch-size 64 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 500000 --lr-decay-iters 320000 --save ckpt --load ckpt "
        "--data-path 0.3 a_text_document 0.7 b_text_document --vocab-file v.json --merge-file m.txt "
        "--data-impl mmap --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine "
        "--min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations "
        "--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --fp16 "
        "--tokenizer-type GPT2BPETokenizer"
    )
    args = parse_args(args=cmd.split())
    args.world_size = 8
    validate_args(args)
    assert args.data_parallel_size == 2
    assert args.ffn_hidden_size == 4096 and args.kv_channels == 64
    assert args.params_dtype == torch.half
    assert args.recompute_granularity == "full" and args.recompute_method == "uniform"
    assert args.data_path == ["0.3", "a_text_document", "0.7", "b_text_document"]
    assert args.consumed_train_samples == 0 and args.consumed_valid_samples == 0
    assert args.dataloader_type == "single"
    # Megatron's defaults for flags not given.
    assert args.seed == 1234 and args.make_vocab_size_divisible_by == 128
    assert args.adam_beta1 == 0.9 and args.adam_beta2 == 0.999 and args.adam_eps == 1e-8
    assert args.initial_loss_scale == 2**32 and args.loss_scale_window == 1000 and args.hysteresis == 2
    assert args.DDP_impl == "local" and args.optimizer == "adam" and args.num_workers == 2
    assert args.hidden_dropout == 0.1 and args.attention_dropout == 0.1 and args.init_method_std == 0.02
    assert args.tensorboard_queue_size == 1000 and args.timing_log_level == 0
    assert args.masked_softmax_fusion and args.bias_gelu_fusion and args.bias_dropout_fusion
    assert args.no_save_optim is None and args.no_load_rng is None
    out = capsys.readouterr().out
    assert "------------------------ arguments ------------------------" in out
    assert "-------------------- end of arguments ---------------------" in out
    assert "  micro_batch_size ................................ 4" in out


def test_flag_aliases_and_store_false_flags():
    args = parse_args(args=(BASE + " --dataset-impl lazy --override-lr-scheduler --use-checkpoint-lr-scheduler "
                                   "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
                                   "--no-log-loss-scale-to-tensorboard --local_rank 3 "
                                   "--no-contiguous-buffers-in-local-ddp").split())
    assert args.data_impl == "lazy"
    assert args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler
    assert not args.masked_softmax_fusion and not args.bias_gelu_fusion and not args.bias_dropout_fusion
    assert not args.log_loss_scale_to_tensorboard and args.local_rank == 3
    assert not args.use_contiguous_buffers_in_local_ddp
    assert parse_args(args=(BASE + " --local-rank 1").split()).local_rank == 1


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=(BASE + " --no-such-flag 3").split())
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    args = parse_args(args=(BASE + " --no-such-flag 3").split(), ignore_unknown_args=True)
    assert args.num_layers == 2


def test_bad_choice_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=(BASE + " --lr-decay-style exp").split())
    assert "--lr-decay-style" in capsys.readouterr().err


def test_extra_args_provider_adds_groups():
    def provider(parser):
        group = parser.add_argument_group(title="DeepSpeed")
        group.add_argument("--deepspeed", action="store_true")
        group.add_argument("--zero-stage", type=int, default=0)
        return parser

    args = parse_args(provider, args=(BASE + " --deepspeed --zero-stage 2").split())
    assert args.deepspeed and args.zero_stage == 2


def test_rank_and_world_size_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = parse_args(args=BASE.split())
    assert (args.rank, args.world_size, args.local_rank) == (3, 4, 1)


def test_derived_values():
    args = _validated("--tensor-model-parallel-size 2", world_size=8)
    assert args.data_parallel_size == 4 and args.global_batch_size == 8
    assert args.params_dtype == torch.float and args.virtual_pipeline_model_parallel_size is None
    args = _validated("--bf16 --swiglu --kv-channels 8")
    assert args.params_dtype == torch.bfloat16 and args.accumulate_allreduce_grads_in_fp32
    assert args.ffn_hidden_size == 128 and args.kv_channels == 8  # int(4*64*2/3 / 64) * 64
    args = _validated("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1",
                      world_size=4, base=BASE.replace("--num-layers 2", "--num-layers 8"))
    assert args.virtual_pipeline_model_parallel_size == 2
    args = _validated("--recompute-activations")
    assert args.recompute_granularity == "selective" and args.recompute_method is None
    args = _validated("--checkpoint-activations --checkpoint-num-layers 2")
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 2)
    args = _validated("--weight-decay 0.1")
    assert args.start_weight_decay == 0.1 and args.end_weight_decay == 0.1
    args = _validated("--apply-query-key-layer-scaling")
    assert args.attention_softmax_in_fp32


def test_sequence_parallel_turned_off_with_tp1(capsys):
    args = _validated("--sequence-parallel")
    assert args.sequence_parallel is False
    assert "--sequence-parallel" in capsys.readouterr().out
    args = _validated("--sequence-parallel --tensor-model-parallel-size 2", world_size=2)
    assert args.sequence_parallel and not args.async_tensor_model_parallel_allreduce


def test_defaults_dict_fills_and_warns(capsys):
    args = validate_args(_args(), {"tokenizer_type": "NullTokenizer", "vocab_size": 500, "seed": 7})
    assert args.tokenizer_type == "NullTokenizer" and args.vocab_size == 500
    assert args.seed == 1234  # given on the command line (default value) wins
    assert "WARNING: overriding default arguments for seed:7 with seed:1234" in capsys.readouterr().out


INVALID = [
    # (extra flags, world size, base override, text the message must contain)
    ("--num-attention-heads 6 --kv-channels 8 --tensor-model-parallel-size 4", 4, None, "--num-attention-heads"),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 6, None, "--pipeline-model-parallel-size"),
    ("--tensor-model-parallel-size 3", 4, None, "--tensor-model-parallel-size"),
    ("--global-batch-size 6", 4, None, "--global-batch-size"),
    ("--seq-length 128", 1, None, "--max-position-embeddings"),
    ("--train-samples 100", 1, None, "--train-iters or --train-samples"),
    ("--lr-decay-samples 100", 1, None, "--lr-decay-iters"),
    ("--lr-warmup-samples 10", 1, None, "--lr-warmup-iters"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 3", 1, None, "--lr-warmup-fraction"),
    ("--lr-decay-iters 10", 1, BASE.replace("--train-iters 10", "--train-samples 100"), "--lr-decay-samples"),
    ("--lr-warmup-iters 10", 1, BASE.replace("--train-iters 10", "--train-samples 100"), "--lr-warmup-samples"),
    ("--rampup-batch-size 2 2 100", 1, None, "--train-samples"),
    ("--rampup-batch-size 2 2", 1, BASE.replace("--train-iters 10", "--train-samples 100"), "--rampup-batch-size"),
    ("--fp16 --bf16", 1, None, "--fp16 and --bf16"),
    ("--fp16-lm-cross-entropy", 1, None, "--fp16-lm-cross-entropy"),
    ("--fp32-residual-connection", 1, None, "--fp32-residual-connection"),
    ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", 2, None, "> 2"),
    ("--pipeline-model-parallel-size 3 --num-layers-per-virtual-pipeline-stage 1", 3, None, "--num-layers"),
    ("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3", 4,
     BASE.replace("--num-layers 2", "--num-layers 8"), "--num-layers-per-virtual-pipeline-stage"),
    ("--DDP-impl torch --use-distributed-optimizer", 1, None, "--DDP-impl local"),
    ("--overlap-param-gather", 1, None, "--use-distributed-optimizer"),
    ("--recompute-activations --recompute-method uniform", 1, None, "--recompute-method"),
    ("--recompute-method block", 1, None, "--recompute-granularity full"),
    ("--distribute-saved-activations --checkpoint-activations", 1, None, "--tensor-model-parallel-size"),
    ("--batch-size 4", 1, None, "--micro-batch-size"),
    ("--model-parallel-size 2", 1, None, "--tensor-model-parallel-size"),
    ("--warmup 10", 1, None, "--lr-warmup-fraction"),
    ("--min-lr 1.0", 1, None, "--min-lr"),
    ("--start-weight-decay 0.1", 1, None, "--weight-decay-incr-style"),
    ("--weight-decay-incr-style linear", 1, None, "--start-weight-decay"),
    ("--data-path a b", 1, None, "--data-path"),
    ("--data-path 0.5 a 0.5", 1, None, "--data-path"),
    ("--data-path 0.5 a x b", 1, None, "--data-path"),
    ("", 1, BASE.replace("--micro-batch-size 2", ""), "--micro-batch-size"),
    ("", 1, BASE.replace("--num-layers 2", ""), "--num-layers"),
    ("", 1, BASE.replace("--max-position-embeddings 64", ""), "--max-position-embeddings"),
    ("--hidden-size 66", 1, None, "--hidden-size"),
    ("--sequence-parallel --tensor-model-parallel-size 2 --seq-length 33", 2, None, "--seq-length"),
    ("", 1, BASE.replace("--seq-length 32", ""), "--seq-length"),
    ("", 1, BASE.replace("--lr 1e-3", ""), "--lr"),
    ("--pipeline-model-parallel-size 2", 2, BASE.replace("--num-layers 2", "--num-layers 3"), "--num-layers"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file v.json", 1, None, "--merge-file"),
    ("--tokenizer-type BertWordPieceLowerCase", 1, None, "--vocab-file"),
    ("--tokenizer-type SentencePieceTokenizer", 1, None, "--tokenizer-model"),
    ("--tokenizer-type NullTokenizer", 1, None, "--vocab-size"),
    ("--split 90,a,1", 1, None, "--split"),
    ("--split 0,0,0", 1, None, "--split"),
    ("--split 1,2,3,4", 1, None, "--split"),
    ("--reset-position-ids --position-embedding-type rope", 1, None, "--reset-position-ids"),
    ("--reset-position-ids --no-position-embedding", 1, None, "--reset-position-ids"),
]


@pytest.mark.parametrize("extra,world,base,needle", INVALID)
def test_validation_errors_name_the_flag(extra, world, base, needle):
    args = _args(extra, world, base=base or BASE)
    with pytest.raises(ArgumentError) as info:
        validate_args(args)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message


def test_argument_error_is_a_value_error():
    assert issubclass(ArgumentError, ValueError)


def test_core_transformer_config_from_args():
    args = _validated("--tensor-model-parallel-size 2 --sequence-parallel --hidden-dropout 0.0 --openai-gelu "
                      "--untie-embeddings-and-output-weights --checkpoint-activations", world_size=2)
    args.padded_vocab_size = 256
    config = core_transformer_config_from_args(args)
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel
    assert config.num_layers == 2 and config.hidden_size == 64 and config.num_attention_heads == 4
    assert config.ffn_hidden_size == 256 and config.kv_channels == 16 and config.max_position_embeddings == 64
    assert config.hidden_dropout == 0.0 and config.openai_gelu and config.padded_vocab_size == 256
    assert not config.share_embeddings_and_output_weights
    assert config.recompute_granularity == "full" and config.recompute_method == "uniform"
    assert config.params_dtype == torch.float and config.use_cpu_initialization
    weight = torch.empty(1000, 10)
    config.init_method(weight)
    assert abs(weight.std().item() - 0.02) < 0.003


def test_validate_args_is_idempotent():
    args = _validated("--checkpoint-activations --weight-decay 0.1 --tensor-model-parallel-size 2 --sequence-parallel "
                      "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 --bf16",
                      world_size=16, base=BASE.replace("--num-layers 2", "--num-layers 8"))
    first = dict(vars(args))
    validate_args(args)
    assert vars(args) == first


def test_mistyped_flag_is_one_line_with_the_closest_names(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(args=(BASE + " --train-iter 3 --hiden-size=8").split())
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith("error: unrecognized arguments: --train-iter (did you mean --train-iters")
    assert "--hiden-size=8 (did you mean --hidden-size" in err


def test_save_needs_save_interval_only_when_pretraining():
    from megatron.settings.required_flags import TRAINING_RUN

    with pytest.raises(ArgumentError, match="--save needs --save-interval"):
        validate_args(_args("--save ckpt --data-path x", 1, base=BASE), {TRAINING_RUN: True})
    # tasks/main.py (finetuning saves at epoch ends; --epochs 0 writes predictions there), as Megatron accepts it
    assert validate_args(_args("--save ckpt", 1, base=BASE)).save_interval is None
