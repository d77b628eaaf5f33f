"""tools/checkpoint/convert.py with the training state (issue 15 section 2, the unit level; the loss curves that
continue on another layout are in tests/training/test_resume_new_layout.py).

A Llama-style checkpoint written by megatron.compat.save_checkpoint after two optimizer steps (fp32 with the
regular optimizer; bf16 with fp32 main params) converts TP1 -> TP2 x PP2 with virtual chunks -> TP1, and the
optimizer state of every parameter (fp32 main param, exp_avg, exp_avg_sq), the step, the iteration, consumed samples,
the LR schedule and the weights including the trained vocabulary padding rows come back bitwise. --no-save-optim
writes the weights only.
"""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint.conversion.driver import convert, parse_args
from tests.tools.checkpoint_convert_helpers import TRUE_VOCAB, build, inputs, load_files

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--ffn-hidden-size", "24",
         "--seq-length", "16", "--max-position-embeddings", "16", "--swiglu", "--normalization", "RMSNorm",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "4",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(TRUE_VOCAB), "--make-vocab-size-divisible-by",
         "4", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-2", "--weight-decay", "0.1"]


def _convert(src, dst, *extra):
    return convert(parse_args(["--model-type", "GPT", "--load-dir", str(src), "--save-dir", str(dst), *extra]))


