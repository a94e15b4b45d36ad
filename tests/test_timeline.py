"""The timeline renderers: a Gantt PNG and a Chrome/Perfetto trace from the same intervals."""

from __future__ import annotations

import json

from lightning_paci.simulation.timeline import Interval, save_timeline_png, to_chrome_trace, write_chrome_trace

INTERVALS = [Interval(0, "F", 0, 0.0, 1.0), Interval(0, "SEND", 0, 1.0, 1.1), Interval(1, "WAIT_F", 0, 0.0, 1.2),
             Interval(1, "F", 0, 1.2, 2.2), Interval(1, "B", 0, 2.2, 4.2), Interval(0, "OPT", None, 5.0, 5.5)]


def test_the_chrome_trace_has_one_row_per_stage_and_one_event_per_interval(tmp_path):
    trace = to_chrome_trace(INTERVALS, time_scale=1000.0)
    rows = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["args"]["name"]) for e in rows] == [(0, "stage 0"), (1, "stage 1")]
    assert [e["name"] for e in events] == ["F0", "SEND0", "WAIT_F0", "F0", "B0", "OPT"]
    assert events[4]["ts"] == 2200.0 and events[4]["dur"] == 2000.0 and events[4]["tid"] == 1
    path = write_chrome_trace(INTERVALS, tmp_path / "trace.json", time_scale=1000.0)
    assert json.loads(path.read_text()) == trace


def test_the_gantt_png_is_written(tmp_path):
    path = save_timeline_png(INTERVALS, 2, tmp_path / "timeline.png", time_unit="s", title="two stages")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_reductions_on_the_link_get_a_lane_under_their_stage_and_a_trace_row_of_their_own():
    from lightning_paci.simulation.timeline import draw_timeline

    with_link = [*INTERVALS, Interval(0, "REDUCE", None, 3.0, 4.5), Interval(1, "REDUCE", None, 4.2, 5.0)]
    figure = draw_timeline(with_link, 2)
    labels = [label.get_text() for label in figure.axes[0].get_yticklabels()]
    assert labels == ["stage 0", "stage 0 link", "stage 1", "stage 1 link"]
    bars = [patch for patch in figure.axes[0].patches if patch.get_width() == 1.5]  # stage 0's reduction
    assert len(bars) == 1 and bars[0].get_y() + bars[0].get_height() / 2 == 1  # row 1: stage 0's link
    assert [label.get_text() for label in draw_timeline(INTERVALS, 2).axes[0].get_yticklabels()] == \
        ["stage 0", "stage 1"]  # no reduction, no lane
    trace = to_chrome_trace(with_link)
    rows = [(e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    assert rows == [(0, 0, "stage 0"), (1, 0, "stage 0 link"), (0, 1, "stage 1"), (1, 1, "stage 1 link")]
    reduce_events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "REDUCE"]
    assert [(e["pid"], e["tid"]) for e in reduce_events] == [(1, 0), (1, 1)]
