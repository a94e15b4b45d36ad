"""``MemoryMonitor``: per-stage in-flight micro-batches and the activation bytes they keep alive, in TensorBoard."""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from lightning_paci.callbacks.stage_monitor import (
    StageMonitor,
    metric_tag,
    monitor_directory,
    paci_strategy,
    stage_writer,
)

__all__ = ["MemoryMonitor"]


class MemoryMonitor(StageMonitor):
    """Log, for every pipeline stage, the peak number of micro-batches held between forward and backward and the
    peak bytes of activations they keep alive -- the figures behind PACI's claim of 1F1B's memory: the in-flight
    cap is ``N - s`` under both, so for ``m >= N`` the peaks are equal (GPipe holds ``m``).

    Bytes are counted exactly, with ``torch.autograd.graph.saved_tensors_hooks`` around each forward: the tensors
    autograd saves, the received inputs and the outgoing activations, each storage once, parameters excluded. The
    weights and optimizer state are not included: they are the same single copy under every schedule. Counting
    costs one Python call per saved tensor.

    Tags (peaks since the start of training, logged every window):

    * ``paci/peak_inflight/stage_<s>``: micro-batches between forward and backward.
    * ``paci/peak_activation_bytes/stage_<s>``: their activation bytes.
    * ``paci/relayed_bytes/stage_<s>``: bytes of the values this stage relays past the next one in one activation
      message (an encoder's output, a long skip: [Note: relayed crossings] in partition/relay.py; included in the
      activation bytes above), the largest seen.

    Args:
        logging_interval: Lightning steps per window (default: the Trainer's ``log_every_n_steps``).
    """

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = paci_strategy(trainer)
        self._writer = stage_writer(monitor_directory(trainer), strategy.stage_index, strategy.replica_index)
        for runtime in strategy.runtimes.values():
            runtime.records.measure(activation_bytes=True)

    def _log(self, trainer: L.Trainer) -> None:
        if self._writer is None:
            return
        figures: dict[str, float] = {}
        for stage, runtime in paci_strategy(trainer).runtimes.items():  # each stage a process runs
            records = runtime.records
            figures.update({metric_tag("peak_inflight", stage): records.peak_inflight,
                            metric_tag("peak_activation_bytes", stage): records.peak_activation_bytes,
                            metric_tag("relayed_bytes", stage): records.peak_relayed_bytes})
        self._write(trainer, figures)
