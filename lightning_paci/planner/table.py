"""How a chosen plan is shown and applied: the table beside its runners-up, the ``PACIStrategy`` options that pin
it, and the check of the prediction against the run.

The table is what ``plan="auto"`` prints at setup and ``python -m lightning_paci.plan`` prints without training;
``plan_options`` turns a plan into the options a user would pass to get exactly that run without searching again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_paci.planner.search import Plan

__all__ = ["MISMATCH", "format_bytes", "format_plans", "mismatches", "plan_options"]

# predicted and measured figures differing by more than this (relative to the measured) are reported
MISMATCH = 0.15


def format_bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def plan_options(plan: Plan) -> dict[str, Any]:
    """The ``PACIStrategy`` keyword arguments that run ``plan`` as it was chosen."""
    options: dict[str, Any] = {
        "pipeline_parallel_size": plan.layout.stages, "data_parallel_size": plan.layout.replicas,
        "microbatches": plan.microbatches, "partition": list(plan.bounds[1:-1]),
        "recompute": "blocks" if plan.recompute_stages else "off",
    }
    if plan.recompute_stages and plan.recompute_stages < plan.layout.stages:
        options["recompute_stages"] = plan.recompute_stages
    if plan.layout.virtual_stages > 1:
        options["virtual_stages"], options["placement"] = plan.layout.virtual_stages, plan.layout.placement
    if plan.layout.replicas > 1:
        if plan.reduce == "blocking":
            options["reduce_bucket_mb"] = None
        elif plan.reduce == "deferred":
            options["deferred_update"] = True
    return options


def _row(rank: str, plan: Plan, best: float) -> list[str]:
    recompute = "-" if not plan.recompute_stages else (
        "all" if plan.recompute_stages >= plan.layout.stages else f"first {plan.recompute_stages}")
    return [rank, f"{plan.layout.stages}x{plan.layout.replicas}" + (
        f" v{plan.layout.virtual_stages}{plan.layout.placement[0]}" if plan.layout.virtual_stages > 1 else ""),
        str(plan.microbatches), ",".join(map(str, plan.bounds[1:-1])) or "-", recompute,
        plan.reduce if plan.layout.replicas > 1 else "-", f"{plan.samples_per_s:.1f}",
        f"{plan.samples_per_s / best:.2f}" if best else "-", format_bytes(plan.peak_memory),
        " / ".join(format_bytes(m) for m in plan.memory), str(plan.drift), "yes" if plan.fits else "NO"]


def format_plans(plans: Sequence[Plan], chosen: Plan, *, runners_up: int = 5,
                 budget: float | None = None) -> str:
    """The chosen plan first, then the next fastest distinct plans: layout, micro-batches, cut points,
    recomputing stages, reduction, predicted samples/s (and relative to the chosen), peak and per-process memory,
    drift bound, whether it fits ``budget``."""
    head = ["", "layout", "m", "cuts", "recompute", "reduce", "samples/s", "rel", "peak mem", "memory per process",
            "drift", "fits"]
    rows = [head, _row("chosen", chosen, chosen.samples_per_s)]
    for plan in [p for p in plans if p is not chosen][:runners_up]:
        rows.append(_row("", plan, chosen.samples_per_s))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    title = "lightning_paci plan (predicted" + (f"; memory budget {format_bytes(budget)} per process" if budget
                                                else "") + ")"
    return "\n".join([title, *lines])


def mismatches(predicted: dict[str, float], measured: dict[str, float], tolerance: float = MISMATCH) -> list[str]:
    """One phrase per figure whose prediction is off by more than ``tolerance`` of the measured value."""
    out = []
    for key, value in measured.items():
        guess = predicted.get(key)
        if guess is None or value <= 0:
            continue
        error = (guess - value) / value
        if abs(error) > tolerance:
            out.append(f"{key}: predicted {guess:.4g}, measured {value:.4g} ({error:+.0%})")
    return out
