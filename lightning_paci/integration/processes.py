"""``PipelineProcesses``: the process side of a pipeline -- one process per stage and data-parallel replica.

What every pipeline strategy needs whatever its schedule: device and rank bookkeeping (topology.py, [Note: rank
layout]), the launcher, the process group, the device mesh and the point-to-point communicators, the failure
watchdog, and the collectives (none of them is ever issued per training batch; the data-parallel gradient
reduction is per local step, data_parallel.py).
:class:`~lightning_paci.strategy.PACIStrategy` adds the training lifecycle on top.
"""

from __future__ import annotations

import logging
import os
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

from lightning_paci.config import PACIConfig
from lightning_paci.engine import nccl_emulation
from lightning_paci.engine.communicators import PipelineLinks, connections_warning
from lightning_paci.engine.pickle_guard import check_no_tensors
from lightning_paci.engine.supervision import (
    ALL,
    StageWatchdog,
    activity,
    connect_store,
    print_setup_errors_once,
    rendezvous_store,
)
from lightning_paci.engine.topology import Topology, check_topology, resolve_sizes
from lightning_paci.integration import lightning_api as api
from lightning_paci.integration.trainer_glue import share_cpu_cores
from lightning_paci.schedules import Communicator

__all__ = ["PipelineProcesses", "start_watchdog"]

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
        self._p2p_groups: dict[Communicator, dist.ProcessGroup] = {}
        self.p2p_connected = 0  # this rank's point-to-point communicators, connected at setup
        # a gloo group of every rank under NCCL: message headers, checkpoint and end-of-fit gathers ([Note: host
        # groups on a bound world]); None where the world itself is a host group
        self.host_group: dist.ProcessGroup | None = None
        self.device_mesh: Any = None  # torch DeviceMesh ("pp", "dp"), built in setup_environment
        self.dp_group: Any = None  # this rank's stage replicas / replica's pipeline, with config.timeout
        self.pp_group: Any = None
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
    def topology(self) -> Topology:
        """Pipeline stages x data-parallel replicas over ``devices x num_nodes`` processes ([Note: rank layout]);
        an impossible split is a ``ValueError`` naming the numbers and the fix."""
        world = self.num_nodes * self.num_processes
        return Topology(*resolve_sizes(self.config.pipeline_parallel_size, self.config.data_parallel_size, world,
                                       devices=self.num_processes, num_nodes=self.num_nodes))

    def _check_topology(self) -> Topology:
        """The sizes, and what data parallelism cannot run with, named with the fix (topology.py)."""
        return check_topology(self.topology, nonfinite=self.config.nonfinite,
                              local_sgd_steps=self.config.local_sgd_steps)

    @property
    def num_stages(self) -> int:
        return self.topology.pipeline

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data

    @property
    def stage_index(self) -> int:
        """Stages run in reverse rank order: global rank 0 -- where Lightning's loggers, progress bar and
        ``is_global_zero`` callbacks live -- holds the *last* stage, which computes mini-batch k's loss and logs in
        its own call k. With stage 0 on rank 0, those values reached rank 0 only with the gradients, calls later,
        and a drain merged several mini-batches into one logged point (see [Note: the logging rank])."""
        return self.topology.stage_of(self.global_rank)

    @property
    def replica_index(self) -> int:
        """This process's data-parallel coordinate (0 without data parallelism)."""
        return self.topology.replica_of(self.global_rank)

    @property
    def watch_id(self) -> int:
        """This process's id for the failure watchdog: its stage, or its global rank when replicas share stages."""
        return self.global_rank if self.data_parallel_size > 1 else self.stage_index

    def watch_name(self, watch_id: int) -> str:
        if self.data_parallel_size == 1:
            return f"stage {watch_id}"
        return f"stage {self.topology.stage_of(watch_id)} (replica {self.topology.replica_of(watch_id)})"

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """The global rank that runs ``stage`` of ``replica`` (default: this process's replica)."""
        return self.topology.rank_of(stage, self.replica_index if replica is None else replica)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one replica sees the same batches; replicas see disjoint shards
        return {"num_replicas": self.data_parallel_size, "rank": self.replica_index}

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
        self._check_topology()  # an impossible split fails here, in the main process, before any start
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
        world = self.num_processes * self.num_nodes
        if environment.creates_processes_externally and world != environment.world_size():
            expected = environment.world_size()  # torchrun, SLURM, ...: check before the rendezvous
            raise ValueError(
                f"`Trainer(devices={self.num_processes}, num_nodes={self.num_nodes})` asks for {world} processes "
                f"(pipeline stages x data-parallel replicas), but the launcher started {expected} (WORLD_SIZE="
                f"{expected}). One process runs one stage of one replica: pass "
                f"`devices={max(1, expected // self.num_nodes)}` (per node) or launch {world} processes."
            )
        topology = self._check_topology()  # the same checks on every rank (torchrun, SLURM: no main process)
        super().setup_environment()
        if (shared := share_cpu_cores(self.root_device, self.num_processes)) is not None:
            log.info(shared)
        reset_seed()
        self.set_world_ranks()
        print_setup_errors_once(self.global_rank)
        emulated = nccl_emulation.enabled()
        if emulated:  # [Note: NCCL emulation]: the NCCL branch of everything below, carried over gloo
            nccl_emulation.install()
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" or emulated else "gloo"
        # the store first, then the watchdog, then the process groups: a rank held anywhere from here on is named
        # (a second fit in the same processes, as after torchrun's first, keeps the world and its store)
        kwargs: dict[str, Any] = {"timeout": self.config.timeout}
        if not api.distributed_is_initialized():
            kwargs["store"] = rendezvous_store(environment, self.global_rank, topology.world, self.config.timeout)
        activity.begin("setup", patient=True)  # until the strategy's setup ends: building, loading, user hooks
        self._watchdog = start_watchdog(topology, self.watch_id, self.watch_name, self.config.failure_timeout)
        with activity.phase("setup: joining the world's process group", waits=ALL):
            if self._process_group_backend == "nccl":  # bound: NCCL connects the world eagerly
                kwargs["device_id"] = self.root_device
            api.init_dist_connection(environment, self._process_group_backend, **kwargs)
        # pipeline messages on their own communicators, apart from Lightning's collectives: the layout the strict
        # rendezvous model proves deadlock-free under NCCL, connected at setup (engine/communicators.py)
        with activity.phase("setup: creating and connecting the pipeline's process groups", waits=ALL):
            # every group in schedules.setup_groups' order, the one the group-creation model checks; with replicas
            # the stages' replicas' and the replicas' pipelines' groups, with the strategy's timeout
            links = PipelineLinks.setup(topology.pipeline, topology.data, topology.rank_of, device=self.root_device,
                                        backend=self._process_group_backend, timeout=self.config.timeout,
                                        stage=self.stage_index, replica=self.replica_index)
        self._p2p_groups, self.host_group, self.p2p_connected = links.groups, links.host, links.connected
        self.dp_group, self.pp_group = links.data, links.pipeline
        if (warning := connections_warning(self._process_group_backend, self.root_device, os.environ)) is not None:
            log.warning(warning)
        if topology.data > 1:  # for users' code that reads the mesh; its groups are NCCL groups of torch's own
            from torch.distributed.device_mesh import DeviceMesh

            with activity.phase("setup: creating the device mesh", waits=ALL):
                self.device_mesh = DeviceMesh(self.root_device.type, torch.tensor(topology.mesh_ranks()),
                                              mesh_dim_names=("pp", "dp"))

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # as Lightning

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _pipeline_broadcast(self, obj: Any, stage: int) -> Any:
        """Broadcast from ``stage`` of this process's replica to the other stages of that replica."""
        check_no_tensors(obj, what=f"a broadcast from stage {stage}")
        group = None if self.data_parallel_size == 1 else self.pp_group
        with activity.collective("a broadcast within the pipeline", _waits(self.topology, group)):
            return _broadcast_object(obj, self.rank_of(stage), group)

    # -- collectives (never per training batch) -------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if api.distributed_is_initialized():
            with activity.collective("a barrier"):
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not api.distributed_is_initialized():
            return obj
        # pickled: a device tensor would come back on the device it left from, on every rank
        check_no_tensors(obj, what="`strategy.broadcast(obj)`", host_tensors=True)
        with activity.collective("strategy.broadcast"):
            return _broadcast_object(obj, src, None)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """``sync_dist=True``: over the data-parallel replicas of this rank's stage. The stages of one replica hold
        the same logged values (every rank replays the records of its replica), so a reduce over the stages is the
        identity and a pure pipeline returns the value as it is; the replicas of a stage replay the same records in
        the same order, so their group issues the same collectives (also under NCCL)."""
        if self.data_parallel_size == 1 or not isinstance(tensor, Tensor):
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op)).lower()
        ops = {"mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"`reduce_op={reduce_op!r}` is not supported across data-parallel replicas: use "
                             f"'mean', 'sum', 'max' or 'min'.")
        result = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().double()
        with activity.collective("a reduction over the replicas", _waits(self.topology, group or self.dp_group)):
            dist.all_reduce(result, op=ops[op], group=self.dp_group if group is None else group)
        if op in ("mean", "avg"):
            result = result / self.data_parallel_size
        return result if tensor.is_floating_point() or op in ("mean", "avg") else result.to(tensor.dtype)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not api.distributed_is_initialized():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        with activity.collective("reduce_boolean_decision"):
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value > 0)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return api.all_gather_if_available(tensor, group=group, sync_grads=sync_grads)


