"""Attention for Megatron's transformer: CoreAttention (softmax(q k^T / sqrt(d)) v on this rank's heads) and
ParallelAttention (fused query_key_value projection, KV cache, selective recomputation, output projection).

Activations are [sequence, batch, ...]; heads are split across the tensor-parallel group. Grouped-query attention
(`config.num_query_groups` < heads, 1 = multi-query) follows Megatron-LM's fused layout: query_key_value rows are
grouped per KV group ``[q of the group's heads; k; v]``, so a plain dim-0 split over TP ranks keeps whole groups;
query head ``g * (heads / groups) + i`` uses K/V head g, and the KV cache holds the groups' K/V (not expanded).
RoPE (`position_embedding_type == "rope"`) rotates q and k after the split, at positions offset by the decode step.
ALiBi (`"alibi"`, BLOOM) adds this rank's heads' ``slope * key position`` to the scores (megatron/layers/alibi.py):
SDPA takes it as an additive float mask (masked entries -inf), the explicit path adds it before the softmax; never
flash-attn.

The one attention path selector is `CoreAttention.forward`:

* ``--use-flash-attn`` with the flash-attn package installed, CUDA tensors and fp16/bf16: ``flash_attn_func``;
* otherwise ``F.scaled_dot_product_attention`` (fused kernels on CUDA, its flash kernel for CPU) whenever it computes
  the same thing as Megatron's softmax (always with ``--use-flash-attn``; without it only when no attention dropout
  is in effect, so that dropout masks come from the model-parallel RNG exactly as in Megatron); a fully masked row
  (a padding query: BERT, T5) gets Megatron's uniform softmax there too, as the mean of V;
* else the explicit bmm / scaled-masked-softmax / dropout / bmm path.

`describe_attention_path` gives the one line printed (rank 0, once per process) when the model is built (not for
a weightless model built on the meta device, as conversion builds one to read the TP layouts).

`--qk-layernorm` (Qwen3): a norm over each head's channels on q and k after the split and before RoPE
(``q_layernorm`` / ``k_layernorm``); each TP rank normalises its own heads with the shared weights, so their grads
are marked `tensor_parallel_partial_grad` and summed over TP (megatron/core/distributed/finalize_model_grads.py), as
Megatron Core does. `--window-size W,0` (sliding window, on the layers `config.is_window_layer` picks): query i
attends keys i-W .. i, a bool mask ORed onto the model's (`window_mask`), also past the window in KV-cache decoding
(the cache keeps every position) and under context parallelism (built from the rank's true positions).

Under context parallelism (`set_context_parallel(cp_group)`, done by ParallelTransformer when
`config.context_parallel_size` > 1) this rank holds two of the sequence's 2N chunks: RoPE rotates them at their true
positions and self-attention runs through megatron/core/context_parallel.py (`config.cp_comm_type`).
"""
from __future__ import annotations

import contextlib
import importlib
import math
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import context_parallel, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.alibi import AlibiBias
from megatron.layers.enums import AttnMaskType, AttnType
from megatron.layers.fused_softmax import FusedScaleMaskSoftmax
from megatron.layers.inference_params import InferenceParams
from megatron.layers.module import MegatronModule
from megatron.layers.norms import norm_class, norm_kwargs
from megatron.layers.paged_kv import PagedStep, paged_attention
from megatron.layers.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron.layers.utils import attention_mask_func, group_rank, group_size

MODEL_PARALLEL_RNG = "model-parallel-rng"


def model_parallel_rng_fork(active: bool):
    """The tracker's model-parallel RNG fork when dropout will actually draw numbers, else a no-op context."""
    if not active:
        return contextlib.nullcontext()
    return tensor_parallel.get_rng_tracker().fork(MODEL_PARALLEL_RNG)

_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa= since 2.5
_MASK_CACHE: list = []  # recent masks: [weakref, in-place version, key, value, SDPA form or None]; T5 uses three
_MASK_CACHE_SIZE = 4
_FLASH_ATTN: dict = {}  # lazy import result: {"func": flash_attn_func or None, "version": str, "error": str}
_ANNOUNCED: set = set()  # attention-path lines already printed in this process


