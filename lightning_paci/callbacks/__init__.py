"""Monitoring callbacks: per-stage drift, bubble time, activation memory and timelines, written to TensorBoard by
each stage, and the stages' weights written for ``from_pretrained``. Each file is named after its class.

* ``stage_monitor.py``: ``StageMonitor``, the monitors' base: the per-stage writer and the figures' way to the
  Trainer's loggers;
* ``drift_monitor.py``: ``DriftMonitor``; ``bubble_monitor.py``: ``BubbleMonitor``; ``memory_monitor.py``:
  ``MemoryMonitor``; ``timeline_monitor.py``: ``TimelineMonitor``;
* ``save_pretrained.py``: ``SavePretrained``, each stage its own safetensors shard, rank 0 the index.
"""

from lightning_paci.callbacks.bubble_monitor import BubbleMonitor
from lightning_paci.callbacks.drift_monitor import DriftMonitor
from lightning_paci.callbacks.memory_monitor import MemoryMonitor
from lightning_paci.callbacks.save_pretrained import SavePretrained
from lightning_paci.callbacks.timeline_monitor import TimelineMonitor

__all__ = ["BubbleMonitor", "DriftMonitor", "MemoryMonitor", "SavePretrained", "TimelineMonitor"]
