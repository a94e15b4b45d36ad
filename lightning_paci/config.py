"""``PACIConfig``: the strategy's options, checked once, at construction, with errors that name the fix."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning_paci.partition import PartitionSpec
from lightning_paci.schedules import SCHEDULE_NAMES

__all__ = ["PACIConfig"]


def _positive_int(name: str, value: object, fix: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1{' (or None for the default)' if optional else ''}, got "
                         f"{value!r}. {fix}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}.")


@dataclass(kw_only=True, slots=True, frozen=True)
class PACIConfig:
    """What ``PACIStrategy(...)`` was asked for (see its docstring for each option's meaning)."""

    schedule: Literal["paci", "1f1b", "gpipe"] = "paci"
    microbatches: int | None = None  # None: one per stage
    accumulation: int | None = None  # None: = microbatches (one step per batch per stage)
    partition: PartitionSpec = "balanced"
    block_container: str | None = None
    process_group_backend: str | None = None  # None: nccl on CUDA, gloo otherwise
    timeout: timedelta = timedelta(minutes=30)
    failure_timeout: float = 20.0
    nonfinite: Literal["raise", "skip"] = "raise"
    checkpoint_layout: Literal["consolidated", "sharded"] = "consolidated"
    max_stream_batches: int = 256
    freeze_gc: bool = True
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"

    def __post_init__(self) -> None:
        _choice("schedule", self.schedule, SCHEDULE_NAMES)
        for name in ("microbatches", "accumulation"):
            _positive_int(name, getattr(self, name), f"Use e.g. `PACIStrategy({name}=8)`.", optional=True)
        _choice("nonfinite", self.nonfinite, ("raise", "skip"))
        _choice("checkpoint_layout", self.checkpoint_layout, ("consolidated", "sharded"))
        _positive_int("max_stream_batches", self.max_stream_batches,
                      "The default 256 drains the pipeline at least every 256 batches.")
        if not isinstance(self.freeze_gc, bool):
            raise ValueError(f"`freeze_gc` must be True or False, got {self.freeze_gc!r}.")
        if isinstance(self.failure_timeout, bool) or not isinstance(self.failure_timeout, (int, float)) \
                or self.failure_timeout <= 0:
            raise ValueError(f"`failure_timeout` must be > 0 seconds, got {self.failure_timeout!r}. The default 20.0 "
                             f"declares a stage dead after 20 s without a heartbeat.")
        _choice("start_method", self.start_method, ("popen", "spawn", "fork", "forkserver"))
