"""T5 (Megatron's T5Model): an encoder-decoder built from the same parts as GPT and BERT (layer_specs.t5_*).

One embedding (word + learned absolute positions, no token types) feeds both the encoder and the decoder; the
encoder is BERT's pre-LN stack with its final LayerNorm (``--encoder-num-layers``); each decoder layer runs causal
self-attention, cross-attention over the encoder output (``inter_attention``: ``query``, ``key_value``, ``dense``)
with ``post_inter_attention_layernorm``, then the MLP; the decoder ends with its own final LayerNorm
(``--decoder-num-layers``; both counts default to ``--num-layers``). LM head: logits through the tied word
embeddings + a vocab-parallel bias (``lm_head.bias``).

Masks follow Megatron: [b, s_q, s_k] with 1 = attend; they become bool [b, 1, s_q, s_k] with True = masked.
Checkpoint layout as Megatron's: ``language_model`` (``embedding.{word,position}_embeddings``, ``encoder``,
``decoder``), ``lm_head`` (``bias``). Pipeline parallelism (Megatron's --pipeline-model-parallel-split-rank) is
not implemented here yet: the model refuses pp > 1 with one line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer_config import TransformerConfig
from megatron.model.enums import AttnMaskType
from megatron.model.gpt_model import LANGUAGE_MODEL_KEY, flatten_checkpoint_state_dict
from megatron.model.language_model import TiedLMHeadWithBias, TransformerLanguageModel, sequential_position_ids
from megatron.model.layer_specs import t5_decoder_layer_spec, t5_encoder_layer_spec
from megatron.model.module import MegatronModule
from megatron.model.utils import group_size

LM_HEAD_KEY = "lm_head"
PP_SPLIT_MISSING = ("T5 pipeline parallelism (--pipeline-model-parallel-split-rank: encoder stages, then decoder "
                    "stages receiving the encoder output) is not implemented yet: use --pipeline-model-parallel-size "
                    "1 (TP, SP, DP, the distributed optimizer and ZeRO 1-3 work)")


def t5_extended_attention_mask(masks: list) -> list:
    """[b, s_q, s_k] masks (1 = attend) -> bool [b, 1, s_q, s_k] (True = masked), Megatron's convention."""
    return [None if m is None else (m.unsqueeze(1) < 0.5) for m in masks]


t5_position_ids = sequential_position_ids
T5LMHead = TiedLMHeadWithBias  # logits through the tied word embeddings plus a vocab-parallel bias


def _with_layers(config: TransformerConfig, layers: Optional[int]) -> TransformerConfig:
    layers = layers or config.num_layers
    return config if layers == config.num_layers else dataclasses.replace(config, num_layers=layers)


def _check_layout(config: TransformerConfig, tp_group: Optional[Any], pp_state: Optional[Any]) -> None:
    if config.padded_vocab_size <= 0:
        raise ValueError("TransformerConfig.padded_vocab_size is not set: build the tokenizer first")
    tp = group_size(tp_group)
    if tp != config.tensor_model_parallel_size:
        raise ValueError(f"T5Model: config.tensor_model_parallel_size={config.tensor_model_parallel_size} but the "
                         f"tp_group has {tp} ranks; pass pp_state=parallel_state")
    pp = getattr(pp_state, "pp_size", 1) if pp_state is not None else 1
    if pp > 1 or config.pipeline_model_parallel_size > 1:
        raise ValueError(PP_SPLIT_MISSING)
    if config.padded_vocab_size % tp:
        raise ValueError(f"padded vocab size {config.padded_vocab_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp}; pad it with --make-vocab-size-divisible-by")
    if not config.share_embeddings_and_output_weights:
        raise ValueError("T5 ties its output layer to the word embeddings: drop --untie-embeddings-and-output-weights")
    if config.position_embedding_type != "learned_absolute":
        raise ValueError("T5 (Megatron's) uses learned absolute position embeddings: drop --position-embedding-type "
                         f"{config.position_embedding_type}")


