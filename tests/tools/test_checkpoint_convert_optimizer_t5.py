"""tools/checkpoint/convert.py with the training state of a T5 model (issue 15 section 2, the unit level).

A T5 checkpoint (encoder and decoder stacks, tied word embeddings, vocab-parallel lm_head bias) written by
megatron.compat.save_checkpoint after two steps of Megatron's regular optimizer converts TP1 -> TP2 x PP2
(split rank 1; the distributed optimizer's files, the embeddings' copies on stage 1 carrying stage 0's state) -> TP1,
and every parameter's optimizer state (fp32 main param, exp_avg, exp_avg_sq), the step, the iteration, consumed
samples, the LR schedule and the weights come back bitwise. The parameter order the converter derives for the regular
optimizer from a rank file's names equals get_param_groups over the real T5Model pipeline stages.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from tests.tools.checkpoint_convert_helpers import TRUE_VOCAB, load_files

FLAGS = ["--num-layers", "2", "--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "10", "--decoder-seq-length", "6", "--max-position-embeddings", "16",
         "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(TRUE_VOCAB),
         "--make-vocab-size-divisible-by", "4", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2",
         "--weight-decay", "0.1", "--no-bias-gelu-fusion"]
PADDED = 64


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "T5", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


def _inputs():
    g = torch.Generator().manual_seed(4)
    enc, dec = torch.randint(0, TRUE_VOCAB, (2, 10), generator=g), torch.randint(0, TRUE_VOCAB, (2, 6), generator=g)
    ev, dv = torch.ones(2, 10, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    return enc, dec, ev[:, :, None] * ev[:, None, :], torch.tril(dv[:, :, None] * dv[:, None, :]), \
        dv[:, :, None] * ev[:, None, :]


def _trained_t5(folder):
    """save_checkpoint of a T5 after two steps of Megatron's regular optimizer; (model, optimizer, scheduler)."""
    from megatron.arguments import build_parser, core_transformer_config_from_args, validate_args
    from megatron.compat import save_checkpoint
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.learning_rates import OptimizerParamScheduler
    from megatron.models.t5.model import T5Model
    from megatron.optimizer import get_megatron_optimizer, optimizer_config_from_args

    args = build_parser().parse_args(FLAGS)
    args.rank, args.world_size = 0, 1
    validate_args(args, {"model_family": "t5"})
    args.true_vocab_size, args.padded_vocab_size = TRUE_VOCAB, PADDED
    args.consumed_train_samples = 24
    model_parallel_manual_seed(5)
    model = T5Model(core_transformer_config_from_args(args))
    optimizer = get_megatron_optimizer([model], optimizer_config_from_args(args))
    sched = OptimizerParamScheduler(optimizer, 0.0, 1e-2, 1e-3, 1, 10, "cosine", 0.1, 0.1, 10, "constant")
    enc, dec, *masks = _inputs()
    for _ in range(2):
        optimizer.zero_grad()
        model(enc, dec, *masks, lm_labels=torch.roll(dec, 1, 1)).float().mean().backward()
        assert optimizer.step()[0]
        sched.step(1)
    save_checkpoint(2, [model], optimizer, sched, args, str(folder))
    return model, optimizer, sched


