"""T5 under Megatron 23.06's --pipeline-model-parallel-split-rank, without processes: the rank groups (word
embeddings {first, R, last}, positions {first, R}), the split helpers of ParallelState, each stage's roles and layer
slice (encoder layers over stages 0..R-1, decoder layers over R..P-1, layer numbers restarting per stack), the final
LayerNorms, the LM head and the embedding copies, the per-stage message shapes of the schedule, and one-line errors
for a missing split rank, an uneven layer split and interleaved stages.
"""
from __future__ import annotations

import pytest

from megatron.core.parallel_state import ParallelState, _build_rank_groups
from megatron.core.pipeline_parallel.pipelined import get_tensor_shapes
from megatron.core.transformer_config import TransformerConfig
from megatron.models.t5.model import PP_INTERLEAVED_T5, PP_SPLIT_MISSING, T5Model, t5_stage_roles


def config(pp: int, enc: int = 4, dec: int = 2, **kw) -> TransformerConfig:
    return TransformerConfig(num_layers=enc, decoder_num_layers=dec, hidden_size=16, num_attention_heads=2,
                             padded_vocab_size=64, max_position_embeddings=16, hidden_dropout=0.0,
                             attention_dropout=0.0, bias_gelu_fusion=False, pipeline_model_parallel_size=pp, **kw)


def state(pp: int, rank: int, split: int | None, **kw) -> ParallelState:
    return ParallelState(pp_size=pp, pp_rank=rank, pipeline_split_rank=split, pp_ranks=list(range(pp)), **kw)


def test_rank_groups_with_a_split_rank() -> None:
    layout = _build_rank_groups(8, 2, 4, split_rank=2)  # TP 2, PP 4, DP 1: stages are ranks {0,1}, {2,3}, ...
    assert layout["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["embedding"] == [[0, 4, 6], [1, 5, 7]]
    assert layout["position_embedding"] == [[0, 4], [1, 5]]
    assert _build_rank_groups(2, 1, 2, split_rank=1)["embedding"] == [[0, 1]]  # R is also the last stage
    assert _build_rank_groups(4, 1, 4)["embedding"] == [[0, 3]]  # GPT: unchanged
    with pytest.raises(ValueError, match=r"split-rank \(4\) must be in 1\.\.3"):
        _build_rank_groups(4, 1, 4, split_rank=4)


def test_stage_roles_layers_and_embeddings_pp4_split2() -> None:
    expect = {  # rank: (pre, post, encoder layer numbers, decoder layer numbers)
        0: (True, False, [1, 2], None), 1: (False, True, [3, 4], None),
        2: (True, False, None, [1]), 3: (False, True, None, [2]),
    }
    for rank, (pre, post, enc_layers, dec_layers) in expect.items():
        st = state(4, rank, 2)
        assert st.is_pipeline_stage_before_split() == (rank < 2)
        assert st.is_pipeline_stage_after_split() == (rank >= 2)
        assert st.is_pipeline_stage_at_split() == (rank == 1)
        assert t5_stage_roles(st) == (pre, post, rank < 2, rank >= 2)
        model = T5Model(config(4), pp_state=st)
        lm = model.language_model
        got_enc = None if lm.encoder is None else [layer.layer_number for layer in lm.encoder.layers]
        got_dec = None if lm.decoder is None else [layer.layer_number for layer in lm.decoder.layers]
        assert (got_enc, got_dec) == (enc_layers, dec_layers), rank
        names = {name for name, _ in model.named_parameters()}
        assert ("language_model.encoder.final_layernorm.weight" in names) == (rank == 1)
        assert ("language_model.decoder.final_layernorm.weight" in names) == (rank == 3)
        assert ("lm_head.bias" in names) == ("word_embeddings.weight" in names) == (rank == 3)
        assert ("language_model.embedding.position_embeddings.weight" in names) == pre
        if rank == 2:  # the decoder's embedding copy: zeroed (the group sum fills it), counted once in norms
            emb = lm.embedding
            assert all(p.shared and float(p.detach().abs().sum()) == 0 for p in
                       (emb.word_embeddings.weight, emb.position_embeddings.weight))
        keys = set(model.state_dict_for_save_checkpoint())
        assert keys == ({"language_model", "lm_head", "word_embeddings_for_head"} if rank == 3 else {"language_model"})


def test_message_shapes_and_one_line_refusals() -> None:
    model = T5Model(config(2, enc=1, dec=1), pp_state=state(2, 1, 1))
    assert get_tensor_shapes(0, state(2, 1, 1), model, 12, 6, 3) == [(12, 3, 16)]
    assert get_tensor_shapes(1, state(2, 1, 1), model, 12, 6, 3) == [(6, 3, 16), (12, 3, 16)]
    sp = T5Model(config(2, enc=1, dec=1, tensor_model_parallel_size=1, sequence_parallel=True),
                 pp_state=state(2, 1, 1))
    sp.config.tensor_model_parallel_size = 2  # the shapes only: seq / tp under sequence parallelism
    assert get_tensor_shapes(1, state(2, 1, 1), sp, 12, 6, 3) == [(3, 3, 16), (6, 3, 16)]
    for st, message in ((state(2, 0, None), PP_SPLIT_MISSING),
                        (state(4, 0, 2, virtual_pp_size=2, virtual_pp_rank=0), PP_INTERLEAVED_T5)):
        with pytest.raises(ValueError) as err:
            T5Model(config(st.pp_size), pp_state=st)
        assert str(err.value) == message and "\n" not in message
    with pytest.raises(ValueError) as err:
        T5Model(config(4, enc=3), pp_state=state(4, 0, 2))
    assert str(err.value) == ("--encoder-num-layers (3) must be divisible by its 2 pipeline stages "
                              "(--pipeline-model-parallel-split-rank 2 of --pipeline-model-parallel-size 4)")
