"""Monitoring callbacks: per-stage drift, bubble time, activation memory and timelines, written to TensorBoard by
each stage."""

from lightning_paci.callbacks.bubble_monitor import BubbleMonitor
from lightning_paci.callbacks.drift_monitor import DriftMonitor
from lightning_paci.callbacks.memory_monitor import MemoryMonitor
from lightning_paci.callbacks.save_pretrained import SavePretrained
from lightning_paci.callbacks.timeline_monitor import TimelineMonitor

__all__ = ["BubbleMonitor", "DriftMonitor", "MemoryMonitor", "SavePretrained", "TimelineMonitor"]
