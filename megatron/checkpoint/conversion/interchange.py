"""The interchange form between loaders and savers: `ModelMeta` (architecture, vocabulary, training counters,
tokenizer files) and `Message`s of full TP=1 tensors under Megatron's parameter names.

Message stream of a GPT-family model, in order (Megatron-LM's tools/checkpoint names the same parts)::

    "embeddings"            word_embeddings.weight [vocab rows], position_embeddings.weight (learned positions),
                            tokentype_embeddings.weight (BERT), word_embeddings.norm.weight/bias (--embed-layernorm)
    "transformer layer {i}" i = 0..num_layers-1; keys are the suffixes after ``language_model.encoder.layers.{i}.``
                            (``self_attention.query_key_value.weight`` in Megatron's grouped layout, SwiGLU's
                            ``mlp.dense_h_to_4h.weight`` as [gate; up], ...)
    "final norm"            final_layernorm.weight [, final_layernorm.bias]
    "output layer"          output_layer.weight (untied models only)
    "mtp"                   the multi-token-prediction block (--mtp-num-layers): ``layers.{k}.enorm.weight``, ...,
                            ``layers.{k}.transformer_layer.<a layer's names>`` (Megatron Core's ``mtp.`` names)
    "pooler", "lm head", "binary head"   BERT: pooler dense.*, LM head dense.* / layernorm.* / bias (vocab rows),
                            binary head weight/bias (keys relative to ``language_model.pooler.``, ``lm_head.``, ...)
    "classification head", "multichoice head"   finetuned BERT (tasks/): weight/bias of the replicated linear head

The word embedding / output layer carry ``meta.true_vocab_size`` rows when the loader knows the tokenizer's size
(padding dropped; savers re-pad as Megatron does), else the source's padded rows. With the training state
(``Message.optimizer``, ``meta.extra["optimizer"]``: step count, param-group hyperparameters, grad scaler) the padded
rows are kept as trained, since they take part in the softmax (megatron/checkpoint/conversion/optimizer_state.py).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from megatron.core.transformer_config import TransformerConfig
from megatron.errors import MegatronUserError
from megatron.settings import all_settings, config_flag, flag_spelling, kept_fields

EMBEDDINGS = "embeddings"
FINAL_NORM = "final norm"
OUTPUT_LAYER = "output layer"
MTP, MTP_PREFIX = "mtp", "mtp."  # the multi-token-prediction block (megatron/layers/mtp.py), keys "layers.{k}.*"
LAYER_PREFIX = "transformer layer "

MODEL_TYPES = ("GPT", "BERT", "T5")
SUPPORTED_MODEL_TYPES = ("GPT", "BERT", "T5")  # T5: Megatron <-> Megatron, TP only (t5_format.py)

# TransformerConfig fields a converted model keeps (the architecture; numerics and parallel sizes are the run's), in
# the order the settings declare (`setting(..., kept=N)` in megatron/settings/): the order of a converted
# checkpoint's ``architecture``.
_KEPT_FIELDS = kept_fields()


# what to do with a Core checkpoint that records no architecture (Megatron-LM takes it from its command line)
NO_ARGS_HINT = ("load it with --load and the model flags (pretrain_*.py --finetune, or the generation tools), which "
                "check every tensor's shape against them, and save it again to convert it")


class ConversionError(MegatronUserError, ValueError):
    """Bad input for a conversion (names the file or flag and the fix); nothing is written."""


def layer_message(i: int) -> str:
    return f"{LAYER_PREFIX}{i}"


@dataclass
class Message:
    """One part of the model: full (TP=1) tensors keyed by Megatron names relative to the part."""

    name: str
    tensors: Dict[str, torch.Tensor]
    # training state (loaders that read it, `--no-save-optim` not given): per key of `tensors`, the full fp32 main
    # param and optimizer moments {"param", "exp_avg", "exp_avg_sq"} (shaped like the tensor, same TP layout)
    optimizer: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ModelMeta:
    """What a saver needs besides the tensors."""

    model_type: str
    architecture: Dict[str, Any]
    true_vocab_size: Optional[int] = None
    iteration: Optional[int] = None  # None: a release checkpoint (no training state)
    checkpoint_args: Optional[Any] = None  # the source's saved args namespace, when it is a Megatron checkpoint
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    make_vocab_size_divisible_by: int = 128
    tokenizer: Dict[str, Any] = field(default_factory=dict)  # {"type", "files": [paths], ...}
    source: str = ""  # a description for messages
    extra: Dict[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any) -> TransformerConfig:
        """A TP=1 TransformerConfig of the architecture (dropouts 0)."""
        kwargs = {k: v for k, v in self.architecture.items() if k in _KEPT_FIELDS}
        if not kwargs.get("group_query_attention"):
            kwargs["num_query_groups"] = None
        kwargs.update(hidden_dropout=0.0, attention_dropout=0.0)
        kwargs.update(overrides)
        try:
            return TransformerConfig(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConversionError(f"{self.source}: the stored architecture is not a valid model ({exc})") from None


def architecture_of(config: TransformerConfig) -> Dict[str, Any]:
    """{field: plain value} of the architecture fields of `config` (what checkpoints store as ``architecture``)."""
    out: Dict[str, Any] = {}
    for name in _KEPT_FIELDS:
        value = getattr(config, name)
        if isinstance(value, tuple):
            value = list(value)  # --window-size (W, R)
        out[name] = value if value is None or isinstance(value, (bool, int, float, str, list)) else str(value)
    if not config.group_query_attention:
        out["num_query_groups"] = None
    return out


def with_architecture(meta: ModelMeta, **changes: Any) -> ModelMeta:
    return dataclasses.replace(meta, architecture={**meta.architecture, **changes})


def model_flags(meta: ModelMeta, tp: int = 1, pp: int = 1, vp_layers: Optional[int] = None) -> str:
    """The Megatron flags that build the model of `meta` (what to pass with the converted checkpoint); the option
    strings are the settings' (megatron/settings/: `config_flag`, `flag_spelling`)."""
    a = meta.architecture
    flags: List[str] = [f"{config_flag(k)} {a[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads")]
    if a.get("ffn_hidden_size") and a["ffn_hidden_size"] != 4 * a["hidden_size"] or a.get("swiglu"):
        flags.append(f"{config_flag('ffn_hidden_size')} {a['ffn_hidden_size']}")
    if a.get("kv_channels") and a["kv_channels"] != a["hidden_size"] // a["num_attention_heads"]:
        flags.append(f"{config_flag('kv_channels')} {a['kv_channels']}")
    seq = getattr(meta.checkpoint_args, "seq_length", None) or a["max_position_embeddings"]
    flags.append(f"{flag_spelling('seq_length')} {seq} {config_flag('max_position_embeddings')} "
                 f"{a['max_position_embeddings']}")
    if a.get("normalization", "LayerNorm") != "LayerNorm":
        flags.append(f"{config_flag('normalization')} {a['normalization']}")
    flags.append(f"{config_flag('layernorm_epsilon')} {a.get('layernorm_epsilon', 1e-5)}")
    flags.extend(config_flag(key) for key in _SWITCHES if a.get(key))
    if a.get("glu_activation"):
        flags.append(f"{config_flag('glu_activation')} {a['glu_activation']}")
    if not a.get("bias_gelu_fusion", True) and not (a.get("swiglu") or a.get("squared_relu")
                                                    or a.get("glu_activation")):
        flags.append(config_flag("bias_gelu_fusion"))
    flags.extend(_position_flags(a))
    if a.get("group_query_attention"):
        flags.append(f"{config_flag('group_query_attention')} {config_flag('num_query_groups')} "
                     f"{a['num_query_groups']}")
    for key in ("add_bias_linear", "share_embeddings_and_output_weights"):  # on by default, a flag turns them off
        if not a.get(key, True):
            flags.append(config_flag(key))
    if a.get("num_moe_experts"):
        flags.append(_moe_flags(a))
    if a.get("window_size"):
        flags.append(f"{config_flag('window_size')} {','.join(str(int(x)) for x in a['window_size'])}")
        if a.get("window_attn_skip_freq") is not None:
            freq = a["window_attn_skip_freq"]
            text = str(freq) if isinstance(freq, int) else "[" + ",".join(str(int(x)) for x in freq) + "]"
            flags.append(f"{config_flag('window_attn_skip_freq')} {text}")
    flags.extend(_layout_flags(meta, tp, pp, vp_layers))
    tok = meta.tokenizer
    if tok.get("type"):
        flags.append(f"{flag_spelling('tokenizer_type')} {tok['type']}")
        flags.extend(f"{flag_spelling(key)} {tok[key]}" for key in _TOKENIZER_FILES if tok.get(key))
    if meta.make_vocab_size_divisible_by != 128:
        flags.append(f"{flag_spelling('make_vocab_size_divisible_by')} {meta.make_vocab_size_divisible_by}")
    return " ".join(flags)


