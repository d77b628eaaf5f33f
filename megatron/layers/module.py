"""MegatronModule base class, shared word embeddings across pipeline stages (their gradient all-reduce is in
megatron/core/distributed/finalize_model_grads.py), and Float16Module (the fp16/bf16 model wrapper)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model  # noqa: F401  (Megatron's megatron.model.unwrap_model)
from megatron.layers.utils import pp_size_of


def _is_pp_multi(pp_state: Optional[Any]) -> bool:
    return pp_size_of(pp_state) > 1


class MegatronModule(torch.nn.Module):
    """Base of every Megatron model: checkpoint-friendly state dicts and tied input/output embeddings."""

    def __init__(self, config: Optional[TransformerConfig] = None, share_embeddings_and_output_weights: bool = True):
        super().__init__()
        self.config = config
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """What goes into a checkpoint; subclasses return Megatron's nested layout."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight on the first stage, or the last stage's copy used by the output layer."""
        if getattr(self, "pre_process", True):
            return self.language_model.embedding.word_embeddings.weight
        if not self.share_embeddings_and_output_weights and getattr(self, "word_embeddings", None) is None:
            raise RuntimeError(
                "shared_embedding_or_output_weight() called on a pipeline stage without the input embedding while "
                "--untie-embeddings-and-output-weights is set; use the output layer weight instead"
            )
        return self.word_embeddings.weight

    # Megatron's older name.
    word_embeddings_weight = shared_embedding_or_output_weight

    def initialize_word_embeddings(self, tp_group: Optional[Any] = None, pp_state: Optional[Any] = None) -> None:
        """Give the last pipeline stage its own copy of the word embeddings, equal to the first stage's.

        The last stage creates `self.word_embeddings` filled with zeros; first and last stage then all-reduce the
        weight over the embedding group, so both hold the first stage's initial values (Megatron's scheme). Untied
        models need the copy for multi-token prediction only (its embedding of the shifted tokens).
        """
        if not self.share_embeddings_and_output_weights and not getattr(self.config, "mtp_num_layers", None):
            raise RuntimeError("initialize_word_embeddings() needs tied input/output embeddings (or --mtp-num-layers)")
        if not _is_pp_multi(pp_state):
            return
        config = self.config
        if getattr(self, "post_process", False) and not getattr(self, "pre_process", False):
            self.word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size,
                config.hidden_size,
                init_method=config.init_method,
                config=config,
                tp_group=tp_group,
            )
            with torch.no_grad():
                self.word_embeddings.weight.fill_(0)
            self.word_embeddings.weight.shared = True
        if getattr(self, "pre_process", False):
            self.shared_embedding_or_output_weight().shared_embedding = True
        if getattr(self, "post_process", False) or getattr(self, "pre_process", False):
            group = getattr(pp_state, "embedding_group", None)
            if group is not None and torch.distributed.is_initialized():
                torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=group)




def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the last stage's copy of the word embedding (so it is counted once in norms)."""
    return not getattr(param, "shared", False)


def _convert_floats(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], src: tuple) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if value.dtype in src else value
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_floats(v, fn, src) for v in value)
    if isinstance(value, dict):
        return {k: _convert_floats(v, fn, src) for k, v in value.items()}
    return value


def fp32_to_float16(value: Any, dtype: torch.dtype) -> Any:
    """Cast every fp32 tensor in a (nested) tuple/list/dict to `dtype`; other tensors and values unchanged."""
    return _convert_floats(value, lambda t: t.to(dtype), (torch.float32,))


def float16_to_fp32(value: Any) -> Any:
    """Cast every fp16/bf16 tensor in a (nested) tuple/list/dict to fp32."""
    return _convert_floats(value, lambda t: t.float(), (torch.float16, torch.bfloat16))


class Float16Module(MegatronModule):
    """Megatron's Float16Module: the wrapped model lives in fp16/bf16; on the first pipeline stage fp32 inputs are
    cast down, on the last stage outputs are cast back to fp32. `precision` is a dtype or an object with
    `.fp16` / `.bf16` (args or TransformerConfig)."""

    def __init__(self, module: torch.nn.Module, precision: Any) -> None:
        super().__init__(config=getattr(module, "config", None),
                         share_embeddings_and_output_weights=getattr(module, "share_embeddings_and_output_weights",
                                                                     True))
        if isinstance(precision, torch.dtype):
            dtype = precision
        elif getattr(precision, "fp16", False):
            dtype = torch.float16
        elif getattr(precision, "bf16", False):
            dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module needs fp16 or bf16 (pass --fp16 or --bf16)")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Float16Module dtype must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self.add_module("module", module.to(dtype))

    def set_input_tensor(self, input_tensor: Any) -> None:
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if getattr(self.module, "pre_process", True):
            inputs = fp32_to_float16(inputs, self.dtype)
        outputs = self.module(*inputs, **kwargs)
        # T5's last encoder stage has post_process but sends fp16 activations on: ``returns_loss`` says which stage.
        if getattr(self.module, "returns_loss", getattr(self.module, "post_process", True)):
            outputs = float16_to_fp32(outputs)
        return outputs

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.module.shared_embedding_or_output_weight()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict)
