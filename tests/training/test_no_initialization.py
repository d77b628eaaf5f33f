"""--no-initialization (TransformerConfig.perform_initialization = False): weights are allocated but no init method
runs; after loading a checkpoint the model computes exactly what the initialised one does; the default path still
initialises every weight. End to end: resuming with --no-initialization gives the same losses as without."""
from __future__ import annotations

from pathlib import Path

import torch

from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.core.transformer_config import TransformerConfig
from tests.dist_utils import run_distributed
from tests.model.helpers import batch, build_gpt, tiny_config
from tests.training._workers import run_pretrain

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", group_query_attention=True,
             num_query_groups=2, add_bias_linear=False, share_embeddings_and_output_weights=False)


def _counting(config: TransformerConfig) -> dict:
    """Wrap the config's init methods so that the test sees how many weights they fill."""
    calls = {"n": 0}
    for name in ("init_method", "output_layer_init_method"):
        method = getattr(config, name)

        def counted(tensor, _method=method):
            calls["n"] += 1
            return _method(tensor)

        setattr(config, name, counted)
    return calls


def test_flag_reaches_the_config_and_is_no_longer_refused() -> None:
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100"]
    for extra, expected in (([], True), (["--no-initialization"], False)):
        args = parse_args(args=[*base, *extra])
        args.rank = 1  # keep the argument dump quiet
        args = validate_args(args, {})
        assert core_transformer_config_from_args(args).perform_initialization is expected


def test_uninitialised_model_loads_a_checkpoint_to_identical_outputs() -> None:
    for variant in ({}, LLAMA):
        reference_config = tiny_config(**variant)
        reference_calls = _counting(reference_config)
        reference = build_gpt(reference_config, seed=11)
        assert reference_calls["n"] > 0  # the default path initialises

        config = tiny_config(perform_initialization=False, **variant)
        calls = _counting(config)
        model = build_gpt(config, seed=99)
        assert calls["n"] == 0  # no init method ran: the weights are only allocated
        if variant:  # no learned position embedding: nothing drew from the global RNG while building
            torch.manual_seed(5)
            state = torch.get_rng_state()
            build_gpt(tiny_config(perform_initialization=False, **variant), seed=5)
            assert torch.equal(torch.get_rng_state(), state)
        # The parameters and tensor-parallel attributes exist as in the initialised model.
        names = {n: (tuple(p.shape), getattr(p, "tensor_model_parallel", False)) for n, p in model.named_parameters()}
        assert names == {n: (tuple(p.shape), getattr(p, "tensor_model_parallel", False))
                         for n, p in reference.named_parameters()}

        model.load_state_dict(reference.state_dict())
        ids, pos, mask, labels = batch()
        assert torch.equal(model(ids, pos, mask), reference(ids, pos, mask))
        model(ids, pos, mask, labels=labels).sum().backward()
        reference(ids, pos, mask, labels=labels).sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_resume_with_no_initialization_gives_the_same_losses(gpt_data: dict, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    common = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--normalization", "RMSNorm", "--swiglu",
              "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-file", gpt_data["vocab"],
              "--merge-file", gpt_data["merges"], "--data-path", gpt_data["prefix"], "--split", "90,10,0",
              "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--num-workers", "0", "--seed", "7", "--lr", "1e-3"]
    (train,) = run_distributed(run_pretrain, 1, args=([*common, "--train-iters", "2", "--save", ckpt,
                                                       "--save-interval", "2"],))
    assert train["error"] is None, train["error"]
    resumed = {}
    for extra in ((), ("--no-initialization",)):
        (run,) = run_distributed(run_pretrain, 1, args=([*common, "--train-iters", "4", "--load", ckpt,
                                                         "--use-checkpoint-opt_param-scheduler", *extra],))
        assert run["error"] is None, run["error"]
        resumed[extra] = run["result"]
    plain, uninitialised = resumed[()], resumed[("--no-initialization",)]
    assert sorted(plain["train_losses"]) == [3, 4]
    assert plain["train_losses"] == uninitialised["train_losses"]
    assert plain["val_loss"] == uninitialised["val_loss"]
