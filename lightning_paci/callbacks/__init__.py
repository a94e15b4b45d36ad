"""Monitoring callbacks: per-stage drift, bubble time, activation memory and timelines, written to TensorBoard by
each stage."""

from lightning_paci.callbacks.bubble import BubbleMonitor
from lightning_paci.callbacks.drift import DriftMonitor
from lightning_paci.callbacks.export import SavePretrained
from lightning_paci.callbacks.memory import MemoryMonitor
from lightning_paci.callbacks.timeline import TimelineMonitor

__all__ = ["BubbleMonitor", "DriftMonitor", "MemoryMonitor", "SavePretrained", "TimelineMonitor"]