def test_t5_optimizer_state_round_trip_is_bitwise(tmp_path):
    from megatron.models.gpt.model import flatten_checkpoint_state_dict
    from megatron.optimizer.distrib_optimizer import regular_state_to_param_state

    model, optimizer, sched = _trained_t5(tmp_path / "src")
    summary = _convert(tmp_path / "src", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
                       "--target-pipeline-parallel-size", "2", "--target-pipeline-model-parallel-split-rank", "1")
    assert summary["meta"].extra["optimizer"]["step"] == 2
    files = load_files(str(tmp_path / "tp2pp2"))
    assert sorted(files) == [(t, p) for t in range(2) for p in range(2)]
    assert all(f["optimizer"]["distributed_optimizer"] for f in files.values())
    stage1 = torch.load(tmp_path / "tp2pp2" / "iter_0000002" / "mp_rank_01_001" / "distrib_optim.pt",
                        weights_only=False)["chunks"][0]
    stage0 = torch.load(tmp_path / "tp2pp2" / "iter_0000002" / "mp_rank_01_000" / "distrib_optim.pt",
                        weights_only=False)["chunks"][0]
    word = "language_model.embedding.word_embeddings.weight"
    assert {"lm_head.bias", word, "language_model.decoder.layers.1.inter_attention.key_value.weight"} <= set(stage1)
    assert all(torch.equal(stage1[word][k], stage0[word][k]) for k in stage0[word])  # the decoder's copy
    assert stage1["lm_head.bias"]["exp_avg"].shape == (PADDED // 2,)
    summary = _convert(tmp_path / "tp2pp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1",
                       "--target-pipeline-parallel-size", "1")
    assert summary["meta"].extra["optimizer"]["step"] == 2

    back = tmp_path / "tp1" / "iter_0000002" / "mp_rank_00"
    sd = torch.load(back / "model_optim_rng.pt", weights_only=False)
    state = torch.load(back / "distrib_optim.pt", weights_only=False)
    assert (sd["iteration"], sd["consumed_train_samples"]) == (2, 24)
    assert sd["opt_param_scheduler"] == sched.state_dict()
    assert state["step"] == 2 and state["state_keys"] == ["exp_avg", "exp_avg_sq"]
    expected = regular_state_to_param_state(optimizer.state_dict(), [model])["chunks"][0]
    got = state["chunks"][0]
    assert sorted(got) == sorted(expected)
    for name, entry in expected.items():
        assert sorted(got[name]) == sorted(entry), name
        for key, value in entry.items():
            assert torch.equal(got[name][key], value), (name, key)
    assert got["lm_head.bias"]["exp_avg_sq"].abs().sum() > 0
    weights = model.state_dict()
    for name, value in flatten_checkpoint_state_dict(sd["model"]).items():
        if not name.endswith("_extra_state"):
            assert torch.equal(value, weights[name]), name


@pytest.mark.parametrize("pp,split", [(1, None), (2, 1), (4, 1)])
def test_t5_regular_optimizer_order_matches_real_stage_models(pp, split):
    """The regular optimizer's parameter order derived from a T5 rank file's names equals get_param_groups over the
    real T5Model of each pipeline stage (encoder stages, the decoder's first stage with its embeddings' copy, the last
    stage with the head's copy of the word embeddings before lm_head)."""
    from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of
    from megatron.checkpoint.conversion.optimizer_state import regular_param_order
    from megatron.checkpoint.conversion.t5_format import t5_layouts
    from megatron.core.parallel_state import ParallelState
    from megatron.core.transformer_config import TransformerConfig
    from megatron.models.gpt.model import flatten_checkpoint_state_dict
    from megatron.models.t5.model import T5Model
    from megatron.optimizer.param_groups import get_param_groups

    cfg = TransformerConfig(num_layers=3, encoder_num_layers=3, decoder_num_layers=3, hidden_size=32,
                            num_attention_heads=4, ffn_hidden_size=48, max_position_embeddings=16,
                            padded_vocab_size=PADDED, hidden_dropout=0.0, attention_dropout=0.0,
                            bias_gelu_fusion=False)
    meta = ModelMeta("T5", architecture_of(cfg), extra={"t5": {"encoder_num_layers": 3, "decoder_num_layers": 3}})
    full_order = list(t5_layouts(meta))
    staged = dataclasses.replace(cfg, pipeline_model_parallel_size=pp)
    for p in range(pp):
        state = ParallelState(pp_size=pp, pp_rank=p, pipeline_split_rank=split, pp_ranks=list(range(pp))) \
            if pp > 1 else None
        stage = T5Model(staged, pp_state=state)
        names = {param: (0, n) for n, param in stage.named_parameters()}
        expected = [[names[param] for param in g["params"]] for g in get_param_groups([stage])]
        flat = flatten_checkpoint_state_dict(stage.state_dict_for_save_checkpoint())
        assert regular_param_order([flat], full_order) == expected, (pp, split, p)
