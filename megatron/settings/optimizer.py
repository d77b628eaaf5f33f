"""Optimizer and learning-rate settings (--help groups "regularization" and "learning rate")."""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from megatron.settings.declare import setting


@dataclasses.dataclass
class RegularizationSettings:
    """--help group "regularization"."""

    TITLE: ClassVar[str] = "regularization"
    attention_dropout: float = setting("--attention-dropout", default=0.1, help="Dropout on attention probabilities.",
        config=True)
    hidden_dropout: float = setting("--hidden-dropout", default=0.1, help="Dropout on transformer hidden states.",
        config=True)
    weight_decay: float = setting("--weight-decay", optimizer_config=True, default=0.01, help="Weight decay (L2) coefficient.",
        read_by="megatron/learning_rates.py")
    start_weight_decay: Optional[float] = setting("--start-weight-decay", help="Initial weight decay (incr. styles).",
        read_by="megatron/model_setup.py")
    end_weight_decay: Optional[float] = setting("--end-weight-decay", help="Final weight decay (incr. styles).",
        read_by="megatron/model_setup.py")
    weight_decay_incr_style: str = setting("--weight-decay-incr-style", default="constant",
        choices=["constant", "linear", "cosine"], help="Weight decay increment function.",
        read_by="megatron/model_setup.py")
    clip_grad: float = setting("--clip-grad", optimizer_config=True, default=1.0, help="Clip gradients to this global L2 norm.",
        read_by="megatron/optimizer/__init__.py")
    adam_beta1: float = setting("--adam-beta1", optimizer_config=True, default=0.9, help="Adam beta1.",
        read_by="megatron/optimizer/__init__.py")
    adam_beta2: float = setting("--adam-beta2", optimizer_config=True, default=0.999, help="Adam beta2.",
        read_by="megatron/optimizer/__init__.py")
    adam_eps: float = setting("--adam-eps", optimizer_config=True, default=1e-08, help="Adam epsilon.",
        read_by="megatron/optimizer/__init__.py")
    sgd_momentum: float = setting("--sgd-momentum", optimizer_config=True, default=0.9, help="SGD momentum.",
        read_by="megatron/optimizer/__init__.py")
    muon_momentum: float = setting("--muon-momentum", optimizer_config=True, default=0.9,
        help="Momentum factor for Muon optimizer", read_by="megatron/optimizer/__init__.py")
    muon_split_qkv: bool = setting("--muon-no-split-qkv", optimizer_config=True, default=True,
        help="Orthogonalise the fused QKV weight whole instead of per Q, K, V part", read_by="megatron/optimizer/__init__.py")
    muon_use_nesterov: bool = setting("--muon-use-nesterov", optimizer_config=True, default=False,
        action="store_true", help="Whether to use Nesterov-style momentum in the internal SGD", read_by="megatron/optimizer/__init__.py")
    muon_scale_mode: str = setting("--muon-scale-mode", optimizer_config=True, default="spectral",
        choices=["spectral", "unit_rms_norm", "shape_scaling"], help="Scale mode for Muon optimizer", read_by="megatron/optimizer/__init__.py")
    muon_fp32_matmul_prec: str = setting("--muon-fp32-matmul-prec", optimizer_config=True, default="medium",
        choices=["low", "medium", "high"], help="FP32 matmul precision for Newton-Schulz iteration (medium: bf16)", read_by="megatron/optimizer/__init__.py")
    muon_num_ns_steps: int = setting("--muon-num-ns-steps", optimizer_config=True, default=5,
        help="Number of Newton-Schulz steps for Muon optimizer", read_by="megatron/optimizer/__init__.py")
    muon_tp_mode: str = setting("--muon-tp-mode", optimizer_config=True, default="blockwise",
        choices=["blockwise", "duplicated", "distributed"],
        help="How to perform NS calculation for tensor model parallel weights", read_by="megatron/optimizer/__init__.py")
    muon_extra_scale_factor: float = setting("--muon-extra-scale-factor", optimizer_config=True, default=1.0,
        help="Additional scale factor for the muon update", read_by="megatron/optimizer/__init__.py")


@dataclasses.dataclass
class LearningRateSettings:
    """--help group "learning rate"."""

    TITLE: ClassVar[str] = "learning rate"
    lr: Optional[float] = setting("--lr", optimizer_config=True, help="Peak learning rate.", read_by="megatron/learning_rates.py")
    lr_decay_style: str = setting("--lr-decay-style", default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="Learning rate decay (WSD: warmup-stable-decay).", read_by="megatron/learning_rates.py")
    lr_wsd_decay_style: str = setting("--lr-wsd-decay-style", default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"], help="Decay style of WSD's annealing phase.",
        read_by="megatron/learning_rates.py")
    lr_wsd_decay_iters: Optional[int] = setting("--lr-wsd-decay-iters",
        help="Iterations of WSD's annealing phase (the last ones of the decay span).", read_by="megatron/model_setup.py")
    lr_wsd_decay_samples: Optional[int] = setting("--lr-wsd-decay-samples",
        help="Samples of WSD's annealing phase (the last ones of the decay span).", read_by="megatron/model_setup.py")
    lr_decay_iters: Optional[int] = setting("--lr-decay-iters", help="Iterations to decay over (default train-iters).",
        read_by="megatron/model_setup.py")
    lr_decay_samples: Optional[int] = setting("--lr-decay-samples",
        help="Samples to decay over (default train-samples).", read_by="megatron/model_setup.py")
    lr_warmup_fraction: Optional[float] = setting("--lr-warmup-fraction", help="Warm-up as a fraction of decay length.",
        read_by="megatron/model_setup.py")
    lr_warmup_iters: int = setting("--lr-warmup-iters", default=0, help="Warm-up iterations.",
        read_by="megatron/model_setup.py")
    lr_warmup_samples: int = setting("--lr-warmup-samples", default=0, help="Warm-up samples.",
        read_by="megatron/model_setup.py")
    warmup: Optional[int] = setting("--warmup", help="Deprecated: use --lr-warmup-fraction.",
        read_by="megatron/arguments.py")
    min_lr: float = setting("--min-lr", optimizer_config=True, default=0.0, help="Learning rate floor.", read_by="megatron/learning_rates.py")
    override_opt_param_scheduler: bool = setting("--override-opt_param-scheduler", "--override-lr-scheduler",
        default=False, help="Take scheduler values from the flags, ignoring the checkpoint.",
        read_by="megatron/learning_rates.py")
    use_checkpoint_opt_param_scheduler: bool = setting("--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-lr-scheduler", default=False,
        help="Take scheduler values from the checkpoint, ignoring the flags.", read_by="megatron/learning_rates.py")