def _flash_attn() -> dict:
    """Import flash-attn once (lazily: only when --use-flash-attn asks for it)."""
    if not _FLASH_ATTN:
        try:
            module = importlib.import_module("flash_attn")
            func = getattr(module, "flash_attn_func", None)
            if func is None:
                raise ImportError("flash_attn has no flash_attn_func (flash-attn 2.x is needed)")
            _FLASH_ATTN.update(func=func, version=str(getattr(module, "__version__", "2.x")), error="",
                               varlen=getattr(module, "flash_attn_varlen_func", None))
        except Exception as exc:  # noqa: BLE001 - any failure to import means "not usable here"
            missing = isinstance(exc, ModuleNotFoundError) and exc.name == "flash_attn"
            error = ("the flash-attn package is not installed (pip install flash-attn)" if missing
                     else f"flash-attn failed to import ({type(exc).__name__}: {exc})")
            _FLASH_ATTN.update(func=None, version="", error=error)
    return _FLASH_ATTN


def reset_flash_attn_cache() -> None:
    """Forget the flash-attn import result and the printed path lines (tests swap a fake module in)."""
    _FLASH_ATTN.clear()
    _ANNOUNCED.clear()


def _sdpa_description(cuda: bool) -> str:
    return "torch scaled_dot_product_attention (" + ("fused kernels on CUDA" if cuda else "its fused flash kernel for CPU") + ")"


def describe_attention_path(config: TransformerConfig, cuda: Optional[bool] = None) -> tuple[bool, str]:
    """(flash-attn will run, the one-line message saying which attention path runs and why)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    sdpa = _sdpa_description(cuda)
    if not config.use_flash_attn:
        return False, (f"> attention: {sdpa} when no attention dropout is active, else the explicit softmax path "
                       "(--use-flash-attn not set)")
    flash = _flash_attn()
    if flash["func"] is None:
        reason = flash["error"]
    elif not cuda:
        reason = "flash-attn needs CUDA tensors and none are available"
    elif not (config.fp16 or config.bf16):
        reason = "flash-attn supports fp16/bf16 only (add --fp16 or --bf16)"
    else:
        dtype = "fp16" if config.fp16 else "bf16"
        return True, f"> attention: flash-attn {flash['version']} (CUDA, {dtype})"
    return False, f"> attention: --use-flash-attn: {reason}; using {sdpa}"


def _announce(message: str) -> None:
    if message in _ANNOUNCED:
        return
    _ANNOUNCED.add(message)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _classify_mask(mask: torch.Tensor, sq: int, sk: int) -> tuple[bool, bool]:
    """(has a fully masked row, is exactly the standard causal mask [1, 1, s, s]) for a bool attention mask.

    Every layer sees the same mask tensor (T5: three), so the answer is cached for the last few mask objects (weak
    reference plus its in-place version counter): one device sync per mask and forward instead of one per layer.
    """
    return _mask_entry(mask, sq, sk)[3]


def _mask_entry(mask: torch.Tensor, sq: int, sk: int) -> list:
    key = (sq, sk, tuple(mask.shape))
    for entry in _MASK_CACHE:
        if entry[0]() is mask and entry[1] == mask._version and entry[2] == key:
            return entry
    fully_masked = bool(mask.all(dim=-1).any())
    plain_causal = False
    if sq == sk and mask.dim() == 4 and mask.size(0) == 1 and mask.size(1) == 1 and mask.shape[-2:] == (sq, sk):
        causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(1)
        plain_causal = bool(torch.equal(mask[0, 0], causal))
    entry = [weakref.ref(mask), mask._version, key, (fully_masked, plain_causal), None]
    _MASK_CACHE.insert(0, entry)
    del _MASK_CACHE[_MASK_CACHE_SIZE:]
    return entry


def _sdpa_mask(mask: torch.Tensor, sq: int, sk: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(SDPA's attn_mask, True = attend; the fully masked rows [.., sq, 1] or None) of a bool mask (True = masked),
    cached with the mask. Fully masked rows attend everywhere in the SDPA mask (SDPA would give NaN); the caller
    replaces their output by Megatron's uniform row."""
    entry = _mask_entry(mask, sq, sk)
    if entry[4] is None:
        empty_rows = mask.all(dim=-1, keepdim=True) if entry[3][0] else None
        entry[4] = (~mask if empty_rows is None else ~(mask & ~empty_rows), empty_rows)
    return entry[4]


_WINDOW_CACHE: list = []  # [weakref to the model's mask or None, its version, key, combined mask]


