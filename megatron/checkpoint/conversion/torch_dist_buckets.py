"""Megatron-LM's default distributed-optimizer layout in `torch_dist` folders (``dp_reshardable``), read into model
space.

Megatron Core 0.16 (``DistributedOptimizer.sharded_state_dict`` without ``--dist-ckpt-optim-fully-reshardable``)
stores, per tensor x pipeline rank (``dp_group_idx = pp_rank * TP + tp_rank``), each bucket of its gradient buffer
as one flat tensor per state key: ``optimizer.distributed.dp_group_idx_I.gbuf_idx_G.dtype_(...).bucket_idx_B.KEY``
(KEY ``param``: the fp32 main params, ``exp_avg``, ``exp_avg_sq``) of the bucket's unpadded length, and beside them
ShardedObjects ``...dp_group_idx_I.optimizer`` (the param groups, with the step count) and
``...per_bucket_numel_unpadded``. Which parameter sits where is not recorded: it is Megatron Core's buffer layout,
rebuilt here from the model (its parameters of that TP x PP rank in module order, walked in reverse, each start
padded to 64 elements; a bucket ends where the recorded unpadded length says, and tied embeddings split across
pipeline stages sit in a bucket of their own) and checked against ``per_bucket_numel_unpadded``. Each parameter's
slice is cut out, shaped like its TP shard and merged over TP and PP into one full tensor: the optimizer state then
loads at any TP/PP/DP layout here, while Megatron Core itself reads this layout back only at the TP/PP that wrote it
(any DP size). Dense GPT / Llama-family models with one gradient buffer, and BERT and T5 without a pipeline (T5 with
the local layer spec: its Transformer Engine order is not rebuilt); MoE, virtual or uneven pipelines are one line
naming ``--dist-ckpt-optim-fully-reshardable``.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint.conversion.interchange import ConversionError, ModelMeta
from megatron.run_configs.saved_args import SavedRunArgs

BUCKETS = "dp_reshardable"
UNREADABLE = "unreadable"  # common["optimizer"][UNREADABLE]: why the bucket state could not be read (raised on use)
_PREFIX = "optimizer.distributed.dp_group_idx_"
_BUCKET_RE = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+\.bucket_idx_(\d+)"
                        r"\.(\w+)$")
_LM = "language_model."
_WORD = _LM + "embedding.word_embeddings.weight"
_HEAD_COPY = "word_embeddings.weight"  # the last stage's copy of tied embeddings
_FIX = "save with --dist-ckpt-optim-fully-reshardable, or load with --no-load-optim"
# a layer's parameters in Megatron Core's module order (our names): local spec, and Transformer Engine's (the norms
# inside linear_qkv / linear_fc1, registered before their linear's weight; linear_proj comes first in SelfAttention)
_NORM1 = ("input_layernorm.weight", "input_layernorm.bias")
_PROJ = ("self_attention.dense.weight", "self_attention.dense.bias")
_REST = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
         "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_h_to_4h.weight",
         "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias")
LAYER_ORDER = {"local": _NORM1 + _PROJ + _REST, "transformer_engine": _PROJ + _NORM1 + _REST}
# BERT after its encoder, and a T5 decoder layer (local spec: the cross-attention's linear_proj before linear_q and
# linear_kv, as its self-attention's), in Megatron Core's module order, our names
_BERT_HEAD = ("encoder.final_layernorm.weight", "encoder.final_layernorm.bias", "lm_head.dense.weight",
              "lm_head.dense.bias", "lm_head.layernorm.weight", "lm_head.layernorm.bias", "lm_head.bias",
              "binary_head.weight", "binary_head.bias", "pooler.dense.weight", "pooler.dense.bias")
_T5_DECODER = _NORM1 + _PROJ + _REST[:2] + (
    "post_attention_layernorm.weight", "post_attention_layernorm.bias", "inter_attention.dense.weight",
    "inter_attention.dense.bias", "inter_attention.query.weight", "inter_attention.query.bias",
    "inter_attention.key_value.weight", "inter_attention.key_value.bias", "post_inter_attention_layernorm.weight",
    "post_inter_attention_layernorm.bias") + _REST[4:]


def _stage_order(names: List[str], layers: range, transformer_impl: str, first: bool, last: bool) -> List[str]:
    """Our names of one pipeline stage's parameters in Megatron Core's `named_parameters` order."""
    present = set(names)
    order = [_WORD, _LM + "embedding.position_embeddings.weight"] if first else []
    for i in layers:
        order += [f"{_LM}encoder.layers.{i}.{suffix}" for suffix in LAYER_ORDER[transformer_impl]]
    if last:
        order += [_LM + "encoder.final_layernorm.weight", _LM + "encoder.final_layernorm.bias",
                  _LM + "output_layer.weight", _HEAD_COPY]
    order = [n for n in order if n in present]
    extra = sorted(present - set(order))
    if extra:
        raise ConversionError(f"{extra[0]} has no place in Megatron Core's buffer layout as rebuilt here")
    return order


def _layer_count(names: List[str], stack: str) -> int:
    return len({n[len(stack):].split(".")[0] for n in names if n.startswith(stack)})


def _encoder_decoder_order(names: List[str], transformer_impl: str) -> List[str]:
    """Our names of a BERT's or T5's parameters (one pipeline stage) in Megatron Core's `named_parameters` order."""
    present = set(names)
    order = [_WORD] + [_LM + f"embedding.{e}_embeddings.weight" for e in ("position", "tokentype")]
    for i in range(_layer_count(names, _LM + "encoder.layers.")):
        order += [f"{_LM}encoder.layers.{i}.{suffix}" for suffix in LAYER_ORDER[transformer_impl]]
    if _LM + "decoder.layers.0.inter_attention.query.weight" in present:  # T5
        order += [_LM + "encoder.final_layernorm.weight", _LM + "encoder.final_layernorm.bias"]
        for i in range(_layer_count(names, _LM + "decoder.layers.")):
            order += [f"{_LM}decoder.layers.{i}.{suffix}" for suffix in _T5_DECODER]
        order += [_LM + "decoder.final_layernorm.weight", _LM + "decoder.final_layernorm.bias", "lm_head.bias"]
    else:
        order += [name if name.startswith(("lm_head.", "binary_head.")) else _LM + name for name in _BERT_HEAD]
    order = [n for n in order if n in present]
    extra = sorted(present - set(order))
    if extra:
        raise ConversionError(f"{extra[0]} has no place in Megatron Core's buffer layout as rebuilt here")
    return order


