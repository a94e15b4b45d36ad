"""The process side of a pipeline: one process per stage and data-parallel replica, joined at setup.

What every pipeline strategy needs whatever its schedule, as functions the strategy's hooks call: the check that the
launcher started the processes the devices ask for, the start-up of this process's process groups (the world, the
pipeline's point-to-point communicators, the replicas' groups, the device mesh) under the failure watchdog, and the
collectives (none of them is ever issued per training batch; the data-parallel gradient reduction is per local step,
engine/replicas/data_parallel.py). Ranks and stages: engine/replicas/topology.py, [Note: rank layout].
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import Tensor

from lightning_paci.config import PACIConfig
from lightning_paci.engine.replicas.topology import Topology
from lightning_paci.engine.supervision.activity import ALL, activity
from lightning_paci.engine.supervision.watchdog import StageWatchdog, is_setup_error, say
from lightning_paci.engine.transport import nccl_emulation
from lightning_paci.engine.transport.collectives import broadcast_object, collective_waits, reduce_over
from lightning_paci.engine.transport.groups import PipelineLinks, connections_warning
from lightning_paci.integration.processes.host_interface import gloo_interface, named_interface
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.schedules import Communicator, stage_devices

__all__ = ["LAUNCHER_PID", "ProcessGroups", "check_launched_world", "connect_store", "current_watchdog",
           "launcher_pid", "print_setup_errors_once", "rendezvous_store", "share_cpu_cores", "start_process_groups",
           "start_watchdog"]

log = logging.getLogger(__name__)


@dataclass
class ProcessGroups:
    """This process's groups, made once at setup by :func:`start_process_groups`: the pipeline's (``links``, as the
    transport made them) and what the process adds around them."""

    backend: str
    topology: Topology
    links: PipelineLinks  # the pipeline's communicators, the host group, the replicas' groups
    mesh: Any = None  # torch DeviceMesh ("pp", "dp") with data parallelism, for users' code that reads it
    watchdog: StageWatchdog | None = None
    leave_at_teardown: bool = False  # Lightning ended the run before its teardown (integration/processes/shutdown.py)

    @property
    def p2p(self) -> dict[Communicator, dist.ProcessGroup]:
        """The pipeline's point-to-point communicators by key (schedules.communicator)."""
        return self.links.groups

    @property
    def host(self) -> dist.ProcessGroup | None:
        """A gloo group of every rank under NCCL: message headers, checkpoint and end-of-fit gathers ([Note: host
        groups on a bound world]); None where the world itself is a host group."""
        return self.links.host

    @property
    def data(self) -> dist.ProcessGroup | None:
        """This rank's stage replicas (with data parallelism)."""
        return self.links.data

    @property
    def pipeline(self) -> dist.ProcessGroup | None:
        """This rank's replica's stages (with data parallelism)."""
        return self.links.pipeline

    def pipeline_broadcast(self, obj: Any, process: int, lane: int) -> Any:
        """From the pipeline's ``process`` (its stage index) to the other processes of ``lane``'s pipeline, over
        the host group ([Note: host groups on a bound world]); with one lane the pipeline is every rank: the host
        group's own broadcast."""
        topology = self.topology
        ranks = None if topology.lanes == 1 else [topology.rank_of(p, lane) for p in range(topology.pipeline)]
        return broadcast_object(obj, topology.rank_of(process, lane), self.host,
                                what=f"a broadcast from stage {process}", ranks=ranks,
                                waits=collective_waits(topology.watch_id, ranks and self.pipeline))

    def reduce_over_replicas(self, tensor: Tensor, reduce_op: Any, group: Any | None) -> Tensor:
        """``tensor`` reduced over this stage's replicas (``group``: another group of Lightning's choosing)."""
        group = self.data if group is None else group
        return reduce_over(tensor, reduce_op, group, self.topology.data, collective_waits(self.topology.watch_id,
                                                                                          group))