def window_mask(attention_mask: Optional[torch.Tensor], sq: int, sk: int, window: tuple,
                device: torch.device) -> torch.Tensor:
    """Bool [.., sq, sk] (True = masked): the sliding window (queries at the last sq of sk positions attend keys
    i - window[0] .. i + window[1], Megatron Core's get_sliding_window_causal_mask) ORed onto `attention_mask`
    (None: the causal mask). Cached per mask object, so every window layer of a forward sees one tensor."""
    key = (sq, sk, tuple(window), str(device), None if attention_mask is None else tuple(attention_mask.shape))
    for entry in _WINDOW_CACHE:
        ref = entry[0]
        if entry[2] == key and ((ref is None and attention_mask is None) or (
                ref is not None and ref() is attention_mask and entry[1] == attention_mask._version)):
            return entry[3]
    q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
    k_pos = torch.arange(sk, device=device)[None, :]
    mask = (k_pos < q_pos - window[0]) | (k_pos > q_pos + window[1])
    if attention_mask is None:
        mask = mask | (k_pos > q_pos)
    else:
        mask = mask | attention_mask
    ref = None if attention_mask is None else weakref.ref(attention_mask)
    version = None if attention_mask is None else attention_mask._version
    _WINDOW_CACHE.insert(0, [ref, version, key, mask])
    del _WINDOW_CACHE[_MASK_CACHE_SIZE:]
    return mask


