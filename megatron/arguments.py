"""Megatron-compatible command-line flags: `parse_args`, `validate_args`, `core_transformer_config_from_args`.

Flag names, groups and defaults follow Megatron-LM / Megatron-DeepSpeed so existing launch scripts work unchanged.
Each flag is declared once, in megatron/settings/ (the parser is built from those declarations); an entry script
adds its own groups through `extra_args_provider(parser) -> parser`.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from megatron import optional
from megatron.core.transformer_config import TransformerConfig, rope_scaling_problem, yarn_problem
from megatron.ds.config import reconcile_deepspeed_config
from megatron.errors import ArgumentError
from megatron.launcher import detect_launcher_env
from megatron.settings import add_core_groups, add_last_groups
from megatron.settings.cli_parser import FlagParser
from megatron.settings.config_flags import config_kwargs_from_args, dests_without_config_field
from megatron.settings.flag_registry import refuse_unimplemented
from megatron.settings.moe_checks import validate_moe_args
from megatron.settings.path_checks import check_load_folder, check_output_folders
from megatron.settings.required_flags import TRAINING_RUN, check_required_flags

# Flags each tokenizer type needs (checked by validate_args before anything is built).
_TOKENIZER_REQUIRED_FLAGS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "PretrainedFromHF": ("tokenizer_name_or_path",),
    "HFTokenizer": ("tokenizer_name_or_path",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def parse_args(
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
    ignore_unknown_args: bool = False,
    args: Optional[List[str]] = None,
) -> argparse.Namespace:
    """Parse Megatron's flags from `args` (default: sys.argv[1:]); also sets `rank` and `world_size` from the env."""
    parser = build_parser(extra_args_provider)
    argv = sys.argv[1:] if args is None else list(args)
    if ignore_unknown_args:
        namespace, _ = parser.parse_known_args(argv)
    else:
        namespace = parser.parse_args(argv)
    # Where this process sits in the job: torch.distributed if already up, else the launcher's environment.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        namespace.rank = torch.distributed.get_rank()
        namespace.world_size = torch.distributed.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        env = detect_launcher_env(os.environ)
        namespace.rank, namespace.world_size, local_rank = env.rank, env.world_size, env.local_rank
    if namespace.local_rank is None:
        namespace.local_rank = local_rank
    return namespace


def build_parser(
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
) -> argparse.ArgumentParser:
    """The argparse parser with every Megatron group (plus the caller's extra groups)."""
    parser = add_core_groups(FlagParser(description="Megatron-LM Arguments", allow_abbrev=False))
    if extra_args_provider is not None:
        result = extra_args_provider(parser)
        parser = parser if result is None else result
    # Last, so a provider that adds DeepSpeed's flags itself (deepspeed.add_config_arguments) keeps its own.
    return add_last_groups(parser)


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------


def _print0(args: argparse.Namespace, message: str) -> None:
    if getattr(args, "rank", 0) == 0:
        print(message, flush=True)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


DeepSpeedStep = Callable[[argparse.Namespace], Mapping[str, Any]]


def deepspeed_settled_values(args: argparse.Namespace) -> Mapping[str, Any]:
    """The default DeepSpeed step: the flag values the DeepSpeed JSON config settles (megatron/ds/config.py)."""
    return reconcile_deepspeed_config(args).settled_values()


def validate_args(args: argparse.Namespace, defaults: Optional[Dict[str, Any]] = None) -> argparse.Namespace:
    """Megatron's API for users' scripts: `validated_args` written back onto `args`, which is returned. Start-up
    (megatron/startup.py) calls `validated_args`, which never changes its input, with its DeepSpeed step."""
    checked = validated_args(args, defaults, deepspeed_settled_values)
    vars(args).update(vars(checked))  # Megatron's in-place contract (the one write, listed in the house test)
    return args


