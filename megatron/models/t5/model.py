"""T5 (Megatron's T5Model): an encoder-decoder built from the same parts as GPT and BERT (layer_specs.t5_*).

One embedding (word + learned absolute positions, no token types) feeds both the encoder and the decoder; the
encoder is BERT's pre-LN stack with its final LayerNorm (``--encoder-num-layers``); each decoder layer runs causal
self-attention, cross-attention over the encoder output (``inter_attention``: ``query``, ``key_value``, ``dense``)
with ``post_inter_attention_layernorm``, then the MLP; the decoder ends with its own final LayerNorm
(``--decoder-num-layers``; both counts default to ``--num-layers``). LM head: logits through the tied word
embeddings + a vocab-parallel bias (``lm_head.bias``).

Masks follow Megatron: [b, s_q, s_k] with 1 = attend; they become bool [b, 1, s_q, s_k] with True = masked.
Checkpoint layout as Megatron's: ``language_model`` (``embedding.{word,position}_embeddings``, ``encoder``,
``decoder``), ``lm_head`` (``bias``)[, ``word_embeddings_for_head`` on a last stage without the embedding].

Pipeline parallelism follows Megatron 23.06's --pipeline-model-parallel-split-rank R: stages 0..R-1 run the encoder
(stage 0 embeds, stage R-1 applies the encoder's final LayerNorm and sends the encoder output), stages R..P-1 the
decoder (stage R embeds the decoder tokens with its own copy of the word and position embeddings; every decoder
stage receives [decoder hidden states, encoder output] and passes both on; the last stage has the decoder's final
LayerNorm and the LM head, tied to the word embeddings through its own copy). The copies start equal (stage R and the
last stage zero theirs, then the word-embedding group {0, R, last} and the position-embedding group {0, R} sum) and
their grads are summed over the same groups after backward (megatron/core/distributed/finalize_model_grads.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.checkpoint_keys import (
    LANGUAGE_MODEL_KEY,
    WORD_EMBEDDINGS_FOR_HEAD_KEY,
    flatten_checkpoint_state_dict,
)
from megatron.layers.enums import AttnMaskType
from megatron.layers.language_model import (
    TiedLMHeadWithBias,
    TransformerLanguageModel,
    lm_cross_entropy,
    sequential_position_ids,
)
from megatron.layers.module import MegatronModule
from megatron.layers.utils import check_model_layout, pp_size_of, resolve_tp_group
from megatron.models.t5.layer_spec import t5_decoder_layer_spec, t5_encoder_layer_spec

LM_HEAD_KEY = "lm_head"
PP_SPLIT_MISSING = ("T5 with --pipeline-model-parallel-size > 1 needs --pipeline-model-parallel-split-rank R "
                    "(stages 0..R-1 run the encoder, R..P-1 the decoder), e.g. R = P/2")
PP_INTERLEAVED_T5 = ("interleaved pipeline stages are not supported for T5: drop "
                     "--num-layers-per-virtual-pipeline-stage (T5 pipelines with --pipeline-model-parallel-split-rank)")


def t5_stage_roles(pp_state: Optional[Any]) -> tuple[bool, bool, bool, bool]:
    """(pre_process, post_process, add_encoder, add_decoder) of this pipeline stage under the split rank R
    (Megatron 23.06's get_model for encoder-and-decoder models): stages 0 and R embed, stages R-1 and P-1 end a stack,
    stages < R hold encoder layers and stages >= R decoder layers."""
    pp = pp_size_of(pp_state)
    if pp == 1:
        return True, True, True, True
    if getattr(pp_state, "virtual_pp_size", None) is not None:
        raise ValueError(PP_INTERLEAVED_T5)
    split = getattr(pp_state, "pipeline_split_rank", None)
    if split is None:
        raise ValueError(PP_SPLIT_MISSING)
    rank = pp_state.pp_rank
    return rank in (0, split), rank in (split - 1, pp - 1), rank < split, rank >= split


def t5_extended_attention_mask(masks: list) -> list:
    """[b, s_q, s_k] masks (1 = attend) -> bool [b, 1, s_q, s_k] (True = masked), Megatron's convention."""
    return [None if m is None else (m.unsqueeze(1) < 0.5) for m in masks]


t5_position_ids = sequential_position_ids
T5LMHead = TiedLMHeadWithBias  # logits through the tied word embeddings plus a vocab-parallel bias


def _with_layers(config: TransformerConfig, layers: Optional[int]) -> TransformerConfig:
    layers = layers or config.num_layers
    return config if layers == config.num_layers else dataclasses.replace(config, num_layers=layers)


def _check_layout(config: TransformerConfig, tp_group: Optional[Any], pp_state: Optional[Any]) -> None:
    check_model_layout("T5Model", config, tp_group, pp_state, check_pp=False)
    pp = pp_size_of(pp_state)
    if config.pipeline_model_parallel_size > 1 and pp == 1:  # no pipeline groups, so no split rank either
        raise ValueError(PP_SPLIT_MISSING)
    if pp > 1 and pp != config.pipeline_model_parallel_size:
        raise ValueError(f"T5Model: config.pipeline_model_parallel_size={config.pipeline_model_parallel_size} but "
                         f"pp_state has {pp} stages")
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

    Under pipeline parallelism (pp_state with a split rank) the stage's roles come from ``t5_stage_roles`` (the
    ``pre_process`` / ``post_process`` arguments are overridden); an encoder stage returns the encoder hidden states
    [s_enc, b, h], a decoder stage other than the last returns [decoder hidden states, encoder output].
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
        tp_group = resolve_tp_group(tp_group, pp_state)
        _check_layout(config, tp_group, pp_state)
        pipelined = pp_size_of(pp_state) > 1
        add_encoder = add_decoder = True
        if pipelined:
            pre_process, post_process, add_encoder, add_decoder = t5_stage_roles(pp_state)
        self.tp_group = tp_group
        self.pp_state = pp_state if pipelined else None
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        # Float16Module casts the outputs of the stage that computes the loss back to fp32, not the encoder's end.
        self.returns_loss = post_process and add_decoder
        self.parallel_output = parallel_output
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.language_model = TransformerLanguageModel(
            _with_layers(config, config.encoder_num_layers), tp_group, pp_state,
            encoder_attn_mask_type=AttnMaskType.padding, num_tokentypes=0, add_encoder=add_encoder,
            add_decoder=add_decoder,
            decoder_attn_mask_type=AttnMaskType.causal, add_pooler=False, pre_process=pre_process,
            post_process=post_process, encoder_layer_spec=t5_encoder_layer_spec(config),
            decoder_layer_spec=t5_decoder_layer_spec(config),
            decoder_config=_with_layers(config, config.decoder_num_layers), pipeline_split=pipelined,
        )
        if pipelined:
            self._initialize_pipeline_embeddings(tp_group, pp_state)
        if self.returns_loss:
            self.lm_head = T5LMHead(config, tp_group, parallel_output)

    def _initialize_pipeline_embeddings(self, tp_group: Optional[Any], pp_state: Any) -> None:
        """Megatron 23.06's initialize_word_embeddings for T5: the last stage (without the embedding) gets a zeroed
        copy of the word embeddings for its head, stage R zeroes its embeddings; summing over the word-embedding
        group {0, R, last} and the position-embedding group {0, R} makes every copy equal to stage 0's. The copies
        are marked ``shared`` (counted once in the grad and param norms, a bucket of their own under the
        distributed optimizer), stage 0's embeddings ``shared_embedding``."""
        config = self.config
        last = pp_state.pp_rank == pp_state.pp_size - 1
        if last and not self.pre_process:
            self.word_embeddings = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                          init_method=config.init_method, config=config,
                                                          tp_group=tp_group)
            with torch.no_grad():
                self.word_embeddings.weight.fill_(0)
            self.word_embeddings.weight.shared = True
        if self.pre_process:
            embedding = self.language_model.embedding
            params = [embedding.word_embeddings.weight, embedding.position_embeddings.weight]
            for param in params:
                if pp_state.pp_rank == 0:
                    param.shared_embedding = True
                else:  # the decoder's copy on stage R
                    with torch.no_grad():
                        param.zero_()
                    param.shared = True
        if not torch.distributed.is_initialized():
            return
        if pp_state.embedding_group is not None and pp_state.is_rank_in_embedding_group(ignore_virtual=True):
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=pp_state.embedding_group)
        if pp_state.position_embedding_group is not None and pp_state.is_rank_in_position_embedding_group():
            torch.distributed.all_reduce(self.language_model.embedding.position_embeddings.weight.data,
                                         group=pp_state.position_embedding_group)

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
        lm_output = self.language_model(
            encoder_input_ids, t5_position_ids(encoder_input_ids), enc_mask,
            decoder_input_ids, t5_position_ids(decoder_input_ids), dec_mask, enc_dec_mask,
            enc_hidden_states=enc_hidden_states,
        )
        if not self.add_decoder:  # an encoder pipeline stage
            return lm_output
        decoder_output, encoder_output = lm_output
        if not self.returns_loss:  # a decoder pipeline stage before the last passes the encoder output on
            return [decoder_output, encoder_output]
        logits = self.lm_head(decoder_output, self.shared_embedding_or_output_weight())
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        return lm_cross_entropy(logits, lm_labels, self.tp_group, self.fp16_lm_cross_entropy)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron's nested layout (see the module docstring)."""
        out = {
            LANGUAGE_MODEL_KEY: self.language_model.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        }
        if self.returns_loss:
            out[LM_HEAD_KEY] = self.lm_head.state_dict(prefix=prefix, keep_vars=keep_vars)
            if not self.pre_process and self.pp_state is not None:
                out[WORD_EMBEDDINGS_FOR_HEAD_KEY] = self.word_embeddings.state_dict(prefix=prefix,
                                                                                    keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Load Megatron's nested checkpoint dict or a flat `state_dict()`."""
        flat = flatten_checkpoint_state_dict(state_dict)
        own = set(self.state_dict().keys())
        flat = {k: v for k, v in flat.items() if not (k.endswith("._extra_state") and k not in own)}
        return super().load_state_dict(flat, strict=strict, assign=assign)