def _expand_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """K or V [s, b, ng, hn] -> [s, b, num_heads, hn], each group repeated for its heads (HF's repeat_kv)."""
    s, b, ng, hn = t.shape
    if ng == num_heads:
        return t
    return t.unsqueeze(3).expand(s, b, ng, num_heads // ng, hn).reshape(s, b, num_heads, hn)


class CoreAttention(MegatronModule):
    """softmax(q k^T / sqrt(d) + mask) v on this rank's heads.

    With `config.use_flash_attn`: flash-attn's `flash_attn_func` where it can run (package installed, CUDA,
    fp16/bf16, no mask other than the causal one), else F.scaled_dot_product_attention. Without it:
    F.scaled_dot_product_attention when it computes the same thing (no attention dropout in effect), else the
    explicit path. Attention dropout runs under the tracker's model-parallel RNG (different per TP rank, as
    Megatron) on the explicit and flash-attn paths.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        tp_group: Optional[Any] = None,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
    ) -> None:
        super().__init__(config=config)
        self.fp16 = config.fp16
        self.bf16 = config.bf16
        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.sequence_parallel = config.sequence_parallel
        self.use_flash_attn = config.use_flash_attn
        tp_size = group_size(tp_group)
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = tensor_parallel.divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = tensor_parallel.divide(config.num_attention_heads, tp_size)
        self.alibi = (AlibiBias(config.num_attention_heads, group_rank(tp_group), tp_size)
                      if config.position_embedding_type == "alibi" else None)
        self.window = config.window_size if config.is_window_layer(self.layer_number) else None

        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            self.fp16,
            self.bf16,
            self.attn_mask_type,
            config.masked_softmax_fusion,
            attention_mask_func,
            self.attention_softmax_in_fp32,
            coeff,
        )
        self.attention_dropout_prob = config.attention_dropout
        self.attention_dropout = torch.nn.Dropout(config.attention_dropout)
        # Tests flip this to compare the two paths.
        self.allow_sdpa = True
        self.deterministic_mode = config.deterministic_mode
        self.softmax_type = config.softmax_type
        self.softmax_offset = sink_parameter(config, tp_group) if config.softmax_type == "learnable" else None
        self.flash_attn_ready, message = describe_attention_path(config)
        if torch.empty(0).device.type != "meta":  # a weightless model (conversion's layouts) runs no attention
            _announce(message)

    def _dropout_active(self) -> bool:
        return self.training and self.attention_dropout_prob > 0.0

    def _can_use_sdpa(self, attention_mask: Optional[torch.Tensor], sq: int, sk: int) -> bool:
        if not self.allow_sdpa:
            return False
        if not self._dropout_active():
            return True  # fully masked rows (padding queries) too: _sdpa_call gives them Megatron's uniform row
        # Dropout (--use-flash-attn) over a fully masked row's uniform probabilities: the explicit path.
        return self.use_flash_attn and (attention_mask is None or not _classify_mask(attention_mask, sq, sk)[0])

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """q [sq, b, np, hn], k/v [sk, b, ng, hn] (ng divides np), mask bool [b or 1, 1, sq, sk] (True = masked)
        -> [sq, b, np*hn]."""
        sq, b, np_, hn = query_layer.shape
        sk = key_layer.size(0)
        causal = self.attn_mask_type == AttnMaskType.causal
        if self.window is not None:
            attention_mask = window_mask(attention_mask if attention_mask is not None or not causal else None,
                                         sq, sk, self.window, query_layer.device)
        elif attention_mask is None and causal and (sq != sk or self.alibi is not None):
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query_layer.device).triu(sk - sq + 1)
        if self.softmax_type == "vanilla" and self._can_use_flash_attn(query_layer, attention_mask, sq, sk):
            context = self._flash(query_layer, key_layer, value_layer)  # flash-attn takes fewer K/V heads itself
        elif self.softmax_type == "vanilla" and self._can_use_sdpa(attention_mask, sq, sk):
            context = self._sdpa(query_layer, key_layer, value_layer, attention_mask)
        else:
            key_layer, value_layer = _expand_kv(key_layer, np_), _expand_kv(value_layer, np_)
            context = self._explicit(query_layer, key_layer, value_layer, attention_mask)
        return context

    def _can_use_flash_attn(self, q: torch.Tensor, mask: Optional[torch.Tensor], sq: int, sk: int) -> bool:
        if not self.flash_attn_ready or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        if self.alibi is not None or self.window is not None:
            return False  # the ALiBi bias goes to SDPA as an additive mask, the window as a bool one
        if q.size(-1) % 8 != 0 or q.size(-1) > 256:  # flash-attn 2's head-dimension limits
            return False
        if self.attn_mask_type != AttnMaskType.causal:
            return mask is None
        # Training shapes only (KV-cache decoding goes to SDPA): no mask or exactly the standard causal one.
        return sq == sk and (mask is None or _classify_mask(mask, sq, sk)[1])

    def can_use_flash_varlen(self, q: torch.Tensor) -> bool:
        """Whether packed rows of q [s, b, np, hn] run through flash-attn's varlen kernel (CUDA, fp16/bf16, causal
        vanilla softmax, no ALiBi, head dim a multiple of 8 up to 256); else they take the document mask."""
        if not self.flash_attn_ready or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        if _FLASH_ATTN.get("varlen") is None or self.alibi is not None or self.softmax_type != "vanilla":
            return False
        return self.attn_mask_type == AttnMaskType.causal and q.size(-1) % 8 == 0 and q.size(-1) <= 256

    def flash_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSeqParams) -> torch.Tensor:
        """Causal attention inside each packed document with ``flash_attn_varlen_func`` (the sliding window too):
        q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]."""
        sq, b, np_, hn = q.shape
        cu, longest = packed.flat_cu_seqlens(b, sq, q.device)
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.size(2), hn) for t in (q, k, v))  # [b * s, heads, hn]
        dropout_p = self.attention_dropout_prob if self._dropout_active() else 0.0
        window = (-1, -1) if self.window is None else tuple(self.window)
        with model_parallel_rng_fork(dropout_p > 0.0 and not self.sequence_parallel):
            ctx = _FLASH_ATTN["varlen"](q, k, v, cu, cu, longest, longest, dropout_p=dropout_p,
                                        softmax_scale=1.0 / math.sqrt(hn), causal=True, window_size=window)
        return ctx.view(b, sq, np_ * hn).transpose(0, 1).contiguous()

    def runs_per_document(self, recompute: bool) -> bool:
        """Whether packed rows run as one causal SDPA call per document (measured faster on CPU than the row's
        block-diagonal mask: tools/benchmarks/bench_packing.py --attention): the vanilla causal softmax without
        ALiBi, sliding window, active attention dropout or selective recomputation; else the document mask."""
        return (self.allow_sdpa and self.softmax_type == "vanilla" and self.alibi is None and self.window is None
                and self.attn_mask_type == AttnMaskType.causal and not self._dropout_active() and not recompute)

    def per_document(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSeqParams) -> torch.Tensor:
        """Causal attention inside each packed document, one SDPA call per document (the end padding too):
        q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]."""
        sq, b, np_, hn = q.shape
        cu = packed.flat_cu_seqlens(b, sq, q.device)[0].tolist()
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.size(2), hn).transpose(0, 1) for t in (q, k, v))  # [h, t, d]
        gqa = {"enable_gqa": True} if k.size(0) != np_ and _SDPA_HAS_GQA else {}
        if k.size(0) != np_ and not gqa:
            k, v = (t.repeat_interleave(np_ // t.size(0), dim=0) for t in (k, v))
        deterministic = self.deterministic_mode and q.is_cuda  # as _sdpa: the fused CUDA backwards are not
        with sdpa_kernel(SDPBackend.MATH) if deterministic else contextlib.nullcontext():
            parts = [F.scaled_dot_product_attention(q[:, a:e], k[:, a:e], v[:, a:e], is_causal=True,
                                                    scale=1.0 / math.sqrt(hn), **gqa) for a, e in zip(cu[:-1], cu[1:])]
        ctx = torch.cat(parts, dim=1)  # [np, b * s, hn]
        return ctx.transpose(0, 1).reshape(b, sq, np_ * hn).transpose(0, 1).contiguous()

    def _flash(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sq, b, np_, hn = q.shape
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [b, s, np, hn], flash-attn's layout
        dropout_p = self.attention_dropout_prob if self._dropout_active() else 0.0
        with model_parallel_rng_fork(dropout_p > 0.0 and not self.sequence_parallel):
            ctx = _FLASH_ATTN["func"](q, k, v, dropout_p=dropout_p, softmax_scale=1.0 / math.sqrt(hn),
                                      causal=self.attn_mask_type == AttnMaskType.causal)
        return ctx.transpose(0, 1).reshape(sq, b, np_ * hn)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.deterministic_mode and q.is_cuda:
            # --deterministic-mode: the fused CUDA kernels' backward passes are not deterministic.
            with sdpa_kernel(SDPBackend.MATH):
                return self._sdpa_call(q, k, v, mask)
        return self._sdpa_call(q, k, v, mask)

    def _sdpa_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: Optional[torch.Tensor]) -> torch.Tensor:
        sq, b, np_, hn = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        if (mask is not None and self.alibi is None and self.attn_mask_type == AttnMaskType.causal
                and _classify_mask(mask, sq, k.size(2))[1]):
            mask = None  # the standard causal mask: let SDPA pick its causal (flash) kernels
        is_causal = mask is None and self.attn_mask_type == AttnMaskType.causal
        dropout_p = self.attention_dropout_prob if self._dropout_active() else 0.0
        gqa: dict = {}
        if k.size(1) != np_:
            if _SDPA_HAS_GQA:
                gqa = {"enable_gqa": True}
            else:
                k, v = (_expand_kv(t.permute(2, 0, 1, 3), np_).permute(1, 2, 0, 3) for t in (k, v))
        # Fully masked rows ([b or 1, 1, sq, 1]): Megatron's -10000 fill gives them a uniform softmax, i.e. the mean
        # of V (no gradient to q and k); SDPA attends everywhere there and the mean replaces its output.
        attend, empty_rows = (None, None) if mask is None else _sdpa_mask(mask, sq, k.size(2))
        if self.alibi is not None:  # additive float mask: the bias where attending, -inf where masked
            bias = self.alibi(k.size(2), q.device, q.dtype).unsqueeze(0)  # [1, np, 1, sk]
            attend = bias if attend is None else torch.where(attend, bias, float("-inf"))
        ctx = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attend,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=1.0 / math.sqrt(hn),
            **gqa,
        )
        if empty_rows is not None:
            v_mean = v.mean(dim=2, keepdim=True)  # [b, ng, 1, hn]
            if v_mean.size(1) != np_:
                v_mean = v_mean.repeat_interleave(np_ // v_mean.size(1), dim=1)
            ctx = torch.where(empty_rows, v_mean, ctx)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        sq, b, np_, hn = q.shape
        sk = k.size(0)
        q2 = q.reshape(sq, b * np_, hn).transpose(0, 1)  # [b*np, sq, hn]
        k2 = k.reshape(sk, b * np_, hn).permute(1, 2, 0)  # [b*np, hn, sk]
        scores = torch.bmm(q2, k2).mul_(1.0 / self.norm_factor).view(b, np_, sq, sk)
        if self.alibi is not None:
            # Megatron-DeepSpeed: baddbmm(alibi, q, k^T, beta=1/layer_number with layer scaling, else 1).
            bias = self.alibi(sk, q.device, scores.dtype)
            scores = scores + (bias / self.layer_number if self.apply_query_key_layer_scaling else bias)
        probs = self.scale_mask_softmax(scores, mask, self._sink(np_, scores))
        if self._dropout_active():
            with model_parallel_rng_fork(not self.sequence_parallel):
                probs = self.attention_dropout(probs)
        v2 = v.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
        ctx = torch.bmm(probs.view(b * np_, sq, sk).to(v2.dtype), v2)  # [b*np, sq, hn]
        return ctx.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


    def _sink(self, np_: int, scores: torch.Tensor) -> Optional[torch.Tensor]:
        """The per-head sink logits of --softmax-type (zeros for off-by-one), None for the vanilla softmax."""
        if self.softmax_type == "off-by-one":
            return scores.new_zeros(np_)
        return self.softmax_offset


def sink_parameter(config: TransformerConfig, tp_group: Optional[Any]) -> torch.nn.Parameter:
    """This TP rank's heads' learnable sink logits ``softmax_offset`` [heads / TP] (--softmax-type learnable):
    the full [heads] vector is initialised with init_method from the global seed and split like the heads, so
    TP=N holds the TP=1 values."""
    full = torch.empty(config.num_attention_heads, dtype=torch.float32)
    if config.perform_initialization:
        config.init_method(full)
    local = full.chunk(group_size(tp_group))[group_rank(tp_group)].clone()
    param = torch.nn.Parameter(local.to(config.params_dtype))
    tensor_parallel.set_tensor_model_parallel_attributes(param, True, 0, 1)
    tensor_parallel.set_tp_layout(param, tensor_parallel.TensorParallelLayout(dim=0, structure="attention heads"))
    return param


def qk_norm(config: TransformerConfig) -> torch.nn.Module:
    """One --qk-layernorm norm over a head's channels; its grad is partial per TP rank (summed over TP)."""
    norm = norm_class(config)(config.kv_channels, **{**norm_kwargs(config), "sequence_parallel": False})
    for p in norm.parameters():
        p.tensor_parallel_partial_grad = True
    return norm


