"""Run one micro-batch of an unchanged LightningModule's step on one pipeline stage.

The user's ``training_step(batch, batch_idx)`` is called as written. On a non-last stage it stops inside the model,
at the egress hook (see [Note: stage boundaries are block inputs] in partition/carve.py), so its loss and logging code
never runs there; on the last stage it runs to the end and returns the loss. ``self.log`` calls are recorded
instead of logged: the strategy replays them on every rank once the records have travelled upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_paci.partition import StageCarve, StageDone
from lightning_paci.runtime import ForwardOutput, LogRecord, microbatch_size

__all__ = ["METRIC_OPTION", "LightningStageProgram", "extract_loss", "recording_logs"]

METRIC_OPTION = "__paci_metric__"  # a log record naming a torchmetrics Metric attribute instead of a value
_LOG_OPTIONS = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx", "enable_graph", "add_dataloader_idx")


def extract_loss(output: Any, step_name: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ValueError(
        f"`{step_name}` must return the loss tensor or a dict with a 'loss' tensor on the last pipeline stage, got "
        f"{type(output).__name__}. Returning None to skip a batch is not supported in pipeline training: every "
        f"stage has already run its part of the micro-batch."
    )


@contextlib.contextmanager
def recording_logs(module: LightningModule, records: list[LogRecord], size: int, step_name: str) -> Iterator[None]:
    """Shadow ``module.log`` with a recorder (an instance attribute; the method comes back on exit)."""

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
        value = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
        records.append(LogRecord(name, value, batch_size, options))

    module.log = log  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


class LightningStageProgram:
    """:class:`~lightning_paci.runtime.StageProgram` for an unchanged LightningModule carved to one stage."""

    def __init__(
        self,
        module: LightningModule,
        carve: StageCarve,
        *,
        step_name: str = "training_step",
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.module = module
        self.carve = carve
        self.step_name = step_name
        self.context = context

    def forward(self, data: Any, *step_args: Any, received: Any | None) -> ForwardOutput:
        """Run the step on one micro-batch. ``step_args`` follow the batch (``batch_idx``, ``dataloader_idx``)."""
        boundary = self.carve.boundary
        boundary.incoming = received
        boundary.outgoing = None
        records: list[LogRecord] = []
        step = getattr(self.module, self.step_name)
        try:
            with recording_logs(self.module, records, microbatch_size(data), self.step_name), self.context():
                output = step(data, *step_args)
        except StageDone:
            if boundary.outgoing is None:
                raise AssertionError("egress hook stopped the forward without capturing the block inputs") from None
            outgoing, boundary.outgoing = boundary.outgoing, None
            return ForwardOutput(outgoing=outgoing)
        finally:
            boundary.incoming = None
        if not self.carve.is_last:
            raise RuntimeError(
                f"Stage {self.carve.stage}: `{self.step_name}` returned before reaching block "
                f"{self.carve.plan.boundaries[self.carve.stage + 1]} of `{self.carve.plan.container}`, where the next "
                f"stage begins. Every step must run the model's forward through all blocks."
            )
        if self.step_name == "training_step":
            return ForwardOutput(loss=extract_loss(output, self.step_name), logs=records)
        return ForwardOutput(result=output, logs=records)