# architecture switches model_flags passes when set (in this order), and the tokenizer files it names
_SWITCHES = ("apply_layernorm_1p", "swiglu", "openai_gelu", "squared_relu", "apply_residual_connection_post_layernorm",
             "add_qkv_bias", "embed_layernorm", "qk_layernorm")
_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model", "tokenizer_name_or_path")


def _position_flags(a: Dict[str, Any]) -> List[str]:
    """--position-embedding-type and, with rope, its base, fraction and scaling (values that differ from defaults)."""
    flags = []
    pos = a.get("position_embedding_type", "learned_absolute")
    if pos != "learned_absolute":
        flags.append(f"{config_flag('position_embedding_type')} {pos}")
    if pos == "rope":
        flags.append(f"{config_flag('rotary_base')} {a.get('rotary_base', 10000.0):g}")
        if a.get("rotary_percent", 1.0) != 1.0:
            flags.append(f"{config_flag('rotary_percent')} {a['rotary_percent']}")
        flags.extend(_rope_scaling_flags(a))
    return flags


def _layout_flags(meta: ModelMeta, tp: int, pp: int, vp_layers: Optional[int]) -> List[str]:
    """T5's layer counts and extra ids, then the parallel layout of the written checkpoint."""
    flags = []
    t5 = meta.extra.get("t5")  # an encoder-decoder's record (only its readers write it): each stack's layers
    if t5:
        flags.append(f"{config_flag('encoder_num_layers')} {t5['encoder_num_layers']} "
                     f"{config_flag('decoder_num_layers')} {t5['decoder_num_layers']}")
        if getattr(meta.checkpoint_args, "vocab_extra_ids", None):
            flags.append(f"{flag_spelling('vocab_extra_ids')} {meta.checkpoint_args.vocab_extra_ids}")
    flags.append(f"{flag_spelling('tensor_model_parallel_size')} {tp} {flag_spelling('pipeline_model_parallel_size')} "
                 f"{pp}")
    if t5 and pp > 1 and meta.extra.get("written_split_rank"):  # T5's first decoder stage (t5_format.T5Writer)
        flags.append(f"{flag_spelling('pipeline_model_parallel_split_rank')} {meta.extra['written_split_rank']}")
    if vp_layers:
        flags.append(f"{flag_spelling('num_layers_per_virtual_pipeline_stage')} {vp_layers}")
    return flags