def validated_args(args: argparse.Namespace, defaults: Optional[Dict[str, Any]] = None,
                   deepspeed_step: Optional[DeepSpeedStep] = None) -> argparse.Namespace:
    """A new namespace: `args` with flag combinations checked (one-line errors naming the flags) and Megatron's
    derived values filled; `args` is not changed. `deepspeed_step` returns the values the DeepSpeed config settles
    (default `deepspeed_settled_values`; start-up passes its step), applied where Megatron-DeepSpeed settles them."""
    args = argparse.Namespace(**vars(args))
    defaults = dict(defaults or {})
    training_run = bool(defaults.pop(TRAINING_RUN, False))  # set by megatron.training.pretrain
    if not hasattr(args, "rank"):
        args.rank = int(os.environ.get("RANK", "0"))
    if not hasattr(args, "world_size"):
        args.world_size = int(os.environ.get("WORLD_SIZE", "1"))

    # Defaults supplied by the entry script (e.g. tokenizer_type for pretrain_gpt.py).
    for key, value in defaults.items():
        current = getattr(args, key, None)
        if current is not None:
            if current != value and _full_arg_log(args):  # the user's own flag: news only in the full log
                _print0(args, f"WARNING: overriding default arguments for {key}:{value} with {key}:{current}")
        else:
            setattr(args, key, value)

    _resolve_position_embedding(args)  # first: the required flags depend on the position embedding
    check_required_flags(args, training_run, _TOKENIZER_REQUIRED_FLAGS)  # all missing flags in one line
    _refuse_unimplemented(args)
    _validate_deprecated(args)
    _validate_parallel_layout(args)
    _validate_batch(args)
    _validate_deepspeed(args, deepspeed_step)
    _validate_precision(args)
    _validate_muon(args)
    _validate_training_length(args, training_run)
    _validate_model_shape(args)
    _validate_architecture(args)
    validate_moe_args(args)
    _validate_recompute(args)
    _validate_misc(args)
    _validate_context_parallel(args, training_run)
    check_output_folders(args)
    check_load_folder(args)

    _print_args(args)
    return args


@functools.lru_cache(maxsize=1)
def _core_flags() -> Dict[str, Tuple[str, Any]]:
    """dest -> (its first long option, parser default) for every core flag."""
    out: Dict[str, Tuple[str, Any]] = {}
    for action in build_parser()._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in out:
            out[action.dest] = (longs[0], action.default)
    return out


def _refuse_unimplemented(args: argparse.Namespace) -> None:
    """Flags that parse but are not implemented: one line naming the flag (megatron/settings/flag_registry.py)."""
    refuse_unimplemented(args, _core_flags(), dests_without_config_field(TransformerConfig))


def _validate_deprecated(args: argparse.Namespace) -> None:
    _require(args.model_parallel_size is None,
             "--model-parallel-size is no longer supported: use --tensor-model-parallel-size instead")
    _require(args.batch_size is None, "--batch-size is no longer supported: use --micro-batch-size instead")
    _require(args.warmup is None, "--warmup is no longer supported: use --lr-warmup-fraction instead")
    if args.checkpoint_num_layers is not None:
        args.recompute_num_layers = args.checkpoint_num_layers


