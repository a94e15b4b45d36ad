"""``PipelineProcesses``: the process side of a pure pipeline -- one process per stage, under Lightning.

What every pipeline strategy needs whatever its schedule: device and rank bookkeeping (stage ``s`` is global rank
``s``), the launcher, the process group and the two point-to-point communicators, the failure watchdog, and the
collectives of a run with one data-parallel replica (none of them is ever issued per training batch).
:class:`~lightning_paci.strategy.PACIStrategy` adds the training lifecycle on top.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_paci import lightning_api as api
from lightning_paci.config import PACIConfig
from lightning_paci.supervision import StageWatchdog, connect_store, print_setup_errors_once

__all__ = ["PipelineProcesses"]

log = logging.getLogger(__name__)


class PipelineProcesses(ParallelStrategy):
    """One process per pipeline stage (see the module docstring); ``config`` holds the options."""

    def __init__(self, config: PACIConfig, *, accelerator: Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.config = config
        self._process_group_backend = config.process_group_backend
        self._num_nodes = 1
        self._p2p_groups: list[dist.ProcessGroup | None] = [None, None]
        self._watchdog: StageWatchdog | None = None

    # -- topology -------------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_stages(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def stage_index(self) -> int:
        """Stages run in reverse rank order: global rank 0 -- where Lightning's loggers, progress bar and
        ``is_global_zero`` callbacks live -- holds the *last* stage, which computes mini-batch k's loss and logs in
        its own call k. With stage 0 on rank 0, those values reached rank 0 only with the gradients, calls later,
        and a drain merged several mini-batches into one logged point (see [Note: the logging rank])."""
        return self.num_stages - 1 - self.global_rank

    def rank_of(self, stage: int) -> int:
        """The global rank that runs ``stage``."""
        return self.num_stages - 1 - stage

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # pure pipeline parallelism: every stage sees the same batches

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    # -- processes ------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.config.start_method != "popen":
            self._launcher = api.multiprocessing_launcher(
                self, self.config.start_method, send=self._send_after_fit, receive=self._receive_after_fit,
                on_exception=self.on_exception)
        elif not self.cluster_environment.creates_processes_externally:
            self._launcher = api.SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _send_after_fit(self, trainer: Any) -> Any:
        """What rank 0 of a fork/spawn run hands to the main process after ``fit`` (see the strategy)."""
        return None

    def _receive_after_fit(self, trainer: Any, sent: Any) -> None:
        """The main process of a fork/spawn run receives rank 0's ``_send_after_fit(trainer)``."""

    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        assert environment is not None
        stages = self.num_processes * self.num_nodes
        if environment.creates_processes_externally and stages != environment.world_size():
            expected = environment.world_size()  # torchrun, SLURM, ...: check before the rendezvous
            raise ValueError(
                f"`Trainer(devices={self.num_processes}, num_nodes={self.num_nodes})` starts {stages} pipeline stages, "
                f"but the launcher started {expected} processes (WORLD_SIZE={expected}). One process runs one stage: "
                f"pass `devices={max(1, expected // self.num_nodes)}` (per node) or launch {stages} processes."
            )
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        print_setup_errors_once(self.global_rank)
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"timeout": self.config.timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        api.init_dist_connection(environment, self._process_group_backend, **kwargs)
        # pipeline messages on their own communicators, apart from Lightning's collectives: one for activations and
        # gradients, one for the tied-weight exchange (independent message order, also under NCCL)
        self._p2p_groups = [dist.new_group(backend=self._process_group_backend, timeout=self.config.timeout)
                            for _ in range(2)]
        store = connect_store()
        if store is not None:
            self._watchdog = StageWatchdog(self.stage_index, self.num_stages, store,
                                           dead_after=self.config.failure_timeout)
            self._watchdog.start()
        else:
            log.warning("lightning_paci: no rendezvous store reachable (MASTER_ADDR/MASTER_PORT); a dead stage "
                        "will only be noticed after the process-group timeout")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives (never per training batch) -------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if api.distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not api.distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        # one data-parallel replica: a reduce over it is the identity (logged values are the same on every rank)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not api.distributed_is_initialized():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value > 0)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return api.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)