def _encoder_decoder_layouts(flat: Dict[str, torch.Tensor], arch: Dict[str, Any]) -> Dict[str, Any]:
    """{our name: TP layout} of the BERT or T5 model `flat` is the state of (built on the meta device)."""
    names = list(flat)
    if any(n.startswith(_LM + "decoder.") for n in names):
        from megatron.checkpoint.conversion.t5_format import t5_layouts

        counts = {"encoder_num_layers": _layer_count(names, _LM + "encoder.layers."),
                  "decoder_num_layers": _layer_count(names, _LM + "decoder.layers.")}
        return t5_layouts(ModelMeta(model_type="T5", architecture=dict(arch, **counts), extra={"t5": counts}))
    from megatron.checkpoint.conversion.megatron_format import layer_layouts

    types = flat.get(_LM + "embedding.tokentype_embeddings.weight")
    bert = {"num_tokentypes": 0 if types is None else int(types.size(0)),
            "add_binary_head": "binary_head.weight" in flat}
    return layer_layouts(ModelMeta(model_type="BERT", architecture=arch, extra={"bert": bert}))


def _offsets(order: List[Tuple[str, int, bool]], recorded: List[int]) -> Tuple[Dict[str, Tuple[int, int]], List[int]]:
    """{name: (bucket, start in the bucket)} of parameters (name, numel, own bucket) laid out as Megatron Core's
    _ParamAndGradBuffer does (reverse order, starts padded to 64), buckets cut at the recorded unpadded lengths; and
    the unpadded lengths this layout gives."""
    where: Dict[str, Tuple[int, int]] = {}
    lengths: List[int] = []
    cursor, used = 0, False
    for name, numel, own in reversed(order):
        start = -(-cursor // 64) * 64
        if own and used:
            lengths.append(start)
            start, used = 0, False
        bucket = len(lengths)
        where[name] = (bucket, start)
        cursor, used = start + numel, True
        if own or (bucket < len(recorded) and cursor >= recorded[bucket]):
            lengths.append(cursor)
            cursor, used = 0, False
    if used:
        lengths.append(cursor)
    return where, lengths


def bucket_state(tensors: Dict[str, torch.Tensor], objects: Dict[str, Any], flat: Dict[str, torch.Tensor],
                 arch: Dict[str, Any], args: Any, where: str) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """({"optimizer": param groups, "grad_scaler"?}, {state key: our full flat dict}) of a dp_reshardable folder,
    from its bucket tensors and ShardedObjects (read_tensors / read_objects with the ``optimizer.distributed.``
    prefix) and the full model `flat` (ours, TP=1) that gives every parameter's shape."""
    from megatron.checkpoint.conversion.megatron_format import layer_layouts
    from megatron.layers.tp_shards import merge_tensor_parallel_state_dicts, split_tensor_parallel_state_dict

    what = f"{where}: its distributed optimizer state (Megatron Core's {BUCKETS} layout)"
    saved = SavedRunArgs.from_args(args)
    tp = int(saved.tensor_model_parallel_size or 1)
    pp = saved.pipeline_model_parallel_size
    _refuse_unread_layouts(saved, what)
    enc_dec = any(k.startswith(("lm_head.", "binary_head.", _LM + "decoder.")) for k in flat)  # BERT or T5
    if enc_dec and pp > 1:
        raise ConversionError(f"{what} is read for BERT and T5 at pipeline-parallel size 1 only; {_FIX}")
    buckets = _buckets(tensors)
    groups = sorted({g for g, _, _ in buckets})
    if groups != list(range(tp * pp)) or any(gbuf for _, gbuf, _ in buckets):
        raise ConversionError(f"{what} holds buffers of model-parallel groups {groups} and gradient buffers "
                              f"{sorted({b for _, b, _ in buckets})}, not one buffer for each of the TP x PP = "
                              f"{tp} x {pp} ranks its args name; {_FIX}")
    keys = sorted(next(iter(buckets.values())))
    if "param" not in keys:
        raise ConversionError(f"{what} has no fp32 main params (bucket 'param' tensors); {_FIX}")
    num_layers = int(arch["num_layers"])
    if num_layers % pp:
        raise ConversionError(f"{what}: {num_layers} layers do not split into {pp} pipeline stages")
    impl = saved.transformer_impl or "transformer_engine"  # Megatron-LM's default
    if impl not in LAYER_ORDER:
        raise ConversionError(f"{what}: unknown --transformer-impl {impl}; {_FIX}")
    if enc_dec and impl != "local" and any(k.startswith(_LM + "decoder.") for k in flat):
        raise ConversionError(f"{what} is read for T5 with --transformer-impl local only; {_FIX}")
    layouts = _encoder_decoder_layouts(flat, arch) if enc_dec else \
        layer_layouts(ModelMeta(model_type="GPT", architecture=arch))
    tied = _LM + "output_layer.weight" not in flat
    per_key_stages: Dict[str, Dict[str, torch.Tensor]] = {k: {} for k in keys}
    per = num_layers // pp
    for p in range(pp):
        layers = range(p * per, (p + 1) * per)
        first, last = p == 0, p == pp - 1
        piece = _stage_piece(flat, layers, first, last)
        if last and tied and pp > 1:
            piece[_HEAD_COPY] = flat[_WORD]
        shards = split_tensor_parallel_state_dict(piece, tp, layouts={**layouts, _HEAD_COPY: layouts[_WORD]})
        order = _encoder_decoder_order(list(piece), impl) if enc_dec else \
            _stage_order(list(piece), layers, impl, first, last)
        local: Dict[str, List[Dict[str, torch.Tensor]]] = {k: [] for k in keys}
        for t in range(tp):
            index = p * tp + t
            recorded = objects.get(f"{_PREFIX}{index}.per_bucket_numel_unpadded")
            try:
                (recorded,) = [list(v) for v in recorded[0].values()]
            except (TypeError, ValueError, KeyError, IndexError, AttributeError):
                raise ConversionError(f"{what} has no readable per_bucket_numel_unpadded for model-parallel group "
                                      f"{index}; {_FIX}") from None
            shared = tied and pp > 1
            params = [(n, shards[t][n].numel(), shared and n in (_WORD, _HEAD_COPY)) for n in order]
            offsets, lengths = _offsets(params, recorded)
            if lengths != recorded:
                raise ConversionError(f"{what}: the buckets of model-parallel group {index} hold {recorded} elements "
                                      f"but this model laid out as Megatron Core does gives {lengths} (another "
                                      f"model or --transformer-impl?); {_FIX}")
            for key in keys:
                cut = {}
                for n in order:
                    bucket, start = offsets[n]
                    flat_bucket = buckets.get((index, 0, bucket), {}).get(key)
                    if flat_bucket is None or flat_bucket.numel() != recorded[bucket]:
                        raise ConversionError(f"{what} lacks bucket {bucket} {key} of model-parallel group {index} "
                                              "(or its length differs); restore the checkpoint or pass --no-load-optim")
                    shape = shards[t][n].shape
                    cut[n] = flat_bucket[start:start + shards[t][n].numel()].reshape(shape).float()
                local[key].append(cut)
        for key in keys:
            merged = merge_tensor_parallel_state_dicts(local[key], layouts={**layouts, _HEAD_COPY: layouts[_WORD]})
            merged.pop(_HEAD_COPY, None)  # the same state as the first stage's (their gradients are summed)
            per_key_stages[key].update(merged)
    return _optimizer_extras(objects, what), per_key_stages


def _refuse_unread_layouts(saved: SavedRunArgs, what: str) -> None:
    """ConversionError for the saved runs whose bucket layout is not read (experts, virtual or uneven pipelines)."""
    for flag, value in (("--num-experts", saved.num_experts),
                        ("--num-layers-per-virtual-pipeline-stage", saved.num_layers_per_virtual_pipeline_stage),
                        ("--decoder-first-pipeline-num-layers", saved.decoder_first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", saved.decoder_last_pipeline_num_layers)):
        if value:
            raise ConversionError(f"{what} is not read for a run with {flag}; {_FIX}")


def _buckets(tensors: Dict[str, torch.Tensor]) -> Dict[Tuple[int, int, int], Dict[str, torch.Tensor]]:
    """(model-parallel group, gradient buffer, bucket) -> {state key: flat bucket tensor} of the bucket tensors."""
    buckets: Dict[Tuple[int, int, int], Dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _BUCKET_RE.match(key)
        if m:
            buckets.setdefault(tuple(int(g) for g in m.groups()[:3]), {})[m.group(4)] = t
    return buckets


def _stage_piece(flat: Dict[str, torch.Tensor], layers: range, first: bool, last: bool) -> Dict[str, torch.Tensor]:
    """The entries of `flat` one pipeline stage holds: its `layers`, the embedding on the first, the rest on the last."""
    piece = {}
    for name, value in flat.items():
        index = name[len(_LM + "encoder.layers."):].split(".")[0] if name.startswith(_LM + "encoder.layers.") \
            else None
        if index is not None and int(index) not in layers:
            continue
        if index is None and not ((first and ".embedding." in name) or (last and ".embedding." not in name)):
            continue
        piece[name] = value
    return piece


def _optimizer_extras(objects: Dict[str, Any], what: str) -> Dict[str, Any]:
    """{"optimizer": {"param_groups"}, "grad_scaler"?} from the folder's ShardedObjects."""
    saved = objects.get(f"{_PREFIX}0.optimizer")
    if not isinstance(saved, dict) or "param_groups" not in saved:
        raise ConversionError(f"{what} has no param groups (ShardedObject {_PREFIX}0.optimizer); {_FIX}")
    extra: Dict[str, Any] = {"optimizer": {"param_groups": saved["param_groups"]}}
    if objects.get(f"{_PREFIX}0.grad_scaler") is not None:
        extra["grad_scaler"] = objects[f"{_PREFIX}0.grad_scaler"]
    return extra


def describe(common: Dict[str, Any]) -> Optional[str]:
    """Why a dp_reshardable folder's optimizer state could not be read (None when it could, or another layout)."""
    opt = common.get("optimizer")
    return opt.get(UNREADABLE) if isinstance(opt, dict) else None
