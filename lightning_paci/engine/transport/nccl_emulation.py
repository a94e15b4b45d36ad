"""NCCL's rules enforced over gloo, so that CPU processes run the GPU code path and break where NCCL would.

[Note: NCCL emulation]
Nothing in this project's CI has a GPU, and a rule of NCCL's that the code breaks shows on a GPU as a hang with no
message. ``LIGHTNING_PACI_EMULATE_NCCL=1`` (read by every rank at setup, however it was launched) makes the strategy
take its NCCL branch on the CPU -- ``process_group_backend="nccl"``, the world bound to the stage's device, the
header/payload wire, the NCCL data-parallel groups -- while this module carries every operation over gloo and
checks, on every rank, the rules torch 2.13 and NCCL apply:

1. *Group creation on a bound world.* Once ``init_process_group(device_id=...)`` has bound the world, every
   ``new_group`` is collective over the world: a rank outside the new group performs a no-color split of the world's
   NCCL communicator (``_new_process_group_helper``: ``split_from.perform_nocolor_split``), the members of a group
   with an NCCL part join that split with their color, and the members of a group with no NCCL part (plain gloo)
   do not join it: they connect to each other over gloo. A non-member then waits for ranks that never come.
2. *Lazy two-rank communicators.* A pair's first point-to-point operation on a group holds the host until the
   peer's first operation with it on the same group.
3. *One collective order.* The members of a communicator issue its collectives in the same order, with the same
   operation and sizes.
4. *Device tensors only.* An NCCL operation takes dense, contiguous tensors on the world's bound device; a gloo
   group takes host tensors only. Host data goes over a gloo group, Python objects included: an object operation
   (``all_gather_object``, ``broadcast_object_list``, ``gather_object``, ``scatter_object_list``,
   ``send_object_list``, ``recv_object_list``) on an NCCL group is refused. torch would run it -- it pickles the
   object into a host tensor, copies it to the device, exchanges sizes first and reads them back with a device
   synchronisation -- but every call then drains the stream twice, the pickles take device memory, and a device
   tensor inside the object is unpickled onto the device it left from on every rank (engine/transport/pickle_guard.py).
   This project carries objects over the host group of every rank ([Note: host groups on a bound world]).

A broken rule raises :class:`NcclRuleError` naming the rule, the group, the ranks and the fix, within seconds: the
ranks meet through the process group's store (each waiting rank polls it and sees the others' records), never
through a timeout. What the emulation cannot show: device memory is host memory here (rule 4 checks the device a
tensor reports, so a host buffer on a CPU run is indistinguishable from a device one), kernels do not overlap the
host, and ``split_group`` (which torch's ``DeviceMesh`` uses on a bound GPU world) is modelled as ``new_group``,
which obeys the same rule.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_paci.errors import NcclRuleError

__all__ = ["ENV", "OBJECT_OPERATIONS", "NcclEmulation", "NcclRuleError", "emulation", "enabled", "install"]

ENV = "LIGHTNING_PACI_EMULATE_NCCL"

_POLL = 0.005  # seconds between two looks at the store while waiting for other ranks
_COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                "allgather_into_tensor_coalesced", "reduce", "gather", "scatter", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "barrier")
# torch.distributed's operations on Python objects (rule 4: never on an NCCL group)
OBJECT_OPERATIONS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                     "send_object_list", "recv_object_list")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``LIGHTNING_PACI_EMULATE_NCCL`` asks for the emulation (``1``, ``true`` or ``yes``)."""
    return environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class _Group:
    """What the emulation knows of a process group: the backend asked for and its members (global ranks)."""

    backend: str
    ranks: tuple[int, ...]

    @property
    def nccl(self) -> bool:
        return "nccl" in self.backend


def _has_nccl(backend: Any) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def _host_backend(backend: Any) -> Any:
    """The backend gloo runs in place of ``backend`` (every device part becomes gloo on the host)."""
    return "gloo" if _has_nccl(backend) else backend


