"""Embeddings, pooler and the transformer language model (embedding -> encoder [-> decoder]) plus LM logits."""
from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.layout import TensorParallelLayout, set_tp_layout
from megatron.core.transformer_config import TransformerConfig
from megatron.layers.attention import model_parallel_rng_fork
from megatron.layers.enums import AttnMaskType, LayerType
from megatron.layers.fused_layer_norm import MixedFusedLayerNorm
from megatron.layers.module import MegatronModule
from megatron.layers.transformer import ParallelTransformer
from megatron.layers.utils import get_linear_layer, group_size


def parallel_lm_logits(
    input_: torch.Tensor,
    word_embeddings_weight: torch.Tensor,
    parallel_output: bool,
    tp_group: Optional[Any] = None,
    bias: Optional[torch.Tensor] = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Logits [s, b, vocab/tp] (or the full vocab when not parallel_output) from hidden states [s(/tp), b, h]."""
    if sequence_parallel:
        input_parallel = tensor_parallel.gather_from_sequence_parallel_region(
            input_, tp_group, tensor_parallel_output_grad=True
        )
    else:
        input_parallel = tensor_parallel.copy_to_tensor_model_parallel_region(input_, tp_group)
    logits = tensor_parallel.lm_logits_linear(input_parallel, word_embeddings_weight, bias)
    if parallel_output:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits, tp_group)


def lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group: Optional[Any] = None,
                     fp16_lm_cross_entropy: bool = False) -> torch.Tensor:
    """Per-token loss [b, s] of vocab-parallel logits [s, b, v/tp] against labels [b, s] (in fp32 unless
    --fp16-lm-cross-entropy, which needs fp16 logits): the one loss GPT, BERT, T5 and the GPT pipe share."""
    labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b]
    if fp16_lm_cross_entropy:
        if logits.dtype != torch.half:
            raise ValueError("--fp16-lm-cross-entropy needs fp16 logits (use it together with --fp16)")
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels, tp_group)
    else:
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels, tp_group)
    return loss.transpose(0, 1).contiguous()


def sequential_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """0..s-1 for every row of [b, s] (BERT's and T5's position ids)."""
    s = token_ids.size(1)
    return torch.arange(s, dtype=torch.long, device=token_ids.device).unsqueeze(0).expand_as(token_ids)


class TiedLMHeadWithBias(MegatronModule):
    """Logits through the tied word embeddings plus a vocab-parallel bias (`lm_head.bias`): T5's head, and the last
    step of BERT's (which first runs dense -> GeLU -> LayerNorm)."""

    def __init__(self, config: TransformerConfig, tp_group: Optional[Any], parallel_output: bool) -> None:
        super().__init__(config=config)
        self.tp_group = tp_group
        self.parallel_output = parallel_output
        self.sequence_parallel = config.sequence_parallel
        vocab_per_rank = config.padded_vocab_size // group_size(tp_group)
        self.bias = torch.nn.Parameter(torch.zeros(vocab_per_rank, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        set_tp_layout(self.bias, TensorParallelLayout(dim=0))

    def logits(self, hidden_states: torch.Tensor, word_embeddings_weight: torch.Tensor) -> torch.Tensor:
        """[s(/tp), b, h] -> logits [s, b, vocab/tp] (full vocab unless parallel_output)."""
        if not self.parallel_output:  # the bias is vocab-parallel: add it before the gather
            return parallel_lm_logits(hidden_states, word_embeddings_weight, False, self.tp_group,
                                      bias=self.bias, sequence_parallel=self.sequence_parallel)
        # Without a bias the output layer writes into its reused logits buffer (lm_head.py); add the bias in place.
        logits = parallel_lm_logits(hidden_states, word_embeddings_weight, True, self.tp_group,
                                    sequence_parallel=self.sequence_parallel)
        return logits.add_(self.bias)

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden_states, word_embeddings_weight)


class Pooler(MegatronModule):
    """tanh(W h[sequence_index]) over the hidden states [s, b, h] (BERT's pooler)."""

    def __init__(self, hidden_size: int, init_method, sequence_parallel: bool = False, tp_group: Optional[Any] = None):
        super().__init__()
        self.dense = get_linear_layer(hidden_size, hidden_size, init_method)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, self.tp_group, tensor_parallel_output_grad=False
            )
        return torch.tanh(self.dense(hidden_states[sequence_index, :, :]))


class Embedding(MegatronModule):
    """word (vocab-parallel) [+ learned position] (+ tokentype) embeddings, transposed to [s, b, h], then dropout.

    The position table exists only for position_embedding_type "learned_absolute" (RoPE and ALiBi live in
    attention). With `config.embed_layernorm` (BLOOM) a LayerNorm follows the word embeddings; as in Megatron-DeepSpeed
    it is ``word_embeddings.norm`` (checkpoint keys ``...word_embeddings.norm.weight/bias``; HF's
    ``word_embeddings_layernorm``). It runs on the full sequence before any sequence-parallel scatter, so its
    gradients are already equal on every TP rank (no sequence-parallel all-reduce).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        max_sequence_length: int,
        embedding_dropout_prob: float,
        config: TransformerConfig,
        tp_group: Optional[Any] = None,
        num_tokentypes: int = 0,
        embed_layernorm: Optional[bool] = None,
    ) -> None:
        """``embed_layernorm``: None = ``config.embed_layernorm``; False for a copy that only serves the tied output
        layer (GPTModelPipe's head on the last stage, which Megatron-DeepSpeed also builds without the norm)."""
        super().__init__(config=config)
        self.hidden_size = hidden_size
        self.num_tokentypes = num_tokentypes
        self.tp_group = tp_group
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, hidden_size, init_method=config.init_method, config=config, tp_group=tp_group
        )
        if config.embed_layernorm if embed_layernorm is None else embed_layernorm:
            self.word_embeddings.norm = MixedFusedLayerNorm(hidden_size, eps=config.layernorm_epsilon,
                                                            params_dtype=config.params_dtype)
        self.add_position_embedding = config.position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, hidden_size, dtype=config.params_dtype)
            if config.perform_initialization:
                config.init_method(self.position_embeddings.weight)
        else:
            self.position_embeddings = None
        if num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(num_tokentypes, hidden_size, dtype=config.params_dtype)
            if config.perform_initialization:
                config.init_method(self.tokentype_embeddings.weight)
        else:
            self.tokentype_embeddings = None
        self.fp32_residual_connection = config.fp32_residual_connection
        self.sequence_parallel = config.sequence_parallel
        self.embedding_dropout_prob = embedding_dropout_prob
        self.embedding_dropout = torch.nn.Dropout(embedding_dropout_prob)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        words = self.word_embeddings(input_ids)
        if isinstance(words, tuple):
            words = words[0]
        norm = getattr(self.word_embeddings, "norm", None)
        if norm is not None:
            words = norm(words)
        # Range check on CPU only (on GPU it would force a device sync every step).
        if (
            self.position_embeddings is not None
            and position_ids is not None
            and position_ids.device.type == "cpu"
            and position_ids.numel()
            and int(position_ids.max()) >= self.position_embeddings.num_embeddings
        ):
            raise ValueError(
                f"position id {int(position_ids.max())} >= --max-position-embeddings "
                f"({self.position_embeddings.num_embeddings}); raise it or shorten --seq-length"
            )
        embeddings = words if self.position_embeddings is None else words + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the model was built with num_tokentypes=0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.fp32_residual_connection:
            embeddings = embeddings.float()
        dropout_active = self.training and self.embedding_dropout_prob > 0
        if self.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, self.tp_group)
            with model_parallel_rng_fork(dropout_active):
                embeddings = self.embedding_dropout(embeddings)
        else:
            embeddings = self.embedding_dropout(embeddings)
        return embeddings

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        out = {"word_embeddings": self.word_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)}
        if self.position_embeddings is not None:
            out["position_embeddings"] = self.position_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)
        if self.tokentype_embeddings is not None:
            out["tokentype_embeddings"] = self.tokentype_embeddings.state_dict(prefix=prefix, keep_vars=keep_vars)
        return out


