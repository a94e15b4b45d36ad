"""Run one micro-batch of an unchanged LightningModule's step on one pipeline stage.

The user's ``training_step(batch, batch_idx)`` is called as written. On a non-last stage it stops inside the model,
at the egress hook (see [Note: stage boundaries are block inputs] in partition/carve.py), so its loss and logging code
never runs there; on the last stage it runs to the end and returns the loss. ``self.log`` calls are recorded
instead of logged: the strategy replays them on every rank once the records have travelled upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule

from lightning_paci.engine.runtime.microbatch import microbatch_size
from lightning_paci.engine.runtime.program import ForwardOutput
from lightning_paci.engine.runtime.whole_batch import LossCall
from lightning_paci.integration.stage.logs import LogRecord, recording_logs
from lightning_paci.partition import StageCarve, StageDone
from lightning_paci.partition.crossing import CrossingCheck

__all__ = ["FIGURE_STEP", "LightningHooks", "LightningStageProgram", "extract_loss", "to_loggers"]

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


class LightningStageProgram:
    """:class:`~lightning_paci.engine.runtime.program.StageProgram` for an unchanged LightningModule carved to one
    stage."""

    def __init__(
        self,
        module: LightningModule,
        carve: StageCarve,
        *,
        step_name: str = "training_step",
        context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        whole_batch_loss: str | None = None,
    ) -> None:
        self.module = module
        # [Note: the whole-batch loss]: on the last stage the step stops at this method's call, its arguments kept
        self.whole_batch_loss = whole_batch_loss if carve.is_last and step_name == "training_step" else None
        self.carve = carve
        self.step_name = step_name
        self.context = context
        self.device_logs: bool | None = None  # `recording_logs(keep=...)`: True forces the device form (tests)
        # the first training forward of a stage > 0 is watched for values crossing from placeholders (crossing.py)
        self._check: CrossingCheck | None = None
        if step_name == "training_step" and not carve.is_first:
            self._check = CrossingCheck(module, carve)

    def forward(self, data: Any, *step_args: Any, received: Any | None) -> ForwardOutput:
        """Run the step on one micro-batch. ``step_args`` follow the batch (``batch_idx``, ``dataloader_idx``)."""
        boundary = self.carve.boundary
        boundary.begin(received)
        records: list[LogRecord] = []
        step = getattr(self.module, self.step_name)
        check, self._check = self._check, None
        calls: list[LossCall] = []
        if self.whole_batch_loss is not None:
            self.module.__dict__[self.whole_batch_loss] = partial(_keep_call, calls, microbatch_size(data))
        try:
            with recording_logs(self.module, records, microbatch_size(data), self.step_name,
                                keep=self.device_logs), self.context(), self.carve.entered(), (
                    check.watch() if check is not None else contextlib.nullcontext()):
                output = step(data, *step_args)
                if boundary.held is not None:  # a value to be made after the egress was not: relayed() names it
                    boundary.finish(self.carve.stage)
        except StageDone:
            if calls:
                return ForwardOutput(outgoing=calls[0], logs=records)
            if boundary.outgoing is None:
                raise AssertionError("egress hook stopped the forward without capturing the block inputs") from None
            outgoing, boundary.outgoing = boundary.outgoing, None
            return ForwardOutput(outgoing=outgoing)
        finally:
            boundary.end()
            if self.whole_batch_loss is not None:
                self.module.__dict__.pop(self.whole_batch_loss, None)
            if check is not None:
                self.carve.foreign_buffers |= check.foreign_buffers
        if not self.carve.is_last:
            raise RuntimeError(
                f"Stage {self.carve.stage}: `{self.step_name}` returned before reaching block "
                f"`{self.carve.plan.block_names[self.carve.plan.boundaries[self.carve.stage + 1]]}`, where the next "
                f"stage begins. Every step must run the model's forward through all blocks."
            )
        if self.whole_batch_loss is not None:
            raise RuntimeError(f"`training_step` returned without calling `self.{self.whole_batch_loss}(...)`, which "
                               f"`PACIStrategy(whole_batch_loss={self.whole_batch_loss!r})` computes the loss with: "
                               f"call it in every step, or drop `whole_batch_loss`.")
        if self.step_name == "training_step":
            return ForwardOutput(loss=extract_loss(output, self.step_name), logs=records)
        return ForwardOutput(result=output, logs=records)

    def whole_loss(self, call: LossCall) -> tuple[torch.Tensor, list[LogRecord]]:
        """The whole-batch loss method on a mini-batch's joined arguments, what it logs recorded for the batch."""
        assert self.whole_batch_loss is not None
        records: list[LogRecord] = []
        with recording_logs(self.module, records, call.samples, self.step_name, keep=self.device_logs), \
                self.context():
            output = getattr(self.module, self.whole_batch_loss)(*call.args, **call.kwargs)
        return extract_loss(output, self.whole_batch_loss), records


