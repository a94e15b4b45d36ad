"""``ProcessLife``: one pipeline process under Lightning, from its launch to its end.

What the strategy's process hooks do, in the order Lightning calls them: the launcher (``_configure_launcher``),
joining the world and making the process groups (``setup_environment``), freezing the heap for training
(``on_train_start``), telling the other ranks of a failure (``on_exception``), and the end of a run -- the drain,
the patches undone, the trained weights gathered, the watchdog's last word (``teardown``). It holds what lives as
long as the process's part in a run: its groups, the patches to undo, what ``save_checkpoint`` after ``fit``
needs, and whether the run failed here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy

from lightning_paci.config import PACIConfig
from lightning_paci.engine.replicas.topology import Topology
from lightning_paci.engine.supervision.activity import activity
from lightning_paci.engine.supervision.watchdog import StageWatchdog
from lightning_paci.integration.checkpoints.checkpoint import PipelineCheckpoints, after_fit_message, receive_after_fit
from lightning_paci.integration.processes.process_groups import (
    ProcessGroups,
    start_process_groups,
)
from lightning_paci.integration.processes.shutdown import (
    EndingStage,
    end_teardown,
    finish_fit,
    preempted,
    report_failure,
)
from lightning_paci.integration.trainer import lightning_api as api

__all__ = ["ProcessLife"]


class ProcessLife:
    """A pipeline process's groups and its end, for one strategy ([Note: ending a run] in shutdown.py)."""

    def __init__(self, config: PACIConfig) -> None:
        self.config = config
        self.groups: ProcessGroups | None = None  # after `join`
        # after `fit`: rank 0's gathered optimizer and scheduler states, for `trainer.save_checkpoint` after `fit`
        self.after_fit: dict[str, list[Any]] | None = None
        self.plan: Any = None  # the partition of the last setup (PartitionPlan), also sent back after fit
        self.failed = False
        self._undo: list[Callable[[], None]] = []
        self._froze_gc = False

    # -- the start ---------------------------------------------------------------------------------------------------
    def launcher(self, strategy: ParallelStrategy, environment: ClusterEnvironment, processes: int,
                 nodes: int, *, built_on_meta: Callable[[], bool]) -> Any:
        """Lightning's launcher for ``config.start_method``: forked or spawned workers that send rank 0's state after
        ``fit`` back to the main process; started as scripts (``"popen"``) unless the processes already exist
        (torchrun, SLURM: None). ``built_on_meta``: whether the ranks built the model on the meta device."""
        if self.config.start_method != "popen":
            return api.multiprocessing_launcher(
                strategy, self.config.start_method, send=self._send_after_fit, receive=self._receive_after_fit,
                on_exception=strategy.on_exception, freeze_heap=self.config.freeze_gc,
                weights_context=partial(whole_tensors, self.config.model_parallel, built_on_meta))
        if not environment.creates_processes_externally:
            return api.SubprocessScriptLauncher(environment, processes, nodes)
        return None

    def _send_after_fit(self, trainer: Trainer) -> dict[str, Any]:
        return {**after_fit_message(trainer, self.after_fit), "plan": self.plan}

    def _receive_after_fit(self, trainer: Trainer, sent: Mapping[str, Any]) -> None:
        self.after_fit = receive_after_fit(trainer, sent)
        self.plan = sent.get("plan")

    def join(self, environment: ClusterEnvironment, topology: Topology, *, rank: int, device: torch.device,
             local_processes: int) -> ProcessGroups:
        """After Lightning's ``setup_environment`` and the world's ranks: the world and every group, in the order the
        group-creation model checks ([Note: group creation])."""
        self.groups = start_process_groups(environment, topology, rank=rank, device=device,
                                           local_processes=local_processes, config=self.config)
        return self.groups

    def host_group(self) -> Any:
        """The host group once joined ([Note: host groups on a bound world]; None: the world is one)."""
        return None if self.groups is None else self.groups.host

    def after_fit_states(self) -> dict[str, list[Any]] | None:
        """Rank 0's optimizer and scheduler states gathered at the end of ``fit`` (None before)."""
        return self.after_fit

    @property
    def watchdog(self) -> StageWatchdog | None:
        """The failure watchdog of this process's run, once it joined (engine/supervision/watchdog.py)."""
        return None if self.groups is None else self.groups.watchdog

    # -- training ----------------------------------------------------------------------------------------------------
    def undo_at_teardown(self, undo: list[Callable[[], None]]) -> None:
        """Patches of the Trainer or the module, undone at teardown in reverse order."""
        self._undo += undo

    def freeze_heap(self) -> None:
        """At the start of training (``PACIConfig.freeze_gc``): full collections then skip everything alive now."""
        if self.config.freeze_gc and not self._froze_gc:
            gc.collect(1)  # young generations only: a full collection costs 0.5-0.6 s per rank
            gc.freeze()
            self._froze_gc = True

    # -- the end -----------------------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage which stage failed and why, before Lightning unwinds; a preemption's agreed stop
        is no failure: the run ends on every rank together after teardown ([Note: a preemption's stop])."""
        if preempted(self.groups, exception):
            return
        self.failed = True
        report_failure(self.groups, exception)

    def end(self, stage: EndingStage | None, *, checkpoints: Callable[[], PipelineCheckpoints],
            schedulers: list[Any], replicas: int, built_on_meta: bool, optimizer_states: bool = True) -> None:
        """The strategy's teardown before Lightning's: unless the run failed here, drain, undo the patches and give
        the module its trained weights back, still watched (shutdown.finish_fit); then the watchdog's end."""
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if not self.failed:  # still watched: a failure here stops every rank as one in training does
            self.after_fit = finish_fit(
                stage, drain=stage.drain if stage is not None else _nothing, undo=self._undo,
                checkpoints=checkpoints, schedulers=schedulers, replicas=replicas, built_on_meta=built_on_meta,
                group=self.groups and self.groups.host, optimizer_states=optimizer_states,
            ) or self.after_fit
        activity.source = None  # the runtime goes with the stage
        end_teardown(self.groups, failed=self.failed)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def whole_tensors(model_parallel: bool, built_on_meta: Callable[[], bool], module: Any) -> Iterator[None]:
    """While every rank takes ``module.state_dict()`` at once (a fork/spawn run's end, which hands rank 0's
    weights to the main process): each DTensor in it whole, gathered over its stage's tensor-parallel ranks (a
    collective, hence only there), a meta one as a meta tensor of the whole shape. A model the ranks built on the
    meta device is on the meta device in the main process too (with or without the module's own parallelism):
    every tensor is handed back as a meta tensor of its whole shape, and no rank gathers its stage ([Note: a stage
    built in shards])."""
    on_meta = built_on_meta()
    if not (model_parallel or on_meta) or module is None:
        yield
        return
    from torch.distributed.tensor import DTensor

    def whole(_: Any, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if on_meta or (isinstance(value, DTensor) and value.to_local().is_meta):
                state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")  # the whole shape
            elif isinstance(value, DTensor):
                state[key] = value.full_tensor().detach()

    handle = module.register_state_dict_post_hook(whole)
    try:
        yield
    finally:
        handle.remove()
