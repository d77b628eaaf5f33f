"""tools/checkpoint/convert.py with the training state of a BERT model (issue 15 section 2, the unit level).

A BERT checkpoint (token types, pooler, binary head, LM head with its dense / layernorm / vocab-parallel bias) written
by megatron.compat.save_checkpoint after two steps of Megatron's regular optimizer converts TP1 -> TP2 x PP2
(the distributed optimizer's files) -> TP1, and every parameter's optimizer state (fp32 main param, exp_avg,
exp_avg_sq), the step, the iteration, consumed samples, the LR schedule and the weights come back bitwise. The
parameter order the converter derives for the regular optimizer from a rank file's names equals get_param_groups over
the real BertModel pipeline stages (the last stage's copy of the tied embedding sits before the heads).
"""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from tests.tools.checkpoint_convert_helpers import TRUE_VOCAB, load_files

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(TRUE_VOCAB), "--make-vocab-size-divisible-by", "4", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--lr", "1e-2", "--weight-decay", "0.1"]
PADDED = 64


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "BERT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


def _bert(cfg, **kw):
    from megatron.models.bert.model import BertModel

    return BertModel(cfg, num_tokentypes=2, add_binary_head=True, **kw)


def _trained_bert(folder):
    """save_checkpoint of a BERT after two steps of Megatron's regular optimizer; (model, optimizer, scheduler)."""
    from megatron.arguments import build_parser, core_transformer_config_from_args, validate_args
    from megatron.compat import save_checkpoint
    from megatron.core.tensor_parallel import model_parallel_manual_seed
    from megatron.learning_rates import OptimizerParamScheduler
    from megatron.optimizer import get_megatron_optimizer, optimizer_config_from_args

    args = build_parser().parse_args(FLAGS)
    args.rank, args.world_size = 0, 1
    validate_args(args, {})
    args.true_vocab_size, args.padded_vocab_size = TRUE_VOCAB, PADDED
    args.consumed_train_samples = 24
    model_parallel_manual_seed(5)
    model = _bert(core_transformer_config_from_args(args))
    optimizer = get_megatron_optimizer([model], optimizer_config_from_args(args))
    sched = OptimizerParamScheduler(optimizer, 0.0, 1e-2, 1e-3, 1, 10, "cosine", 0.1, 0.1, 10, "constant")
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, TRUE_VOCAB, (2, 16), generator=g)
    types = torch.randint(0, 2, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    for _ in range(2):
        optimizer.zero_grad()
        lm_loss, binary = model(ids, mask, tokentype_ids=types, lm_labels=torch.roll(ids, 1, 1))
        (lm_loss.float().mean() + binary.float().square().mean()).backward()
        assert optimizer.step()[0]
        sched.step(1)
    save_checkpoint(2, [model], optimizer, sched, args, str(folder))
    return model, optimizer, sched


def test_bert_optimizer_state_round_trip_is_bitwise(tmp_path):
    from megatron.models.gpt.model import flatten_checkpoint_state_dict
    from megatron.optimizer.distrib_optimizer import regular_state_to_param_state

    model, optimizer, sched = _trained_bert(tmp_path / "src")
    summary = _convert(tmp_path / "src", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
                       "--target-pipeline-parallel-size", "2")
    assert summary["meta"].extra["optimizer"]["step"] == 2
    files = load_files(str(tmp_path / "tp2pp2"))
    assert sorted(files) == [(t, p) for t in range(2) for p in range(2)]
    assert all(f["optimizer"]["distributed_optimizer"] for f in files.values())
    last = torch.load(tmp_path / "tp2pp2" / "iter_0000002" / "mp_rank_01_001" / "distrib_optim.pt",
                      weights_only=False)["chunks"][0]
    assert {"lm_head.bias", "lm_head.dense.weight", "lm_head.layernorm.weight", "binary_head.weight",
            "language_model.pooler.dense.weight", "word_embeddings.weight"} <= set(last)
    assert last["lm_head.bias"]["exp_avg"].shape == (PADDED // 2,)  # vocab-parallel bias split over TP
    summary = _convert(tmp_path / "tp2pp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1",
                       "--target-pipeline-parallel-size", "1")
    assert summary["meta"].extra["optimizer"]["step"] == 2

    back = tmp_path / "tp1" / "iter_0000002" / "mp_rank_00"
    sd = torch.load(back / "model_optim_rng.pt", weights_only=False)
    state = torch.load(back / "distrib_optim.pt", weights_only=False)
    assert (sd["iteration"], sd["consumed_train_samples"]) == (2, 24)
    assert sd["opt_param_scheduler"] == sched.state_dict() and sd["args"].bert_binary_head is True
    assert state["step"] == 2 and state["state_keys"] == ["exp_avg", "exp_avg_sq"]
    expected = regular_state_to_param_state(optimizer.state_dict(), [model])["chunks"][0]
    got = state["chunks"][0]
    assert sorted(got) == sorted(expected) and "language_model.embedding.tokentype_embeddings.weight" in got
    for name, entry in expected.items():
        assert sorted(got[name]) == sorted(entry), name
        for key, value in entry.items():
            assert torch.equal(got[name][key], value), (name, key)
    assert got["lm_head.bias"]["exp_avg_sq"].abs().sum() > 0  # the heads were trained and their moments carried
    weights = model.state_dict()
    for name, value in flatten_checkpoint_state_dict(sd["model"]).items():
        if not name.endswith("_extra_state"):
            assert torch.equal(value, weights[name]), name
    groups = sd["optimizer"]["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in optimizer.param_groups]


@pytest.mark.parametrize("pp,vp", [(1, 1), (2, 1), (2, 2)])
def test_bert_regular_optimizer_order_matches_real_stage_models(pp, vp):
    """The regular optimizer's parameter order derived from a BERT rank file's names equals get_param_groups over
    the real BertModel chunks of each pipeline stage."""
    import dataclasses
    import types

    from megatron.checkpoint.conversion.interchange import ModelMeta, architecture_of
    from megatron.checkpoint.conversion.megatron_format import layer_layouts
    from megatron.checkpoint.conversion.optimizer_state import regular_param_order
    from megatron.models.gpt.model import flatten_checkpoint_state_dict
    from megatron.optimizer.param_groups import get_param_groups
    from tests.tools.checkpoint_convert_helpers import config

    cfg = config("gpt2")
    meta = ModelMeta("BERT", architecture_of(cfg), extra={"bert": {"num_tokentypes": 2, "add_binary_head": True}})
    full_order = list(layer_layouts(meta))
    staged = dataclasses.replace(cfg, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    for p in range(pp):
        chunks = []
        for v in range(vp):
            state = types.SimpleNamespace(pp_size=pp, pp_rank=p, virtual_pp_size=vp if vp > 1 else None,
                                          virtual_pp_rank=v, tp_group=None, embedding_group=None)
            chunks.append(_bert(staged, pp_state=state, pre_process=p == 0 and v == 0,
                                post_process=p == pp - 1 and v == vp - 1))
        names = {param: (c, n) for c, chunk in enumerate(chunks) for n, param in chunk.named_parameters()}
        expected = [[names[param] for param in g["params"]] for g in get_param_groups(chunks)]
        flats = [flatten_checkpoint_state_dict(chunk.state_dict_for_save_checkpoint()) for chunk in chunks]
        assert regular_param_order(flats, full_order) == expected, (pp, vp, p)
        if p == pp - 1 and pp > 1:
            assert any(n == "word_embeddings.weight" for g in expected for _, n in g)
