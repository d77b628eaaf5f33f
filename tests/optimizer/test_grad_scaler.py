"""Constant and dynamic loss scalers: backoff after hysteresis, floor, growth after the window, state_dict."""
import pytest
import torch

from megatron.optimizer import ConstantGradScaler, DynamicGradScaler


def _dyn(**kw):
    args = dict(initial_scale=1024.0, min_scale=64.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                hysteresis=2)
    args.update(kw)
    return DynamicGradScaler(**args)


def test_dynamic_hysteresis_backoff_floor_and_growth():
    s = _dyn()
    s.update(True)
    assert s.scale.item() == 1024.0  # first overflow is absorbed by hysteresis
    s.update(True)
    assert s.scale.item() == 512.0
    s.update(True)
    assert s.scale.item() == 256.0  # hysteresis stays exhausted until the scale grows again
    for _ in range(4):
        s.update(True)
    assert s.scale.item() == 64.0  # never below min_scale
    s.update(False)
    s.update(False)
    assert s.scale.item() == 64.0
    s.update(False)
    assert s.scale.item() == 128.0  # grows after growth_interval clean steps
    s.update(True)
    assert s.scale.item() == 128.0  # hysteresis re-armed by the growth
    assert s.inv_scale.item() == 1.0 / 128.0


def test_overflow_resets_growth_tracker():
    s = _dyn(hysteresis=5)
    s.update(False)
    s.update(False)
    s.update(True)
    s.update(False)
    s.update(False)
    assert s.scale.item() == 1024.0
    s.update(False)
    assert s.scale.item() == 2048.0


def test_state_dict_round_trip():
    s = _dyn()
    for found in (True, False, True, True, False):
        s.update(found)
    t = _dyn()
    t.load_state_dict(s.state_dict())
    assert t.scale.item() == s.scale.item()
    for found in (False, False, True, True, False, False, False):
        s.update(found)
        t.update(found)
        assert t.scale.item() == s.scale.item()


def test_constant_scaler_and_errors():
    c = ConstantGradScaler(8.0)
    c.update(True)
    assert c.scale.item() == 8.0 and c.state_dict() == {}
    assert c.scale.dtype == torch.float32
    with pytest.raises(ValueError, match="loss scale"):
        ConstantGradScaler(0.0)
    with pytest.raises(ValueError, match="--min-loss-scale"):
        _dyn(min_scale=4096.0)
    with pytest.raises(ValueError, match="--hysteresis"):
        _dyn(hysteresis=0)
