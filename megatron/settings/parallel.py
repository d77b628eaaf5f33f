"""Mixed precision and distributed layout settings (--help groups "mixed precision" and "distributed")."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, ClassVar, Optional

from megatron.settings.declare import ConfigField, extra_flag, setting


def _params_dtype(args: argparse.Namespace) -> Any:
    import torch  # lazily: the flag layer is imported by the preprocessing tools, which never load torch
    return getattr(args, "params_dtype", torch.float)  # filled by validate_args from --fp16/--bf16


def _use_cpu_initialization(args: argparse.Namespace) -> Any:
    import torch  # lazily: the flag layer is imported by the preprocessing tools, which never load torch
    return bool(args.use_cpu_initialization) or not torch.cuda.is_available()


def _virtual_pipeline_model_parallel_size(args: argparse.Namespace) -> Any:
    return args.virtual_pipeline_model_parallel_size  # computed by validate_args from the layers per virtual stage


@dataclasses.dataclass
class MixedPrecisionSettings:
    """--help group "mixed precision"."""

    TITLE: ClassVar[str] = "mixed precision"
    fp16: bool = setting("--fp16", optimizer_config=True, default=False, help="fp16 mixed precision.", config=(ConfigField("params_dtype",
        compute=_params_dtype), ConfigField()))
    bf16: bool = setting("--bf16", optimizer_config=True, default=False, help="bf16 mixed precision.", config=True, feeds=("params_dtype",))
    loss_scale: Optional[float] = setting("--loss-scale", optimizer_config=True,
        help="Static loss scale (power of 2); default: dynamic loss scaling.",
        read_by="megatron/optimizer/optimizer_config.py")
    initial_loss_scale: float = setting("--initial-loss-scale", optimizer_config=True, default=4294967296, help="Initial dynamic loss scale.",
        read_by="megatron/optimizer/optimizer_config.py")
    min_loss_scale: float = setting("--min-loss-scale", optimizer_config=True, default=1.0, help="Minimum dynamic loss scale.",
        read_by="megatron/optimizer/optimizer_config.py")
    loss_scale_window: float = setting("--loss-scale-window", optimizer_config=True, default=1000, help="Iterations between scale increases.",
        read_by="megatron/optimizer/optimizer_config.py")
    hysteresis: int = setting("--hysteresis", optimizer_config=True, default=2, help="Overflows tolerated before decreasing the scale.",
        read_by="megatron/optimizer/optimizer_config.py")
    fp32_residual_connection: bool = setting("--fp32-residual-connection", default=False,
        help="Keep the residual stream in fp32.", config=True)
    apply_query_key_layer_scaling: bool = setting("--apply-query-key-layer-scaling", default=False,
        also=(extra_flag("--no-query-key-layer-scaling", action="store_false",
                         help="Megatron-DeepSpeed spelling: no query-key layer scaling."),),
        help="Scale Q*K^T by 1/layer-number (fp16 range safety).", config=True)
    attention_softmax_in_fp32: bool = setting("--attention-softmax-in-fp32", default=False,
        help="Attention softmax in fp32.", config=True)
    accumulate_allreduce_grads_in_fp32: bool = setting("--accumulate-allreduce-grads-in-fp32", default=False,
        help="Accumulate and all-reduce gradients in fp32.", read_by="megatron/model_setup.py")
    fp16_lm_cross_entropy: bool = setting("--fp16-lm-cross-entropy", default=False,
        help="LM cross entropy in fp16 (unfused).", read_by="pretrain_gpt.py")


@dataclasses.dataclass
class DistributedSettings:
    """--help group "distributed"."""

    TITLE: ClassVar[str] = "distributed"
    tensor_model_parallel_size: int = setting("--tensor-model-parallel-size", default=1,
        help="Tensor model parallel size.", config=True)
    pipeline_model_parallel_size: int = setting("--pipeline-model-parallel-size", default=1,
        help="Pipeline model parallel size.", config=True)
    context_parallel_size: int = setting("--context-parallel-size", default=1,
        help="Context parallel size: the sequence is split over this many ranks (ring attention; GPT).", config=True)
    cp_comm_type: str = setting("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a"],
        help="Context-parallel attention: p2p (ring of K/V), all_gather (of K/V) or a2a (DeepSpeed-Ulysses).",
        config=True)
    pipeline_model_parallel_split_rank: Optional[int] = setting("--pipeline-model-parallel-split-rank",
        help="Rank where the encoder ends and the decoder starts (T5).", families=("t5",))
    model_parallel_size: Optional[int] = setting("--model-parallel-size",
        help="Deprecated: use --tensor-model-parallel-size.", read_by="megatron/arguments.py")
    num_layers_per_virtual_pipeline_stage: Optional[int] = setting("--num-layers-per-virtual-pipeline-stage",
        help="Layers per virtual pipeline stage (interleaved schedule).",
        config=ConfigField("virtual_pipeline_model_parallel_size", compute=_virtual_pipeline_model_parallel_size))
    distributed_backend: Optional[str] = setting("--distributed-backend", choices=["nccl", "gloo"],
        help="torch.distributed backend (default: nccl with CUDA, gloo without).", read_by="megatron/initialize.py")
    distributed_timeout_minutes: int = setting("--distributed-timeout-minutes", default=10,
        help="Timeout for torch.distributed collectives, in minutes.", read_by="megatron/initialize.py")
    DDP_impl: str = setting("--DDP-impl", default="local", choices=["local", "torch"],
        help="Data-parallel implementation.", read_by="megatron/model_setup.py")
    use_contiguous_buffers_in_local_ddp: bool = setting("--no-contiguous-buffers-in-local-ddp", default=True,
        help="Do not use a contiguous gradient buffer in the local DDP.", read_by="megatron/model_setup.py")
    scatter_gather_tensors_in_pipeline: bool = setting("--no-scatter-gather-tensors-in-pipeline", default=True,
        help="Send whole activations between pipeline stages (no TP scatter/gather).",
        variant="pipeline p2p always sends whole activations (what the --no- form asks)")
    use_ring_exchange_p2p: bool = setting("--use-ring-exchange-p2p", default=False,
        help="Ring-exchange P2P (custom PyTorch builds).",
        refused="needs a custom PyTorch build (torch.distributed.ring_exchange); not supported")
    local_rank: Optional[int] = setting("--local_rank", "--local-rank", help="Local rank, passed by the launcher.",
        read_by="megatron/initialize.py")
    lazy_mpu_init: Optional[bool] = setting("--lazy-mpu-init", type=bool,
        help="Skip torch.distributed init; the caller initialises later.", read_by="megatron/initialize.py")
    use_cpu_initialization: Optional[bool] = setting("--use-cpu-initialization", action="store_true",
        help="Initialise full weights on CPU (TP shards then match TP=1 bitwise).",
        config=ConfigField(compute=_use_cpu_initialization))
    standalone_embedding_stage: bool = setting("--standalone-embedding-stage", default=False,
        help="Put the input embedding on its own pipeline stage.",
        refused="is not implemented (the embedding shares the first pipeline stage)")
    use_distributed_optimizer: bool = setting("--use-distributed-optimizer", optimizer_config=True, default=False,
        help="Shard optimizer state across data-parallel ranks (ZeRO-1).", read_by="megatron/model_setup.py")
    overlap_grad_reduce: bool = setting("--overlap-grad-reduce", default=False,
        help="Overlap gradient reduction with backward.", read_by="megatron/model_setup.py")
    overlap_param_gather: bool = setting("--overlap-param-gather", default=False,
        help="Overlap the distributed optimizer's parameter all-gather with forward.",
        read_by="megatron/model_setup.py")
    ddp_bucket_size: Optional[int] = setting("--ddp-bucket-size",
        help="Elements per gradient bucket of the local DDP with --overlap-grad-reduce (default 40M).",
        read_by="megatron/model_setup.py")
