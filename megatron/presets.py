"""Named model presets, declared once: the example scripts' model shapes and launch defaults, the real sizes, and the
test suite's tiny models, used by tests, benchmarks and examples alike.

    from megatron.presets import get_preset
    get_preset("llama_tiny").argv()                   # ['--num-layers', '4', ..., '--seq-length', '256', ...]
    get_preset("llama2_7b").argv(seq_length=2048)     # SEQ_LENGTH overridden, as the example scripts allow
    python -m megatron.presets --write examples/presets    # regenerate the shell presets the example scripts source

A preset is a family's model flags (`model_args`, shell text with ``$SEQ_LENGTH`` where the sequence length goes when
`seq_length` gives its default) and the environment defaults an example script reads (`defaults`: MICRO_BATCH_SIZE,
LR, ...). The ones with ``example=True`` are written to examples/presets/NAME.sh (``FAMILY_MODEL_ARGS="..."`` and
``: "${VAR:=value}"`` lines, the `about` text as comments): tests/test_presets.py checks that the files there are
exactly what this module writes, so a preset changes here and nowhere else. The ``*_test`` presets are the tests'
tiny models (not example presets).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Preset:
    """One named model shape (see the module docstring)."""

    name: str
    family: str  # gpt, llama, bloom, bert, t5: the example scripts' FAMILY_MODEL_ARGS variable
    about: tuple[str, ...]
    model_args: tuple[str, ...]  # shell text, one line each in the generated file
    seq_length: Optional[int] = None  # the SEQ_LENGTH default where model_args say $SEQ_LENGTH
    defaults: dict = dataclasses.field(default_factory=dict)  # example scripts' environment defaults
    example: bool = True  # written to examples/presets/NAME.sh

    def argv(self, seq_length: Optional[int] = None) -> list[str]:
        """The model flags as a command line (`seq_length` replaces the default sequence length)."""
        text = " ".join(self.model_args)
        if "$SEQ_LENGTH" in text:
            text = text.replace("$SEQ_LENGTH", str(seq_length or self.seq_length))
        elif seq_length is not None:
            raise ValueError(f"preset {self.name} has a fixed sequence length: drop seq_length")
        return shlex.split(text)

    def value(self, flag: str, seq_length: Optional[int] = None) -> str:
        """The value `flag` (e.g. ``--hidden-size``) has in `argv`; KeyError when the preset does not set it."""
        argv = self.argv(seq_length)
        if flag not in argv:
            raise KeyError(f"preset {self.name} does not set {flag}")
        return argv[argv.index(flag) + 1]

    def shell(self) -> str:
        """The text of examples/presets/NAME.sh."""
        lines = [f"# {line}" for line in self.about]
        if self.seq_length is not None:
            lines.append(f': "${{SEQ_LENGTH:={self.seq_length}}}"')
        lines.append(f'{self.family.upper()}_MODEL_ARGS="' + " \\\n  ".join(self.model_args) + '"')
        lines += [f': "${{{key}:={value}}}"' for key, value in self.defaults.items()]
        return "\n".join(lines) + "\n"


def _gpt_oss_published_args(layers: int, experts: int) -> tuple:
    """The model flags gpt-oss-20b and gpt-oss-120b share (they differ in depth and expert count only)."""
    return (f"--num-layers {layers} --hidden-size 2880 --num-attention-heads 64 --kv-channels 64 "
            "--ffn-hidden-size 2880",
            "--group-query-attention --num-query-groups 8 --seq-length $SEQ_LENGTH "
            "--max-position-embeddings 131072",
            "--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 150000",
            "--rope-type yarn --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096 "
            "--no-yarn-correction-range-round-to-int --window-size 127,0 --window-attn-skip-freq 2",
            "--untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0",
            "--softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0",
            f"--num-experts {experts} --moe-router-topk 4 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type "
            "alltoall")


_PRESETS = (
    Preset(
        "gpt_tiny", "gpt",
        about=("A tiny GPT that trains in minutes on a CPU (the quick-start's model): 4 layers, hidden 128, 4 "
               "heads, seq 128.",
               "Picked by examples/gpt_common.sh when no GPU is found and PRESET is not set."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                    "--max-position-embeddings 128",),
        defaults={"MICRO_BATCH_SIZE": "8", "GLOBAL_BATCH_SIZE": "16", "LR": "0.001", "MIN_LR": "0.0001",
                  "TRAIN_ITERS": "300", "LR_DECAY_ITERS": "300", "LOG_INTERVAL": "25", "SAVE_INTERVAL": "150",
                  "EVAL_INTERVAL": "100", "CPU_PROCESSES": "2"},
    ),
    Preset(
        "gpt_345m", "gpt",
        about=("GPT-2 medium / Megatron \"345M\": 24 layers, hidden 1024, 16 heads, seq 1024 (354.9M params with a "
               "50,304 vocab).",
               "Sourced by examples/pretrain_gpt*.sh and examples/slurm/pretrain_gpt.slurm; sets GPT_MODEL_ARGS and "
               "defaults."),
        model_args=("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                    "--max-position-embeddings 1024",),
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "0.00015", "MIN_LR": "1.0e-5"},
    ),
    Preset(
        "gpt_1.3b", "gpt",
        about=("GPT-3 XL class \"1.3B\": 24 layers, hidden 2048, 16 heads, seq 2048 (1.32B params with a 50,304 "
               "vocab).",),
        model_args=("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
                    "--max-position-embeddings 2048",),
        defaults={"MICRO_BATCH_SIZE": "2", "GLOBAL_BATCH_SIZE": "512", "LR": "0.0002", "MIN_LR": "2.0e-5"},
    ),
    Preset(
        "gpt_2.7b", "gpt",
        about=("GPT-3 \"2.7B\": 32 layers, hidden 2560, 32 heads, seq 2048 (2.65B params with a 50,304 vocab).",),
        model_args=("--num-layers 32 --hidden-size 2560 --num-attention-heads 32 --seq-length 2048 "
                    "--max-position-embeddings 2048",),
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "512", "LR": "0.00016", "MIN_LR": "1.6e-5"},
    ),
    Preset(
        "gpt_3.7b", "gpt",
        about=("\"3.7B\": 32 layers, hidden 3072, 32 heads, seq 2048 (3.79B params with a 50,304 vocab; 36 layers "
               "would be 4.2B,",
               "30 layers is Megatron-LM's 3.6B). Usually run with --tensor-model-parallel-size 2 or more."),
        model_args=("--num-layers 32 --hidden-size 3072 --num-attention-heads 32 --seq-length 2048 "
                    "--max-position-embeddings 2048",),
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "512", "LR": "0.00012", "MIN_LR": "1.2e-5"},
    ),
    Preset(
        "llama_tiny", "llama",
        about=("Tiny Llama-style model that trains on a CPU in minutes: 4 layers, hidden 128, 4 query heads in 2 KV "
               "groups (GQA),",
               "SwiGLU ffn 352, RMSNorm, RoPE, untied output layer, no linear biases, no dropout, seq 256.",
               "Sourced by examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 352",
                    "--group-query-attention --num-query-groups 2",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope "
                    "--rotary-base 10000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "8", "GLOBAL_BATCH_SIZE": "16", "LR": "1.0e-3", "MIN_LR": "1.0e-4",
                  "LR_WARMUP_ITERS": "20"},
    ),
    Preset(
        "llama2_7b", "llama",
        about=("Llama-2 7B: 32 layers, hidden 4096, 32 heads (no GQA), SwiGLU ffn 11008, RMSNorm (eps 1e-5), RoPE "
               "(base 10000),",
               "untied output layer, no linear biases, no dropout, seq 4096, 32,000-piece SentencePiece vocab "
               "(Llama2Tokenizer).",
               "6.74B params. Sourced by examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults (Llama-2 "
               "paper: AdamW",
               "beta2 0.95, eps 1e-5, weight decay 0.1, clip 1.0, cosine to 10% of the peak lr, 2,000 warm-up "
               "steps, 4M tokens/batch)."),
        model_args=("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings 4096",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope "
                    "--rotary-base 10000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "1024", "LR": "3.0e-4", "MIN_LR": "3.0e-5",
                  "LR_WARMUP_ITERS": "2000"},
    ),
    Preset(
        "mistral_7b", "llama",
        about=("Mistral 7B (v0.2/v0.3 layout): 32 layers, hidden 4096, 32 query heads in 8 KV groups (GQA), SwiGLU "
               "ffn 14336,",
               "RMSNorm (eps 1e-5), RoPE base 1e6, untied output layer, no linear biases, no dropout, 32k context "
               "(no sliding",
               "window). 7.24B params with Mistral's 32,768-piece SentencePiece vocab (Llama2Tokenizer). Sourced by",
               "examples/pretrain_llama.sh; sets LLAMA_MODEL_ARGS and defaults. SEQ_LENGTH=4096 trains on shorter "
               "sequences."),
        model_args=("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336",
                    "--group-query-attention --num-query-groups 8",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings 32768",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0"),
        seq_length=32768,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "128", "LR": "3.0e-4", "MIN_LR": "3.0e-5",
                  "LR_WARMUP_ITERS": "2000"},
    ),
    Preset(
        "mixtral_tiny", "llama",
        about=("A tiny Mixtral-style model that trains on a CPU: 4 layers, hidden 128, 4 heads with 2 K/V groups, 8 "
               "SwiGLU",
               "experts (ffn 256), top-2, load-balancing loss 1e-2 and z-loss 1e-3, RMSNorm, RoPE, untied output, "
               "seq 256.",
               "Sourced by examples/pretrain_mixtral.sh; sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256",
                    "--group-query-attention --num-query-groups 2 --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 256",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope "
                    "--rotary-base 10000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0",
                    "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "6.0e-4", "MIN_LR": "6.0e-5",
                  "LR_WARMUP_ITERS": "10"},
    ),
    Preset(
        "mixtral_8x7b", "llama",
        about=("Mixtral 8x7B: 32 layers, hidden 4096, 32 heads with 8 K/V groups, RMSNorm (eps 1e-5), RoPE (base "
               "1e6), untied",
               "output layer, no linear biases, no dropout; every MLP is a mixture of 8 SwiGLU experts (ffn 14336), "
               "top-2 routing",
               "(top-k over the logits then softmax), load-balancing loss 1e-2 (Megatron-LM's Mixtral recipe). "
               "46.7B params",
               "(12.9B active per token) with the 32,000-piece SentencePiece vocab. Sourced by "
               "examples/pretrain_mixtral.sh;",
               "sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336",
                    "--group-query-attention --num-query-groups 8 --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 32768",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0",
                    "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
                    "--moe-aux-loss-coeff 1e-2",
                    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "1.0e-4", "MIN_LR": "1.0e-5",
                  "LR_WARMUP_ITERS": "500"},
    ),
    Preset(
        "qwen3_tiny", "llama",
        about=("A tiny Qwen3-style model that trains on a CPU: 4 layers, hidden 128, 4 heads of 48 channels "
               "(--kv-channels != hidden/heads)",
               "in 2 K/V groups, per-head q/k RMSNorm (--qk-layernorm), SwiGLU ffn 384, RoPE base 1e6, untied "
               "output, no biases,",
               "seq 256. Sourced by examples/pretrain_qwen3.sh; sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 48 --ffn-hidden-size 384",
                    "--group-query-attention --num-query-groups 2 --qk-layernorm --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 256",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "6.0e-4", "MIN_LR": "6.0e-5",
                  "LR_WARMUP_ITERS": "10"},
    ),
    Preset(
        "qwen3_8b", "llama",
        about=("Qwen3-8B: 36 layers, hidden 4096, 32 query heads of 128 channels in 8 K/V groups, per-head q/k "
               "RMSNorm",
               "(--qk-layernorm), SwiGLU ffn 12288, RMSNorm (eps 1e-6), RoPE base 1e6, untied output layer, no "
               "biases, 40,960",
               "positions, Qwen's 151,936-row vocabulary (HuggingFaceTokenizer Qwen/Qwen3-8B). 8.19B params. "
               "Sourced by",
               "examples/pretrain_qwen3.sh; sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 36 --hidden-size 4096 --num-attention-heads 32 --kv-channels 128 "
                    "--ffn-hidden-size 12288",
                    "--group-query-attention --num-query-groups 8 --qk-layernorm --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 40960",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "3.0e-4", "MIN_LR": "3.0e-5",
                  "LR_WARMUP_ITERS": "2000"},
    ),
    Preset(
        "qwen3_moe_tiny", "llama",
        about=("A tiny Qwen3-MoE-style model that trains on a CPU: 4 layers, hidden 128, 4 heads of 48 channels in 2 "
               "K/V groups,",
               "--qk-layernorm, 8 SwiGLU experts (ffn 64), top-2 renormalised (HF norm_topk_prob), no shared "
               "expert, load-balancing",
               "loss 1e-3, RoPE base 1e6, untied output, seq 256. Sourced by examples/pretrain_qwen3.sh (PRESET="
               "qwen3_moe_tiny)."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 48 --ffn-hidden-size 384",
                    "--group-query-attention --num-query-groups 2 --qk-layernorm --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 256",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0",
                    "--num-experts 8 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-aux-loss-coeff 1e-3"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "6.0e-4", "MIN_LR": "6.0e-5",
                  "LR_WARMUP_ITERS": "10"},
    ),
    Preset(
        "qwen3_30b_a3b", "llama",
        about=("Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query heads of 128 channels in 4 K/V groups, "
               "--qk-layernorm, every MLP",
               "a mixture of 128 SwiGLU experts (ffn 768), top-8 renormalised (HF norm_topk_prob), no shared "
               "expert, RMSNorm (eps",
               "1e-6), RoPE base 1e6, untied output, 40,960 positions, 151,936-row vocabulary. 30.5B params (3.3B "
               "active per token).",
               "Sourced by examples/pretrain_qwen3.sh (PRESET=qwen3_30b_a3b)."),
        model_args=("--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 "
                    "--ffn-hidden-size 6144",
                    "--group-query-attention --num-query-groups 4 --qk-layernorm --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 40960",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope "
                    "--rotary-base 1000000",
                    "--untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0.0 "
                    "--attention-dropout 0.0",
                    "--num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 "
                    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3",
                    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "1.0e-4", "MIN_LR": "1.0e-5",
                  "LR_WARMUP_ITERS": "500"},
    ),
    Preset(
        "deepseek_v3_tiny", "llama",
        about=("A tiny DeepSeek-V3-style model that trains on a CPU: 4 layers (the first dense), hidden 128, 4 heads of "
               "multi-latent",
               "attention (q-lora 64, kv-lora 32, head 32 + rope 16, value 32, YaRN x4 over 64 positions), 8 SwiGLU "
               "experts (ffn 64)",
               "in 4 groups, top-2 from 2 groups, sigmoid scores with the aux-loss-free expert bias, weights x 2.5, "
               "one shared",
               "expert, one multi-token-prediction layer, RMSNorm, untied output, seq 256. Sourced by "
               "examples/pretrain_deepseek.sh;",
               "sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings 256",
                    "--multi-latent-attention --qk-layernorm --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 "
                    "--qk-pos-emb-head-dim 16 --v-head-dim 32",
                    "--position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 4 "
                    "--mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 64",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
                    "--disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0",
                    "--num-experts 8 --moe-layer-freq ([0]+[1]*3) --moe-ffn-hidden-size 64 "
                    "--moe-shared-expert-intermediate-size 64 --moe-router-topk 2",
                    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 4 "
                    "--moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5",
                    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32",
                    "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "6.0e-4", "MIN_LR": "6.0e-5",
                  "LR_WARMUP_ITERS": "10"},
    ),
    Preset(
        "deepseek_v2_lite", "llama",
        about=("DeepSeek-V2-Lite: 27 layers (the first dense, ffn 10944), hidden 2048, 16 heads of multi-latent "
               "attention without",
               "q-lora (kv-lora 512, head 128 + rope 64, value 128), YaRN x40 over 4096 positions (mscale 0.707), 64 "
               "SwiGLU experts",
               "(ffn 1408) with 2 shared, top-6 of the softmax over all experts (not renormalised), aux loss 1e-3, "
               "RMSNorm (eps",
               "1e-6), untied output. 15.7B params (2.4B active) with its 102,400-token vocab. Sourced by "
               "examples/pretrain_deepseek.sh;",
               "sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 27 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 10944",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings 163840",
                    "--multi-latent-attention --qk-layernorm --kv-lora-rank 512 --qk-head-dim 128 "
                    "--qk-pos-emb-head-dim 64 --v-head-dim 128",
                    "--position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 40 "
                    "--mscale 0.707 --mscale-all-dim 0.707 --yarn-original-max-position-embeddings 4096",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
                    "--disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0",
                    "--num-experts 64 --moe-layer-freq ([0]+[1]*26) --moe-ffn-hidden-size 1408 "
                    "--moe-shared-expert-intermediate-size 2816 --moe-router-topk 6",
                    "--moe-router-pre-softmax --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 "
                    "--moe-router-dtype fp32",
                    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "4.2e-4", "MIN_LR": "4.2e-5",
                  "LR_WARMUP_ITERS": "2000"},
    ),
    Preset(
        "deepseek_v3_671b", "llama",
        about=("DeepSeek-V3 671B: 61 layers (the first 3 dense, ffn 18432), hidden 7168, 128 heads of multi-latent "
               "attention",
               "(q-lora 1536, kv-lora 512, head 128 + rope 64, value 128), YaRN x40 over 4096 positions, 256 SwiGLU "
               "experts (ffn 2048)",
               "in 8 groups, top-8 from 4 groups, sigmoid scores with the aux-loss-free expert bias (rate 1e-3), "
               "weights x 2.5, one",
               "shared expert, sequence aux loss 1e-4, one multi-token-prediction layer (loss x 0.1), RMSNorm (eps "
               "1e-6), untied",
               "output. 671B params (37B active) with its 129,280-token vocab, the MTP layer besides. Sourced by "
               "examples/pretrain_deepseek.sh;",
               "sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 61 --hidden-size 7168 --num-attention-heads 128 --ffn-hidden-size 18432",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings 163840",
                    "--multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
                    "--qk-pos-emb-head-dim 64 --v-head-dim 128",
                    "--position-embedding-type rope --rope-type yarn --rotary-base 10000 --rotary-scaling-factor 40 "
                    "--mscale 1.0 --mscale-all-dim 1.0 --yarn-original-max-position-embeddings 4096",
                    "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
                    "--disable-bias-linear --hidden-dropout 0.0 --attention-dropout 0.0",
                    "--num-experts 256 --moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048 "
                    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8",
                    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                    "--moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8 --moe-router-group-topk 4 "
                    "--moe-router-topk-scaling-factor 2.5",
                    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-router-dtype fp32",
                    "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1",
                    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall"),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "15360", "LR": "2.2e-4", "MIN_LR": "2.2e-5",
                  "LR_WARMUP_ITERS": "2000"},
    ),
    Preset(
        "gpt_oss_tiny", "llama",
        about=("A tiny GPT-OSS-style model that trains on a CPU: 4 layers, hidden 128, 4 heads with 2 K/V groups, "
               "attention sinks,",
               "linear biases everywhere, 8 experts (ffn 128) with the clamped quick-GeGLU, top-2, RMSNorm, RoPE, "
               "untied output, seq 256.",
               "Sourced by examples/pretrain_gpt_oss.sh; sets LLAMA_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --ffn-hidden-size 128",
                    "--group-query-attention --num-query-groups 2 --seq-length $SEQ_LENGTH "
                    "--max-position-embeddings 256",
                    "--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 150000",
                    "--untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0",
                    "--softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0",
                    "--num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-3"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "6.0e-4", "MIN_LR": "6.0e-5",
                  "LR_WARMUP_ITERS": "10"},
    ),
    Preset(
        "gpt_oss_20b", "llama",
        about=("gpt-oss-20b: 24 layers, hidden 2880, 64 heads of 64 with 8 K/V groups, attention sinks, linear "
               "biases, RMSNorm,",
               "RoPE (base 150000), untied output; every MLP is 32 experts (ffn 2880, clamped quick-GeGLU: limit 7, "
               "offset 1), top-4.",
               "20.9B params, 4.2B active per token (3.6B without the input embedding table: the model card's count) "
               "with its",
               "201,088-token vocab; YaRN RoPE (factor 32 over 4096, unrounded correction range); the 128-token",
               "sliding window of every other layer. Sourced by examples/pretrain_gpt_oss.sh."),
        model_args=_gpt_oss_published_args(layers=24, experts=32),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "1.0e-4", "MIN_LR": "1.0e-5",
                  "LR_WARMUP_ITERS": "500"},
    ),
    Preset(
        "gpt_oss_120b", "llama",
        about=("gpt-oss-120b: gpt-oss-20b's layers (hidden 2880, 64 heads of 64, 8 K/V groups, sinks, biases) x 36, "
               "128 experts",
               "(ffn 2880, clamped quick-GeGLU), top-4. 116.8B params, 5.7B active per token (5.1B without the input "
               "embedding",
               "table: the model card's count) with its 201,088-token vocab; YaRN RoPE; the 128-token sliding "
               "window of every other layer. Sourced by",
               "examples/pretrain_gpt_oss.sh."),
        model_args=_gpt_oss_published_args(layers=36, experts=128),
        seq_length=4096,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "1.0e-4", "MIN_LR": "1.0e-5",
                  "LR_WARMUP_ITERS": "500"},
    ),
    Preset(
        "bloom_tiny", "bloom",
        about=("Tiny BLOOM-style model that trains on a CPU in minutes: 4 layers, hidden 96, 6 heads (ALiBi slopes "
               "of a head count",
               "that is not a power of two), --embed-layernorm, 4h tanh-GeLU MLP with biases, tied output layer, "
               "seq 256.",
               "Sourced by examples/pretrain_bloom.sh; sets BLOOM_MODEL_ARGS and defaults."),
        model_args=("--num-layers 4 --hidden-size 96 --num-attention-heads 6",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH",
                    "--position-embedding-type alibi --embed-layernorm --hidden-dropout 0.0 --attention-dropout 0.0",
                    "--init-method-std 0.02"),
        seq_length=256,
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "1.0e-3", "MIN_LR": "1.0e-4",
                  "LR_WARMUP_ITERS": "20"},
    ),
    Preset(
        "bloom_560m", "bloom",
        about=("BLOOM-560M (BigScience): 24 layers, hidden 1024, 16 heads, 4h tanh-GeLU MLP with biases, ALiBi (no "
               "position table),",
               "LayerNorm after the word embeddings, tied output layer, seq 2048. The BLOOM tokenizer's 250,680 "
               "tokens are padded",
               "to 250,880 rows, as BigScience's --pad-vocab-size-to 250880 did: --make-vocab-size-divisible-by 512 "
               "gives exactly",
               "that at TP 1 and 2. 559,214,592 parameters.",
               "Sourced by examples/pretrain_bloom.sh; sets BLOOM_MODEL_ARGS and defaults."),
        model_args=("--num-layers 24 --hidden-size 1024 --num-attention-heads 16",
                    "--seq-length $SEQ_LENGTH --max-position-embeddings $SEQ_LENGTH",
                    "--position-embedding-type alibi --embed-layernorm --make-vocab-size-divisible-by 512",
                    "--hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.0048"),
        seq_length=2048,
        defaults={"MICRO_BATCH_SIZE": "1", "GLOBAL_BATCH_SIZE": "256", "LR": "3.0e-4", "MIN_LR": "1.0e-5",
                  "LR_WARMUP_ITERS": "375"},
    ),
    Preset(
        "bert_tiny", "bert",
        about=("A tiny BERT that trains in minutes on a CPU (the quick-start's BERT): 2 layers, hidden 128, 4 "
               "heads, seq 128.",
               "Picked by examples/bert_common.sh when no GPU is found and PRESET is not set."),
        model_args=("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                    "--max-position-embeddings 128",),
        defaults={"MICRO_BATCH_SIZE": "8", "GLOBAL_BATCH_SIZE": "16", "LR": "0.001", "MIN_LR": "0.0001",
                  "TRAIN_ITERS": "200", "LR_DECAY_ITERS": "200", "LOG_INTERVAL": "20", "SAVE_INTERVAL": "100",
                  "EVAL_INTERVAL": "100", "CPU_PROCESSES": "2"},
    ),
    Preset(
        "bert_345m", "bert",
        about=("BERT-345M (Megatron's BERT-Large shape): 24 layers, hidden 1024, 16 heads, seq 512, with the binary "
               "head.",
               "Sourced by examples/pretrain_bert*.sh and examples/slurm/pretrain_bert.slurm; sets BERT_MODEL_ARGS "
               "and defaults."),
        model_args=("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
                    "--max-position-embeddings 512",),
        defaults={"MICRO_BATCH_SIZE": "4", "GLOBAL_BATCH_SIZE": "8", "LR": "0.0001", "MIN_LR": "0.00001"},
    ),
    Preset(
        "t5_tiny", "t5",
        about=("A tiny T5 that trains in minutes on a CPU: 2 + 2 layers, hidden 128, 4 heads, encoder 128 / decoder "
               "32 tokens.",
               "Picked by examples/t5_common.sh when no GPU is found and PRESET is not set."),
        model_args=("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --ffn-hidden-size 512",
                    "--encoder-seq-length 128 --decoder-seq-length 32 --max-position-embeddings 128 "
                    "--vocab-extra-ids 100"),
        defaults={"MICRO_BATCH_SIZE": "8", "GLOBAL_BATCH_SIZE": "16", "LR": "0.001", "MIN_LR": "0.0001",
                  "TRAIN_ITERS": "200", "LR_DECAY_ITERS": "200", "LOG_INTERVAL": "20", "SAVE_INTERVAL": "100",
                  "EVAL_INTERVAL": "100", "CPU_PROCESSES": "2"},
    ),
    Preset(
        "t5_220m", "t5",
        about=("T5-220M (Megatron's documented examples/pretrain_t5.sh shape): 12 encoder + 12 decoder layers, "
               "hidden 768,",
               "12 heads, kv-channels 64, FFN 3072, encoder 512 / decoder 128 tokens, 100 sentinel ids.",
               "Sourced by examples/pretrain_t5*.sh; sets T5_MODEL_ARGS and defaults."),
        model_args=("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --kv-channels 64 --ffn-hidden-size "
                    "3072",
                    "--encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512 "
                    "--vocab-extra-ids 100"),
        defaults={"MICRO_BATCH_SIZE": "16", "GLOBAL_BATCH_SIZE": "16", "LR": "0.0001", "MIN_LR": "0.00001"},
    ),
    # The tests' tiny models (not example presets).
    Preset(
        "gpt_test", "gpt",
        about=("The tests' tiny GPT (the golden curves): 2 layers, hidden 64, 4 heads, seq 64.",),
        model_args=("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                    "--max-position-embeddings 64",),
        example=False,
    ),
    Preset(
        "bert_test", "bert",
        about=("The tests' tiny BERT (the BERT curves and finetuning chain): 2 layers, hidden 64, 4 heads, seq 64.",),
        model_args=("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                    "--max-position-embeddings 64",),
        example=False,
    ),
    Preset(
        "t5_test", "t5",
        about=("The tests' tiny T5 (the T5 curves): 2 encoder + 1 decoder layers, hidden 64, 4 heads, encoder 64 / "
               "decoder 32 tokens.",),
        model_args=("--num-layers 2 --decoder-num-layers 1 --hidden-size 64 --num-attention-heads 4 "
                    "--encoder-seq-length 64 --decoder-seq-length 32 --max-position-embeddings 64",),
        example=False,
    ),
    Preset(
        "gpt_micro_test", "gpt",
        about=("The reliability tests' smallest GPT: 2 layers, hidden 32, 4 heads, seq 32.",),
        model_args=("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
                    "--max-position-embeddings 32",),
        example=False,
    ),
)
PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def get_preset(name: str) -> Preset:
    """The preset called `name`; an unknown name: ValueError naming the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    return PRESETS[name]


def write_shell(folder: str) -> list[str]:
    """Write every example preset to FOLDER/NAME.sh; returns the paths."""
    paths = []
    for preset in _PRESETS:
        if preset.example:
            path = os.path.join(folder, f"{preset.name}.sh")
            with open(path, "w", encoding="utf-8") as f:
                f.write(preset.shell())
            paths.append(path)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Named model presets (megatron/presets.py).")
    parser.add_argument("--write", metavar="DIR", help="write the example presets' shell files into DIR")
    parser.add_argument("--argv", metavar="NAME", help="print the model flags of preset NAME")
    args = parser.parse_args(argv)
    if args.write:
        for path in write_shell(args.write):
            print(path)
    if args.argv:
        print(shlex.join(get_preset(args.argv).argv()))
    if not (args.write or args.argv):
        print("\n".join(PRESETS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
