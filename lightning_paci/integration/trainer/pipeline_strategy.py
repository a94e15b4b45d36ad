"""``PipelineStrategy``: what the integration's parts read from the strategy, as a type below it.

The strategy (strategy.py) sits above every module of the integration and hands itself to the parts that set up a
stage, adapt Lightning's callbacks or clip gradients. They name it by this protocol rather than by the class, so
that the imports still run downwards and a reader sees, in one place, the whole surface a part may touch: the
ranks and stages, the options, this process's stage (``stage``), its runtimes, and the few collectives and
patches the parts need. Every member is a public property or method of ``PACIStrategy``; mypy checks that it
satisfies the protocol wherever the strategy is passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision

from lightning_paci.config import PACIConfig
from lightning_paci.engine.replicas.topology import Topology
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.partition import PartitionPlan

if TYPE_CHECKING:  # types only: both modules import this one's neighbours at run time
    from lightning_paci.integration.processes.process_groups import ProcessGroups
    from lightning_paci.integration.stage.local_stage import LocalStage

__all__ = ["PipelineStrategy"]


class PipelineStrategy(Protocol):
    """``PACIStrategy`` as its parts see it ([Note: rank layout] for the ranks and stages)."""

    config: PACIConfig  # the pipeline options, checked
    lr_scheduler_configs: list[Any]  # Lightning's, after its setup

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def precision_plugin(self) -> Precision: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def stage_devices(self) -> tuple[int, ...]: ...

    @property
    def stage_index(self) -> int: ...

    @property
    def replica_index(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def num_microbatches(self) -> int: ...

    @property
    def accumulation(self) -> int: ...

    @property
    def process_groups(self) -> ProcessGroups: ...

    @property
    def stage(self) -> LocalStage | None: ...

    @property
    def runtime(self) -> StageRuntime: ...

    @property
    def runtimes(self) -> dict[int, StageRuntime]: ...

    @property
    def plan(self) -> PartitionPlan: ...

    def rank_of(self, stage: int, lane: int | None = None) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def pipeline_broadcast(self, obj: Any, stage: int) -> Any: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any: ...

    def undo_at_teardown(self, undo: list[Callable[[], None]]) -> None: ...

    def log_figures(self, figures: dict[str, float], step: int) -> None: ...
