"""Schedules on paper: the discrete-event simulator, its command line and the timeline drawing.

* :mod:`~lightning_paci.simulation.simulator`: predicted bubble, drift, in-flight depth and makespan of a list
  (``simulate``), measured phases of a run (``measured_phases``), the table and ``main`` behind
  ``python -m lightning_paci.simulate``;
* :mod:`~lightning_paci.simulation.reports`: per-stage figures read off a timeline, simulated or measured (phases,
  drift, in-flight depth);
* :mod:`~lightning_paci.simulation.timeline`: intervals (simulated or measured) -> Gantt PNG and Chrome trace.

It reads the schedules' lists and nothing else of the package: no torch, no Lightning (matplotlib only when a
picture is drawn). The runtime's records and the simulator both produce
:class:`~lightning_paci.schedules.Interval` records, so both kinds draw the same way.
"""

from __future__ import annotations

from lightning_paci.simulation.simulator import (
    SimulationResult,
    StageReport,
    format_table,
    main,
    measured_phases,
    simulate_schedule,
)

__all__ = ["SimulationResult", "StageReport", "format_table", "main", "measured_phases", "simulate_schedule"]