class NcclEmulation:
    """The patches and the state of one process (see the module docstring). :func:`install` makes the one
    instance; ``wait_limit`` bounds a wait no rule explains (a rank that never comes), in seconds."""

    def __init__(self, wait_limit: float = 120.0) -> None:
        self.wait_limit = wait_limit
        self.bound: torch.device | None = None  # the world's device (init_process_group's device_id)
        self.world_backend = "gloo"
        self._groups: dict[str, _Group] = {}
        self.created: list[tuple[tuple[int, ...], str]] = []  # every new_group (members, backend asked), in order
        self._met: set[tuple[str, int]] = set()  # (group, peer) pairs whose first p2p operation has met
        self._issued: dict[str, int] = {}  # collectives issued per group (rule 3)
        self._store: Any = None
        self._originals: list[tuple[Any, str, Any]] = []

    @property
    def met(self) -> int:
        """The (group, peer) pairs whose first point-to-point operations have met on this rank (rule 2)."""
        return len(self._met)

    # -- installation ---------------------------------------------------------------------------------------------
    def install(self) -> None:
        def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
            original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, make(original))

        init = self._init_process_group(c10d.init_process_group)
        self._originals.append((dist, "init_process_group", dist.init_process_group))
        self._originals.append((c10d, "init_process_group", c10d.init_process_group))
        dist.init_process_group = c10d.init_process_group = init
        patch(c10d, "_new_group_with_tag", self._new_group)
        patch(dist.ProcessGroup, "send", lambda op: self._p2p(op, "send"))
        patch(dist.ProcessGroup, "recv", lambda op: self._p2p(op, "recv"))
        for name in _COLLECTIVES:
            if hasattr(dist.ProcessGroup, name):
                patch(dist.ProcessGroup, name, functools.partial(self._collective, name=name))
        for name in OBJECT_OPERATIONS:  # torch.distributed's namespace holds c10d's functions under the same names
            for owner in (c10d, dist):
                patch(owner, name, functools.partial(_object_operation, self._groups, name=name))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    # -- the store: where ranks see each other ---------------------------------------------------------------------
    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = dist.PrefixStore("paci_nccl_emulation/", c10d._get_default_store())
        return self._store

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _wait(self, done: Callable[[], bool], what: str, check: Callable[[], None] | None = None) -> None:
        """Poll until ``done()``; ``check()`` raises when a rule shows the wait can never end. A rule broken
        anywhere is published, so that every rank waiting here stops with it (not only the one that saw it)."""
        deadline = time.monotonic() + self.wait_limit
        while True:
            try:
                finished = done()
                if check is not None:
                    check()
            except NcclRuleError as err:
                self.store.set("broken", f"{err.rule}\n{dist.get_rank()}\n{err}")
                raise
            if finished:
                return
            if self.store.check(["broken"]):
                rule, rank, message = self.store.get("broken").decode().split("\n", 2)
                raise NcclRuleError(int(rule), f"rank {dist.get_rank()} stops while waiting for {what}, as rank "
                                               f"{rank} found: {message.split(': ', 1)[1]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL emulation: rank {dist.get_rank()} waited {self.wait_limit:.0f} s for "
                                   f"{what}; no rule explains it (a rank stopped or took another path)")
            time.sleep(_POLL)

    # -- the world and rule 1 ----------------------------------------------------------------------------------------
    def _init_process_group(self, original: Any) -> Any:
        def init_process_group(backend: Any = None, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            self.world_backend = str(backend or "nccl")
            self.bound = torch.device(device_id) if device_id is not None else None
            original(_host_backend(backend), *args, **kwargs)  # gloo carries it; the binding is the emulation's
            world = dist.group.WORLD
            assert world is not None
            self._groups[world.group_name] = _Group(self.world_backend, tuple(range(dist.get_world_size())))

        return init_process_group

    def _new_group(self, original: Any) -> Any:
        def new_group_with_tag(ranks: Iterable[int] | None = None, timeout: Any = None, backend: Any = None,
                               *args: Any, **kwargs: Any) -> Any:
            world = dist.get_world_size()
            members = tuple(sorted(ranks)) if ranks is not None else tuple(range(world))
            asked = str(backend) if backend else self.world_backend
            self.created.append((members, asked))  # the same sequence on every rank (rule 1)
            self._creation(len(self.created), members, asked, world)
            kwargs.pop("device_id", None)
            group = original(list(members), timeout, _host_backend(asked), *args, **kwargs)
            if group is not None and group != c10d.GroupMember.NON_GROUP_MEMBER:
                self._groups[group.group_name] = _Group(asked, members)
            return group

        return new_group_with_tag

    def _creation(self, index: int, members: tuple[int, ...], backend: str, world: int) -> None:
        """Rule 1 for the ``index``-th ``new_group`` of the run: who takes the world's split, and who waits in it."""
        me = dist.get_rank()
        outside = me not in members
        if self.bound is None or (len(members) == world and not _has_nccl(backend)):
            return  # an unbound world, or a host group of every rank: nobody splits
        role = "nocolor" if outside else ("color" if _has_nccl(backend) else "absent")
        described = f"ranks {list(members)} backend {backend!r}"
        prefix = f"create/{index}"
        self.store.set(f"{prefix}/{me}", f"{role}\n{described}")
        self.store.add(f"{prefix}/arrived", 1)
        if role == "absent":  # a gloo member connects over gloo and never enters the split
            self.store.add(f"{prefix}/absent", 1)
            return

        def check() -> None:
            if self._count(f"{prefix}/absent"):
                absent = [r for r in members if self.store.check([f"{prefix}/{r}"])
                          and self.store.get(f"{prefix}/{r}").decode().startswith("absent")]
                raise NcclRuleError(1, (
                    f"rank {me} waits in the no-color split of the world's NCCL communicator for new_group "
                    f"#{index} ({described}), which its members {absent or list(members)} never join: a group with "
                    f"no NCCL part is connected over gloo by its members alone, while every rank outside it splits "
                    f"the device-bound world. Give the group an NCCL part (backend='cpu:gloo,cuda:nccl'), create it "
                    f"before the world is bound, or make it a group of every rank."))
            for rank in range(world):
                key = f"{prefix}/{rank}"
                if self.store.check([key]):
                    theirs = self.store.get(key).decode().split("\n", 1)[1]
                    if theirs != described:
                        raise NcclRuleError(1, (
                            f"new_group #{index} is {described} on rank {me} and {theirs} on rank {rank}: every "
                            f"rank must create the same groups in the same order (it is collective over the world)."))

        self._wait(lambda: self._count(f"{prefix}/arrived") >= world, f"the world's split for new_group #{index}",
                   check)

    # -- rule 2 and rule 4 on point-to-point operations ------------------------------------------------------------
    def _p2p(self, op: Any, kind: str) -> Any:
        emulation = self

        def wrapped(group: Any, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> Any:
            known = emulation._groups.get(group.group_name)
            if known is not None:
                emulation._check_tensors(known, group, tensors, f"{kind} with group rank {peer}")
                if known.nccl:
                    emulation._first_operation(known, group, dist.get_global_rank(group, peer), kind)
            return op(group, tensors, peer, tag)

        return wrapped

    def _first_operation(self, known: _Group, group: Any, peer: int, kind: str) -> None:
        name = group.group_name
        if (name, peer) in self._met:
            return
        me = dist.get_rank()
        pair = f"p2p/{name}/{min(me, peer)}-{max(me, peer)}"
        self.store.set(f"{pair}/{me}", kind)
        waiting = f"waiting/{me}"
        self.store.set(waiting, f"{name}\n{peer}\n{kind}")

        def check() -> None:  # a cycle of ranks, each held in a first operation for the next on another group
            chain, rank, seen = [f"rank {me} ({kind} on group {name}, for rank {peer})"], peer, {me}
            while rank not in seen:
                seen.add(rank)
                key = f"waiting/{rank}"
                if not self.store.check([key]):
                    return
                text = self.store.get(key).decode()
                if not text:
                    return
                their_group, their_peer, their_kind = text.split("\n")
                if self.store.check([f"p2p/{their_group}/{min(rank, int(their_peer))}-"
                                     f"{max(rank, int(their_peer))}/{their_peer}"]):
                    return  # its peer has arrived: it is about to go on
                chain.append(f"rank {rank} ({their_kind} on group {their_group}, for rank {their_peer})")
                rank = int(their_peer)
            if rank == me:
                raise NcclRuleError(2, (
                    "each rank's first operation on a group waits for its peer's first operation on that group, and "
                    "these wait for each other in a cycle: " + " -> ".join(chain) + ". Create and connect the "
                    "communicators at setup in one global order (engine/transport/groups.py) before posting receives."))

        self._wait(lambda: self.store.check([f"{pair}/{peer}"]), f"rank {peer}'s first operation on group {name}",
                   check)
        self.store.set(waiting, "")
        self._met.add((name, peer))

    def _check_tensors(self, known: _Group, group: Any, tensors: Iterable[Any], what: str) -> None:
        for tensor in _tensors(tensors):
            if known.nccl:
                wrong = self.bound is not None and tensor.device != self.bound
                if wrong or tensor.layout != torch.strided or not tensor.is_contiguous():
                    raise NcclRuleError(4, (
                        f"rank {dist.get_rank()}: {what} on NCCL group {group.group_name} (ranks "
                        f"{list(known.ranks)}) got a {'non-contiguous ' if not tensor.is_contiguous() else ''}"
                        f"{tensor.layout} tensor on {tensor.device}; NCCL takes dense contiguous tensors on the "
                        f"world's device ({self.bound}). Copy it there, or send host data over a gloo group."))
            elif tensor.device.type != "cpu":
                raise NcclRuleError(4, (
                    f"rank {dist.get_rank()}: {what} on gloo group {group.group_name} got a tensor on "
                    f"{tensor.device}; gloo takes host tensors only."))

    # -- rule 3 and rule 4 on collectives --------------------------------------------------------------------------
    def _collective(self, op: Any, name: str) -> Any:
        emulation = self

        def wrapped(group: Any, *args: Any, **kwargs: Any) -> Any:
            known = emulation._groups.get(group.group_name)
            if known is not None:
                tensors = list(_tensors(args))
                emulation._check_tensors(known, group, tensors, name)
                if known.nccl:
                    emulation._in_order(known, group, name, tensors)
            return op(group, *args, **kwargs)

        return wrapped

    def _in_order(self, known: _Group, group: Any, name: str, tensors: list[torch.Tensor]) -> None:
        me = dist.get_rank()
        index = self._issued[group.group_name] = self._issued.get(group.group_name, 0) + 1
        # a scatter's inputs and a gather's outputs exist on its root only: the members agree on the one tensor
        # each of them passes (the scatter's output, the gather's input)
        agreed = tensors[:1] if name == "scatter" else tensors[-1:] if name == "gather" else tensors[:4]
        signature = name + "".join(f" {t.dtype}[{t.numel()}]" for t in agreed)
        prefix = f"coll/{group.group_name}"
        self.store.set(f"{prefix}/{index}/{me}", signature)

        def check() -> None:
            for rank in known.ranks:
                key = f"{prefix}/{index}/{rank}"
                if rank != me and self.store.check([key]):
                    theirs = self.store.get(key).decode()
                    if theirs != signature:
                        raise NcclRuleError(3, (
                            f"collective #{index} on group {group.group_name} (ranks {list(known.ranks)}) is "
                            f"{signature} on rank {me} and {theirs} on rank {rank}: NCCL pairs the members' "
                            f"collectives by issue order. Issue them in the same order with the same sizes on "
                            f"every member."))

        self._wait(lambda: all(self.store.check([f"{prefix}/{index}/{r}"]) for r in known.ranks),
                   f"collective #{index} ({signature}) of group {group.group_name}'s members {list(known.ranks)}",
                   check)
        if index > 1:  # every member has read this rank's previous entry: bounded keys per group
            self.store.delete_key(f"{prefix}/{index - 1}/{me}")


def _tensors(items: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors in a call's arguments (lists of tensors, lists of lists), in order."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple)):
            yield from _tensors(item)


_INSTANCE: list[NcclEmulation] = []


def install() -> NcclEmulation:
    """Install the emulation in this process, once (later calls return the same instance)."""
    if not _INSTANCE:
        instance = NcclEmulation()
        instance.install()
        _INSTANCE.append(instance)
    return _INSTANCE[0]


def emulation() -> NcclEmulation | None:
    """The installed emulation of this process, or None."""
    return _INSTANCE[0] if _INSTANCE else None


def _object_operation(groups: Mapping[str, Any], op: Any, *, name: str) -> Any:
    """``op`` (one of ``OBJECT_OPERATIONS``) refusing an NCCL group (rule 4); ``groups``: the emulation's groups by
    name."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        group = signature.bind(*args, **kwargs).arguments.get("group")
        group = dist.group.WORLD if group is None else group
        known = None if group is None else groups.get(group.group_name)
        if group is not None and known is not None and known.nccl:
            raise NcclRuleError(4, (
                f"rank {dist.get_rank()}: {name} on NCCL group {group.group_name} (ranks {list(known.ranks)}): "
                f"a Python object would be pickled into device memory, its size read back with a device "
                f"synchronisation, and a device tensor in it unpickled onto the device it left from on every "
                f"rank. Carry host data over a gloo group: the host group of every rank "
                f"(`ProcessGroups.host`, [Note: host groups on a bound world]), or send device data as tensors."))
        return op(*args, **kwargs)

    return wrapped
