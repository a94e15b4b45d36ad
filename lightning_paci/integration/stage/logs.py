"""``self.log`` under pipeline training: recorded on the last stage, carried upstream, replayed on every rank.

The user's step runs to its ``self.log`` calls on the last stage only. Each call becomes a :class:`LogRecord`
that travels upstream with the micro-batch's gradients (no collective per batch, see [Note: no flush per Lightning
batch] in engine/streams/driver.py). Once all micro-batches of a mini-batch have reached a rank, :class:`LogRelay`
replays the records there through the real ``LightningModule.log``, so every rank's ``trainer.callback_metrics``
see them.

[Note: the logging rank]
Lightning's loggers and progress bar live on global rank 0, which runs the *last* stage (``stage_index`` in
process_groups.py): mini-batch k's records are complete there in its own call k, so the value logged at step k is
mini-batch k's, under every schedule. The stages before it receive the records with the gradients, some calls
later (their ``callback_metrics`` lag by that much; nothing is logged from them).

[Note: no log read off the logging rank]
Lightning turns every ``prog_bar=True`` value into a Python number at the end of every batch, on every rank
(``_ResultCollection.metrics``: ``.item()``), and every ``logger=True`` value at every logging step: on a GPU a
device read that waits for the stream, per batch, on ranks whose progress bar and loggers show nothing. On every
rank but global rank 0 the records are therefore replayed with ``prog_bar=False, logger=False``: their
``callback_metrics`` hold the same values (device tensors, read only by whoever reads them), and their
``progress_bar_metrics`` and ``logged_metrics`` stay empty. Counted in tests/test_host_reads.py: no read from
logging on the stage that does not show the bar, one per batch on the one that does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.engine.runtime.program import LOSS_KEY, LogRecord

__all__ = ["LOSS_KEY", "METRIC_OPTION", "LogRecord", "LogRelay", "host_records", "recording_logs", "replay_logs"]

METRIC_OPTION = "__paci_metric__"  # a log record naming a torchmetrics Metric attribute instead of a value
_LOG_OPTIONS = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "add_dataloader_idx",
                "sync_dist", "rank_zero_only", "metric_attribute")
# how Lightning combines values of one key; the micro-batches of a batch are combined the same way
_REDUCTIONS: dict[Any, str] = {"mean": "mean", "avg": "mean", torch.mean: "mean", "sum": "sum", torch.sum: "sum",
                               "max": "max", torch.max: "max", "min": "min", torch.min: "min"}


@contextlib.contextmanager
def recording_logs(module: LightningModule, records: list[LogRecord], size: int, step_name: str, *,
                   keep: bool | None = None) -> Iterator[None]:
    """Shadow ``module.log`` with a recorder (an instance attribute; the method comes back on exit). A tensor
    value stays a 0-dim tensor on an accelerator, and a float64 one on the CPU (Lightning logs it in float64), and
    becomes a float otherwise; ``keep`` forces the tensor form (True: tests of the device form on the CPU) or the
    float form."""

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("lightning_paci records `self.log(name, value, **options)`: pass options by keyword.")
        batch_size = int(kwargs.get("batch_size") or size)
        options = tuple(sorted((k, kwargs[k]) for k in _LOG_OPTIONS if k in kwargs))
        if hasattr(value, "compute") and hasattr(value, "update"):  # a torchmetrics Metric object
            if step_name == "training_step":
                raise TypeError(
                    f"`self.log({name!r}, <Metric>)` in `training_step` under pipeline training: log the metric's "
                    f"value (`metric(preds, target)` returns it) instead of the Metric object; its state is "
                    f"updated on the last stage only, while the training loop never waits for it."
                )
            path = next((n for n, m in module.named_modules() if m is value), None)
            if path is None:
                raise TypeError(f"`self.log({name!r}, <Metric>)`: the Metric must be an attribute of the module.")
            # replayed on every rank with that rank's own Metric object: torchmetrics syncs the states over the
            # process group at compute(), and only the last stage's state is non-empty (sum/cat reductions)
            records.append(LogRecord(name, float("nan"), batch_size, options + ((METRIC_OPTION, path),)))
            return
        if isinstance(value, torch.Tensor):  # stays on an accelerator: see [Note: no host sync per micro-batch]
            # float32 and float64 kept, other dtypes made float32: what Lightning's own `log` keeps
            value = value.detach()
            value = (value if value.dtype in (torch.float32, torch.float64) else value.float()).mean()
            # a float64 value stays a tensor on the CPU too: replayed as a Python float, Lightning would log float32
            kept = keep if keep is not None else value.device.type != "cpu" or value.dtype == torch.float64
            value = value if kept else float(value)
        else:
            value = float(value)
        records.append(LogRecord(name, value, batch_size, options))

    # straight into the instance's dict: nn.Module.__setattr__/__delattr__ would check parameters, buffers and
    # submodules on every forward for what is only a function
    module.__dict__["log"] = log
    try:
        yield
    finally:
        module.__dict__.pop("log", None)


def host_records(records: list[LogRecord]) -> list[LogRecord]:
    """The records with every value a host number: what an object collective may carry (a device tensor pickled
    comes back on the device it left from, on every rank: see engine/transport/pickle_guard.py). One host read per
    value."""
    return [r._replace(value=float(r.value)) if isinstance(r.value, torch.Tensor) else r for r in records]


def replay_logs(module: LightningModule, records: list[LogRecord], *,
                shown: bool = True) -> float | torch.Tensor | None:
    """Call the real ``self.log`` once per key with the micro-batches' values combined as Lightning combines values
    of one key (``reduce_fx``): the batch-size-weighted mean (the default), the sum, the max or the min -- what one
    device computing the whole batch would have logged. Returns the loss record's mean.

    ``shown=False`` on a rank whose progress bar and loggers show nothing ([Note: no log read off the logging
    rank]): the values are replayed with ``prog_bar=False, logger=False``."""
    totals: dict[str, tuple[str, list[LogRecord]]] = {}
    for record in records:
        options = dict(record.options)
        if METRIC_OPTION in options:
            metric: Any = module.get_submodule(options.pop(METRIC_OPTION))  # the torchmetrics Metric logged
            module.log(record.name, metric, **options)
            continue
        fx = options.get("reduce_fx", "mean")
        if fx not in _REDUCTIONS:
            raise ValueError(
                f"`self.log({record.name!r}, ..., reduce_fx={fx!r})` cannot be combined over micro-batches: pipeline "
                f"training logs each micro-batch and combines them like Lightning combines steps. Use 'mean', "
                f"'sum', 'max' or 'min' (or torch.mean/sum/max/min)."
            )
        totals.setdefault(record.name, (_REDUCTIONS[fx], []))[1].append(record)
    loss = None
    for name, (how, group) in totals.items():
        size = sum(r.batch_size for r in group)
        if how == "mean":
            value = sum(r.value * r.batch_size for r in group) / size
        elif how == "sum":
            value = sum(r.value for r in group)
        elif how == "max":
            value = max(r.value for r in group)
        else:
            value = min(r.value for r in group)
        if name == LOSS_KEY:
            loss = value
            continue
        options = dict(group[0].options)
        if not shown:
            options.update(prog_bar=False, logger=False)
        module.log(name, value, batch_size=size, **options)
    return loss


class LogRelay:
    """Replays, on this rank, the records of every mini-batch whose ``m`` micro-batches have all arrived.

    ``pending`` (micro-batch -> records) is filled by the runtime: on the last stage at each forward, upstream with
    each received gradient. Records leave it when replayed, so it holds at most the micro-batches in flight.
    """

    def __init__(self, num_microbatches: int, *, shown: bool = True) -> None:
        self.num_microbatches = num_microbatches
        self.shown = shown  # this rank's progress bar and loggers show the values (global rank 0)
        # the mean loss of the last mini-batch replayed here, and that mini-batch's index in the run (-1: none yet)
        self.last_loss: float | torch.Tensor = 0.0
        self.last_minibatch = -1

    def emit(self, module: LightningModule, pending: dict[int, list[LogRecord]]) -> None:
        m = self.num_microbatches
        complete = sorted(k for k in {mb // m for mb in pending} if all(k * m + i in pending for i in range(m)))
        if not complete:
            return
        # one replay per mini-batch: where several complete at once (a drain on a stage before the last), epoch
        # aggregates get every one of them and the step value is the newest, never a merge of several
        for k in complete:
            records: list[LogRecord] = []
            for i in range(m):
                records.extend(pending.pop(k * m + i))
            loss = replay_logs(module, records, shown=self.shown)
            if loss is not None:
                self.last_loss, self.last_minibatch = loss, k
