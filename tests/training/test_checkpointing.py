"""Unit tests of the checkpoint run-time layer (megatron/checkpoint/) through Megatron's wrappers
(megatron/compat.py) in one process: layout, atomic tracker, finetune/no-load flags, release checkpoints and the one-line mismatch errors."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from megatron import compat as ck


class _Net(torch.nn.Module):
    def __init__(self, hidden: int = 4) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _args(tmp: Path, **kw) -> argparse.Namespace:
    base = dict(save=str(tmp), load=str(tmp), num_layers=2, hidden_size=4, num_attention_heads=2,
                ffn_hidden_size=16, kv_channels=2, max_position_embeddings=8, padded_vocab_size=128,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, consumed_train_samples=40,
                consumed_valid_samples=8, consumed_train_tokens=320, finetune=False, no_load_optim=False,
                no_load_rng=False, no_save_optim=False, no_save_rng=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _opt(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=0.1)


def _save(tmp: Path, iteration: int = 5, **kw) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = _Net()
    opt = _opt(net)
    net(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck.save_checkpoint(iteration, [net], opt, None, _args(tmp, **kw))
    return net, opt


def test_layout_tracker_and_roundtrip(tmp_path: Path) -> None:
    net, opt = _save(tmp_path)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert sorted(os.listdir(tmp_path / "iter_0000005")) == ["manifest.json", "mp_rank_00"]
    assert ck.get_checkpoint_name("x", 7, pipeline_parallel=True, tensor_rank=1, pipeline_rank=2) == \
        os.path.join("x", "iter_0000007", "mp_rank_01_002", "model_optim_rng.pt")
    assert ck.get_checkpoint_name("x", 0, release=True) == os.path.join("x", "release", "mp_rank_00",
                                                                         "model_optim_rng.pt")
    expected = torch.rand(3)  # RNG draw right after the save ...
    fresh, fresh_opt = _Net(), None
    fresh_opt = _opt(fresh)
    args = _args(tmp_path, consumed_train_samples=0, consumed_valid_samples=0)
    assert ck.load_checkpoint([fresh], fresh_opt, None, args) == 5
    assert torch.equal(torch.rand(3), expected)  # ... is replayed after loading (RNG restored)
    assert torch.equal(fresh.lin.weight, net.lin.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert (args.consumed_train_samples, args.consumed_valid_samples, args.consumed_train_tokens) == (40, 8, 320)


def test_finetune_and_no_load_optim(tmp_path: Path) -> None:
    net, _ = _save(tmp_path)
    fresh = _Net()
    fresh_opt = _opt(fresh)
    assert ck.load_checkpoint([fresh], fresh_opt, None, _args(tmp_path, finetune=True)) == 0
    assert torch.equal(fresh.lin.weight, net.lin.weight)
    assert fresh_opt.state_dict()["state"] == {}  # optimizer state not loaded
    fresh_opt2 = _opt(_Net())
    assert ck.load_checkpoint([_Net()], fresh_opt2, None, _args(tmp_path, no_load_optim=True)) == 5
    assert fresh_opt2.state_dict()["state"] == {}


def test_release_checkpoint_starts_at_zero(tmp_path: Path) -> None:
    net, _ = _save(tmp_path)
    os.rename(tmp_path / "iter_0000005", tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    fresh = _Net()
    assert ck.load_checkpoint([fresh], _opt(fresh), None, _args(tmp_path)) == 0
    assert torch.equal(fresh.lin.weight, net.lin.weight)


def test_missing_tracker_starts_from_scratch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ck.load_checkpoint([_Net()], None, None, _args(tmp_path)) == 0
    assert "will not load any checkpoints" in capsys.readouterr().out


@pytest.mark.parametrize("attr,value,flag", [
    ("hidden_size", 8, "--hidden-size"),
    ("num_layers", 3, "--num-layers"),
    ("padded_vocab_size", 256, "--make-vocab-size-divisible-by"),
    ("tensor_model_parallel_size", 2, "--tensor-model-parallel-size"),
])
def test_mismatch_is_one_line_error(tmp_path: Path, attr: str, value: int, flag: str) -> None:
    _save(tmp_path)
    with pytest.raises(RuntimeError) as info:
        ck.load_checkpoint([_Net()], None, None, _args(tmp_path, **{attr: value}))
    msg = str(info.value)
    assert "\n" not in msg and flag in msg and attr in msg


def test_layout_mismatch_names_the_parallel_sizes(tmp_path: Path) -> None:
    _save(tmp_path)
    it = tmp_path / "iter_0000005"
    os.rename(it / "mp_rank_00", it / "mp_rank_00_000")
    os.makedirs(it / "mp_rank_01_000")
    os.makedirs(it / "mp_rank_00_001")
    with pytest.raises(RuntimeError, match="--tensor-model-parallel-size 2 and --pipeline-model-parallel-size 2"):
        ck.load_checkpoint([_Net()], None, None, _args(tmp_path))


def test_layout_mismatch_names_the_expert_parallel_size(tmp_path: Path) -> None:
    """An EP2 checkpoint (mp_rank_00_000 / mp_rank_00_001, args with expert_model_parallel_size 2) loaded by a
    one-process run: the message names the expert-parallel size, not a pipeline size."""
    _save(tmp_path, expert_model_parallel_size=2)
    it = tmp_path / "iter_0000005"
    os.rename(it / "mp_rank_00", it / "mp_rank_00_000")
    os.makedirs(it / "mp_rank_00_001")
    with pytest.raises(RuntimeError) as info:
        ck.load_checkpoint([_Net()], None, None, _args(tmp_path))
    msg = str(info.value)
    assert "--tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 and " \
        "--expert-model-parallel-size 2, but this run uses 1 and 1 and 1" in msg
    assert "\n" not in msg


def test_bad_tracker_and_missing_iteration(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc")
    with pytest.raises(RuntimeError, match="must contain an iteration number"):
        ck.load_checkpoint([_Net()], None, None, _args(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(RuntimeError, match="does not exist"):
        ck.load_checkpoint([_Net()], None, None, _args(tmp_path))


def test_shape_mismatch_in_weights_is_one_line(tmp_path: Path) -> None:
    _save(tmp_path)
    with pytest.raises(RuntimeError) as info:
        ck.load_checkpoint([_Net(hidden=6)], None, None, _args(tmp_path))
    assert "\n" not in str(info.value) and "does not match the model" in str(info.value)


def test_weights_only_loading_refuses_other_classes(tmp_path: Path) -> None:
    _save(tmp_path)
    sd = ck.load_state_dict_file(str(tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"))
    assert sd["iteration"] == 5 and isinstance(sd["args"], argparse.Namespace)
    odd = tmp_path / "odd.pt"
    torch.save({"args": argparse.Namespace(p=Path("/x"))}, odd)  # a class outside the allow-list
    with pytest.raises(RuntimeError, match="odd.pt: it needs 'pathlib.PosixPath'.*--trust-checkpoint"):
        ck.load_state_dict_file(str(odd))
    assert ck.load_state_dict_file(str(odd), trust=True)["args"].p == Path("/x")  # the explicit opt-in


def test_no_temp_files_left(tmp_path: Path) -> None:
    _save(tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp." in p.name]
    assert leftovers == []


def test_use_checkpoint_args_copies_model_shape(tmp_path: Path) -> None:
    _save(tmp_path, hidden_size=4, num_layers=2, max_position_embeddings=8)
    args = argparse.Namespace(load=str(tmp_path), num_layers=None, hidden_size=None, max_position_embeddings=None)
    ck.load_args_from_checkpoint(args)
    assert (args.num_layers, args.hidden_size, args.max_position_embeddings) == (2, 4, 8)
    with pytest.raises(RuntimeError, match="no latest_checkpointed_iteration.txt"):
        ck.load_args_from_checkpoint(argparse.Namespace(load=str(tmp_path / "empty")))


def _damage(tmp: Path, iteration: int) -> None:
    path = tmp / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the manifest's CRC no longer matches
    path.write_bytes(bytes(data))


def test_use_checkpoint_args_follows_the_integrity_fallback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _save(tmp_path, iteration=5, hidden_size=4)
    _save(tmp_path, iteration=10, hidden_size=8)
    args = argparse.Namespace(load=str(tmp_path), num_layers=None, hidden_size=None)
    ck.load_args_from_checkpoint(args)
    assert args.hidden_size == 8  # intact: the tracker's iteration
    _damage(tmp_path, 10)
    capsys.readouterr()
    args = argparse.Namespace(load=str(tmp_path), num_layers=None, hidden_size=None)
    ck.load_args_from_checkpoint(args)
    assert args.hidden_size == 4  # the iteration load_checkpoint will load
    assert "skipped damaged checkpoint iteration(s) 10 (" in capsys.readouterr().out
    net = _Net()
    assert ck.load_checkpoint([net], _opt(net), None, _args(tmp_path, hidden_size=args.hidden_size)) == 5
    with pytest.raises(RuntimeError, match="checkpoint iteration 10 .* is damaged"):
        ck.load_args_from_checkpoint(argparse.Namespace(load=str(tmp_path), hidden_size=None,
                                                        no_checkpoint_fallback=True))


def test_iteration_newer_than_the_tracker_is_ignored_with_a_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    _save(tmp_path, iteration=5, hidden_size=4)
    _save(tmp_path, iteration=10, hidden_size=8)  # complete (manifest written) ...
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")  # ... but the crash came before the tracker
    capsys.readouterr()
    net = _Net()
    assert ck.load_checkpoint([net], _opt(net), None, _args(tmp_path)) == 5
    out = capsys.readouterr().out
    assert "iteration(s) 10 in" in out and "newer than the tracker's 5" in out, out
    args = argparse.Namespace(load=str(tmp_path), hidden_size=None)
    ck.load_args_from_checkpoint(args)
    assert args.hidden_size == 4


def test_use_checkpoint_args_follows_the_deepspeed_fallback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron.checkpoint import integrity

    for step, hidden in ((5, 4), (10, 8), (15, 16)):  # DeepSpeed's layout with Megatron's client state
        tag_dir = tmp_path / f"global_step{step}"
        tag_dir.mkdir()
        torch.save({"architecture": {"hidden_size": hidden, "num_layers": 2}, "module": {"w": torch.ones(64)}},
                   tag_dir / "mp_rank_00_model_states.pt")
        integrity.write_manifest(str(tag_dir))
    (tmp_path / "latest").write_text("global_step10")  # global_step15 complete, the crash came before 'latest'
    capsys.readouterr()
    args = argparse.Namespace(load=str(tmp_path), hidden_size=None)
    ck.load_args_from_checkpoint(args)
    assert args.hidden_size == 8
    assert "global_step(s) 15 in" in capsys.readouterr().out
    path = tmp_path / "global_step10" / "mp_rank_00_model_states.pt"
    path.write_bytes(path.read_bytes()[:-16])  # truncated
    capsys.readouterr()
    args = argparse.Namespace(load=str(tmp_path), hidden_size=None)
    ck.load_args_from_checkpoint(args)
    assert args.hidden_size == 4
    assert "skipped damaged checkpoint(s) global_step10 (" in capsys.readouterr().out
