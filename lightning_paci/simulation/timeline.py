"""Timelines: intervals of stage work, drawn as a Gantt PNG or exported as a Chrome/Perfetto trace.

Shared by the simulator (predicted intervals) and the runtime (measured intervals); this module does not know where
its intervals came from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_paci.schedules.actions import Interval  # re-exported: the pictures' input

__all__ = ["Interval", "COLORS", "draw_timeline", "save_timeline_png", "to_chrome_trace", "write_chrome_trace"]


COLORS: dict[str, str] = {
    "F": "#4C78A8",  # forward: blue
    "B": "#54A24B",  # backward: green
    "OPT": "#E45756",  # optimizer step: red
    "WAIT_F": "#D9D9D9",  # waiting for an activation: light grey
    "WAIT_B": "#BDBDBD",  # waiting for a gradient: grey
    "SEND": "#B279A2",  # posting a message: purple
    "REDUCE": "#F58518",  # a data-parallel reduction on the replicas' link (its own lane): orange
}
_LINK = "REDUCE"  # the kind drawn in a lane of its own under its stage's row
_IDLE_COLOR = "#F2F2F2"


def draw_timeline(
    intervals: Sequence[Interval],
    num_stages: int,
    *,
    title: str = "",
    time_unit: str = "time",
    figure_width: float | None = None,
    chunks: Sequence[int] | None = None,
) -> Any:
    """Return a matplotlib ``Figure``: one row per stage (stage 0 on top), forward / backward / optimizer step /
    waits in distinct colours, idle as the pale background, micro-batch numbers written inside wide-enough boxes.
    ``REDUCE`` intervals (the simulator's ``link_intervals``) get a lane of their own under their stage's row, so a
    reduction that overlaps the backward shows beside it rather than hiding it.

    ``chunks`` (with virtual stages, [Note: virtual stages]: rows are devices): each interval's chunk index in the
    device's order (0 for its first chunk, 1 for its second, ...); a device's later chunks are drawn in lighter
    shades of the same colours."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = max((iv.end for iv in intervals), default=1.0)
    start = min((iv.start for iv in intervals), default=0.0)
    span = max(end - start, 1e-12)
    width = figure_width or min(40.0, max(8.0, 0.09 * len(intervals) / max(num_stages, 1) + 6))
    lanes = 2 if any(iv.kind == _LINK for iv in intervals) else 1  # per stage: its work, then its link
    rows = lanes * num_stages
    fig, ax = plt.subplots(figsize=(width, 0.6 * rows + 1.6))
    ax.barh(range(rows), [span] * rows, left=start, height=0.8, color=_IDLE_COLOR, edgecolor="none")
    min_label_width = span / (width * 9.0)  # about one character at the figure's scale
    for index, iv in enumerate(intervals):
        row = lanes * iv.stage + (iv.kind == _LINK)
        alpha = 1.0 if chunks is None else 1.0 / (1.0 + 0.8 * chunks[index])  # later chunks: lighter
        if iv.end - iv.start <= 0.0:  # an instantaneous event (a zero-cost optimizer step): a marker line
            ax.plot([iv.start, iv.start], [row - 0.4, row + 0.4], color=COLORS.get(iv.kind, "#999999"), linewidth=2.5,
                    alpha=alpha)
            continue
        ax.barh(row, iv.end - iv.start, left=iv.start, height=0.8, color=COLORS.get(iv.kind, "#999999"),
                edgecolor="white", linewidth=0.4, alpha=alpha)
        label = str(iv.microbatch)
        if iv.microbatch is not None and iv.kind in ("F", "B") and iv.end - iv.start >= min_label_width * len(label):
            ax.text((iv.start + iv.end) / 2, row, label, ha="center", va="center", fontsize=7, color="white")
    row_name = "stage" if chunks is None else "device"
    labels = [f"{row_name} {s}" if lane == 0 else f"{row_name} {s} link" for s in range(num_stages)
              for lane in range(lanes)]
    ax.set_yticks(range(rows), labels)
    ax.invert_yaxis()
    ax.set_xlim(start, end)
    ax.set_xlabel(time_unit)
    if title:
        ax.set_title(title)
    present = [kind for kind in COLORS if any(iv.kind == kind for iv in intervals)]
    names = {"F": "forward", "B": "backward", "OPT": "optimizer step", "WAIT_F": "wait: activation",
             "WAIT_B": "wait: gradient", "SEND": "send", _LINK: "reduction on the link"}
    handles = [Patch(color=COLORS[k], label=names[k]) for k in present] + [Patch(color=_IDLE_COLOR, label="idle")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if rows < 4 else -0.18),
              ncol=len(handles), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def save_timeline_png(intervals: Sequence[Interval], num_stages: int, path: str | Path, **kwargs: Any) -> Path:
    import matplotlib.pyplot as plt

    fig = draw_timeline(intervals, num_stages, **kwargs)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_chrome_trace(intervals: Sequence[Interval], *, time_scale: float = 1e6) -> dict[str, Any]:
    """Chrome/Perfetto trace events (``chrome://tracing``, ui.perfetto.dev): one thread row per stage (process 0),
    and one per stage's link for ``REDUCE`` intervals (process 1).

    ``time_scale`` converts interval times to microseconds (1e6 for seconds).
    """
    events: list[dict[str, Any]] = []
    for stage, link in sorted({(iv.stage, iv.kind == _LINK) for iv in intervals}):  # a link: process 1's thread
        events.append({"name": "thread_name", "ph": "M", "pid": int(link), "tid": stage,
                       "args": {"name": f"stage {stage}" + " link" * link}})
    for iv in intervals:
        name = iv.kind if iv.microbatch is None else f"{iv.kind}{iv.microbatch}"
        events.append({
            "name": name, "cat": iv.kind, "ph": "X", "pid": int(iv.kind == _LINK), "tid": iv.stage,
            "ts": iv.start * time_scale, "dur": max(0.0, (iv.end - iv.start) * time_scale),
            "args": {"microbatch": iv.microbatch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(intervals: Sequence[Interval], path: str | Path, *, time_scale: float = 1e6) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(intervals, time_scale=time_scale)))
    return path
