"""A full disk during a checkpoint save without the fault injector: torch's own file writer reports no errno (on a
full device it says "unexpected pos <n> vs <m>"), and a plain ENOSPC from a write. Both are one line naming the folder,
what the save needs and what is free; the tracker stays on the last good checkpoint, which loads."""
from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path

import pytest
import torch

from megatron import compat as ck
from megatron.checkpoint import atomic_io
from megatron.checkpoint.atomic_io import DiskFullError, tensor_bytes


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)


def _args(tmp: Path) -> argparse.Namespace:
    return argparse.Namespace(
        save=str(tmp), load=str(tmp), num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=64,
        kv_channels=8, max_position_embeddings=8, padded_vocab_size=128, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, consumed_train_samples=40, consumed_valid_samples=8,
        consumed_train_tokens=320, finetune=False, no_load_optim=True, no_load_rng=True, no_save_optim=True,
        no_save_rng=True)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, _Net]:
    torch.manual_seed(0)
    net = _Net()
    ck.save_checkpoint(5, [net], None, None, _args(tmp_path))
    return tmp_path, net


def _torch_writer_on_a_full_device(obj, target, *a, **kw):
    """The real torch.save path writer, pointed at /dev/full: torch's genuine error for a full device."""
    assert isinstance(target, str)
    open(target, "wb").close()  # the temporary file exists, as with a real partial write
    return _REAL_SAVE(obj, "/dev/full")


_REAL_SAVE = torch.save


def _assert_last_good_checkpoint_loads(tmp: Path, net: _Net) -> None:
    assert (tmp / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not list(tmp.rglob("*.tmp.*"))
    fresh = _Net()
    assert ck.load_checkpoint([fresh], None, None, _args(tmp)) == 5
    assert torch.equal(fresh.lin.weight, net.lin.weight)


def test_torch_writer_failure_on_a_full_device_is_one_line(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp, net = saved
    monkeypatch.setattr(atomic_io.torch, "save", _torch_writer_on_a_full_device)
    monkeypatch.setattr(atomic_io, "_free_bytes", lambda folder: 0)  # what a full device reports
    with pytest.raises(DiskFullError) as info:
        ck.save_checkpoint(6, [_Net()], None, None, _args(tmp))
    folder = tmp / "iter_0000006" / "mp_rank_00"
    assert str(info.value) == (f"no space left on the device holding {folder} while writing model_optim_rng.pt "
                               "(needs about 1.1 KiB; 0 bytes free): free space or write somewhere else; "
                               "model_optim_rng.pt was not published (the previous version, if any, is intact)")
    monkeypatch.undo()
    _assert_last_good_checkpoint_loads(tmp, net)


def test_enospc_from_a_write_is_one_line(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp, net = saved

    def half_then_enospc(obj, target, *a, **kw):
        with open(target, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_io.torch, "save", half_then_enospc)
    with pytest.raises(DiskFullError) as info:
        ck.save_checkpoint(6, [_Net()], None, None, _args(tmp))
    assert str(info.value).startswith(f"no space left on the device holding {tmp / 'iter_0000006' / 'mp_rank_00'} "
                                      "while writing model_optim_rng.pt (needs about 1.1 KiB; ")
    monkeypatch.undo()
    _assert_last_good_checkpoint_loads(tmp, net)


def test_torch_writer_failure_with_space_left_is_not_called_a_full_disk(saved, monkeypatch) -> None:
    tmp, _ = saved
    monkeypatch.setattr(atomic_io.torch, "save", _torch_writer_on_a_full_device)
    monkeypatch.setattr(atomic_io, "_free_bytes", lambda folder: 50 << 30)
    with pytest.raises(RuntimeError) as info:
        ck.save_checkpoint(6, [_Net()], None, None, _args(tmp))
    assert not isinstance(info.value, DiskFullError)


def test_tensor_bytes_counts_each_storage_once() -> None:
    w = torch.zeros(10, 10)
    assert tensor_bytes({"a": w, "b": [w, w[:2]], "c": (torch.zeros(3, dtype=torch.float64), "x", 1)}) == 400 + 24


def test_deepspeed_engine_save_on_a_full_disk_is_one_line(tmp_path: Path, monkeypatch) -> None:
    from megatron.ds import engine as ds_engine

    class _Engine:
        def save_checkpoint(self, save_dir, tag, client_state):
            os.makedirs(os.path.join(save_dir, tag))
            _REAL_SAVE({"w": torch.zeros(8)}, "/dev/full")

    monkeypatch.setattr(atomic_io, "_free_bytes", lambda folder: 0)
    tag_dir = str(tmp_path / "global_step6")
    with pytest.raises(DiskFullError) as info:
        ds_engine._engine_save(_Engine(), str(tmp_path), tag_dir, 6, {})
    assert str(info.value).startswith(f"no space left on the device holding {tag_dir} while DeepSpeed saved "
                                      "iteration 6: free space or save somewhere else;")
