"""lightning_paci: asynchronous, bubble-free pipeline-parallel training (PACI) for PyTorch Lightning.

``import lightning_paci`` registers ``Trainer(strategy="paci")``, ``"paci_fork"`` and ``"paci_spawn"``. The public
names below are loaded on first use, so the pure tools (``python -m lightning_paci.simulate``, the schedule
builders) start without importing torch or Lightning; the strategy itself is imported, and registered, at once
unless the package is being imported only to run one of its own command-line modules (``python -m
lightning_paci.simulate``); any other launch form registers it (``python -m pkg.train`` included).
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

__all__ = [
    "PACIStrategy",
    "PACIConfig",
    "BubbleMonitor",
    "DriftMonitor",
    "MemoryMonitor",
    "SavePretrained",
    "TimelineMonitor",
    "PartitionPlan",
    "ReferencePipeline",
    "plan_partition",
    "Action",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "BuildMismatchError",
    "CrossingError",
    "DataMismatchError",
    "LightningAPIError",
    "MetaLoadError",
    "NcclRuleError",
    "ReplicaMismatchError",
    "StageFailure",
    "StageMismatchError",
    "TensorPickleError",
    "WeightsError",
    "build_schedule",
    "drift_bound",
    "simulate_schedule",
    "validate_schedule",
]
__version__ = "0.4.0.dev0"

_HOME = {
    "PACIStrategy": "strategy",
    "PACIConfig": "config",
    "BubbleMonitor": "callbacks",
    "DriftMonitor": "callbacks",
    "MemoryMonitor": "callbacks",
    "SavePretrained": "callbacks",
    "TimelineMonitor": "callbacks",
    "PartitionPlan": "partition",
    "plan_partition": "partition",
    "ReferencePipeline": "integration.stage.reference_pipeline",
    "Action": "schedules",
    "Schedule": "schedules",
    "ScheduleError": "errors",
    "BuildMismatchError": "errors",
    "CrossingError": "errors",
    "DataMismatchError": "errors",
    "LightningAPIError": "errors",
    "MetaLoadError": "errors",
    "NcclRuleError": "errors",
    "ReplicaMismatchError": "errors",
    "StageFailure": "errors",
    "StageMismatchError": "errors",
    "TensorPickleError": "errors",
    "WeightsError": "errors",
    "build_schedule": "schedules",
    "drift_bound": "schedules",
    "validate_schedule": "schedules",
    "SimulationResult": "simulation",
    "simulate_schedule": "simulation",
}


_RENAMED = {"build": "build_schedule", "validate": "validate_schedule"}  # the names of 0.3 and before


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"`lightning_paci.{name}` is `lightning_paci.{_RENAMED[name]}`; the old name will be removed.",
                      DeprecationWarning, stacklevel=2)
        return __getattr__(_RENAMED[name])
    if name not in _HOME:
        raise AttributeError(f"module 'lightning_paci' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_paci.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


def _running_own_tool() -> bool:
    """Whether this import is ``python -m lightning_paci.<tool>`` importing its own package first: only then is the
    strategy left unimported. ``python -m pkg.train`` whose ``pkg/__init__.py`` imports lightning_paci is also
    imported while ``sys.argv[0] == "-m"``, and must register ``"paci"``: the module run is read from the command
    line itself (``sys.orig_argv``)."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", [])
    target = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return target == "lightning_paci" or target.startswith("lightning_paci.")


def _console_logger() -> None:
    """The package's own lines said at INFO (a model built on the meta device, the weights' key prefix, the plan's
    prediction) reach the console as Lightning's own do: without a root handler, the ``lightning_paci`` logger gets
    a stderr handler at INFO and does not propagate; with one (an application's logging, pytest), the records go to
    it and its level decides."""
    logger = logging.getLogger(__name__)
    if not logger.handlers and not logging.getLogger().hasHandlers():
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


_console_logger()

if TYPE_CHECKING:
    from lightning_paci.callbacks import BubbleMonitor, DriftMonitor, MemoryMonitor, SavePretrained, TimelineMonitor
    from lightning_paci.config import PACIConfig
    from lightning_paci.errors import (
        BuildMismatchError,
        CrossingError,
        DataMismatchError,
        LightningAPIError,
        MetaLoadError,
        NcclRuleError,
        ReplicaMismatchError,
        ScheduleError,
        StageFailure,
        StageMismatchError,
        TensorPickleError,
        WeightsError,
    )
    from lightning_paci.integration.stage.reference_pipeline import ReferencePipeline
    from lightning_paci.partition import PartitionPlan, plan_partition
    from lightning_paci.schedules import Action, Schedule, build_schedule, drift_bound, validate_schedule
    from lightning_paci.simulation import SimulationResult, simulate_schedule
    from lightning_paci.strategy import PACIStrategy
elif not _running_own_tool():
    from lightning_paci.strategy import PACIStrategy  # registers "paci", "paci_fork", "paci_spawn"
