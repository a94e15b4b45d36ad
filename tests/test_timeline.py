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
