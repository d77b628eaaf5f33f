"""Megatron-compatible command-line flags: `parse_args`, `validate_args`, `core_transformer_config_from_args`.

Flag names, groups and defaults follow Megatron-LM / Megatron-DeepSpeed so existing launch scripts work unchanged.
Extra flag groups (e.g. DeepSpeed's) are added through `extra_args_provider(parser) -> parser`.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron.cli_parser import FlagParser
from megatron.config_flags import config_kwargs_from_args, dests_without_config_field
from megatron.core.transformer_config import TransformerConfig, rope_scaling_problem
from megatron.errors import ArgumentError
from megatron.flag_registry import refuse_unimplemented
from megatron.launcher import detect_launcher_env
from megatron.moe_arguments import add_moe_args, validate_moe_args
from megatron.required_flags import TRAINING_RUN, check_required_flags

_FALLBACK_TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "PretrainedFromHF",
    "NullTokenizer",
)


def _tokenizer_types() -> List[str]:
    """The --tokenizer-type choices: whatever megatron.tokenizer supports (it imports without torch)."""
    try:
        from megatron.tokenizer.tokenizer import TOKENIZER_TYPES
    except ImportError:
        return list(_FALLBACK_TOKENIZER_TYPES)
    return list(TOKENIZER_TYPES)


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
    parser = FlagParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add_group in (
        _add_network_size_args,
        _add_regularization_args,
        _add_training_args,
        _add_initialization_args,
        _add_learning_rate_args,
        _add_checkpointing_args,
        _add_mixed_precision_args,
        _add_distributed_args,
        _add_validation_args,
        _add_data_args,
        _add_logging_args,
        _add_inference_args,
        add_moe_args,
    ):
        parser = add_group(parser)
    if extra_args_provider is not None:
        result = extra_args_provider(parser)
        parser = parser if result is None else result
    # Last, so a provider that adds DeepSpeed's flags itself (deepspeed.add_config_arguments) keeps its own.
    return _add_deepspeed_args(parser)


# --------------------------------------------------------------------------------------------------------------------
# Flag groups
# --------------------------------------------------------------------------------------------------------------------


def _add_network_size_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--encoder-num-layers", type=int, default=None, help="Number of encoder layers (T5).")
    g.add_argument("--decoder-num-layers", type=int, default=None, help="Number of decoder layers (T5).")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4 * hidden-size).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Projection size per head (default hidden-size // num-attention-heads).")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="Largest sequence length supported.")
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "alibi", "none", "absolute", "rotary"],
                   help="Position embedding: learned absolute (GPT-2), rotary (Llama), ALiBi linear biases (BLOOM), "
                        "or none; Megatron-DeepSpeed's names absolute/rotary are accepted.")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM 23.06 spelling of --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="No learned absolute position embedding (with rope: the rotary embedding only).")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's channels that RoPE rotates (0 < p <= 1).")
    g.add_argument("--rotary-base", type=float, default=10000.0,
                   help="RoPE base (theta): 10000 for Llama-2, 1e6 for Mistral v0.3, 500000 for Llama-3.")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="Linear position interpolation: RoPE rotates position p as p / factor (HF rope_type linear; "
                        "Megatron-LM parses an int, any positive number is accepted here).")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama-3.1 RoPE frequency scaling (HF rope_type llama3), as Megatron-LM.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="Llama-3.1 scaling factor with --use-rope-scaling (8 for Llama-3.1, 32 for Llama-3.2).")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="Llama-3.1 low_freq_factor with --use-rope-scaling (Megatron-LM hard-codes 1).")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="Llama-3.1 high_freq_factor with --use-rope-scaling (Megatron-LM hard-codes 4).")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="Llama-3.1 original context length with --use-rope-scaling (Megatron-LM hard-codes 8192).")
    g.add_argument("--normalization", type=str, default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="Normalization layer: LayerNorm (GPT-2/BERT) or RMSNorm (Llama).")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups K/V heads shared by the query heads.")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="Number of K/V head groups with --group-query-attention (default 1: multi-query).")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No biases in the linear layers (QKV, attention output, MLP).")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Keep the QKV bias even with --disable-bias-linear (Qwen-style).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocab so its size is divisible by this value (times TP size).")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", type=float, default=1e-5, dest="layernorm_epsilon",
                   help="Epsilon of the LayerNorm/RMSNorm layers.")
    g.add_argument("--apply-layernorm-1p", action="store_true", help="LayerNorm with (1 + weight) (zero-centered).")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="Residual connection after the layer norm (original BERT).")
    g.add_argument("--openai-gelu", action="store_true", help="OpenAI's tanh GeLU approximation.")
    g.add_argument("--squared-relu", action="store_true", help="Squared ReLU activation instead of GeLU.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU activation instead of GeLU.")
    g.add_argument("--glu-activation", type=str, default=None, choices=["geglu", "liglu", "reglu", "swiglu"],
                   help="Megatron-DeepSpeed's GLU activations: x1 * act(x2) over the two halves of a 2 * ffn "
                        "first projection (act = GeLU, identity, ReLU, SiLU).")
    g.add_argument("--embed-layernorm", action="store_true",
                   help="LayerNorm right after the word embeddings (BLOOM; Megatron-DeepSpeed's flag).")
    g.add_argument("--onnx-safe", type=bool, required=False, help="Workarounds for known ONNX exporter problems.")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="Disable BERT's binary (next-sentence) head.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output layer weights.")
    return parser


def _add_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-params-norm", action="store_true", help="Log the L2 norm of the parameters.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log the number of zeros in the gradient.")
    g.add_argument("--timing-log-level", type=int, default=0, choices=range(0, 3),
                   help="0: iteration time only; 1: coarse timers; 2: every timer.")
    g.add_argument("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time",
                   help="Do not barrier before level-1 timers (times then include load imbalance).")
    g.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"],
                   help="How timers are reported across ranks.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="Tensorboard logging interval.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="Tensorboard events queued before a flush to disk.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write timers to tensorboard.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true", help="Write batch size to tensorboard.")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
                   action="store_false", dest="log_learning_rate_to_tensorboard",
                   help="Do not write the learning rate to tensorboard.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard",
                   help="Do not write the loss scale to tensorboard.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Write validation perplexity to tensorboard.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory use to tensorboard.")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Write world size to tensorboard.")
    g.add_argument("--log-optimizer-states-to-tensorboard", action="store_true",
                   help="Write optimizer state statistics to tensorboard.")
    return parser


def _add_regularization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on transformer hidden states.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay (L2) coefficient.")
    g.add_argument("--start-weight-decay", type=float, default=None, help="Initial weight decay (incr. styles).")
    g.add_argument("--end-weight-decay", type=float, default=None, help="Final weight decay (incr. styles).")
    g.add_argument("--weight-decay-incr-style", type=str, default="constant",
                   choices=["constant", "linear", "cosine"], help="Weight decay increment function.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Clip gradients to this global L2 norm.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-08, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    return parser


def _add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Batch size per model instance (local).")
    g.add_argument("--batch-size", type=int, default=None, help="Deprecated: use --micro-batch-size.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Training batch size across all data-parallel ranks (default micro-batch-size * DP).")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="Batch-size ramp-up: <start batch size> <increment> <ramp-up samples>.")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Megatron-DeepSpeed: full activation recomputation (uniform method).")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Selective activation recomputation (attention core only).")
    g.add_argument("--recompute-granularity", type=str, default=None, choices=["full", "selective"],
                   help="Activation recomputation granularity.")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="Shard recomputation checkpoints across the tensor-parallel group.")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"],
                   help="Full recomputation: 'uniform' chunks or the first N layers per stage ('block').")
    g.add_argument("--recompute-num-layers", type=int, default=1, help="Layers per recomputation unit.")
    g.add_argument("--checkpoint-num-layers", type=int, default=None,
                   help="Megatron-DeepSpeed alias of --recompute-num-layers.")
    g.add_argument("--train-iters", type=int, default=None, help="Total training iterations.")
    g.add_argument("--train-samples", type=int, default=None, help="Total training samples.")
    g.add_argument("--log-interval", type=int, default=100, help="Report loss and timing every N iterations.")
    g.add_argument("--log-args", action="store_true",
                   help="Print Megatron's full argument dump on a terminal too (a redirected log always has it; on a "
                        "terminal one summary line is printed instead).")
    g.add_argument("--exit-interval", type=int, default=None, help="Exit when iteration %% N == 0.")
    g.add_argument("--exit-duration-in-mins", type=int, default=None, help="Exit after this many minutes.")
    g.add_argument("--exit-signal-handler", action="store_true", help="Save and exit on SIGTERM.")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   dest="check_for_nan_in_loss_and_grad",
                   help="Skip (and count) an iteration whose loss or grad norm is not finite (default on).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="Do not check the loss and grad norm for nan/inf before the optimizer step.")
    g.add_argument("--max-skipped-iterations", type=int, default=10,
                   help="Stop with an error after this many consecutive skipped non-finite iterations (0: never).")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="Tensorboard log directory.")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="Do not fuse scaling, masking and softmax.")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="Do not fuse bias add and GeLU.")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="Do not fuse bias add and SwiGLU (the Triton kernel on CUDA).")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="Do not fuse bias add, dropout and residual add.")
    g.add_argument("--use-flash-attn", action="store_true", help="FlashAttention (CUDA only).")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"], help="Optimizer.")
    g.add_argument("--dataloader-type", type=str, default=None, choices=["single", "cyclic"],
                   help="Data sampler ('single' by default).")
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce",
                   help="Do not overlap the tensor-parallel all-reduce with the weight-gradient computation.")
    g.add_argument("--no-persist-layer-norm", action="store_true", help="Do not use persistent layer-norm kernels.")
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs TP > 1).")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="Do not fuse weight-gradient accumulation (needs a CUDA extension).")
    g.add_argument("--deterministic-mode", action="store_true", help="Choose deterministic algorithms.")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="Call torch.cuda.empty_cache() each iteration (0 off, 1 moderate, 2 aggressive).")
    g.add_argument("--skip-train", action="store_true", help="Skip training; only evaluate.")
    return parser


def _add_initialization_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (python, numpy, torch).")
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="Different initial weights on each data-parallel rank.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight initialiser.")
    g.add_argument("--init-method-xavier-uniform", action="store_true", help="Xavier uniform initialisation.")
    return parser


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"], help="Learning rate decay.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Iterations to decay over (default train-iters).")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples to decay over (default train-samples).")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warm-up as a fraction of decay length.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Warm-up iterations.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Warm-up samples.")
    g.add_argument("--warmup", type=int, default=None, help="Deprecated: use --lr-warmup-fraction.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor.")
    g.add_argument("--override-opt_param-scheduler", "--override-lr-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="Take scheduler values from the flags, ignoring the checkpoint.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-lr-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="Take scheduler values from the checkpoint, ignoring the flags.")
    return parser


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    g.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save optimizer state.")
    g.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save RNG state.")
    g.add_argument("--load", type=str, default=None, help="Directory containing a checkpoint to load.")
    g.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load RNG state.")
    g.add_argument("--finetune", action="store_true",
                   help="Load model weights only; reset iteration count, optimizer and RNG.")
    g.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                   help="Skip weight initialisation (weights come from a checkpoint).")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take model arguments from the checkpoint in --load.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Exit if --load is set but no checkpoint is found there.")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="Load checkpoint files with full unpickling (can run code in them); default: weights-only "
                        "with an allow-list (also MEGATRON_TRUST_CHECKPOINT=1).")
    g.add_argument("--no-checkpoint-fallback", action="store_true",
                   help="A damaged latest checkpoint is an error (default: load the newest iteration that verifies).")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None,
                   help="After a save verifies, delete all but the N newest checkpoint iterations.")
    g.add_argument("--ckpt-format", type=str, default="torch", choices=["torch", "torch_dist"],
                   help="Checkpoint format to save (and expect on load): torch = per-rank model_optim_rng.pt files "
                        "(ours, the default; Megatron-LM's default is torch_dist), torch_dist = one "
                        "torch.distributed.checkpoint folder with Megatron Core names, any layout can load it.")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Load whichever format the checkpoint folder holds (torch, Megatron Core torch, torch_dist).")
    return parser


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true", help="fp16 mixed precision.")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (power of 2); default: dynamic loss scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000, help="Iterations between scale increases.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before decreasing the scale.")
    g.add_argument("--fp32-residual-connection", action="store_true", help="Keep the residual stream in fp32.")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true", dest="apply_query_key_layer_scaling",
                   help="Scale Q*K^T by 1/layer-number (fp16 range safety).")
    g.add_argument("--no-query-key-layer-scaling", action="store_false", dest="apply_query_key_layer_scaling",
                   help="Megatron-DeepSpeed spelling: no query-key layer scaling.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", help="Attention softmax in fp32.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate and all-reduce gradients in fp32.")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true", help="LM cross entropy in fp16 (unfused).")
    return parser


def _add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor model parallel size.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline model parallel size.")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context parallel size: the sequence is split over this many ranks (ring attention; GPT).")
    g.add_argument("--cp-comm-type", type=str, default="p2p", choices=["p2p", "all_gather", "a2a"],
                   help="Context-parallel attention: p2p (ring of K/V), all_gather (of K/V) or a2a (DeepSpeed-Ulysses).")
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None,
                   help="Rank where the encoder ends and the decoder starts (T5).")
    g.add_argument("--model-parallel-size", type=int, default=None,
                   help="Deprecated: use --tensor-model-parallel-size.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual pipeline stage (interleaved schedule).")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="torch.distributed backend (default: nccl with CUDA, gloo without).")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout for torch.distributed collectives, in minutes.")
    g.add_argument("--DDP-impl", default="local", choices=["local", "torch"],
                   help="Data-parallel implementation.")
    g.add_argument("--no-contiguous-buffers-in-local-ddp", action="store_false",
                   dest="use_contiguous_buffers_in_local_ddp",
                   help="Do not use a contiguous gradient buffer in the local DDP.")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                   dest="scatter_gather_tensors_in_pipeline",
                   help="Send whole activations between pipeline stages (no TP scatter/gather).")
    g.add_argument("--use-ring-exchange-p2p", action="store_true", help="Ring-exchange P2P (custom PyTorch builds).")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, dest="local_rank",
                   help="Local rank, passed by the launcher.")
    g.add_argument("--lazy-mpu-init", type=bool, required=False,
                   help="Skip torch.distributed init; the caller initialises later.")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None,
                   help="Initialise full weights on CPU (TP shards then match TP=1 bitwise).")
    g.add_argument("--standalone-embedding-stage", action="store_true",
                   help="Put the input embedding on its own pipeline stage.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state across data-parallel ranks (ZeRO-1).")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap gradient reduction with backward.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Overlap the distributed optimizer's parameter all-gather with forward.")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Elements per gradient bucket of the local DDP with --overlap-grad-reduce (default 40M).")
    return parser


def _add_validation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="validation")
    g.add_argument("--eval-iters", type=int, default=100, help="Iterations per validation/test evaluation.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between validation runs.")
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefix, or weighted prefixes: 'w1 prefix1 w2 prefix2 ...'.")
    g.add_argument("--split", type=str, default="969, 30, 1", help="Train/valid/test split, e.g. '949,50,1'.")
    g.add_argument("--train-data-path", nargs="*", default=None, help="Separate training data prefix(es).")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="Separate validation data prefix(es).")
    g.add_argument("--test-data-path", nargs="*", default=None, help="Separate test data prefix(es).")
    g.add_argument("--data-cache-path", type=str, default=None, help="Where to store index-mapping caches.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size (NullTokenizer / no vocab file).")
    g.add_argument("--vocab-file", type=str, default=None, help="Vocabulary file.")
    g.add_argument("--merge-file", type=str, default=None, help="BPE merges file.")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="Extra sentinel tokens (T5).")
    g.add_argument("--seq-length", type=int, default=None, help="Maximum sequence length.")
    g.add_argument("--encoder-seq-length", type=int, default=None, help="Encoder sequence length (T5/BERT).")
    g.add_argument("--decoder-seq-length", type=int, default=None, help="Decoder sequence length (T5).")
    g.add_argument("--sample-rate", type=float, default=1.0, help="Fraction of data to use (0, 1].")
    g.add_argument("--mask-prob", type=float, default=0.15, help="Masking probability (BERT/T5).")
    g.add_argument("--short-seq-prob", type=float, default=0.1, help="Probability of a short sequence (BERT).")
    g.add_argument("--mmap-warmup", action="store_true", help="Warm up the memory-mapped dataset files.")
    g.add_argument("--num-workers", type=int, default=2, help="Dataloader worker processes.")
    g.add_argument("--tokenizer-type", type=str, default=None, choices=_tokenizer_types(), help="Tokenizer.")
    g.add_argument("--tokenizer-model", type=str, default=None, help="SentencePiece model file.")
    g.add_argument("--tokenizer-name-or-path", type=str, default=None,
                   help="Hugging Face tokenizer name or directory (HFTokenizer).")
    g.add_argument("--data-impl", "--dataset-impl", type=str, default="infer", dest="data_impl",
                   choices=["mmap", "infer", "lazy", "cached"], help="Indexed dataset implementation.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each EOD.")
    g.add_argument("--reset-attention-mask", action="store_true", help="Do not attend across EOD tokens.")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    return parser


def _int_or_sci(text: str) -> int:
    """An integer flag value that also accepts scientific notation (Megatron-DeepSpeed scripts pass 5e8)."""
    value = float(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(value)


def _add_deepspeed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's own flags (deepspeed.add_config_arguments) and Megatron-DeepSpeed's ZeRO/checkpointing flags.

    Flags the parser already has (an extra_args_provider that called deepspeed.add_config_arguments) are skipped.
    """
    group = parser.add_argument_group(title="DeepSpeed", description="DeepSpeed configurations")

    class _Group:
        @staticmethod
        def add_argument(*names: str, **kwargs: Any) -> None:
            if not any(name in parser._option_string_actions for name in names):
                group.add_argument(*names, **kwargs)

    g = _Group()
    g.add_argument("--deepspeed", action="store_true",
                   help="Enable DeepSpeed (ZeRO, DeepSpeed pipeline engine); needs --deepspeed_config.")
    g.add_argument("--deepspeed_config", type=str, default=None, help="DeepSpeed json configuration file.")
    g.add_argument("--deepscale", action="store_true", help="Deprecated enable DeepSpeed (same as --deepspeed).")
    g.add_argument("--deepscale_config", type=str, default=None,
                   help="Deprecated DeepSpeed json configuration file (same as --deepspeed_config).")
    g.add_argument("--deepspeed_mpi", action="store_true",
                   help="Run via MPI: take rank and world size from the MPI (OpenMPI) environment.")
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default: zero_optimization.stage of the DeepSpeed config, else 0).")
    g.add_argument("--zero-reduce-scatter", action="store_true", default=None,
                   help="Use reduce-scatter for gradient reduction (zero_optimization.reduce_scatter).")
    g.add_argument("--zero-contigious-gradients", action="store_true", default=None,
                   help="Copy gradients into a contiguous buffer (zero_optimization.contiguous_gradients).")
    g.add_argument("--zero-reduce-bucket-size", type=_int_or_sci, default=None,
                   help="Elements reduced at a time (zero_optimization.reduce_bucket_size).")
    g.add_argument("--zero-allgather-bucket-size", type=_int_or_sci, default=None,
                   help="Elements all-gathered at a time (zero_optimization.allgather_bucket_size).")
    g.add_argument("--remote-device", type=str, default="none", choices=["none", "cpu", "nvme"],
                   help="ZeRO-3: keep parameters on this device (zero_optimization.offload_param).")
    g.add_argument("--use-pin-memory", action="store_true", help="ZeRO-3 parameter offload: pin CPU memory.")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Recompute activations with deepspeed.checkpointing (with --checkpoint-activations).")
    g.add_argument("--partition-activations", action="store_true",
                   help="DeepSpeed activation checkpointing: partition checkpoints across tensor-parallel ranks.")
    g.add_argument("--contigious-checkpointing", action="store_true",
                   help="DeepSpeed activation checkpointing: contiguous checkpoint buffers (needs "
                        "--partition-activations).")
    g.add_argument("--checkpoint-in-cpu", action="store_true",
                   help="DeepSpeed activation checkpointing: keep checkpoints in CPU memory.")
    g.add_argument("--synchronize-each-layer", action="store_true",
                   help="DeepSpeed activation checkpointing: synchronize at the start and end of each layer.")
    g.add_argument("--profile-backward", action="store_true",
                   help="DeepSpeed activation checkpointing: time the forward and backward of each layer.")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Under --deepspeed: use the plain GPT model, not DeepSpeed's pipeline engine (PP=1).")
    return parser


