"""Rotary position embedding (RoPE) in the half-split convention of GPT-NeoX / Hugging Face Llama / Megatron-LM.

``inv_freq = 1 / base^(arange(0, d, 2) / d)`` over the rotary dimension d = int(kv_channels * rotary_percent),
``emb = cat(freqs, freqs)``; a head vector t becomes ``t[:d] * cos + rotate_half(t[:d]) * sin`` with
``rotate_half(x) = cat(-x[d/2:], x[:d/2])``; channels past d pass through. Positions are 0..s-1 plus the KV-cache
decode offset (as Megatron-LM, which does not read position_ids for RoPE).

Long-context scaling changes only the frequencies, as Megatron-LM core's RotaryEmbedding and Hugging Face's
``rope_type`` "llama3" / "linear" do: Llama-3.1 scaling (`llama3_inv_freq`, --use-rope-scaling) divides the low
frequencies by the factor and blends the middle band; linear position interpolation
(--rotary-seq-len-interpolation-factor f) rotates position p by the angles of p / f.

YaRN (`yarn_inv_freq`, --rope-type yarn; HF rope_type "yarn", Megatron-LM core's YarnRotaryEmbedding) blends the
interpolated frequencies inv_freq / factor and the original ones over a ramp of dimensions between the correction
range of beta_fast and beta_slow rotations in the original context, and multiplies cos and sin by the concentration
factor (`yarn_concentration`, HF's attention_factor). Multi-latent attention also scales its softmax by
`yarn_get_mscale(factor, mscale_all_dim)` squared (Megatron-LM's MLA). `rotary_cos_sin` gives an attention variant
(cos, sin, concentration) for its own rotary dimension.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from megatron import fused_kernels


class Llama3Scaling(NamedTuple):
    """Llama-3.1 RoPE scaling (HF rope_type "llama3"); Megatron-LM hard-codes all but the factor to these values."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    """Llama-3.1 frequencies: wavelengths longer than original_len / low_freq_factor are stretched by the factor,
    shorter than original_len / high_freq_factor kept, and the band between blended linearly in original_len /
    wavelength (the formula of Megatron-LM core's `_apply_scaling` and HF's `_compute_llama3_parameters`)."""
    factor, low, high, old_len = scaling
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, stretched)


class YarnScaling(NamedTuple):
    """YaRN's settings (HF rope_parameters of rope_type "yarn"; Megatron-LM core's YarnRotaryEmbedding defaults)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True  # HF's "truncate": the correction range's ends rounded outwards to whole dimensions


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature term ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration(scaling: YarnScaling) -> float:
    """The factor cos and sin are multiplied by: mscale(factor, mscale) / mscale(factor, mscale_all_dim), which is
    mscale(factor) at the defaults (Megatron-LM's `_yarn_get_concentration_factor`; HF's attention_factor)."""
    return float(yarn_get_mscale(scaling.factor, scaling.mscale)
                 / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim))


