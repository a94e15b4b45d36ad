"""lightning_paci: asynchronous, bubble-free pipeline-parallel training (PACI) for PyTorch Lightning."""

from __future__ import annotations

import importlib
from typing import Any

from lightning_paci.partition import PartitionPlan, plan_partition
from lightning_paci.reference import ReferencePipeline
from lightning_paci.schedules import Action, Schedule, ScheduleError, build, drift_bound, validate
from lightning_paci.strategy import PACIStrategy  # registers "paci", "paci_fork", "paci_spawn"

__all__ = [
    "PACIStrategy",
    "PartitionPlan",
    "ReferencePipeline",
    "plan_partition",
    "Action",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "build",
    "drift_bound",
    "simulate",
    "validate",
]
__version__ = "0.1.0.dev0"

# Imported on first use so that `python -m lightning_paci.simulate` does not find the module half-imported.
_LAZY = {"simulate": "lightning_paci.simulate", "SimulationResult": "lightning_paci.simulate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_paci' has no attribute {name!r}")
