"""The interval-union report of a rank's communication hidden under compute (sim.overlap_report),
the figures NVIDIA reads off an Nsight trace to judge the EP overlap: on hand-made spans against
hand-computed unions, and on a small MoE run with and without the overlap."""

from __future__ import annotations

import pytest

from sim.engine import Span
from sim.overlap_report import main, overlap_report
from sim.streams import DP_COMM, EP_COMM
from tests.sim.test_ep_overlap import _run


def _span(stream: str, start: float, end: float, rank: int = 0, phase: str = "A") -> Span:
    return Span(rank, stream, f"{stream} {start}", "compute" if stream == "compute" else "comm", start, end, phase)


def test_unions_and_intersection_of_hand_made_spans():
    spans = [
        _span("compute", 0.0, 2.0), _span("compute", 1.0, 3.0),  # compute union [0, 3]
        _span(EP_COMM, 2.5, 4.0), _span(EP_COMM, 3.5, 5.0),  # EP union [2.5, 5]: 0.5 s under compute
        _span(DP_COMM, 6.0, 7.0),  # another stream: active, not EP
        _span("compute", 10.0, 20.0, phase="B"),  # the optimizer step: not counted
        _span(EP_COMM, 0.0, 9.0, rank=1),  # another rank
    ]
    r = overlap_report(spans, 0)
    assert (r.compute_s, r.comm_s, r.concurrent_s, r.active_s) == pytest.approx((3.0, 2.5, 0.5, 6.0))
    assert r.hidden == pytest.approx(0.2)
    both = overlap_report(spans, 0, streams=(EP_COMM, DP_COMM))
    assert (both.comm_s, both.concurrent_s) == pytest.approx((3.5, 0.5))
    assert overlap_report(spans, 2).hidden == 0.0  # nothing on that rank: no division by zero


def test_the_combined_schedule_hides_what_the_plain_schedule_exposes():
    """Without the overlap every all-to-all waits for the compute before it and the compute after
    it waits for the all-to-all: nothing concurrent. With it the small model's all-to-alls (each
    shorter than the compute beside it) run under the other micro-batch's compute."""
    serial, overlapped = overlap_report(_run(False).spans, 0), overlap_report(_run(True).spans, 0)
    assert serial.comm_s > 0 and serial.concurrent_s == pytest.approx(0.0, abs=1e-12)
    # the two unions are disjoint; the gradient reduction after them is active too
    assert serial.active_s >= serial.compute_s + serial.comm_s - 1e-12
    assert overlapped.comm_s > 0 and 0.5 < overlapped.hidden <= 1.0
    assert overlapped.active_s < serial.active_s


def test_main_refuses_an_ambiguous_row(capsys):
    with pytest.raises(SystemExit):
        main(["qwen3"])
    assert "matches" in capsys.readouterr().err