def _validate_parallel_layout(args: argparse.Namespace) -> None:
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    cp = getattr(args, "context_parallel_size", 1)
    _require(tp >= 1, f"--tensor-model-parallel-size must be >= 1 (got {tp})")
    _require(pp >= 1, f"--pipeline-model-parallel-size must be >= 1 (got {pp})")
    _require(cp >= 1, f"--context-parallel-size must be >= 1 (got {cp})")
    if cp == 1:
        _require(world % (tp * pp) == 0,
                 f"world size ({world}) is not divisible by --tensor-model-parallel-size ({tp}) x "
                 f"--pipeline-model-parallel-size ({pp}); launch a multiple of {tp * pp} processes or change the sizes")
    else:
        _require(world % (tp * pp * cp) == 0,
                 f"world size ({world}) is not divisible by --tensor-model-parallel-size ({tp}) x "
                 f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); launch a multiple of "
                 f"{tp * pp * cp} processes or change the sizes")
    args.data_parallel_size = world // (tp * pp * cp)
    _print0(args, f"using world size: {world}, data-parallel size: {args.data_parallel_size}, "
                  + (f"context-parallel size: {cp}, " if cp > 1 else "")
                  + f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: {pp} ")
    if args.pipeline_model_parallel_split_rank is not None:
        _require(args.pipeline_model_parallel_split_rank < pp,
                 f"--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) must be smaller "
                 f"than --pipeline-model-parallel-size ({pp})")
    args.transformer_pipeline_model_parallel_size = pp - 1 if args.standalone_embedding_stage else pp

    if args.num_layers_per_virtual_pipeline_stage is not None:
        _require(pp > 2, "--num-layers-per-virtual-pipeline-stage (interleaved schedule) needs "
                         f"--pipeline-model-parallel-size > 2 (got {pp})")
        _require(args.num_layers is not None, "--num-layers-per-virtual-pipeline-stage needs --num-layers")
        _require(args.num_layers % args.transformer_pipeline_model_parallel_size == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size "
                 f"({args.transformer_pipeline_model_parallel_size}) for the interleaved schedule")
        per_stage = args.num_layers // args.transformer_pipeline_model_parallel_size
        _require(per_stage % args.num_layers_per_virtual_pipeline_stage == 0,
                 f"layers per pipeline stage ({per_stage}) must be divisible by "
                 f"--num-layers-per-virtual-pipeline-stage ({args.num_layers_per_virtual_pipeline_stage})")
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    else:
        args.virtual_pipeline_model_parallel_size = None

    if args.sequence_parallel and tp == 1:
        _print0(args, "WARNING: --sequence-parallel needs --tensor-model-parallel-size > 1; disabling it")
        args.sequence_parallel = False
    if args.sequence_parallel:
        # The sequence-parallel all-gather already overlaps; Megatron turns the async all-reduce off.
        args.async_tensor_model_parallel_allreduce = False

    if args.DDP_impl == "torch":
        _require(not args.use_distributed_optimizer,
                 "--use-distributed-optimizer needs --DDP-impl local (it shards the local DDP's gradient buffer)")
        _require(not args.overlap_grad_reduce, "--overlap-grad-reduce needs --DDP-impl local")
    if args.use_distributed_optimizer:
        _require(args.use_contiguous_buffers_in_local_ddp,
                 "--use-distributed-optimizer needs contiguous gradient buffers: drop "
                 "--no-contiguous-buffers-in-local-ddp")
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer, "--overlap-param-gather needs --use-distributed-optimizer")
        _require(args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    if args.overlap_grad_reduce:
        _require(args.use_contiguous_buffers_in_local_ddp,
                 "--overlap-grad-reduce needs contiguous gradient buffers: drop --no-contiguous-buffers-in-local-ddp")
    if args.ddp_bucket_size is not None:
        _require(args.ddp_bucket_size > 0, f"--ddp-bucket-size must be positive (got {args.ddp_bucket_size})")


def _validate_batch(args: argparse.Namespace) -> None:
    _require(args.micro_batch_size is not None, "--micro-batch-size is required (batch size per model instance)")
    _require(args.micro_batch_size > 0, f"--micro-batch-size must be positive (got {args.micro_batch_size})")
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
        _print0(args, f"setting global batch size to {args.global_batch_size}")
    _require(args.global_batch_size > 0, f"--global-batch-size must be positive (got {args.global_batch_size})")
    if args.rampup_batch_size is not None:
        _require(len(args.rampup_batch_size) == 3,
                 "--rampup-batch-size takes three numbers: <start batch size> <batch size increment> "
                 f"<ramp-up samples> (got {args.rampup_batch_size})")
        try:
            start, incr, _samples = (int(v) for v in args.rampup_batch_size)
        except ValueError:
            raise ArgumentError(f"--rampup-batch-size values must be integers (got {args.rampup_batch_size})") from None
        unit = args.micro_batch_size * dp
        _require(start > 0 and incr > 0, "--rampup-batch-size start and increment must be positive")
        _require(start <= args.global_batch_size,
                 f"--rampup-batch-size start ({start}) exceeds --global-batch-size ({args.global_batch_size})")
        _require(start % unit == 0 and incr % unit == 0,
                 f"--rampup-batch-size start ({start}) and increment ({incr}) must be multiples of "
                 f"--micro-batch-size x data-parallel size ({unit})")
        _require((args.global_batch_size - start) % incr == 0,
                 f"--global-batch-size ({args.global_batch_size}) minus the ramp-up start ({start}) must be a "
                 f"multiple of the ramp-up increment ({incr})")
    else:
        _require(args.global_batch_size % (args.micro_batch_size * dp) == 0,
                 f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
                 f"({args.micro_batch_size}) x data-parallel size ({dp}); e.g. use --global-batch-size "
                 f"{max(1, args.global_batch_size // (args.micro_batch_size * dp)) * args.micro_batch_size * dp}")
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0


def _validate_deepspeed(args: argparse.Namespace, deepspeed_step: Optional[DeepSpeedStep]) -> None:
    """--deepspeed: the values `deepspeed_step` settles from the DeepSpeed JSON config (start-up's step)."""
    if getattr(args, "deepscale", False):
        args.deepspeed = True
    if getattr(args, "deepscale_config", None) and not getattr(args, "deepspeed_config", None):
        args.deepspeed_config = args.deepscale_config
    if getattr(args, "deepspeed_mpi", False):
        # DeepSpeed's --deepspeed_mpi discovers ranks from MPI; the launcher detection reads OpenMPI's variables.
        _require("OMPI_COMM_WORLD_RANK" in os.environ,
                 "--deepspeed_mpi needs an mpirun (OpenMPI) launch: OMPI_COMM_WORLD_RANK is not set")
    if not getattr(args, "deepspeed", False):
        for flag, attr in (("--deepspeed_config", "deepspeed_config"), ("--zero-stage", "zero_stage"),
                           ("--deepspeed-activation-checkpointing", "deepspeed_activation_checkpointing")):
            _require(not getattr(args, attr, None), f"{flag} needs --deepspeed")
        args.zero_stage = None
        return
    _require(not getattr(args, "calculate_per_token_loss", False),
             "--calculate-per-token-loss is not implemented with --deepspeed (DeepSpeed's engine averages each "
             "micro-batch's loss and grads itself): drop one of them")
    _require(not (getattr(args, "qk_layernorm", False) and not getattr(args, "multi_latent_attention", False)
                  and args.tensor_model_parallel_size > 1),
             "--qk-layernorm with --deepspeed runs at --tensor-model-parallel-size 1 (the per-head q/k norm grads are "
             "summed over TP by Megatron's backend only): drop --deepspeed or use TP 1")
    # The config, ZeRO stage, --clip-grad, --fp16/--bf16 as the config settles them.
    for name, value in (deepspeed_step or deepspeed_settled_values)(args).items():
        setattr(args, name, value)
    if args.deepspeed_activation_checkpointing and not (args.checkpoint_activations
                                                       or args.recompute_granularity == "full"):
        _print0(args, "notice: --deepspeed-activation-checkpointing takes effect with --checkpoint-activations "
                      "(full recomputation); without it no activations are recomputed")
    if getattr(args, "no_save_optim", False):
        _print0(args, "notice: with --deepspeed, --no-save-optim leaves out only the LR scheduler state: DeepSpeed "
                      "always writes its optimizer (ZeRO) state files")


def _validate_muon(args: argparse.Namespace) -> None:
    """--optimizer muon's (and dist_muon's) combinations Megatron-LM core 0.16.1 refuses."""
    if getattr(args, "optimizer", "adam") not in ("muon", "dist_muon"):
        return
    _require(not args.use_distributed_optimizer, f"--optimizer {args.optimizer} does not work with "
             "--use-distributed-optimizer (as in Megatron-LM core 0.16.1: Muon orthogonalises whole matrices); drop "
             "--use-distributed-optimizer and use --optimizer dist_muon (layer-wise distributed over data parallel)")
    _require(args.muon_fp32_matmul_prec != "low", "--muon-fp32-matmul-prec low: torch has no such float32 matmul "
             "precision; use medium (bf16 Newton-Schulz, the default) or high (fp32)")
    _require(args.muon_num_ns_steps >= 5 and args.muon_num_ns_steps % 5 == 0, f"--muon-num-ns-steps "
             f"{args.muon_num_ns_steps} must be a multiple of 5 (the quintic coefficient schedule's length)")


def _validate_precision(args: argparse.Namespace) -> None:
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot be used together; pick one")
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        if not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            _print0(args, "accumulate and all-reduce gradients in fp32 for bfloat16 data type.")
    _print0(args, f"using {args.params_dtype} for parameters ...")
    if args.apply_query_key_layer_scaling:
        # Layer scaling divides scores by the layer number and multiplies back inside the softmax: needs fp32 there.
        args.attention_softmax_in_fp32 = True
    if args.fp16_lm_cross_entropy:
        _require(args.fp16, "--fp16-lm-cross-entropy needs --fp16")
    if args.fp32_residual_connection:
        _require(args.fp16 or args.bf16, "--fp32-residual-connection needs --fp16 or --bf16")
    if args.loss_scale is not None:
        _require(args.loss_scale > 0, f"--loss-scale must be positive (got {args.loss_scale})")
    _require(args.initial_loss_scale > 0 and args.min_loss_scale > 0,
             "--initial-loss-scale and --min-loss-scale must be positive")
    if args.gradient_accumulation_fusion and not _grad_accumulation_fusion_available():
        args.gradient_accumulation_fusion = False
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = bool(args.lazy_mpu_init) or not torch.cuda.is_available()


def _grad_accumulation_fusion_available() -> bool:
    try:
        optional.load("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return False
    return torch.cuda.is_available()


def _check_warmup_before_decay(warmup: int, decay: Optional[int], train: int, unit: str) -> None:
    """The LR warmup must end before the decay does: checked here in the flags' own units (the scheduler counts
    samples), before anything is built."""
    decay_flag = f"--lr-decay-{unit}" if decay is not None else f"--train-{unit} (the decay length by default)"
    decay = decay if decay is not None else train
    if warmup and decay and warmup >= decay:
        raise ArgumentError(f"--lr-warmup-{unit} {warmup} must be smaller than {decay_flag} {decay}: lower the warmup "
                            f"or lengthen the decay")


def _validate_wsd(args: argparse.Namespace) -> None:
    """--lr-decay-style WSD needs its anneal length in the run's unit; the WSD flags need that style."""
    iters, samples = getattr(args, "lr_wsd_decay_iters", None), getattr(args, "lr_wsd_decay_samples", None)
    if getattr(args, "lr_decay_style", None) != "WSD":
        _require(iters is None and samples is None and getattr(args, "lr_wsd_decay_style", "exponential") == "exponential",
                 "--lr-wsd-decay-iters/--lr-wsd-decay-samples/--lr-wsd-decay-style need --lr-decay-style WSD")
        return
    if args.train_iters is not None:
        _require(samples is None, "--lr-wsd-decay-samples needs --train-samples; with --train-iters use "
                 "--lr-wsd-decay-iters")
        _require(iters is not None and iters > 0, "--lr-decay-style WSD with --train-iters needs "
                 "--lr-wsd-decay-iters N > 0 (the annealing phase's length)")
    if args.train_samples is not None:
        _require(iters is None, "--lr-wsd-decay-iters needs --train-iters; with --train-samples use "
                 "--lr-wsd-decay-samples")
        _require(samples is not None and samples > 0, "--lr-decay-style WSD with --train-samples needs "
                 "--lr-wsd-decay-samples N > 0 (the annealing phase's length)")


def _validate_training_length(args: argparse.Namespace, training_run: bool = False) -> None:
    _require(not (args.train_iters is not None and args.train_samples is not None),
             "use either --train-iters or --train-samples, not both")
    if args.train_iters is not None:
        _require(args.train_iters > 0 or args.skip_train,
                 f"--train-iters must be > 0 (got {args.train_iters}); to only evaluate a checkpoint, pass --skip-train")
        _require(args.lr_decay_samples is None,
                 "--lr-decay-samples needs --train-samples; with --train-iters use --lr-decay-iters")
        _require(args.lr_warmup_samples == 0,
                 "--lr-warmup-samples needs --train-samples; with --train-iters use --lr-warmup-iters")
        _require(args.rampup_batch_size is None,
                 "--rampup-batch-size needs sample-based training: use --train-samples instead of --train-iters")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_iters == 0, "use either --lr-warmup-fraction or --lr-warmup-iters, not both")
        _check_warmup_before_decay(args.lr_warmup_iters, args.lr_decay_iters, args.train_iters, "iters")
    if args.train_samples is not None:
        _require(args.train_samples > 0 or args.skip_train,
                 f"--train-samples must be > 0 (got {args.train_samples}); to only evaluate, pass --skip-train")
        _require(args.lr_decay_iters is None,
                 "--lr-decay-iters needs --train-iters; with --train-samples use --lr-decay-samples")
        _require(args.lr_warmup_iters == 0,
                 "--lr-warmup-iters needs --train-iters; with --train-samples use --lr-warmup-samples")
        if args.lr_warmup_fraction is not None:
            _require(args.lr_warmup_samples == 0, "use either --lr-warmup-fraction or --lr-warmup-samples, not both")
        _check_warmup_before_decay(args.lr_warmup_samples, args.lr_decay_samples, args.train_samples, "samples")
    _validate_wsd(args)
    if (args.train_iters or args.train_samples) and not args.skip_train:
        _require(args.lr is not None, "--lr is required for training (peak learning rate, e.g. --lr 1.5e-4)")
    if args.lr is not None:
        _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must not exceed --lr ({args.lr})")
    if args.lr_warmup_fraction is not None:
        _require(0.0 <= args.lr_warmup_fraction <= 1.0,
                 f"--lr-warmup-fraction must be within [0, 1] (got {args.lr_warmup_fraction})")
    if args.save is not None and training_run:  # finetuning saves at epoch ends; evaluation writes predictions there
        _require(args.save_interval is not None, "--save needs --save-interval (iterations between saves)")
    if args.save_interval is not None:
        _require(args.save_interval > 0, f"--save-interval must be positive (got {args.save_interval})")
    _require(args.log_interval > 0, f"--log-interval must be positive (got {args.log_interval})")
    _require(args.eval_interval > 0, f"--eval-interval must be positive (got {args.eval_interval})")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0 (got {args.eval_iters})")
    if args.weight_decay_incr_style == "constant":
        # (Values equal to --weight-decay are what a previous validation filled in: keep validation idempotent.)
        unchanged = (None, args.weight_decay)
        _require(args.start_weight_decay in unchanged and args.end_weight_decay in unchanged,
                 "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine "
                 "(with constant style use --weight-decay)")
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    else:
        _require(args.start_weight_decay is not None and args.end_weight_decay is not None,
                 f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                 "--end-weight-decay")


def _validate_model_shape(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        _require(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    if args.encoder_num_layers is None:
        args.encoder_num_layers = args.num_layers
    _require(args.num_layers > 0 and args.hidden_size > 0 and args.num_attention_heads > 0,
             "--num-layers, --hidden-size and --num-attention-heads must be positive")
    stages = args.transformer_pipeline_model_parallel_size
    if stages > 1 and args.pipeline_model_parallel_split_rank is None:
        _require(args.num_layers % stages == 0,
                 f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({stages})")
    tp = args.tensor_model_parallel_size
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Keep the parameter count of a 4h GeLU MLP, rounded to a multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                 f"({args.num_attention_heads}), or set --kv-channels")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.seq_length is not None:
        _require(args.encoder_seq_length in (None, args.seq_length),
                 "use either --seq-length or --encoder-seq-length, not both")
        args.encoder_seq_length = args.seq_length
    elif args.encoder_seq_length is not None:
        args.seq_length = args.encoder_seq_length
    _require(args.seq_length is not None, "--seq-length is required (or --encoder-seq-length)")
    for flag in ("seq_length", "decoder_seq_length", "max_position_embeddings", "ffn_hidden_size", "kv_channels"):
        value = getattr(args, flag)
        _require(value is None or value > 0, f"--{flag.replace('_', '-')} must be positive (got {value})")
    if args.max_position_embeddings is None and args.position_embedding_type in ("rope", "alibi", "none"):
        args.max_position_embeddings = args.seq_length
    _require(args.max_position_embeddings is not None, "--max-position-embeddings is required")
    if args.seq_length is not None:
        _require(args.max_position_embeddings >= args.seq_length,
                 f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
                 f"({args.max_position_embeddings}); raise --max-position-embeddings or lower --seq-length")
    if args.decoder_seq_length is not None:
        _require(args.max_position_embeddings >= args.decoder_seq_length,
                 f"--decoder-seq-length ({args.decoder_seq_length}) exceeds --max-position-embeddings "
                 f"({args.max_position_embeddings})")
    if args.sequence_parallel and args.seq_length is not None:
        _require(args.seq_length % tp == 0,
                 f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                 f"--tensor-model-parallel-size ({tp})")
    _require(args.make_vocab_size_divisible_by > 0, "--make-vocab-size-divisible-by must be positive")


def _resolve_position_embedding(args: argparse.Namespace) -> None:
    """--use-rotary-position-embeddings / --no-position-embedding (Megatron-LM 23.06) -> --position-embedding-type."""
    kind = {"absolute": "learned_absolute", "rotary": "rope"}.get(args.position_embedding_type,
                                                                   args.position_embedding_type)
    if args.use_rotary_position_embeddings:
        _require(kind in ("learned_absolute", "rope"),
                 f"--use-rotary-position-embeddings means --position-embedding-type rope (got {kind}); drop one")
        kind = "rope"
    if not args.add_position_embedding and kind == "learned_absolute":
        kind = "none"
    args.position_embedding_type = kind
    args.add_position_embedding = kind == "learned_absolute"
    args.use_rotary_position_embeddings = kind == "rope"
    if kind != "rope":
        _require(args.rotary_percent == 1.0 and args.rotary_base == 10000.0,
                 f"--rotary-percent/--rotary-base need --position-embedding-type rope (got {kind})")
        _require(not args.use_rope_scaling and args.rotary_seq_len_interpolation_factor is None,
                 "--use-rope-scaling/--rotary-seq-len-interpolation-factor need --position-embedding-type rope "
                 f"(got {kind})")
    # Rotary embeddings take positions 0..s-1 (plus the decode offset), as in Megatron-LM: reset position ids would
    # silently change nothing there.
    _require(not (getattr(args, "reset_position_ids", False) and kind != "learned_absolute"),
             f"--reset-position-ids needs learned absolute position embeddings (--position-embedding-type {kind} "
             "does not read position ids); drop --reset-position-ids")


def _validate_architecture(args: argparse.Namespace) -> None:
    """Query groups, rotary range, activations: refuse what cannot work, with one line naming the flags."""
    _require(0.0 < args.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1] (got {args.rotary_percent})")
    _require(args.rotary_base > 0, f"--rotary-base must be positive (got {args.rotary_base})")
    problem = rope_scaling_problem(args) or yarn_problem(args)
    _require(problem is None, problem or "")
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if args.group_query_attention:
        if args.num_query_groups is None:
            args.num_query_groups = 1  # Megatron-LM's default: multi-query attention
        groups = args.num_query_groups
        _require(groups >= 1 and heads % groups == 0,
                 f"--num-query-groups ({groups}) must divide --num-attention-heads ({heads})")
        _require(groups % tp == 0,
                 f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp})")
    else:
        _require(args.num_query_groups is None, "--num-query-groups needs --group-query-attention")
    kinds = [flag for flag, on in (("--openai-gelu", args.openai_gelu), ("--squared-relu", args.squared_relu),
                                   ("--swiglu", args.swiglu), ("--glu-activation", args.glu_activation)) if on]
    _require(len(kinds) <= 1, f"{' and '.join(kinds)} are different activations; pick one")


def _validate_recompute(args: argparse.Namespace) -> None:
    if args.checkpoint_activations:
        # Megatron-DeepSpeed semantics: the old flag means full recomputation of uniform chunks.
        _require(args.recompute_granularity in (None, "full"),
                 "--checkpoint-activations means --recompute-granularity full; drop one of them")
        args.recompute_granularity = "full"
        if args.recompute_method is None:
            args.recompute_method = "uniform"
    if args.recompute_activations:
        _require(args.recompute_granularity in (None, "selective") and not args.checkpoint_activations,
                 "--recompute-activations means --recompute-granularity selective; drop the other recompute flag")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "selective":
        _require(args.recompute_method is None,
                 "--recompute-method is only for --recompute-granularity full (selective has no method)")
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            args.recompute_method = "uniform"
        _require(args.recompute_num_layers is not None and args.recompute_num_layers >= 1,
                 "--recompute-num-layers must be >= 1")
    elif args.recompute_method is not None:
        raise ArgumentError("--recompute-method needs --recompute-granularity full (or --checkpoint-activations)")
    if args.distribute_saved_activations:
        _require(args.tensor_model_parallel_size > 1,
                 "--distribute-saved-activations needs --tensor-model-parallel-size > 1")
        _require(args.recompute_granularity == "full",
                 "--distribute-saved-activations needs --recompute-granularity full (or --checkpoint-activations)")
        _require(not args.sequence_parallel,
                 "--distribute-saved-activations cannot be combined with --sequence-parallel")


def _validate_misc(args: argparse.Namespace) -> None:
    family = getattr(args, "model_family", "gpt")
    _require(not (getattr(args, "calculate_per_token_loss", False) and family in ("bert", "t5")),
             f"--calculate-per-token-loss is implemented for pretrain_gpt.py (its loss function returns Megatron's "
             f"sum and token count), not {family.upper()}: drop it")
    if args.data_path:
        _validate_weighted_paths("--data-path", args.data_path)
    for flag in ("train_data_path", "valid_data_path", "test_data_path"):
        paths = getattr(args, flag)
        if paths:
            _validate_weighted_paths("--" + flag.replace("_", "-"), paths)
    _validate_tokenizer(args)
    if args.split is not None:
        _validate_split(args.split)
    if args.use_flash_attn:
        _require(not args.deterministic_mode,
                 "--deterministic-mode cannot be combined with --use-flash-attn (flash attention's backward is not "
                 "deterministic, as in Megatron): drop one of the two flags")
    _require(args.num_workers >= 0, f"--num-workers must be >= 0 (got {args.num_workers})")
    _require(args.tensorboard_queue_size > 0, "--tensorboard-queue-size must be positive")
    _require(args.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive")
    if args.vocab_extra_ids < 0:
        raise ArgumentError(f"--vocab-extra-ids must be >= 0 (got {args.vocab_extra_ids})")
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, f"--exit-interval must be positive (got {args.exit_interval})")
    if args.keep_last_n_checkpoints is not None:
        _require(args.keep_last_n_checkpoints > 0,
                 f"--keep-last-n-checkpoints must be positive (got {args.keep_last_n_checkpoints})")
    if args.ckpt_format == "torch_dist" and args.save:
        _require(not getattr(args, "deepspeed", False), "--ckpt-format torch_dist cannot be used with --deepspeed "
                 "(DeepSpeed writes its own checkpoints): drop one of the two flags")
    _validate_async_save(args)
    _require(args.max_skipped_iterations >= 0,
             f"--max-skipped-iterations must be >= 0 (got {args.max_skipped_iterations}; 0 means no limit)")


def _validate_async_save(args: argparse.Namespace) -> None:
    """--async-save: refused with --deepspeed; with torch_dist it needs --use-persistent-ckpt-worker, as in Megatron-LM
    (which then turns it off with a warning). Megatron-LM's note on the deprecated --ckpt-fully-parallel-save."""
    if args.ckpt_fully_parallel_save_deprecated:
        _print0(args, "--ckpt-fully-parallel-save flag is deprecated and has no effect. Use "
                      "--no-ckpt-fully-parallel-save to disable parallel save.")
    if not args.async_save:
        return
    _require(not getattr(args, "deepspeed", False), "--async-save cannot be used with --deepspeed (DeepSpeed's engine "
             "writes its own checkpoints synchronously): drop --async-save")
    if args.ckpt_format == "torch_dist" and not args.use_persistent_ckpt_worker:
        _print0(args, "WARNING: --async-save is not supported without --use-persistent-ckpt-worker. "
                      "Disabling --async-save.")
        args.async_save = False


def _validate_tokenizer(args: argparse.Namespace) -> None:
    kind = args.tokenizer_type
    for flag in _TOKENIZER_REQUIRED_FLAGS.get(kind, ()):
        _require(getattr(args, flag, None) is not None,
                 f"--tokenizer-type {kind} needs --{flag.replace('_', '-')}")


def _validate_split(split: str) -> None:
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    _require(1 <= len(parts) <= 3 and all(_is_number(p) for p in parts),
             f"--split {split!r} must be up to three comma-separated numbers, e.g. --split 949,50,1")
    values = [float(p) for p in parts]
    _require(all(v >= 0 for v in values) and sum(values) > 0,
             f"--split {split!r} needs non-negative numbers with a positive sum")


def _validate_weighted_paths(flag: str, paths: List[str]) -> None:
    if len(paths) == 1:
        return
    if not _is_number(paths[0]):
        # Several unweighted prefixes: Megatron treats them as equal weights only in newer versions; be explicit.
        raise ArgumentError(f"{flag} with several datasets needs weights: '{flag} w1 prefix1 w2 prefix2 ...'")
    _require(len(paths) % 2 == 0, f"{flag} needs pairs of '<weight> <prefix>' (got {len(paths)} values)")
    for weight, prefix in zip(paths[0::2], paths[1::2]):
        _require(_is_number(weight), f"{flag}: '{weight}' (before '{prefix}') is not a number; "
                                     "use '<weight> <prefix>' pairs")
        _require(float(weight) >= 0, f"{flag}: weight {weight} must be >= 0")
        _require(not _is_number(prefix), f"{flag}: expected a dataset prefix after weight {weight}, got '{prefix}'")
    _require(any(float(w) > 0 for w in paths[0::2]),
             f"{flag}: every blend weight is 0 (nothing to sample); give at least one dataset a positive weight")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _full_arg_log(args: argparse.Namespace) -> bool:
    """Megatron's argument dump goes to redirected logs (not a terminal) or anywhere with --log-args."""
    return bool(getattr(args, "log_args", False)) or not sys.stdout.isatty()


def _print_args(args: argparse.Namespace) -> None:
    """Megatron's argument dump on rank 0 (on a terminal without --log-args: one summary line)."""
    if getattr(args, "rank", 0) != 0:
        return
    if not _full_arg_log(args):
        shape = ", ".join(f"{label} {getattr(args, name)}" for name, label in (
            ("num_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
            ("seq_length", "seq"), ("micro_batch_size", "micro-batch"), ("global_batch_size", "global batch"),
            ("world_size", "processes")) if getattr(args, name, None) is not None)
        print(f"> arguments: {shape} ({len(vars(args))} settings: --log-args prints them all)", flush=True)
        return
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args), key=lambda s: s.lower()):
        dots = "." * (48 - len(name))
        lines.append(f"  {name} {dots} {getattr(args, name)}")
    lines.append("-------------------- end of arguments ---------------------")
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Typed config for the model
# --------------------------------------------------------------------------------------------------------------------


def core_transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """Build the `TransformerConfig` the model layers take, from validated args (explicit table: config_flags.py).
    The config's own checks of flag combinations (each message names the flags) become one-line ArgumentErrors."""
    try:
        return TransformerConfig(**config_kwargs_from_args(TransformerConfig, args))
    except ArgumentError:
        raise
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _validate_context_parallel(args: argparse.Namespace, training_run: bool) -> None:
    """--context-parallel-size N: GPT training with Megatron's 2N-chunk layout; impossible layouts are one line."""
    cp = getattr(args, "context_parallel_size", 1)
    if cp == 1:
        return
    _require(training_run, f"--context-parallel-size {cp} is for training (pretrain_gpt.py); evaluation and text "
                           "generation run at --context-parallel-size 1 (load the same checkpoint: CP shards no weights)")
    family = getattr(args, "model_family", "gpt")
    _require(family == "gpt", f"--context-parallel-size is implemented for GPT-style decoders (pretrain_gpt.py), "
                              f"not {family.upper()}: drop it")
    _require(not getattr(args, "deepspeed", False),
             "--context-parallel-size is not implemented with --deepspeed: drop one of them")
    seq, tp = args.seq_length, args.tensor_model_parallel_size
    _require(seq % (2 * cp) == 0, f"--seq-length ({seq}) must be divisible by {2 * cp} (2 x --context-parallel-size "
                                  f"{cp}): each context-parallel rank holds 2 of {2 * cp} equal chunks")
    if args.sequence_parallel:
        _require((seq // cp) % tp == 0, f"--sequence-parallel with --context-parallel-size {cp} needs the per-rank "
                                        f"sequence ({seq // cp}) divisible by --tensor-model-parallel-size ({tp})")
    heads = args.num_attention_heads // tp
    if args.cp_comm_type == "a2a":
        _require(heads % cp == 0, f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank ({heads}) "
                                  f"divisible by --context-parallel-size ({cp}); use --cp-comm-type p2p or all_gather")
    _require(not args.attention_dropout, f"--context-parallel-size needs --attention-dropout 0 (got "
                                         f"{args.attention_dropout}): context-parallel attention has no dropout")
    _require(args.position_embedding_type != "alibi",
             "--context-parallel-size does not support ALiBi (--position-embedding-type alibi): use rope or learned")
    _require(getattr(args, "num_experts", None) is None,
             "--context-parallel-size with --num-experts (MoE) is not implemented: the router's auxiliary losses are "
             "not yet reduced over the context-parallel group; drop one of them")
