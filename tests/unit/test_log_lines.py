"""tests/log_lines.py reads the lines megatron/logging_utils.py writes (Megatron-DeepSpeed's formats)."""
from __future__ import annotations

from tests.log_lines import iteration_lines, iteration_values, parse_losses, validation_values

LOG = """\
 iteration        1/      20 | consumed samples:            8 | consumed tokens:          512 | elapsed time per iteration (s): 0.12 | learning rate: 5.000E-04 | global batch size:     8 | lm loss: 8.012345E+00 | sop loss: 6.931472E-01 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
 iteration        2/      20 | consumed samples:           16 | lm loss: nan | loss scale: 1.0 | grad norm: 2.500 |
noise between the lines | lm loss: 99 |
 iteration        2/      20 | consumed samples:           16 | lm loss: 7.500000E+00 | loss scale: 1.0 |
 validation loss at iteration 2 | lm loss value: 7.400000E+00 | lm loss PPL: 1.636E+03 |
 validation loss at the end of training for val data | lm loss value: 7.300000E+00 | lm loss PPL: 1.480E+03 |
"""


def test_training_lines() -> None:
    assert iteration_values(LOG) == {1: 8.012345, 2: 7.5}  # the repeated iteration: the last line wins
    assert iteration_lines(LOG, as_text=True) == [(1, "8.012345E+00"), (2, "nan"), (2, "7.500000E+00")]
    assert iteration_values(LOG, "sop loss") == {1: 0.6931472}
    assert iteration_values(LOG, "grad norm") == {1: 1.234, 2: 2.5}
    assert iteration_values(LOG, "consumed samples") == {1: 8, 2: 16}


def test_validation_lines() -> None:
    assert validation_values(LOG) == [("iteration 2", 7.4), ("the end of training for val data", 7.3)]
    assert validation_values(LOG, "lm loss PPL", as_text=True)[0] == ("iteration 2", "1.636E+03")
    assert parse_losses(LOG) == {"train": {1: 8.012345, 2: 7.5},
                                 "val": [("iteration 2", 7.4), ("the end of training for val data", 7.3)]}