def _rope_scaling_flags(a: Dict[str, Any]) -> List[str]:
    """--rotary-seq-len-interpolation-factor / --use-rope-scaling and its values that differ from the defaults."""
    flags = []
    if a.get("rotary_seq_len_interpolation_factor") is not None:
        flags.append(f"{config_flag('rotary_seq_len_interpolation_factor')} {a['rotary_seq_len_interpolation_factor']}")
    if a.get("use_rope_scaling"):
        flags.append(config_flag("use_rope_scaling"))
        for key in ("rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                    "rope_scaling_original_max_position_embeddings"):
            default = _DEFAULTS[key]
            if a.get(key, default) != default:
                flags.append(f"{config_flag(key)} {a[key]}")
    if a.get("rope_type") is not None:
        flags.append(f"{config_flag('rope_type')} {a['rope_type']}")
    for key in ("rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
                "beta_slow"):  # YaRN's values that differ from the defaults
        if a.get(key, _DEFAULTS[key]) != _DEFAULTS[key]:
            flags.append(f"{config_flag(key)} {a[key]}")
    if not a.get("yarn_correction_range_round_to_int", True):
        flags.append(config_flag("yarn_correction_range_round_to_int"))
    return flags


def _moe_flags(a: Dict[str, Any]) -> str:
    """The MoE architecture flags of `a` (values that differ from Megatron-LM's defaults)."""
    flags = [f"{config_flag('num_moe_experts')} {a['num_moe_experts']} {config_flag('moe_router_topk')} "
             f"{a.get('moe_router_topk', 2)}"]
    freq = a.get("moe_layer_freq", 1)
    if freq != 1:
        flags.append(f"{config_flag('moe_layer_freq')} {str(freq).replace(' ', '')}" if isinstance(freq, list)
                     else f"{config_flag('moe_layer_freq')} {freq}")
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor",
                "moe_expert_capacity_factor", "moe_z_loss_coeff", "moe_router_dtype"):
        if a.get(key) is not None:
            flags.append(f"{config_flag(key)} {a[key]}")
    flags.extend(config_flag(key) for key in ("moe_router_pre_softmax", "moe_shared_expert_gate",
                                              "moe_pad_expert_input_to_capacity", "moe_apply_probs_on_input")
                 if a.get(key))
    for key in ("moe_router_score_function", "moe_router_load_balancing_type", "moe_token_drop_policy"):
        if a.get(key, _DEFAULTS[key]) != _DEFAULTS[key]:
            flags.append(f"{config_flag(key)} {a[key]}")
    if a.get("moe_aux_loss_coeff"):
        flags.append(f"{config_flag('moe_aux_loss_coeff')} {a['moe_aux_loss_coeff']}")
    if a.get("moe_router_group_topk"):
        flags.append(f"{config_flag('moe_router_num_groups')} {a['moe_router_num_groups']} "
                     f"{config_flag('moe_router_group_topk')} {a['moe_router_group_topk']}")
    if a.get("moe_router_enable_expert_bias"):
        flags.append(config_flag("moe_router_enable_expert_bias"))
    return " ".join(flags)