_FITS = [0]  # watchdogs this process started


def start_watchdog(topology: Topology, watch_id: int, name: Any, failure_timeout: float) -> StageWatchdog | None:
    """The failure watchdog of this process, from the start of setup (supervision.py): it judges the whole
    process, setup's group creations and collectives included, not only the pipeline's actions. None (with a
    warning) where no store is reachable."""
    watched = connect_store()
    if watched is None:
        log.warning("lightning_paci: no rendezvous store reachable (MASTER_ADDR/MASTER_PORT); a dead stage "
                    "will only be noticed after the process-group timeout")
        return None
    _FITS[0] += 1  # every rank starts one watchdog per fit: the same run number on every rank
    watchdog = StageWatchdog(watch_id, topology.world if topology.data > 1 else topology.pipeline, watched,
                             dead_after=failure_timeout, store_host=0 if topology.data > 1 else topology.stage_of(0),
                             name=name, run=_FITS[0], interval=min(1.0, failure_timeout / 4))
    watchdog.activity = activity.now
    watchdog.start()
    return watchdog


def _waits(topology: Topology, group: Any) -> Any:
    """What a collective on ``group`` waits for, as the watchdog's ids (stages in a pure pipeline, global ranks
    with replicas); ALL for the world (None)."""
    if group is None:
        return ALL
    return frozenset(r if topology.data > 1 else topology.stage_of(r) for r in dist.get_process_group_ranks(group))


def _broadcast_object(obj: Any, src: int, group: Any) -> Any:
    """``obj`` from global rank ``src`` to every rank of ``group`` (None: the world), through pickle; ``obj`` itself
    without a process group."""
    if not api.distributed_is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
