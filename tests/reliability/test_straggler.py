"""--log-straggler (megatron/straggler.py): every rank's forward time per iteration, gathered every --log-interval,
Megatron's min/max line on rank 0 and the ranks slower than --straggler-threshold x the median named. Two gloo ranks
of the tiny GPT (--straggler-threshold 4: this shared 2-core machine's clean runs differ by up to ~2.6x
between ranks over 3 iterations): a clean run names nobody; a rank slowed by an injected sleep from its 4th forward step is named at
the second report (within two report intervals). The toggle port turns collection off and on."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from megatron.initialize import find_free_port
from megatron.straggler import StragglerDetector, StragglerReport, find_stragglers, report_lines
from tests.reliability.helpers import run_ranks, train_argv


def test_find_stragglers_uses_the_median() -> None:
    assert find_stragglers([10.0, 11.0, 9.5, 30.0], 2.0) == ([3], 10.5)
    assert find_stragglers([10.0, 11.0, 9.5, 19.0], 2.0) == ([], 10.5)
    assert find_stragglers([10.0, 25.0], 2.0) == ([1], 17.5)  # two ranks: each against the other
    assert find_stragglers([0.0, 0.0], 2.0) == ([], 0.0) and find_stragglers([5.0], 2.0) == ([], 5.0)


def test_report_lines_megatron_minmax_and_named_rank() -> None:
    report = StragglerReport(times_ms=[10.0, 40.0, 11.0, 12.0], tflops=[0.4, 0.1, 0.36, 0.33], stragglers=[1],
                             median_ms=11.5)
    lines = report_lines(report, 2, ["a", "b", "c", "d"], 2.0)
    assert "| MnRtt/Rnk: 10.00ms/0 | MxRtt/Rnk: 40.00ms/1 | MnEtpt/Rnk: 0.10TF/1 | MxEtpt/Rnk: 0.40TF/0" in lines[0]
    assert lines[1] == "^^^^ Bottom 2 Ranks with lowest  Etpt(TF):  0.10/1, 0.33/3,"
    assert lines[2] == "^^^^ Top    2 Ranks with highest Etpt(TF):  0.36/2, 0.40/0,"
    assert lines[3].startswith("straggler: rank(s) 1 (b: 40.0ms) took more than 2x the other ranks' median")
    assert len(report_lines(StragglerReport([10.0, 11.0], [1.0, 1.0], [], 10.5), 1, ["a", "b"], 2.0)) == 1


def test_single_process_times_reports_and_toggles(capsys: pytest.CaptureFixture) -> None:
    det = StragglerDetector(port=0, threshold=2.0)
    try:
        step = det.timed(lambda it, model: (it, model))
        assert step(1, 2) == (1, 2)
        report = det.report(total_flops=3e12, log_interval=1)
        assert report is not None and report.stragglers == [] and report.times_ms[0] > 0
        assert report.tflops[0] == pytest.approx(3e12 / (report.times_ms[0] * 1e9) / 3.0)
        # a connection to the control port toggles collection at the next report (Megatron's controller)
        with socket.create_connection(("127.0.0.1", det.controller.port), timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert b"200 OK" in conn.recv(1024)
        assert det.report(3e12, 1) is not None  # this report still ran; the toggle applies after it
        assert det.on is False and det.report(3e12, 1) is None
        step(1, 2)
        assert det.elapsed_s == 0.0  # off: nothing timed
    finally:
        det.close()
    assert "StragglerDetector is now OFF" in capsys.readouterr().out


@pytest.mark.slow
def test_slowed_rank_is_named_and_a_clean_run_names_none(tiny_data: dict, tmp_path: Path) -> None:
    argv = train_argv(tiny_data, "--distributed-backend", "gloo", "--global-batch-size", "8", "--micro-batch-size",
                      "2", "--log-interval", "3", "--log-straggler", "--straggler-ctrlr-port",
                      str(find_free_port()), "--straggler-minmax-count", "2", "--straggler-threshold", "4", iters=6)
    clean = run_ranks(argv, tmp_path / "clean")
    assert [r["stragglers"] for r in clean] == [{"3": [], "6": []}] * 2
    slowed = run_ranks(argv, tmp_path / "slow", REL_SLOW="1 7 0.3")  # rank 1's 7th forward = iteration 4's first
    assert [r["stragglers"] for r in slowed] == [{"3": [], "6": [1]}] * 2
    log = (tmp_path / "slow" / "rank0.out").read_text()
    assert "| MxRtt/Rnk: " in log and "ms/1 |" in log.split("| MxRtt/Rnk: ")[-1].split("\n")[0]
    assert "straggler: rank(s) 1 (" in log
    # the numbers are the run's own: the slowed run's losses equal the clean run's
    assert slowed[0]["train_losses"] == clean[0]["train_losses"]


def test_bad_threshold_or_count_is_one_line() -> None:
    from types import SimpleNamespace

    from megatron.errors import ArgumentError

    log = dict(log_straggler=True, disable_straggler_on_startup=False, straggler_ctrlr_port=None)
    with pytest.raises(ArgumentError, match="--straggler-threshold must be > 0"):
        StragglerDetector.for_run(SimpleNamespace(**log, straggler_minmax_count=1, straggler_threshold=0.0))
    with pytest.raises(ArgumentError, match="--straggler-minmax-count >= 1"):
        StragglerDetector.for_run(SimpleNamespace(**log, straggler_minmax_count=0, straggler_threshold=2.0))
    assert StragglerDetector.for_run(SimpleNamespace(**log, straggler_minmax_count=1, straggler_threshold=2.0))