class TransformerLanguageModel(MegatronModule):
    """Embedding (first stage) -> encoder transformer [-> decoder] [-> pooler] [-> untied output layer]."""

    def __init__(
        self,
        config: TransformerConfig,
        tp_group: Optional[Any] = None,
        pp_state: Optional[Any] = None,
        encoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
        num_tokentypes: int = 0,
        add_encoder: bool = True,
        add_decoder: bool = False,
        decoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
        add_pooler: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        encoder_layer_spec: Optional[Any] = None,
        decoder_layer_spec: Optional[Any] = None,
        decoder_config: Optional[TransformerConfig] = None,
        pipeline_split: bool = False,
    ) -> None:
        """``pipeline_split``: the encoder and decoder stacks sit on either side of pp_state's pipeline split rank
        (T5 under --pipeline-model-parallel-split-rank); ``add_encoder`` / ``add_decoder`` say which this stage has."""
        super().__init__(config=config, share_embeddings_and_output_weights=config.share_embeddings_and_output_weights)
        self.pre_process = pre_process
        self.post_process = post_process
        self.add_encoder = add_encoder
        self.add_decoder = add_decoder
        self.add_pooler = add_pooler
        self.tp_group = tp_group
        self.encoder_hidden_state: Optional[torch.Tensor] = None
        if pre_process:
            self.embedding = Embedding(
                config.hidden_size,
                config.padded_vocab_size,
                config.max_position_embeddings,
                config.hidden_dropout,
                config,
                tp_group,
                num_tokentypes,
            )
        self.encoder = (
            ParallelTransformer(
                config, tp_group, pp_state, self_attn_mask_type=encoder_attn_mask_type,
                pre_process=pre_process, post_process=post_process, spec=encoder_layer_spec,
                split_stack="encoder" if pipeline_split else None,
            )
            if add_encoder
            else None
        )
        self.decoder = (
            ParallelTransformer(
                decoder_config or config, tp_group, pp_state, layer_type=LayerType.decoder,
                self_attn_mask_type=decoder_attn_mask_type,
                pre_process=pre_process, post_process=post_process, spec=decoder_layer_spec,
                split_stack="decoder" if pipeline_split else None,
            )
            if add_decoder
            else None
        )
        if post_process:
            if add_pooler:
                self.pooler = Pooler(config.hidden_size, config.init_method, config.sequence_parallel, tp_group)
            if not self.share_embeddings_and_output_weights:
                self.output_layer = tensor_parallel.ColumnParallelLinear(
                    config.hidden_size,
                    config.padded_vocab_size,
                    config=config,
                    init_method=config.init_method,
                    tp_group=tp_group,
                    bias=False,
                )

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline input: a tensor or a one-element list (Megatron's schedules pass lists)."""
        if not isinstance(input_tensor, (list, tuple)):
            input_tensor = [input_tensor]
        if self.add_encoder:
            self.encoder.set_input_tensor(input_tensor[0])
        elif self.add_decoder:
            if len(input_tensor) == 2:
                self.decoder.set_input_tensor(input_tensor[0])
                self.encoder_hidden_state = input_tensor[1]
            else:
                self.decoder.set_input_tensor(None)
                self.encoder_hidden_state = input_tensor[0]

    def forward(
        self,
        enc_input_ids: Optional[torch.Tensor],
        enc_position_ids: Optional[torch.Tensor],
        enc_attn_mask: Optional[torch.Tensor],
        dec_input_ids: Optional[torch.Tensor] = None,
        dec_position_ids: Optional[torch.Tensor] = None,
        dec_attn_mask: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[torch.Tensor] = None,
        tokentype_ids: Optional[torch.Tensor] = None,
        inference_params: Optional[Any] = None,
        pooling_sequence_index: int = 0,
        enc_hidden_states: Optional[torch.Tensor] = None,
        output_enc_hidden: bool = False,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Any:
        if packed_seq_params is not None and self.add_decoder:
            raise ValueError("packed sequences (cu_seqlens) run in decoder-only models (GPT family), not encoder-"
                             "and-decoder models")
        encoder_input = (  # a decoder-only pipeline stage (T5's split stage) embeds the decoder tokens only
            self.embedding(enc_input_ids, enc_position_ids, tokentype_ids=tokentype_ids)
            if self.pre_process and self.encoder is not None else None
        )
        if enc_hidden_states is not None:
            encoder_output = enc_hidden_states
        elif self.encoder is not None:
            encoder_output = self.encoder(encoder_input, enc_attn_mask, inference_params=inference_params,
                                          packed_seq_params=packed_seq_params)
        else:
            encoder_output = self.encoder_hidden_state
        pooled = None
        if self.post_process and self.add_pooler:
            pooled = self.pooler(encoder_output, pooling_sequence_index)

        if not self.add_decoder or output_enc_hidden:
            return (encoder_output, pooled) if pooled is not None else encoder_output

        decoder_input = self.embedding(dec_input_ids, dec_position_ids) if self.pre_process else None
        decoder_output = self.decoder(
            decoder_input,
            dec_attn_mask,
            encoder_output=encoder_output,
            enc_dec_attn_mask=enc_dec_attn_mask,
            inference_params=inference_params,
        )
        if pooled is not None:
            return decoder_output, encoder_output, pooled
        return decoder_output, encoder_output

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        out: dict = {}
        if self.pre_process:
            out["embedding"] = self.embedding.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        if self.encoder is not None:
            out["encoder"] = self.encoder.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        if self.decoder is not None:
            out["decoder"] = self.decoder.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        if self.post_process:
            if self.add_pooler:
                out["pooler"] = self.pooler.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
            if not self.share_embeddings_and_output_weights:
                out["output_layer"] = self.output_layer.state_dict(prefix=prefix, keep_vars=keep_vars)
        return out
