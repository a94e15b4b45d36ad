"""Where the monitors write: one TensorBoard event directory per stage, written by that stage's own process.

With a ``TensorBoardLogger`` the stage directories live under its ``log_dir`` (resolved on rank 0 once, at setup,
and shared: other ranks cannot resolve the logger's version themselves). With another logger or ``logger=False``
the monitors warn once and write under ``<default_root_dir>/paci_monitors``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["DEFAULT_SUBDIR", "metric_tag", "monitor_directory", "stage_writer"]

DEFAULT_SUBDIR = "paci_monitors"
_warned = False


def metric_tag(figure: str, stage: int) -> str:
    """The stable tag of a per-stage figure: ``paci/<figure>/stage_<s>``."""
    return f"paci/{figure}/stage_{stage}"


def monitor_directory(trainer: L.Trainer) -> str:
    global _warned
    directory = None
    if trainer.is_global_zero:
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        if logger is not None:
            directory = logger.log_dir
        else:
            directory = os.path.join(trainer.default_root_dir, DEFAULT_SUBDIR)
            if not _warned:
                rank_zero_warn(
                    f"lightning_paci monitors write TensorBoard files; the Trainer has no TensorBoardLogger, so they "
                    f"go to {directory!r}. Pass `logger=TensorBoardLogger(...)` to write beside your other logs."
                )
                _warned = True
    return trainer.strategy.broadcast(directory, src=0)


def stage_writer(directory: str, stage: int) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(directory, f"stage_{stage}"))
