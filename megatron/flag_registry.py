"""Every command-line destination that is not a model-config field: where it is read, or why it is refused.

"Nothing accepted is ignored": each parser destination of each entry script is exactly one of
  * a source of a `TransformerConfig` field (megatron/config_flags.py, `CONFIG_FIELDS`);
  * a run-time setting (`RUNTIME_SETTINGS`: dest -> the file that reads it; the every-flag test checks that the
    file mentions it);
  * a setting that only picks a kernel or communication variant in Megatron and gives the same numbers
    (`SAME_RESULT_VARIANTS`: dest -> why; we have one variant, so any value is honoured);
  * refused when set (`REFUSED`: dest -> (default, one-line reason)), or refused outside the model family that uses it
    (`FAMILY_ONLY`: dest -> (families, default)).
`refuse_unimplemented(args)` (called by validate_args) raises one line naming the first refused flag that is set.

Adding a flag: put it in megatron/arguments.py (or your entry script's extra_args_provider), read it, and add one line
here (or to config_flags.CONFIG_FIELDS for an architecture field). tests/test_every_flag.py names the line to add.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Iterable, Mapping, Tuple

from megatron.errors import ArgumentError

# dest -> the file (repository-relative) that reads it. Settings checked and then folded into others by
# validate_args (aliases, deprecated spellings that are refused there) name megatron/arguments.py.
RUNTIME_SETTINGS: Dict[str, str] = {
    # parallel layout / distributed start-up
    "world_size": "megatron/arguments.py",
    "rank": "megatron/arguments.py",
    "local_rank": "megatron/initialize.py",
    "distributed_backend": "megatron/initialize.py",
    "distributed_timeout_minutes": "megatron/initialize.py",
    "lazy_mpu_init": "megatron/initialize.py",
    "model_parallel_size": "megatron/arguments.py",  # deprecated: refused by _validate_deprecated
    "DDP_impl": "megatron/model_setup.py",
    "use_contiguous_buffers_in_local_ddp": "megatron/model_setup.py",
    "ddp_bucket_size": "megatron/model_setup.py",
    "overlap_grad_reduce": "megatron/model_setup.py",
    "overlap_param_gather": "megatron/model_setup.py",
    "use_distributed_optimizer": "megatron/model_setup.py",
    "accumulate_allreduce_grads_in_fp32": "megatron/model_setup.py",
    "data_parallel_random_init": "megatron/initialize.py",
    "seed": "megatron/initialize.py",
    # batch and schedule
    "micro_batch_size": "megatron/training.py",
    "global_batch_size": "megatron/microbatches.py",
    "rampup_batch_size": "megatron/global_vars.py",
    "batch_size": "megatron/arguments.py",  # deprecated: refused by _validate_deprecated
    "train_iters": "megatron/training.py",
    "train_samples": "megatron/training.py",
    "skip_train": "megatron/training.py",
    "exit_interval": "megatron/training.py",
    "exit_duration_in_mins": "megatron/training.py",
    "exit_signal_handler": "megatron/training.py",
    "check_for_nan_in_loss_and_grad": "megatron/backend/megatron.py",
    "max_skipped_iterations": "megatron/training.py",
    "empty_unused_memory_level": "megatron/training.py",
    # optimizer and learning rate
    "optimizer": "megatron/optimizer/__init__.py",
    "lr": "megatron/learning_rates.py",
    "min_lr": "megatron/learning_rates.py",
    "lr_decay_style": "megatron/learning_rates.py",
    "lr_decay_iters": "megatron/model_setup.py",
    "lr_decay_samples": "megatron/model_setup.py",
    "lr_warmup_fraction": "megatron/model_setup.py",
    "lr_warmup_iters": "megatron/model_setup.py",
    "lr_warmup_samples": "megatron/model_setup.py",
    "warmup": "megatron/arguments.py",  # deprecated: refused by _validate_deprecated
    "override_opt_param_scheduler": "megatron/learning_rates.py",
    "use_checkpoint_opt_param_scheduler": "megatron/learning_rates.py",
    "weight_decay": "megatron/learning_rates.py",
    "start_weight_decay": "megatron/model_setup.py",
    "end_weight_decay": "megatron/model_setup.py",
    "weight_decay_incr_style": "megatron/model_setup.py",
    "clip_grad": "megatron/optimizer/__init__.py",
    "adam_beta1": "megatron/optimizer/__init__.py",
    "adam_beta2": "megatron/optimizer/__init__.py",
    "adam_eps": "megatron/optimizer/__init__.py",
    "sgd_momentum": "megatron/optimizer/__init__.py",
    # mixed precision (loss scaling; params_dtype is a config field)
    "loss_scale": "megatron/optimizer/optimizer_config.py",
    "initial_loss_scale": "megatron/optimizer/optimizer_config.py",
    "min_loss_scale": "megatron/optimizer/optimizer_config.py",
    "loss_scale_window": "megatron/optimizer/optimizer_config.py",
    "hysteresis": "megatron/optimizer/optimizer_config.py",
    "fp16_lm_cross_entropy": "pretrain_gpt.py",
    # checkpointing
    "save": "megatron/training.py",
    "save_interval": "megatron/training.py",
    "load": "megatron/checkpointing.py",
    "no_save_optim": "megatron/checkpointing.py",
    "no_save_rng": "megatron/checkpointing.py",
    "no_load_optim": "megatron/checkpointing.py",
    "no_load_rng": "megatron/checkpointing.py",
    "finetune": "megatron/checkpointing.py",
    "use_checkpoint_args": "megatron/initialize.py",
    "exit_on_missing_checkpoint": "megatron/checkpointing.py",
    "trust_checkpoint": "megatron/checkpointing.py",
    "no_checkpoint_fallback": "megatron/checkpointing.py",
    "keep_last_n_checkpoints": "megatron/checkpointing.py",
    "ckpt_format": "megatron/checkpoint_formats.py",
    "auto_detect_ckpt_format": "megatron/checkpoint_formats.py",
    # evaluation
    "eval_iters": "megatron/training.py",
    "eval_interval": "megatron/training.py",
    # data
    "data_path": "pretrain_gpt.py",
    "split": "pretrain_gpt.py",
    "train_data_path": "pretrain_gpt.py",
    "valid_data_path": "pretrain_gpt.py",
    "test_data_path": "pretrain_gpt.py",
    "data_cache_path": "pretrain_gpt.py",
    "data_impl": "pretrain_gpt.py",
    "mmap_warmup": "pretrain_gpt.py",
    "seq_length": "pretrain_gpt.py",
    "encoder_seq_length": "megatron/arguments.py",  # alias of --seq-length
    "num_workers": "megatron/training.py",
    "dataloader_type": "megatron/training.py",
    "reset_position_ids": "pretrain_gpt.py",
    "reset_attention_mask": "pretrain_gpt.py",
    "eod_mask_loss": "pretrain_gpt.py",
    # tokenizer
    "tokenizer_type": "megatron/tokenizer/tokenizer.py",
    "tokenizer_model": "megatron/tokenizer/tokenizer.py",
    "tokenizer_name_or_path": "megatron/tokenizer/tokenizer.py",
    "vocab_file": "megatron/tokenizer/tokenizer.py",
    "merge_file": "megatron/tokenizer/tokenizer.py",
    "vocab_size": "megatron/tokenizer/tokenizer.py",
    "vocab_extra_ids": "megatron/tokenizer/tokenizer.py",
    # logging
    "log_interval": "megatron/training.py",
    "log_args": "megatron/arguments.py",
    "log_params_norm": "megatron/training.py",
    "log_num_zeros_in_grad": "megatron/optimizer/__init__.py",
    "timing_log_level": "megatron/global_vars.py",
    "timing_log_option": "megatron/global_vars.py",
    "barrier_with_L1_time": "megatron/backend/megatron.py",
    "tensorboard_dir": "megatron/global_vars.py",
    "tensorboard_log_interval": "megatron/training.py",
    "tensorboard_queue_size": "megatron/global_vars.py",
    "log_timers_to_tensorboard": "megatron/training.py",
    "log_batch_size_to_tensorboard": "megatron/logging_utils.py",
    "log_learning_rate_to_tensorboard": "megatron/logging_utils.py",
    "log_loss_scale_to_tensorboard": "megatron/logging_utils.py",
    "log_validation_ppl_to_tensorboard": "megatron/logging_utils.py",
    "log_memory_to_tensorboard": "megatron/logging_utils.py",
    "log_world_size_to_tensorboard": "megatron/logging_utils.py",
    # DeepSpeed
    "deepspeed": "megatron/backend/__init__.py",
    "deepspeed_config": "megatron/ds/config.py",
    "deepscale": "megatron/arguments.py",  # alias of --deepspeed
    "deepscale_config": "megatron/ds/config.py",
    "deepspeed_mpi": "megatron/arguments.py",  # checked against the launcher's MPI environment
    "zero_stage": "megatron/ds/config.py",
    "zero_reduce_scatter": "megatron/ds/config.py",
    "zero_contigious_gradients": "megatron/ds/config.py",
    "zero_reduce_bucket_size": "megatron/ds/config.py",
    "zero_allgather_bucket_size": "megatron/ds/config.py",
    "remote_device": "megatron/ds/config.py",
    "use_pin_memory": "megatron/ds/config.py",
    "deepspeed_activation_checkpointing": "megatron/ds/engine.py",
    "partition_activations": "megatron/ds/engine.py",
    "contigious_checkpointing": "megatron/ds/engine.py",
    "checkpoint_in_cpu": "megatron/ds/engine.py",
    "synchronize_each_layer": "megatron/ds/engine.py",
    "profile_backward": "megatron/ds/engine.py",
    "no_pipeline_parallel": "megatron/backend/deepspeed.py",
    # inference (tools/generate_samples_gpt.py, tools/run_text_generation_server.py)
    "max_tokens_to_oom": "tools/run_text_generation_server.py",
    "temperature": "tools/generate_samples_gpt.py",
    "greedy": "tools/generate_samples_gpt.py",
    "top_p": "tools/generate_samples_gpt.py",
    "top_k": "tools/generate_samples_gpt.py",
    "out_seq_length": "tools/generate_samples_gpt.py",
    "sample_input_file": "tools/generate_samples_gpt.py",
    "sample_output_file": "tools/generate_samples_gpt.py",
    "num_samples": "tools/generate_samples_gpt.py",
    "recompute": "tools/generate_samples_gpt.py",
    "host": "tools/run_text_generation_server.py",
    "port": "tools/run_text_generation_server.py",
    "max_tokens_to_generate": "tools/run_text_generation_server.py",
    "max_prompts": "tools/run_text_generation_server.py",
    "max_request_bytes": "tools/run_text_generation_server.py",
    "request_timeout": "tools/run_text_generation_server.py",
    "allow_random_weights": "tools/run_text_generation_server.py",
    # tasks/main.py
    "task": "tasks/main.py",
    "valid_data": "tasks/zeroshot_gpt/evaluate.py",
    "overlapping_eval": "tasks/zeroshot_gpt/evaluate.py",
    "strict_lambada": "tasks/zeroshot_gpt/evaluate.py",
    # finetuning (tasks/main.py --task MNLI|QQP|RACE; the zero-shot tasks refuse them in tasks/main.py)
    "epochs": "tasks/finetune_utils.py",
    "pretrained_checkpoint": "tasks/finetune_utils.py",
    "train_data": "tasks/finetune_utils.py",
    "keep_last": "tasks/finetune_utils.py",
    # tasks/eval_harness/evaluate.py (lm-eval harness)
    "task_list": "tasks/eval_harness/evaluate.py",
    "results_path": "tasks/eval_harness/evaluate.py",
    "include_path": "tasks/eval_harness/evaluate.py",
    "num_fewshot": "tasks/eval_harness/evaluate.py",
    "limit": "tasks/eval_harness/evaluate.py",
    "bootstrap_iters": "tasks/eval_harness/evaluate.py",
    "adaptive_seq_len": "tasks/eval_harness/evaluate.py",
    "eval_fp32": "tasks/eval_harness/evaluate.py",
    "intermed_results": "tasks/eval_harness/evaluate.py",
    "micro_bs_multiplier": "tasks/eval_harness/evaluate.py",
    "max_gen_toks": "tasks/eval_harness/evaluate.py",
    # mixture of experts (megatron/moe_arguments.py checks them)
    "moe_per_layer_logging": "megatron/training.py",
    "expert_tensor_parallel_size": "megatron/moe_arguments.py",  # expert grid; refusals checked there
}

# In Megatron these only choose a kernel or a communication pattern; the numbers are the same. We have one variant.
SAME_RESULT_VARIANTS: Dict[str, str] = {
    "no_persist_layer_norm": "picks apex's non-persistent LayerNorm kernel; this build's LayerNorm is torch's, or on "
                             "CUDA the Triton one (megatron/fused_kernels/norms.py) for every hidden size",
    "scatter_gather_tensors_in_pipeline": "pipeline p2p always sends whole activations (what the --no- form asks)",
    "inference_batch_times_seqlen_threshold": "generation sends the whole batch through the pipeline stages at "
                                              "once; micro-batching it gives the same tokens",
    "moe_grouped_gemm": "the experts always run as one batched GEMM per projection (megatron/model/moe.py)",
    "moe_use_legacy_grouped_gemm": "one expert implementation (batched GEMM); legacy or TE grouped GEMM alike",
    "moe_permute_fusion": "picks TE's fused permutation kernel; the permutation is the same",
    "moe_router_fusion": "picks TE's fused top-k/aux-loss kernels; the routing is the same",
    "moe_shared_expert_overlap": "overlaps the shared expert with dispatch on GPU; the shared expert's output is the "
                                 "same (only the order of gradient additions differs)",
}

# dest -> (default, why it is refused when set to anything else). Implement a flag and move it to RUNTIME_SETTINGS.
REFUSED: Dict[str, Tuple[Any, str]] = {
    "standalone_embedding_stage": (False, "is not implemented (the embedding shares the first pipeline stage)"),
    "use_ring_exchange_p2p": (False, "needs a custom PyTorch build (torch.distributed.ring_exchange); not supported"),
    "log_optimizer_states_to_tensorboard": (False, "is not implemented"),
    "sample_rate": (1.0, "is not implemented (it subsamples BERT/T5 data in Megatron)"),
    # mixture of experts: Megatron-LM flags this build does not implement
    "moe_extended_tp": (False, "is deprecated in Megatron-LM and not implemented"),
    "moe_use_upcycling": (False, "(dense -> MoE upcycling) is not implemented"),
    "moe_layer_recompute": (False, "is not implemented (use --recompute-granularity full)"),
    "moe_router_num_groups": (None, "(group-limited routing) is not implemented"),
    "moe_router_group_topk": (None, "(group-limited routing) is not implemented"),
    "moe_router_enable_expert_bias": (False, "(aux-loss-free expert bias) is not implemented"),
    "moe_router_bias_update_rate": (1e-3, "(aux-loss-free expert bias) is not implemented"),
    "moe_router_force_load_balancing": (False, "(random benchmark routing) is not implemented"),
    "moe_router_padding_for_fp8": (False, "is an FP8 setting; FP8 is not supported"),
    "moe_input_jitter_eps": (None, "(input jitter) is not implemented"),
    "moe_enable_deepep": (False, "(DeepEP) needs CUDA; not supported"),
    "moe_deepep_num_sms": (20, "(DeepEP) needs CUDA; not supported"),
    "overlap_moe_expert_parallel_comm": (False, "needs expert parallelism on GPUs; not supported"),
    "delay_wgrad_compute": (False, "is not implemented"),
    "moe_upcycling_granularity": (1, "(upcycling) is not implemented"),
    "moe_pad_experts_for_cuda_graph_inference": (False, "is a CUDA-graph setting; not supported"),
}

# dest -> (model families that read it, default). The entry script's family comes from its args_defaults
# ("model_family", default "gpt"); pretrain_bert.py is "bert" (it reads --bert-no-binary-head,
# --mask-prob, --short-seq-prob); pretrain_t5.py is "t5" (--decoder-seq-length, --encoder/--decoder-num-layers,
# --mask-prob, --short-seq-prob); the other entry scripts are GPT.
FAMILY_ONLY: Dict[str, Tuple[Tuple[str, ...], Any]] = {
    "bert_binary_head": (("bert",), True),
    "mask_prob": (("bert", "t5"), 0.15),
    "short_seq_prob": (("bert", "t5"), 0.1),
    "decoder_seq_length": (("t5",), None),
    "decoder_num_layers": (("t5",), None),
    "pipeline_model_parallel_split_rank": (("t5",), None),
}

# Attributes validate_args / start-up set that are not flags (never parser destinations; listed so that a flag
# with one of these names is noticed).
DERIVED_ATTRIBUTES = frozenset({
    "data_parallel_size", "transformer_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "params_dtype", "padded_vocab_size", "consumed_train_samples", "consumed_valid_samples", "iteration",
    "model_family",
})


class UnsupportedFlagError(ArgumentError):
    """A flag that parses but is not implemented here (one line naming it)."""


def refuse_unimplemented(args: argparse.Namespace, flags: Mapping[str, Tuple[str, Any]],
                         missing_config_dests: Iterable[str] = ()) -> None:
    """Raise one line naming the first flag set to a non-default value that this build does not implement.

    `flags`: dest -> (option string, parser default) of the core parser; `missing_config_dests`: the sources of
    config fields the model's config class does not declare.
    """
    def name(dest: str) -> str:
        return flags[dest][0] if dest in flags else "--" + dest.replace("_", "-")

    for dest, (default, why) in REFUSED.items():
        if hasattr(args, dest) and getattr(args, dest) != default:
            raise UnsupportedFlagError(f"{name(dest)} {why}; drop it")
    family = getattr(args, "model_family", "gpt")
    for dest, (families, default) in FAMILY_ONLY.items():
        if family not in families and hasattr(args, dest) and getattr(args, dest) != default:
            raise UnsupportedFlagError(f"{name(dest)} is a {'/'.join(f.upper() for f in families)} setting that this "
                                       f"{family.upper()} entry point does not use: drop it (an entry point that "
                                       f"reads it passes args_defaults={{'model_family': '{families[0]}'}})")
    if family != "t5" and getattr(args, "encoder_num_layers", None) not in (None, getattr(args, "num_layers", None)):
        raise UnsupportedFlagError(f"--encoder-num-layers is a T5 setting; this {family.upper()} entry point uses "
                                   "--num-layers: drop it")
    for dest in missing_config_dests:
        if dest in flags and getattr(args, dest, flags[dest][1]) != flags[dest][1]:
            raise UnsupportedFlagError(f"{name(dest)} is not implemented by this model (no config field reads it); "
                                       "drop it")
