"""Micro-batch calculators: constant split, Megatron's batch-size ramp-up, and divisibility errors."""
import pytest

from megatron.microbatches import (
    ConstantNumMicroBatches,
    RampupBatchsizeNumMicroBatches,
    build_num_microbatches_calculator,
)


def test_constant(capsys):
    calc = build_num_microbatches_calculator(0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert isinstance(calc, ConstantNumMicroBatches)
    assert calc.get() == 4
    assert calc.get_current_global_batch_size() == 32
    calc.update(10_000, True)
    assert calc.get() == 4
    assert "setting number of micro-batches to constant 4" in capsys.readouterr().out


def test_constant_not_divisible():
    with pytest.raises(ValueError, match="--global-batch-size"):
        build_num_microbatches_calculator(0, None, global_batch_size=30, micro_batch_size=4, data_parallel_size=2)


def test_rampup_key_points(capsys):
    # start 8, +8 per increment, over 1000 samples, to 32: 3 increments, 333.33 samples each.
    calc = build_num_microbatches_calculator(0, ["8", "8", "1000"], 32, 2, 2)
    assert isinstance(calc, RampupBatchsizeNumMicroBatches)
    assert "will use batch size rampup starting from global batch size 8" in capsys.readouterr().out
    expected = {0: 8, 333: 8, 334: 16, 666: 16, 667: 24, 999: 24, 1000: 32, 1001: 32, 10**6: 32}
    for consumed, gbs in expected.items():
        calc.update(consumed, True)
        assert calc.get_current_global_batch_size() == gbs, consumed
        assert calc.get() == gbs // 4
    # Formula check against Megatron's: start + int(consumed / (ramp / n_incr)) * incr.
    for consumed in range(0, 1001, 37):
        calc.update(consumed, False)
        assert calc.get_current_global_batch_size() == 8 + int(consumed / (1000 / 3)) * 8


def test_rampup_start_equals_global():
    calc = RampupBatchsizeNumMicroBatches(16, 4, 100, 16, 2, 2)
    for consumed in (0, 50, 200):
        calc.update(consumed, True)
        assert calc.get() == 4


@pytest.mark.parametrize(
    "ramp, gbs, mbs, dp, match",
    [
        ([8, 7, 100], 32, 1, 1, "divisible by the increment"),
        ([40, 8, 100], 32, 1, 1, "must be <="),
        ([8, 8], 32, 1, 1, "expects 3 values"),
        ([0, 8, 100], 32, 1, 1, "start batch size"),
        (["a", 8, 100], 32, 1, 1, "must be integers"),
    ],
)
def test_rampup_bad_config(ramp, gbs, mbs, dp, match):
    with pytest.raises(ValueError, match=match):
        build_num_microbatches_calculator(1, ramp, gbs, mbs, dp)


def test_rampup_consistency_check():
    # start 6 with micro*dp = 4 is not divisible: the check names the flags.
    calc = build_num_microbatches_calculator(1, [6, 2, 100], 12, 2, 2)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        calc.update(0, True)
    calc.update(0, False)
    assert calc.get_current_global_batch_size() == 6
