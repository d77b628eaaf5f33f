"""megatron/timers.py: log levels, accumulation, Megatron's log text and tensorboard output, across 2 ranks."""
from __future__ import annotations

import pytest

import megatron.timers as timers_mod
from megatron.timers import DummyTimer, Timer, Timers
from tests.dist_utils import run_distributed


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timers_mod.time, "time", fake)
    return fake


class FakeWriter:
    def __init__(self) -> None:
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


def test_log_levels():
    timers = Timers(log_level=1)
    assert isinstance(timers("interval-time", log_level=0), Timer)
    assert isinstance(timers("forward-backward", log_level=1), Timer)
    assert isinstance(timers("forward-compute", log_level=2), DummyTimer)
    assert isinstance(timers("no-level"), DummyTimer)  # no level: the most detailed (2)
    with pytest.raises(ValueError, match="log level"):
        timers("interval-time", log_level=1)
    with pytest.raises(ValueError, match="maximum"):
        timers("x", log_level=3)
    timers("forward-compute", log_level=2).start()  # dummy timers are no-ops
    timers("forward-compute", log_level=2).stop()


def test_accumulation_and_reset(clock):
    timers = Timers(log_level=2)
    t = timers("step", 0)
    t.start()
    clock.now += 1.5
    t.stop()
    t.start()
    clock.now += 0.5
    assert t.elapsed(reset=False) == pytest.approx(2.0)  # a running timer keeps running
    clock.now += 1.0
    t.stop()
    assert t.elapsed() == pytest.approx(3.0)
    assert t.elapsed() == 0.0
    assert t.active_time() == pytest.approx(3.0)
    with pytest.raises(RuntimeError, match="not started"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="already been started"):
        t.start()


def test_log_text_single_process(clock, capsys):
    for option, expected in [
        ("minmax", "(min, max) time across ranks (ms):\n    forward-compute ................................: "
                   "(250.00, 250.00)"),
        ("max", "(min, max) time across ranks (ms):\n    forward-compute ................................: 250.00"),
        ("all", "times across ranks (ms):\n  forward-compute:\n     rank  0: 250.00"),
    ]:
        timers = Timers(log_level=2, log_option=option)
        timers("forward-compute", 1).start()
        clock.now += 0.5
        timers("forward-compute").stop()
        timers.log(["forward-compute", "never-started"], normalizer=2.0)
        assert capsys.readouterr().out.strip() == expected
    assert Timers(2).get_log_string(["missing"]) is None
    with pytest.raises(ValueError, match="normalizer"):
        Timers(2).log(["x"], normalizer=0.0)
    with pytest.raises(ValueError, match="--timing-log-option"):
        Timers(2, log_option="median")


def test_write_to_tensorboard(clock):
    timers = Timers(log_level=2)
    timers("batch-generator", 1).start()
    clock.now += 0.2
    timers("batch-generator").stop()
    writer = FakeWriter()
    timers.write(["batch-generator", "absent"], writer, iteration=7, normalizer=1.0)
    assert len(writer.scalars) == 1
    name, value, step = writer.scalars[0]
    assert (name, step) == ("batch-generator-time", 7) and value == pytest.approx(200.0)


def _distributed_body(rank, world_size):
    clock = FakeClock()
    timers_mod.time.time = clock
    timers = Timers(log_level=2, log_option="minmax")
    timers("optimizer", 1).start()
    clock.now += 0.1 * (rank + 1)
    timers("optimizer").stop()
    if rank == 1:
        timers("only-on-rank-1", 2).start()
        clock.now += 0.3
        timers("only-on-rank-1").stop()
    text = timers.get_log_string(["optimizer", "only-on-rank-1"], reset=False)
    timers.log(["optimizer"], reset=False)  # collective on every rank
    writer = FakeWriter()
    timers.write(["optimizer"], writer, iteration=3)
    return text, writer.scalars


def test_min_max_across_two_ranks():
    results = run_distributed(_distributed_body, world_size=2)
    for text, scalars in results:
        assert "optimizer ......................................: (100.00, 200.00)" in text
        assert "only-on-rank-1 .................................: (300.00, 300.00)" in text
        assert scalars[0][0] == "optimizer-time" and scalars[0][1] == pytest.approx(200.0)