class ParallelAttention(MegatronModule):
    """Self- or cross-attention with a fused query_key_value projection (rows [groups, (q x heads/groups, k, v),
    head_dim]; with one group per head that is Megatron's [heads, (q, k, v), head_dim])."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        tp_group: Optional[Any] = None,
        attention_type: AttnType = AttnType.self_attn,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type
        hn, nq, ng = config.kv_channels, config.num_attention_heads, config.num_query_groups
        projection_size = hn * nq
        tp_size = group_size(tp_group)
        self.hidden_size_per_attention_head = hn
        self.num_attention_heads_per_partition = tensor_parallel.divide(nq, tp_size)
        self.num_query_groups_per_partition = tensor_parallel.divide(ng, tp_size)
        self.queries_per_group = nq // ng
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        common = dict(config=config, init_method=config.init_method, tp_group=tp_group, bias=qkv_bias,
                      gather_output=False, sequence_parallel=config.sequence_parallel)
        if attention_type == AttnType.self_attn:
            self.query_key_value = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, projection_size + 2 * hn * ng, **common
            )
            rows = (self.queries_per_group + 2) * hn
            layout = tensor_parallel.TensorParallelLayout(
                dim=0, unit=rows, structure=f"{ng} KV groups of [q x {self.queries_per_group}; k; v] x {hn}")
            for p in self.query_key_value.parameters():
                tensor_parallel.set_tp_layout(p, layout)
        else:
            self.query = tensor_parallel.ColumnParallelLinear(config.hidden_size, projection_size, **common)
            self.key_value = tensor_parallel.ColumnParallelLinear(config.hidden_size, 2 * hn * ng, **common)
            layout = tensor_parallel.TensorParallelLayout(dim=0, unit=2 * hn, structure=f"{ng} KV groups of [k; v]")
            for p in self.key_value.parameters():
                tensor_parallel.set_tp_layout(p, layout)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = qk_norm(config), qk_norm(config)
        self.rotary = (RotaryEmbedding.from_config(config)
                       if config.position_embedding_type == "rope" and attention_type == AttnType.self_attn else None)
        self.core_attention = CoreAttention(config, self.layer_number, tp_group, attn_mask_type)
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self.cp_group: Optional[Any] = None
        self.cp_comm_type = config.cp_comm_type
        self._cp_mask_cache: list = []  # [weakref to the mask, its version, "is the plain causal mask"]
        self.dense = tensor_parallel.RowParallelLinear(
            projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
        )

    def set_context_parallel(self, cp_group: Any) -> None:
        """Split the sequence over `cp_group` (self-attention only): this rank holds chunks r and 2N-1-r."""
        if self.attention_type != AttnType.self_attn:
            raise ValueError("context parallelism splits self-attention only (no cross-attention)")
        if self.core_attention.softmax_type != "vanilla":
            raise ValueError(f"--softmax-type {self.core_attention.softmax_type} does not run under context "
                             "parallelism; use --context-parallel-size 1")
        self.cp_group = cp_group

    def _cp_coords(self) -> tuple[int, int]:
        return torch.distributed.get_world_size(self.cp_group), torch.distributed.get_rank(self.cp_group)

    def _cp_plain_causal(self, mask: Optional[torch.Tensor], seq_len: int, positions: torch.Tensor) -> bool:
        """Whether this rank's mask rows [b|1, 1, s, S] are exactly the causal mask at `positions` (cached)."""
        if mask is None:
            return True
        entry = self._cp_mask_cache
        if entry and entry[0]() is mask and entry[1] == mask._version:
            return entry[2]
        keys = torch.arange(seq_len, device=mask.device)
        causal = (keys[None, :] > positions.to(mask.device)[:, None]).expand(mask.shape)
        plain = bool(torch.equal(mask, causal))
        self._cp_mask_cache = [weakref.ref(mask), mask._version, plain]
        return plain

    def _context_parallel_forward(self, q, k, v, attention_mask):
        n, r = self._cp_coords()
        causal = self.attn_mask_type == AttnMaskType.causal
        if causal and self._cp_plain_causal(attention_mask, q.size(0) * n,
                                            context_parallel.cp_positions(q.size(0) * n, n, r)):
            attention_mask = None  # built per block from positions, never materialised
        window = self.core_attention.window
        if window is not None:  # this rank's rows of the window mask, from its true positions
            positions = context_parallel.cp_positions(q.size(0) * n, n, r, q.device)[:, None]
            keys = torch.arange(q.size(0) * n, device=q.device)[None, :]
            band = (keys < positions - window[0]) | (keys > positions + window[1])
            attention_mask = band if attention_mask is None else (attention_mask | band)
        if attention_mask is not None and attention_mask.size(-2) != q.size(0):
            raise ValueError(f"context parallelism needs this rank's attention-mask rows ([b, 1, {q.size(0)}, S]), "
                             f"got {tuple(attention_mask.shape)}: slice the batch with slice_for_cp")

        def run(q_, k_, v_, mask_):
            return context_parallel.context_parallel_attention(
                q_, k_, v_, self.cp_group, comm_type=self.cp_comm_type, causal=causal, attention_mask=mask_)

        if self.checkpoint_core_attention and self.training and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(run, False, q, k, v, attention_mask)
        return run(q, k, v, attention_mask)

    def _checkpointed_attention_forward(self, q, k, v, attention_mask):
        def custom_forward(q_, k_, v_, mask_):
            return self.core_attention(q_, k_, v_, mask_)

        return tensor_parallel.checkpoint(custom_forward, False, q, k, v, attention_mask)

    def _update_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, inference_params: InferenceParams
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        cache = inference_params.key_value_memory_dict
        if self.layer_number not in cache:
            shape = (
                inference_params.max_sequence_length,
                inference_params.max_batch_size,
                self.num_query_groups_per_partition,
                self.hidden_size_per_attention_head,
            )
            cache[self.layer_number] = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=value.dtype, device=value.device),
            )
        keys, values = cache[self.layer_number]
        b0 = inference_params.batch_size_offset
        b1 = b0 + key.size(1)
        s0 = inference_params.sequence_len_offset
        s1 = s0 + key.size(0)
        if s1 > keys.size(0) or b1 > keys.size(1):
            raise ValueError(
                f"inference cache too small: need sequence {s1} / batch {b1}, allocated "
                f"{keys.size(0)} / {keys.size(1)} (InferenceParams(max_batch_size, max_sequence_length))"
            )
        keys[s0:s1, b0:b1] = key
        values[s0:s1, b0:b1] = value
        return keys[:s1, b0:b1], values[:s1, b0:b1], s0, s1

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        encoder_output: Optional[torch.Tensor] = None,
        inference_params: Optional[InferenceParams] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """hidden [sq, b, h] -> (output, bias). `packed_seq_params`: packed documents in each row (their own
        positions and block-diagonal causal mask; replaces `attention_mask`), megatron/core/packed_seq_params.py."""
        np_ = self.num_attention_heads_per_partition
        ng = self.num_query_groups_per_partition
        hn = self.hidden_size_per_attention_head
        if self.attention_type == AttnType.self_attn:
            mixed, _ = self.query_key_value(hidden_states)  # [sq, b, ng * (np/ng + 2) * hn]
            mixed = mixed.view(mixed.size(0), mixed.size(1), ng, (self.queries_per_group + 2) * hn)
            query, key, value = torch.split(mixed, [self.queries_per_group * hn, hn, hn], dim=-1)
            query = query.reshape(query.size(0), query.size(1), np_, hn)
        else:
            if encoder_output is None:
                raise ValueError("cross attention needs encoder_output")
            mixed_kv, _ = self.key_value(encoder_output)
            mixed_kv = mixed_kv.view(mixed_kv.size(0), mixed_kv.size(1), ng, 2 * hn)
            key, value = torch.split(mixed_kv, hn, dim=-1)
            query, _ = self.query(hidden_states)
            query = query.view(query.size(0), query.size(1), np_, hn)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)

        if isinstance(inference_params, PagedStep):  # the inference engine's paged cache (megatron/inference/)
            return self._paged_forward(query, key, value, inference_params)
        if self.cp_group is not None and inference_params is not None:
            raise ValueError("KV-cache decoding does not run under context parallelism; generate at "
                             "--context-parallel-size 1")
        if packed_seq_params is not None:
            query, key, attention_mask = self._packed_rope_and_mask(query, key, packed_seq_params, inference_params)
        elif self.rotary is not None and self.cp_group is not None:  # each chunk at its true positions
            n, r = self._cp_coords()
            cos, sin = self.rotary.cos_sin(query.size(0) * n, 0, query.device, query.dtype)
            positions = context_parallel.cp_positions(query.size(0) * n, n, r, query.device)
            query = apply_rotary_pos_emb(query, cos[positions], sin[positions])
            key = apply_rotary_pos_emb(key, cos[positions], sin[positions])
        elif self.rotary is not None:
            offset = inference_params.sequence_len_offset if inference_params is not None else 0
            cos, sin = self.rotary.cos_sin(query.size(0), offset, query.device, query.dtype)
            query = apply_rotary_pos_emb(query, cos, sin)
            key = apply_rotary_pos_emb(key, cos, sin)

        if inference_params is not None and self.attention_type == AttnType.self_attn:
            key, value, s0, s1 = self._update_kv_cache(key, value, inference_params)
            if attention_mask is not None and attention_mask.size(-2) != query.size(0):
                attention_mask = attention_mask[..., s0:s1, :s1]

        if self.cp_group is not None:
            context = self._context_parallel_forward(query, key, value, attention_mask)
        elif packed_seq_params is not None and self.core_attention.can_use_flash_varlen(query):
            context = self.core_attention.flash_varlen(query, key, value, packed_seq_params)
        elif packed_seq_params is not None and self.core_attention.runs_per_document(self.checkpoint_core_attention):
            context = self.core_attention.per_document(query, key, value, packed_seq_params)
        elif self.checkpoint_core_attention and self.training and torch.is_grad_enabled():
            context = self._checkpointed_attention_forward(query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        return self.dense(context)

    def _packed_rope_and_mask(self, query: torch.Tensor, key: torch.Tensor, packed: PackedSeqParams,
                              inference_params: Optional[InferenceParams]) -> tuple:
        """(query, key rotated at their positions inside their documents, this rank's rows of the documents'
        block-diagonal causal mask) for packed rows; under context parallelism the rows of chunks r, 2N-1-r."""
        if inference_params is not None or self.attention_type != AttnType.self_attn:
            raise ValueError("packed sequences (cu_seqlens) are for training and evaluation self-attention; "
                             "KV-cache decoding and cross-attention take one sequence per row")
        n, r = self._cp_coords() if self.cp_group is not None else (1, 0)
        b, full = query.size(1), query.size(0) * n
        rows = context_parallel.cp_positions(full, n, r, query.device) if n > 1 else None
        if self.rotary is not None:
            positions = packed.position_ids(b, full, query.device)
            cos, sin = self.rotary.cos_sin_at(positions if rows is None else positions[:, rows], query.dtype)
            query, key = apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
        return query, key, packed.attention_mask(b, full, query.device, rows=rows)

    def _paged_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       step: PagedStep) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Self-attention of one engine step (tokens [T, 1, ...]) over the paged cache: RoPE at each token's
        position, this step's K/V written to its blocks, each request's context gathered; GQA, ALiBi, sliding
        window and sinks as the static path."""
        if self.attention_type != AttnType.self_attn or self.cp_group is not None:
            raise ValueError("the inference engine runs decoder self-attention at --context-parallel-size 1 only")
        if self.rotary is not None:
            cos, sin = step.rotary_cos_sin(self.rotary, query.dtype)
            query, key = apply_rotary_pos_emb(query, cos, sin), apply_rotary_pos_emb(key, cos, sin)
        keys, values = step.write(self.layer_number, key[:, 0], value[:, 0])
        core = self.core_attention
        bias = core.alibi(step.max_context, query.device, torch.float32)[:, 0] if core.alibi is not None else None
        sink = core.softmax_offset if core.softmax_type == "learnable" else None
        if core.softmax_type == "off-by-one":
            sink = query.new_zeros(query.size(2))
        ctx = paged_attention(step.pad_queries(query[:, 0]), step.gather(keys), step.gather(values),
                              step.attend_mask(core.window), 1.0 / math.sqrt(self.hidden_size_per_attention_head),
                              bias, sink)
        context = step.unpad(ctx).to(query.dtype)
        return self.dense(context.reshape(context.size(0), 1, -1))