def _trained_checkpoint(folder, precision):
    """save_checkpoint of a model after two steps of Megatron's optimizer; returns (model, optimizer, args)."""
    from megatron.arguments import build_parser, core_transformer_config_from_args, validate_args
    from megatron.compat import save_checkpoint
    from megatron.learning_rates import OptimizerParamScheduler
    from megatron.optimizer import get_megatron_optimizer, optimizer_config_from_args

    args = build_parser().parse_args(FLAGS + ([f"--{precision}"] if precision != "fp32" else []))
    args.rank, args.world_size = 0, 1
    validate_args(args, {})
    args.true_vocab_size, args.padded_vocab_size = TRUE_VOCAB, 64
    args.consumed_train_samples = 24
    model = build(core_transformer_config_from_args(args))
    if precision == "bf16":
        model.bfloat16()
    optimizer = get_megatron_optimizer([model], optimizer_config_from_args(args))
    sched = OptimizerParamScheduler(optimizer, 0.0, 1e-2, 1e-3, 1, 10, "cosine", 0.1, 0.1, 10, "constant")
    ids, pos, mask = inputs()
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, pos, mask, labels=torch.roll(ids, 1, 1)).float().mean().backward()
        assert optimizer.step()[0]
        sched.step(1)
    save_checkpoint(2, [model], optimizer, sched, args, str(folder))
    return model, optimizer, sched


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_state_round_trip_is_bitwise(tmp_path, precision):
    from megatron.optimizer.distrib_optimizer import regular_state_to_param_state

    model, optimizer, sched = _trained_checkpoint(tmp_path / "src", precision)
    _convert(tmp_path / "src", tmp_path / "tp2pp2", "--target-tensor-parallel-size", "2",
             "--target-pipeline-parallel-size", "2", "--target-num-layers-per-virtual-pipeline-stage", "1")
    files = load_files(str(tmp_path / "tp2pp2"))
    assert sorted(files) == [(t, p) for t in range(2) for p in range(2)]
    assert all(f["optimizer"]["distributed_optimizer"] and "model1" in f for f in files.values())
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
        for key, value in entry.items():
            assert torch.equal(got[name][key], value), (name, key)
    weights = model.state_dict()
    from megatron.models.gpt.model import flatten_checkpoint_state_dict

    for name, value in flatten_checkpoint_state_dict(sd["model"]).items():  # padding rows as trained, not re-padded
        if not name.endswith("_extra_state"):
            assert torch.equal(value, weights[name]), name
    groups = sd["optimizer"]["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in optimizer.param_groups]


def test_no_save_optim_writes_weights_only(tmp_path):
    model, _, _ = _trained_checkpoint(tmp_path / "src", "fp32")
    summary = _convert(tmp_path / "src", tmp_path / "out", "--target-tensor-parallel-size", "2", "--no-save-optim")
    assert "optimizer" not in summary["meta"].extra
    files = load_files(str(tmp_path / "out"))
    assert all("optimizer" not in f for f in files.values())
    assert not list((tmp_path / "out" / "iter_0000002").glob("*/distrib_optim.pt"))
    word = torch.cat([files[(t, 0)]["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
                      for t in range(2)])
    ref = model.state_dict()["language_model.embedding.word_embeddings.weight"]
    assert torch.equal(word[:TRUE_VOCAB], ref[:TRUE_VOCAB])
    assert torch.equal(word[TRUE_VOCAB:], ref[TRUE_VOCAB - 1].expand(64 - TRUE_VOCAB, -1))  # Megatron's re-padding


def test_missing_distrib_optim_is_one_line(tmp_path):
    from megatron.checkpoint.conversion.interchange import ConversionError

    _trained_checkpoint(tmp_path / "src", "fp32")
    _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2")
    (tmp_path / "tp2" / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt").unlink()
    with pytest.raises(ConversionError, match="iter_0000002 .mp_rank_01/distrib_optim.pt is missing"):  # manifest
        _convert(tmp_path / "tp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1")
    assert not (tmp_path / "tp1").exists()
    (tmp_path / "tp2" / "iter_0000002" / "manifest.json").unlink()  # unverified: the reader's own check names it
    with pytest.raises(ConversionError, match="missing rank file .*distrib_optim.pt"):
        _convert(tmp_path / "tp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1")
    assert not (tmp_path / "tp1").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_regular_optimizer_order_matches_real_stage_models(family):
    """The regular optimizer's parameter order that the reader derives from a rank file's names equals
    get_param_groups over the real GPTModel chunks of each pipeline stage (PP2 x 2 virtual chunks; GPT-2 style has
    the last stage's copy of the tied embedding)."""
    import dataclasses
    import types

    from megatron.checkpoint.conversion.megatron_format import layer_layouts
    from megatron.checkpoint.conversion.optimizer_state import regular_param_order
    from megatron.models.gpt.model import GPTModel, flatten_checkpoint_state_dict
    from megatron.optimizer.param_groups import get_param_groups
    from tests.tools.checkpoint_convert_helpers import config, meta_for

    cfg = config(family)
    full_order = list(layer_layouts(meta_for(cfg)))
    pp, vp = 2, 2
    staged = dataclasses.replace(cfg, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    for p in range(pp):
        chunks = []
        for v in range(vp):
            state = types.SimpleNamespace(pp_size=pp, pp_rank=p, virtual_pp_size=vp, virtual_pp_rank=v,
                                          tp_group=None)
            chunks.append(GPTModel(staged, pp_state=state, pre_process=p == 0 and v == 0,
                                   post_process=p == pp - 1 and v == vp - 1))
        names = {param: (c, n) for c, chunk in enumerate(chunks) for n, param in chunk.named_parameters()}
        expected = [[names[param] for param in g["params"]] for g in get_param_groups(chunks)]
        flats = [flatten_checkpoint_state_dict(chunk.state_dict_for_save_checkpoint()) for chunk in chunks]
        assert regular_param_order(flats, full_order) == expected, (family, p)


def test_new_padding_rows_repeat_the_last_row_with_its_moments(tmp_path):
    """A target padding of 66 rows (--make-vocab-size-divisible-by 33) instead of 64: the two new rows of the word
    embedding and the untied output layer repeat the last row, weights and optimizer state alike, and the tool says
    the continuation will differ."""
    _trained_checkpoint(tmp_path / "src", "fp32")
    summary = _convert(tmp_path / "src", tmp_path / "out", "--make-vocab-size-divisible-by", "33")
    assert "the padded vocabulary changed from 64 to 66 rows" in summary["note"]
    folder = tmp_path / "out" / "iter_0000002" / "mp_rank_00"
    state = torch.load(folder / "distrib_optim.pt", weights_only=False)["chunks"][0]
    src = torch.load(tmp_path / "src" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert src["padded_vocab_size"] == 64
    for name in ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"):
        for key, value in state[name].items():
            assert value.shape[0] == 66 and torch.equal(value[64:], value[63].expand(2, -1)), (name, key)
    out = state["language_model.output_layer.weight"]["exp_avg_sq"]
    assert out[63].abs().sum() > 0  # a padding row of the output layer is trained (softmax), its moments carried


def test_foreign_optimizer_state_converts_the_weights_only(tmp_path, capsys):
    """A distrib_optim.pt of another framework's format: one note, the weights are converted as before."""
    _trained_checkpoint(tmp_path / "src", "fp32")
    _convert(tmp_path / "src", tmp_path / "tp2", "--target-tensor-parallel-size", "2")
    for path in (tmp_path / "tp2" / "iter_0000002").glob("*/distrib_optim.pt"):
        torch.save({"param_state_sharding_type": "dp_zero_gather_scatter"}, path)
    (tmp_path / "tp2" / "iter_0000002" / "manifest.json").unlink(missing_ok=True)
    summary = _convert(tmp_path / "tp2", tmp_path / "tp1", "--target-tensor-parallel-size", "1")
    assert "optimizer" not in summary["meta"].extra
    assert "is not a distributed optimizer state of this framework: its optimizer state is not converted; writing " \
           "the weights only" in capsys.readouterr().out
    assert all("optimizer" not in f for f in load_files(str(tmp_path / "tp1")).values())
