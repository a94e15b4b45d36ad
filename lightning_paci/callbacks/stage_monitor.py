"""Where the monitors write: one TensorBoard event directory per stage, written by that stage's own process.

With a ``TensorBoardLogger`` the stage directories live under its ``log_dir`` (resolved on rank 0 once, at setup,
and shared: other ranks cannot resolve the logger's version themselves); otherwise under
``<default_root_dir>/paci_monitors`` (with ``logger=False`` the monitors warn once that nothing else gets them).
Every figure also reaches the Trainer's loggers (CSV, MLflow, W&B, TensorBoard, ...) on global rank 0, where
Lightning's loggers write, as ``paci/<figure>/stage_<s>`` at the step it was made: a stage before the last sends its
window's figures with its next activation message ([Note: the logging rank] in integration/stage/logs.py).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

if TYPE_CHECKING:
    from lightning_paci.strategy import PACIStrategy

__all__ = ["DEFAULT_SUBDIR", "StageMonitor", "metric_tag", "monitor_directory", "paci_strategy", "stage_writer"]

DEFAULT_SUBDIR = "paci_monitors"
_warned = False


def paci_strategy(trainer: L.Trainer) -> PACIStrategy:
    """The Trainer's ``PACIStrategy``, typed: the one way the monitors reach the strategy and its runtime."""
    from lightning_paci.strategy import PACIStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, PACIStrategy):
        raise TypeError(f"lightning_paci monitors need `Trainer(strategy='paci')`, got {type(strategy).__name__}.")
    return strategy


def metric_tag(figure: str, stage: int) -> str:
    """The stable tag of a per-stage figure: ``paci/<figure>/stage_<s>``."""
    return f"paci/{figure}/stage_{stage}"


def monitor_directory(trainer: L.Trainer) -> str:
    global _warned
    directory: str | None = None
    if trainer.is_global_zero:
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if logger is not None:
            directory = logger.log_dir
        else:
            directory = os.path.join(trainer.default_root_dir, DEFAULT_SUBDIR)
            if not _warned and not trainer.loggers:
                rank_zero_warn(
                    f"lightning_paci monitors write each stage's figures to TensorBoard runs and to the Trainer's "
                    f"loggers; with `logger=False` they go to TensorBoard files in {directory!r} only."
                )
                _warned = True
    return str(trainer.strategy.broadcast(directory, src=0))  # rank 0 always has one


def stage_writer(directory: str, stage: int, replica: int = 0) -> Any:
    """The stage's event directory, ``stage_<s>``; with data parallelism the other replicas of the stage write
    beside it, ``stage_<s>_replica_<r>`` (each process its own run, the same tags)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(directory, f"stage_{stage}" + (f"_replica_{replica}" if replica else "")))


class StageMonitor(Callback, ABC):
    """What the monitors share: a check that the strategy is PACI, a window every ``logging_interval`` steps (the
    Trainer's ``log_every_n_steps`` by default), a last window at the end of training, and the stage's writer.
    Subclasses implement ``_log(trainer)``."""

    def __init__(self, logging_interval: int | None = None, *, argument: str = "logging_interval") -> None:
        if logging_interval is not None and logging_interval < 1:
            raise ValueError(f"`{argument}` must be >= 1 (Lightning steps per window), got {logging_interval}.")
        self.logging_interval = logging_interval
        self._writer: Any = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lightning_paci.strategy import PACIStrategy

        if not isinstance(trainer.strategy, PACIStrategy):
            raise TypeError(f"`{type(self).__name__}` needs `Trainer(strategy='paci')`, got "
                            f"{type(trainer.strategy).__name__}.")

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        every = self.logging_interval or trainer.log_every_n_steps  # type: ignore[attr-defined]  # set in __init__
        if trainer.global_step % every == 0:
            self._log(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, trainer: L.Trainer, figures: dict[str, float]) -> None:
        """One window's figures (tag -> value) to this stage's TensorBoard run and to the Trainer's loggers on
        global rank 0 (``PACIStrategy.log_figures``), at the current global step."""
        if not figures:
            return
        step = trainer.global_step
        if self._writer is not None:
            for tag, value in figures.items():
                self._writer.add_scalar(tag, value, step)
            self._writer.flush()
        if trainer.loggers:
            paci_strategy(trainer).log_figures({tag: float(value) for tag, value in figures.items()}, step)

    @abstractmethod
    def _log(self, trainer: L.Trainer) -> None:
        """Write one window's figures (each monitor defines what a window holds)."""