def check_launched_world(environment: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """torchrun, SLURM, ...: the processes the launcher started must be those ``Trainer(devices, num_nodes)`` asks
    for, checked before the rendezvous (a mismatch would wait there forever)."""
    world = devices * num_nodes
    if environment.creates_processes_externally and world != environment.world_size():
        expected = environment.world_size()
        raise ValueError(
            f"`Trainer(devices={devices}, num_nodes={num_nodes})` asks for {world} processes (pipeline stages x "
            f"data-parallel replicas), but the launcher started {expected} (WORLD_SIZE={expected}). One process "
            f"runs one stage of one replica: pass `devices={max(1, expected // num_nodes)}` (per node) or launch "
            f"{world} processes.")


def start_process_groups(environment: ClusterEnvironment, topology: Topology, *, rank: int, device: torch.device,
                         local_processes: int, config: PACIConfig) -> ProcessGroups:
    """Join the world and make every group this process uses, in the order the group-creation model checks
    (schedules.setup_groups, [Note: group creation]): the store first, then the watchdog, then the groups, so a
    rank held anywhere from here on is named. A second fit in the same processes (as after torchrun's first)
    keeps the world and its store."""
    if (shared := share_cpu_cores(device, local_processes)) is not None:
        log.info(shared)
    print_setup_errors_once(rank)
    if (said := gloo_interface()) is not None and environment.local_rank() == 0:  # once per node
        say(said)
    emulated = nccl_emulation.enabled()
    if emulated:  # [Note: NCCL emulation]: the NCCL branch of everything below, carried over gloo
        nccl_emulation.install()
    backend = config.process_group_backend or ("nccl" if device.type == "cuda" or emulated else "gloo")
    kwargs: dict[str, Any] = {"timeout": config.timeout}
    launcher = launcher_pid(environment)
    if not api.distributed_is_initialized():
        kwargs["store"] = rendezvous_store(environment, rank, topology.world, config.timeout, launcher=launcher)
    activity.begin("setup", patient=True)  # until the strategy's setup ends: building, loading, user hooks
    watchdog = start_watchdog(topology, topology.watch_id(rank), config.failure_timeout, launcher=launcher)
    with activity.phase("setup: joining the world's process group", waits=ALL), _interface_named():
        if backend == "nccl":  # bound: NCCL connects the world eagerly
            kwargs["device_id"] = device
        api.init_dist_connection(environment, backend, **kwargs)
    if watchdog is not None:
        watchdog.joined()
    stage, lane = topology.stage_of(rank), topology.lane_of(rank)
    # pipeline messages on their own communicators, apart from Lightning's collectives: the layout the deadlock
    # model proves deadlock-free under NCCL, connected at setup (engine/transport/groups.py)
    with activity.phase("setup: creating and connecting the pipeline's process groups", waits=ALL), \
            _interface_named():
        placement = stage_devices(topology.pipeline, config.virtual_stages, config.placement) \
            if config.virtual_stages > 1 else None
        links = PipelineLinks.setup(topology.pipeline, topology.lanes, topology.rank_of, device=device,
                                    backend=backend, timeout=config.timeout, stage=stage, replica=lane,
                                    placement=placement)
    groups = ProcessGroups(backend, topology, links, watchdog=watchdog)
    if (warning := connections_warning(backend, device, os.environ)) is not None:
        log.warning(warning)
    if topology.lanes > 1 or config.model_parallel:  # its groups are NCCL groups of torch's own, made after ours
        from torch.distributed.device_mesh import DeviceMesh

        with activity.phase("setup: creating the device mesh", waits=ALL):
            if config.model_parallel:  # [Note: tensor parallelism in a stage]
                groups.mesh = DeviceMesh(device.type, torch.tensor(topology.mesh_ranks_3d()),
                                         mesh_dim_names=("pp", "data_parallel", "tensor_parallel"))
            else:
                groups.mesh = DeviceMesh(device.type, torch.tensor(topology.mesh_ranks()),
                                         mesh_dim_names=("pp", "dp"))
    return groups


@contextlib.contextmanager
def _interface_named() -> Iterator[None]:
    """A connection failure (a timeout, a refused connection) names the host group's interface ([Note: the host
    group's interface]); a check's error at setup passes as it is."""
    try:
        yield
    except RuntimeError as err:
        connecting = isinstance(err, dist.DistError) or re.search(r"time[d ]?out|connect", str(err), re.IGNORECASE)
        if is_setup_error(err) or not connecting:
            raise
        raise named_interface(err) from err


def share_cpu_cores(device: torch.device, local_processes: int, environ: Any = os.environ) -> str | None:
    """On the CPU, give each of a node's stage processes its share of the cores for torch's intra-op threads.

    Every process otherwise starts one thread per core: 4 stages on 2 cores run 8 compute threads, and the main
    example's 20 steps take 71 s instead of 33 s (measured; the cost doubled when the stages' compute began to
    overlap in time). torchrun sets ``OMP_NUM_THREADS=1`` for the same reason; Lightning's launchers do not. A value
    the user set (``OMP_NUM_THREADS``) is kept. Returns the log line, or None when nothing changed."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in environ or local_processes < 2:
        return None
    threads = max(1, (os.cpu_count() or 1) // local_processes)
    if torch.get_num_threads() <= threads:
        return None
    torch.set_num_threads(threads)
    return (f"lightning_paci: {local_processes} stage processes share this node's {os.cpu_count()} cores: "
            f"{threads} intra-op thread(s) each (set OMP_NUM_THREADS to choose)")


_FITS = [0]  # watchdogs this process started
_WATCHING: list[StageWatchdog] = []  # the last watchdog this process started (a failed run's outlives its strategy)
_PARENT = os.getppid()  # the process that started this one, as this module was first imported
LAUNCHER_PID = "LIGHTNING_PACI_LAUNCHER_PID"  # set by Lightning's script launcher for the ranks it starts


def launcher_pid(environment: ClusterEnvironment) -> int | None:
    """The pid of the launcher that started this process, which it must not outlive: a fork/spawn worker's main
    process, torchrun's agent, or Lightning's script launcher (local rank 0) for the ranks it starts. None for a
    process started by hand or by a scheduler (SLURM), and for the launcher itself."""
    if (parent := multiprocessing.parent_process()) is not None:
        return parent.pid
    if isinstance(environment, LightningEnvironment) and environment.local_rank() > 0:
        return int(os.environ.get(LAUNCHER_PID, _PARENT))  # known even where it died before this one started
    return _PARENT if "TORCHELASTIC_RUN_ID" in os.environ else None


def rendezvous_store(environment: Any, rank: int, world: int, timeout: timedelta, *,
                     launcher: int | None = None) -> Any:
    """The world's TCP store, made before the process group so the watchdog can run from the start of setup.
    Global rank 0 hosts it (a launcher's agent store when torchelastic provides one) and waits for no one: a rank
    that never arrives is named by the others' watchdogs, not by a store timeout. Sets MASTER_ADDR/MASTER_PORT as
    Lightning's own process-group start does. Another rank waits for the store to open (``timeout``) by probing
    its port, never by torch's client retries, and stops at once where its launcher is gone ([Note: ending a run]
    in watchdog.py): a rank started by a launcher that failed never waits for a store that will not open."""
    import torch.distributed as dist

    address, port = environment.main_address, int(environment.main_port)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    deadline = time.monotonic() + timeout.total_seconds()
    while not hosts and not _listens(address, port):
        if launcher is not None and (os.getppid() != launcher or launcher == 1):
            say(f"lightning_paci: rank {rank} stopped: the rendezvous store at {address}:{port} is not open and "
                f"the launcher that started this process (pid {launcher}) is gone (its message is above)")
            os._exit(1)
        if time.monotonic() > deadline:
            raise TimeoutError(f"lightning_paci: rank {rank} found no rendezvous store at {address}:{port} within "
                               f"`timeout={timeout}`: global rank 0 hosts it; check that it started and that "
                               f"MASTER_ADDR/MASTER_PORT reach it.")
        time.sleep(0.25)
    return dist.TCPStore(address, port, world, is_master=hosts, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True)


def _listens(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def connect_store(timeout: float = 10.0) -> Any | None:
    """A new client connection to the rendezvous TCP store (MASTER_ADDR / MASTER_PORT), or ``None``."""
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    except Exception:
        return None


def current_watchdog() -> StageWatchdog | None:
    """The watchdog this process started last, while its thread runs (also where the strategy's groups were never
    made, or its run failed); else None."""
    return _WATCHING[-1] if _WATCHING and _WATCHING[-1].watching else None


def start_watchdog(topology: Topology, watch_id: int, failure_timeout: float, *,
                   launcher: int | None = None) -> StageWatchdog | None:
    """The failure watchdog of this process, from the start of setup (watchdog.py): it judges the whole
    process, setup's group creations and collectives included, not only the pipeline's actions. None (with a
    warning) where no store is reachable."""
    watched = connect_store()
    if watched is None:
        log.warning("lightning_paci: no rendezvous store reachable (MASTER_ADDR/MASTER_PORT); a dead stage "
                    "will only be noticed after the process-group timeout")
        return None
    _FITS[0] += 1  # every rank starts one watchdog per fit: the same run number on every rank
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the store outlives every rank
    watchdog = StageWatchdog(watch_id, topology.world if topology.lanes > 1 else topology.pipeline, watched,
                             dead_after=failure_timeout, store_host=None if agent else topology.watch_id(0),
                             name=topology.watch_name, run=_FITS[0], interval=min(1.0, failure_timeout / 4),
                             launcher=launcher, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    watchdog.activity = activity.now
    watchdog.start()
    _WATCHING[:] = [watchdog]
    _report_consequences_in_one_line(watchdog)
    return watchdog


def _report_consequences_in_one_line(watchdog: StageWatchdog) -> None:
    """An uncaught exception after another stage reported its failure is a consequence of that failure (the
    neighbour's connection closed): one line naming the cause instead of a traceback, or nothing where the
    watchdog said this process's line already ([Note: ending a run] in watchdog.py)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if watchdog.said:
            return
        failure = None if is_setup_error(value) else watchdog.failed_elsewhere()[0]
        if failure is None:
            previous(kind, value, traceback)
            return
        first_line = str(value).splitlines()[0][:200] if str(value) else ""
        say(f"lightning_paci: {watchdog.name(watchdog.stage)} stopped ({kind.__name__}: {first_line}) because "
            f"{watchdog.name(failure[0])} failed first: {failure[1].splitlines()[0] if failure[1] else ''}")

    sys.excepthook = hook


def print_setup_errors_once(rank: int) -> None:
    """On ranks other than 0, report a marked setup error in one line instead of a full traceback.

    A setup error is the same on every rank; with the default launcher each rank is its own Python process, and
    8 stages printed 8 identical tracebacks (186 lines) for one bad option. Rank 0 prints the traceback; the others
    print one line that names their rank and points at it. Any other uncaught exception is reported as before.
    """
    if rank == 0:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if is_setup_error(value):
            first_line = str(value).splitlines()[0] if str(value) else ""
            say(f"lightning_paci: rank {rank} stopped at setup with the error rank 0 reports in full: "
                f"{kind.__name__}: {first_line}")
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook


