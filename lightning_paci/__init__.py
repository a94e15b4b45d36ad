"""lightning_paci: asynchronous, bubble-free pipeline-parallel training (PACI) for PyTorch Lightning."""

from __future__ import annotations

from lightning_paci.callbacks import BubbleMonitor, DriftMonitor, MemoryMonitor, TimelineMonitor
from lightning_paci.partition import PartitionPlan, plan_partition
from lightning_paci.reference import ReferencePipeline
from lightning_paci.schedules import Action, Schedule, ScheduleError, build, drift_bound, validate
from lightning_paci.simulation import SimulationResult, simulate
from lightning_paci.strategy import PACIStrategy  # registers "paci", "paci_fork", "paci_spawn"

__all__ = [
    "PACIStrategy",
    "BubbleMonitor",
    "DriftMonitor",
    "MemoryMonitor",
    "TimelineMonitor",
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