def _keep_call(calls: list[LossCall], samples: int, *args: Any, **kwargs: Any) -> Any:
    """Stands for the whole-batch loss method on the last stage during a micro-batch's step: keeps the call and ends
    the step there (``StageDone``, as a stage's egress does)."""
    calls.append(LossCall(args, kwargs, samples))
    raise StageDone


class LightningHooks:
    """Lightning's backward and optimizer hooks, run by each stage at its own local backward and update, with that
    stage's gradients: callbacks first, then the module, as Lightning orders them. ``before_step`` ends with
    ``configure_gradient_clipping`` (by default: ``Trainer(gradient_clip_val=...)`` on the stage's own gradients).

    What the hooks ``self.log`` is recorded with the name tagged ``<name>/stage_<s>`` (each stage's value is its
    own: its gradients, its parameters) and kept in ``logs``; the runtime carries the records downstream with the
    activations, and the last stage -- global rank 0, where Lightning logs -- replays them (``replay_hook_logs``).
    """

    def __init__(self, module: LightningModule, trainer: Any, stage: int) -> None:
        self.module, self.trainer, self.stage = module, trainer, stage
        self.logs: list[LogRecord] = []
        self._overrides: dict[str, list[Callable[..., Any]]] = {}

    def _overriding(self, hook: str) -> list[Callable[..., Any]]:
        """The callbacks' (bound to the trainer and module) and then the module's ``hook`` methods that are not
        Lightning's no-op defaults, looked up at the first call (the Trainer's callbacks are final by then): the
        backward hooks run per micro-batch, and with none overridden a stage skips them and their log recording."""
        found = self._overrides.get(hook)
        if found is None:
            found = [partial(getattr(callback, hook), self.trainer, self.module) for callback in self.trainer.callbacks
                     if _overridden(callback, hook, Callback)]
            if _overridden(self.module, hook, LightningModule):
                found.append(getattr(self.module, hook))
            self._overrides[hook] = found
        return found

    @contextlib.contextmanager
    def _recording(self, hook: str) -> Iterator[None]:
        records: list[LogRecord] = []
        try:
            with recording_logs(self.module, records, 1, hook):
                yield
        finally:
            self.logs.extend(r._replace(name=f"{r.name}/stage_{self.stage}") for r in records)

    def before_backward(self, loss: torch.Tensor) -> None:
        hooks = self._overriding("on_before_backward")
        if hooks:
            with self._recording("on_before_backward"):
                for hook in hooks:
                    hook(loss)

    def after_backward(self) -> None:
        hooks = self._overriding("on_after_backward")
        if hooks:
            with self._recording("on_after_backward"):
                for hook in hooks:
                    hook()

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        with self._recording("on_before_optimizer_step"):
            for callback in self.trainer.callbacks:
                callback.on_before_optimizer_step(self.trainer, self.module, optimizer)
            self.module.on_before_optimizer_step(optimizer)
            self.module.configure_gradient_clipping(optimizer, gradient_clip_val=self.trainer.gradient_clip_val,
                                                    gradient_clip_algorithm=self.trainer.gradient_clip_algorithm)

    def replay_hook_logs(self) -> None:
        """On the last stage: log every record that has arrived, one ``self.log`` call each (as the hooks made them,
        so epoch aggregates see every call and the step value is the newest); a monitor's figures go to the
        Trainer's loggers at the step they were made (``figures``)."""
        records, self.logs[:] = list(self.logs), []
        figures: dict[int, dict[str, float]] = {}  # step -> the monitors' figures made at that step
        for record in records:
            options = dict(record.options)
            if FIGURE_STEP in options:
                figures.setdefault(options[FIGURE_STEP], {})[record.name] = float(record.value)
                continue
            self.module.log(record.name, record.value, batch_size=record.batch_size, **options)
        for step, values in sorted(figures.items()):
            to_loggers(self.trainer, values, step)

    def figures(self, figures: dict[str, float], step: int, *, last_stage: bool) -> None:
        """A monitor's figures of this stage for the Trainer's loggers, which live on global rank 0 (the last
        stage): logged at once there, else carried downstream with the next activation message, as the hooks'
        records are (no message of their own, no synchronisation)."""
        if last_stage:
            to_loggers(self.trainer, figures, step)
        else:
            self.logs.extend(LogRecord(name, float(value), 1, ((FIGURE_STEP, step),))
                             for name, value in figures.items())


def _overridden(obj: Any, hook: str, base: type) -> bool:
    """Whether ``obj.hook`` is something other than ``base``'s own (a no-op in Lightning's hook classes)."""
    method = getattr(obj, hook, None)
    return getattr(method, "__func__", None) is not getattr(base, hook)


FIGURE_STEP = "paci_figure_step"  # the option marking a monitor's figure among the hooks' log records


def to_loggers(trainer: Any, figures: dict[str, float], step: int) -> None:
    """``log_metrics`` on every logger of the Trainer, as Lightning's own monitors do (the loggers write on global
    rank 0 only)."""
    for logger in trainer.loggers:
        logger.log_metrics(figures, step=step)