def yarn_correction_range(scaling: YarnScaling, dim: int, base: float) -> tuple[float, float]:
    """The dimensions (of `dim`) that turn beta_fast and beta_slow times over the original context, clamped to
    [0, dim - 1] (rounded outwards when `round_to_int`)."""
    def dim_of(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, scaling: YarnScaling, device: torch.device) -> torch.Tensor:
    """YaRN's d/2 inverse frequencies (fp32): the original ones below the correction range's low end, the ones
    divided by the factor above its high end, a linear blend between (HF's `_compute_yarn_parameters`, bitwise)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = yarn_correction_range(scaling, dim, base)
    if low == high:
        high += 0.001  # as both references: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """cos/sin tables (fp32, grown on demand, one per device) for one rotary dimension and base, optionally with
    Llama-3.1 frequency scaling and linear position interpolation, or YaRN (its frequencies, and cos/sin times its
    concentration factor). Holds no parameters or buffers, so state dicts and dtype conversions of the model are
    unaffected."""

    def __init__(self, rotary_dim: int, base: float = 10000.0, *,
                 seq_len_interpolation_factor: Optional[float] = None,
                 llama3_scaling: Optional[Llama3Scaling] = None, yarn: Optional[YarnScaling] = None) -> None:
        self.rotary_dim = rotary_dim
        self.base = float(base)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.llama3_scaling = llama3_scaling
        self.yarn = yarn
        self.concentration = yarn_concentration(yarn) if yarn is not None else 1.0
        self._tables: dict = {}

    @classmethod
    def from_config(cls, config: Any, rotary_dim: Optional[int] = None) -> RotaryEmbedding:
        """The rotary embedding a `TransformerConfig` describes (rotary_dim, base and the scaling fields);
        `rotary_dim` overrides the config's (an attention variant rotating another part of its heads)."""
        scaling = (Llama3Scaling(config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                                 config.rope_scaling_high_freq_factor,
                                 config.rope_scaling_original_max_position_embeddings)
                   if config.use_rope_scaling else None)
        return cls(rotary_dim or config.rotary_dim, config.rotary_base,
                   seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor, llama3_scaling=scaling,
                   yarn=yarn_scaling_of(config))

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The d/2 inverse frequencies (fp32), scaled when Llama-3.1 scaling or YaRN is on."""
        d = self.rotary_dim
        if self.yarn is not None:
            return yarn_inv_freq(d, self.base, self.yarn, device)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        return llama3_inv_freq(inv_freq, self.llama3_scaling) if self.llama3_scaling is not None else inv_freq

    def positions(self, size: int, device: torch.device) -> torch.Tensor:
        """Positions 0..size-1 (fp32), times 1/f under linear interpolation by f (Megatron-LM's order of operations)."""
        seq = torch.arange(size, device=device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            seq *= 1 / self.seq_len_interpolation_factor
        return seq

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._tables.get(device)
        if cached is None or cached[0].size(0) < length:
            size = max(length, 2 * cached[0].size(0) if cached is not None else length)
            freqs = torch.outer(self.positions(size, device), self.inv_freq(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            cached = (emb.cos(), emb.sin())
            if self.yarn is not None:
                cached = (cached[0] * self.concentration, cached[1] * self.concentration)
            self._tables[device] = cached
        return cached

    def cos_sin(self, seq_len: int, offset: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions offset..offset+seq_len-1, shaped [s, 1, 1, d] in `dtype`."""
        cos, sin = self._table(offset + seq_len, device)
        cos = cos[offset:offset + seq_len, None, None, :].to(dtype)
        sin = sin[offset:offset + seq_len, None, None, :].to(dtype)
        return cos, sin

    def cos_sin_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at per-token positions (long [b, s]: packed documents restart at 0), shaped [s, b, 1, d]."""
        cos, sin = self._table(int(positions.max()) + 1, positions.device)
        index = positions.t()
        return cos[index].unsqueeze(2).to(dtype), sin[index].unsqueeze(2).to(dtype)


def yarn_scaling_of(config: Any) -> Optional[YarnScaling]:
    """The YaRN settings of a `TransformerConfig` (or parsed args: the same names) whose RoPE is YaRN (rope_type
    "yarn", or unset with multi-latent attention, as Megatron-LM defaults), else None."""
    rope_type = getattr(config, "rope_type", None)
    if rope_type is None and getattr(config, "multi_latent_attention", False):
        rope_type = "yarn"
    if rope_type != "yarn":
        return None
    return YarnScaling(float(config.rotary_scaling_factor), int(config.original_max_position_embeddings),
                       float(config.beta_fast), float(config.beta_slow), float(config.mscale),
                       float(config.mscale_all_dim), bool(config.yarn_correction_range_round_to_int))


def yarn_softmax_scale(config: Any, head_dim: int) -> float:
    """Multi-latent attention's softmax scale, mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(head_dim)
    (Megatron-LM core's MLA, whatever the rope type)."""
    mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(head_dim)


def rotary_cos_sin(config: Any, rotary_dim: int, seq_len: int, offset: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(cos, sin, concentration) of `config`'s RoPE for `rotary_dim` channels at positions offset..offset+seq_len-1,
    cos/sin [s, 1, 1, rotary_dim] already multiplied by the concentration (1.0 without YaRN). Builds the table each
    call: a module keeps `RotaryEmbedding.from_config(config, rotary_dim)` instead."""
    rotary = RotaryEmbedding.from_config(config, rotary_dim)
    cos, sin = rotary.cos_sin(seq_len, offset, device, dtype)
    return cos, sin, rotary.concentration


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_into(out: torch.Tensor, t: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """out += rotate_half(t) * sin (sign 1) or its transpose, rotate_half^T(t) * sin (sign -1), half by half."""
    half = t.size(-1) // 2
    low, high = out[..., :half], out[..., half:]
    (low.sub_ if sign > 0 else low.add_)(t[..., half:] * sin[..., :half])  # not addcmul_: it may fuse (FMA)
    (high.add_ if sign > 0 else high.sub_)(t[..., :half] * sin[..., half:])
    return out


class _RotaryFull(torch.autograd.Function):
    """t * cos + rotate_half(t) * sin over the whole head dimension in three passes (no negated copy, no cat), and
    its backward g * cos + rotate_half^T(g * sin) likewise. Bitwise equal to the plain expression and its autograd:
    each element is the same product and sum (a negation moved onto the other factor is exact)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate_into(t * cos, t, sin, 1.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate_into(grad_output * cos, grad_output, sin, -1.0), None, None


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [s, b, heads, head_dim] with cos/sin [s, 1, 1, d] (or [s, b, 1, d]: per-token positions),
    d <= head_dim."""
    d = cos.size(-1)
    if (d % 2 == 0 and not (cos.requires_grad or sin.requires_grad) and cos.size(1) == 1
            and fused_kernels.runs_on(t)):
        return fused_kernels.apply_rope(t, cos, sin)  # the Triton kernel: same numbers, one pass
    if d == t.size(-1):
        if d % 2 == 0 and not cos.requires_grad and not sin.requires_grad:
            return _RotaryFull.apply(t, cos, sin)
        return t * cos + rotate_half(t) * sin
    t_rot, t_pass = t[..., :d], t[..., d:]
    return torch.cat((t_rot * cos + rotate_half(t_rot) * sin, t_pass), dim=-1)