# the declared defaults of the settings above whose default value model_flags leaves out
_DEFAULTS = {dest: default for dest, default, _spec in all_settings()}


def expect(messages: Iterator[Message], name: str) -> Message:
    """The next message, which must be `name` (one-line error otherwise, as Megatron's saver)."""
    msg = next(messages, None)
    if msg is None:
        raise ConversionError(f"the loader stopped before sending {name!r}")
    if msg.name != name:
        raise ConversionError(f'unexpected message: expecting "{name}" but got "{msg.name}"')
    return msg


def args_namespace(meta: ModelMeta) -> argparse.Namespace:
    """A Megatron args namespace with the model fields of `meta` (for checkpoints from non-Megatron sources)."""
    a = meta.architecture
    ns = argparse.Namespace(**{k: v for k, v in a.items() if k != "share_embeddings_and_output_weights"})
    ns.untie_embeddings_and_output_weights = not a.get("share_embeddings_and_output_weights", True)
    ns.norm_epsilon = a.get("layernorm_epsilon")
    ns.use_rotary_position_embeddings = a.get("position_embedding_type") == "rope"
    ns.add_position_embedding = a.get("position_embedding_type") == "learned_absolute"
    ns.onnx_safe = None
    ns.num_experts = a.get("num_moe_experts")
    ns.make_vocab_size_divisible_by = meta.make_vocab_size_divisible_by
    ns.seq_length = a.get("max_position_embeddings")
    ns.true_vocab_size = meta.true_vocab_size
    for key in ("type", "vocab_file", "merge_file", "tokenizer_model", "tokenizer_name_or_path"):
        if meta.tokenizer.get(key):
            setattr(ns, "tokenizer_type" if key == "type" else key, meta.tokenizer[key])
    ns.consumed_train_samples = meta.consumed_train_samples
    ns.consumed_valid_samples = meta.consumed_valid_samples
    return ns


_LM = "language_model."
_LAYERS = _LM + "encoder.layers."
# parts after the final norm: (flat names starting with, prefix the message keys drop, message); BERT's pooler/heads
_HEADS = ((_LM + "output_layer.", _LM, OUTPUT_LAYER), (_LM + "pooler.", _LM + "pooler.", "pooler"),
          ("lm_head.", "lm_head.", "lm head"), ("binary_head.", "binary_head.", "binary head"),
          ("classification_head.", "classification_head.", "classification head"),
          ("multichoice_head.", "multichoice_head.", "multichoice head"), (MTP_PREFIX, MTP_PREFIX, MTP))


def messages_from_state_dict(flat: Dict[str, torch.Tensor], num_layers: int) -> Iterator[Message]:
    """The message stream of a full TP=1 flat GPT state dict (``GPTModel.state_dict()`` names)."""
    emb = {k[len(_LM + "embedding."):]: v for k, v in flat.items() if k.startswith(_LM + "embedding.")}
    yield Message(EMBEDDINGS, emb)
    for i in range(num_layers):
        prefix = f"{_LAYERS}{i}."
        yield Message(layer_message(i), {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)})
    yield Message(FINAL_NORM, {k[len(_LM + "encoder."):]: v for k, v in flat.items()
                               if k.startswith(_LM + "encoder.final_layernorm.")})
    for match, prefix, name in _HEADS:
        part = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(match)}
        if part:
            yield Message(name, part)


def state_dict_from_messages(messages: Iterator[Message]) -> Dict[str, torch.Tensor]:
    """Inverse of `messages_from_state_dict`: collect a stream into one full TP=1 flat state dict."""
    out: Dict[str, torch.Tensor] = {}
    for msg in messages:
        if msg.name == EMBEDDINGS:
            out.update({_LM + "embedding." + k: v for k, v in msg.tensors.items()})
        elif msg.name.startswith(LAYER_PREFIX):
            i = int(msg.name[len(LAYER_PREFIX):])
            out.update({f"{_LAYERS}{i}.{k}": v for k, v in msg.tensors.items()})
        elif msg.name == FINAL_NORM:
            out.update({_LM + "encoder." + k: v for k, v in msg.tensors.items()})
        elif msg.name in {n for _, _, n in _HEADS}:
            prefix = {n: p for _, p, n in _HEADS}[msg.name]
            out.update({prefix + k: v for k, v in msg.tensors.items()})
        else:
            raise ConversionError(f"unknown message {msg.name!r}")
    return out