def t5_num_floating_point_operations(config: TransformerConfig, batch_size: int, encoder_seq_length: int,
                                     decoder_seq_length: int) -> float:
    """FLOPs of one T5 training iteration (forward + backward = 3 forwards, 2 per multiply-add; megatron/flops.py's
    conventions): encoder layers over the encoder tokens, decoder layers (self-attention over the decoder tokens,
    cross-attention whose key/value projections run over the encoder tokens) and the logits over the decoder tokens.
    """
    b, h, n = batch_size, config.hidden_size, config.num_attention_heads
    se, sd = encoder_seq_length, decoder_seq_length
    kv = (config.num_query_groups or n) / n  # key/value projection size relative to the query projection's
    q = config.kv_channels * n
    ffn = 2.0 * h * config.ffn_hidden_size * (1.5 if config.swiglu else 1.0)

    def self_layer(s: int) -> float:  # multiply-adds of one layer over one sequence of s tokens
        return s * (2.0 * h * q * (1.0 + kv) + 2.0 * s * q + ffn)

    enc_layers = config.encoder_num_layers or config.num_layers
    dec_layers = config.decoder_num_layers or config.num_layers
    cross = sd * (2.0 * h * q + 2.0 * se * q) + se * 2.0 * h * q * kv
    transformer = 6.0 * b * (enc_layers * self_layer(se) + dec_layers * (self_layer(sd) + cross))
    if config.recompute_granularity == "full":
        transformer *= 4.0 / 3.0
    return transformer + 6.0 * b * sd * h * config.padded_vocab_size


class T5Model(MegatronModule):
    """Megatron's T5Model. forward(enc_ids, dec_ids, enc_mask, dec_mask, enc_dec_mask, lm_labels=None) ->
    logits [b, s_dec, v/tp] (full vocab unless parallel_output), or the per-token lm loss [b, s_dec] with labels.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        tp_group: Optional[Any] = None,
        pp_state: Optional[Any] = None,
        parallel_output: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
    ) -> None:
        super().__init__(config=config, share_embeddings_and_output_weights=True)
        if tp_group is None and pp_state is not None:
            tp_group = getattr(pp_state, "tp_group", None)
        _check_layout(config, tp_group, pp_state)
        self.tp_group = tp_group
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.language_model = TransformerLanguageModel(
            _with_layers(config, config.encoder_num_layers), tp_group, pp_state,
            encoder_attn_mask_type=AttnMaskType.padding, num_tokentypes=0, add_encoder=True, add_decoder=True,
            decoder_attn_mask_type=AttnMaskType.causal, add_pooler=False, pre_process=pre_process,
            post_process=post_process, encoder_layer_spec=t5_encoder_layer_spec(config),
            decoder_layer_spec=t5_decoder_layer_spec(config),
            decoder_config=_with_layers(config, config.decoder_num_layers),
        )
        self.initialize_word_embeddings(tp_group, pp_state)
        if post_process:
            self.lm_head = T5LMHead(config, tp_group, parallel_output)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: torch.Tensor,
        decoder_attn_mask: torch.Tensor,
        encoder_decoder_attn_mask: torch.Tensor,
        tokentype_ids: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
        enc_hidden_states: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if tokentype_ids is not None:
            raise ValueError("T5Model has no token-type embeddings: pass tokentype_ids=None")
        enc_mask, dec_mask, enc_dec_mask = t5_extended_attention_mask(
            [encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask])
        decoder_output, _ = self.language_model(
            encoder_input_ids, t5_position_ids(encoder_input_ids), enc_mask,
            decoder_input_ids, t5_position_ids(decoder_input_ids), dec_mask, enc_dec_mask,
            enc_hidden_states=enc_hidden_states,
        )
        logits = self.lm_head(decoder_output, self.shared_embedding_or_output_weight())
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        labels = lm_labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
        if self.fp16_lm_cross_entropy:
            if logits.dtype != torch.half:
                raise ValueError("--fp16-lm-cross-entropy needs fp16 logits (use it together with --fp16)")
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, self.tp_group)
        else:
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels, self.tp_group)
        return loss.transpose(0, 1).contiguous()

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron's nested layout (see the module docstring)."""
        return {
            LANGUAGE_MODEL_KEY: self.language_model.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars),
            LM_HEAD_KEY: self.lm_head.state_dict(prefix=prefix, keep_vars=keep_vars),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load Megatron's nested checkpoint dict or a flat `state_dict()`."""
        flat = flatten_checkpoint_state_dict(state_dict)
        own = set(self.state_dict().keys())
        flat = {k: v for k, v in flat.items() if not (k.endswith("._extra_state") and k not in own)}
        return super().load_state_dict(flat, strict=strict, assign=assign)