def _add_inference_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(title="inference")
    g.add_argument("--inference-batch-times-seqlen-threshold", type=int, default=512,
                   help="Pipeline the forward pass during inference above this batch * seq-length.")
    g.add_argument("--max-tokens-to-oom", type=int, default=12000, help="Refuse generation above this many tokens.")
    return parser


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------


def _print0(args: argparse.Namespace, message: str) -> None:
    if getattr(args, "rank", 0) == 0:
        print(message, flush=True)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


def validate_args(args: argparse.Namespace, defaults: Optional[Dict[str, Any]] = None) -> argparse.Namespace:
    """Check flag combinations (one-line errors naming the flags) and fill derived values, as Megatron does."""
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
    _validate_deepspeed(args)
    _validate_precision(args)
    _validate_training_length(args, training_run)
    _validate_model_shape(args)
    _validate_architecture(args)
    validate_moe_args(args)
    _validate_recompute(args)
    _validate_misc(args)
    _validate_context_parallel(args, training_run)

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
    """Flags that parse but are not implemented: one line naming the flag (megatron/flag_registry.py)."""
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


def _validate_deepspeed(args: argparse.Namespace) -> None:
    """--deepspeed: reconcile the DeepSpeed JSON config with the flags (megatron.ds.config; no deepspeed import)."""
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
    from megatron.ds.config import resolve_deepspeed_config

    resolve_deepspeed_config(args)
    if args.deepspeed_activation_checkpointing and not (args.checkpoint_activations
                                                       or args.recompute_granularity == "full"):
        _print0(args, "notice: --deepspeed-activation-checkpointing takes effect with --checkpoint-activations "
                      "(full recomputation); without it no activations are recomputed")
    if getattr(args, "no_save_optim", False):
        _print0(args, "notice: with --deepspeed, --no-save-optim leaves out only the LR scheduler state: DeepSpeed "
                      "always writes its optimizer (ZeRO) state files")


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
        import fused_weight_gradient_mlp_cuda  # noqa: F401
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
    problem = rope_scaling_problem(args)
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
        freq = getattr(args, "moe_layer_freq", 1)
        _require(not getattr(args, "num_experts", None) or freq == 1 or (isinstance(freq, list) and all(freq)),
                 "--ckpt-format torch_dist stacks layers, so it needs every layer MoE or none (--moe-layer-freq 1): "
                 "save with --ckpt-format torch")
        _require(not getattr(args, "deepspeed", False), "--ckpt-format torch_dist cannot be used with --deepspeed "
                 "(DeepSpeed writes its own checkpoints): drop one of the two flags")
    _require(args.max_skipped_iterations >= 0,
             f"--max-skipped-iterations must be >= 0 (got {args.max_skipped_iterations}; 0 means no limit)")


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
    """Build the `TransformerConfig` the model layers take, from validated args (explicit table: config_flags.py)."""
    return TransformerConfig(**config_kwargs_from_args(TransformerConfig, args))


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
    _require(seq % (2 * cp) == 0, f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size "
                                  f"({2 * cp}): each context-parallel rank holds 2 of {2 * cp} equal chunks")
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
