"""The strict deadlock model of NCCL messaging, and the check of lists against it under each communicator layout.

[Note: deadlock model]
gloo buffers a send, so a CPU run cannot show the deadlock NCCL can. Under NCCL a point-to-point send completes
only when the peer's matching receive runs, and each communicator runs its operations in issue order on one stream
per rank. torch also orders each operation after the work the rank's current stream already waits for: a receive
(``dist.recv``) and a reduction whose result the next action needs make the current stream wait on them, a send
(``isend``, never waited right away) does not. So, per rank:

* an operation starts only after every earlier operation on its communicator (FIFO per communicator and rank) and
  after every earlier receive and reduction of the rank (the current stream);
* a send and its receive complete together, when both are first in their communicators' queues; a collective
  completes when every member has it first;
* at the end of its list a rank waits for all its sends (``DistComm.flush``).

Under this model 1F1B's steady state deadlocks on one shared communicator: stage ``s`` posts ``SEND_F(i)`` then
``RECV_B(j)``, stage ``s+1`` posts ``SEND_B(j)`` then ``RECV_F(i)``; each receive queues behind the rank's own
send, and each send waits for the other's receive. :func:`check_deadlock_free` finds that cycle in the layout 0.1
used (``"shared"``: activations and gradients on one communicator) and proves the ``"directed"`` layout free of it
for every list it is given: one communicator per neighbour pair *and direction*, so a communicator has one sender
and one receiver and its queue on each side holds only sends or only receives, in the same message order.

With ``replicas > 1`` every stage has that many data-parallel replicas running the same list, and every ``OPT``
is preceded by a gradient all-reduce over the replicas of that stage (its own communicator), which the rank waits
for: the reductions sit in the model where the runtime issues them.

What the model assumes, and what it leaves out: communicators progress independently of each other (NCCL's
kernels of two communicators may not run concurrently when a GPU's resources are exhausted, e.g. under MPS or with
many communicators; NCCL then asks for one issue order across ranks, which the directed layout does not give:
batching each step's send and receive with ``batch_isend_irecv`` on one communicator per neighbour pair would
remove that assumption; the runtime does not do that); the collectives outside the lists (``sync_dist``
reductions, LocalSGD's and the drains' averages and broadcasts) are issued by every replica of a stage at the same
points of identical lists, so they pair up as long as the replicas stay in lockstep (``nonfinite="skip"`` would
break that and is refused with replicas).

[Note: communicator creation]
NCCL creates a group's point-to-point communicator lazily, at a rank's first operation on it, and that first
operation blocks the *host* until the peer makes its first operation on the same group; gloo connects a group when
it is created, so no CPU run can show what this does. The model has it as a ``connect`` of the communicator's ranks
(a collective that holds each rank's host until all have reached it): ``connect="lazy"`` puts one before each
rank's first operation on a communicator. Left to itself that deadlocks every list at batch 0 once receives are
posted ahead -- stage 0 posts its first gradient receive on B(1->0) and waits there for stage 1, which posted its
first activation receive on F(0->1) and waits for stage 0 -- and, with tied weights, even without posting (stage
0's first ``SEND_T`` waits for the last stage, which waits for an activation stage 0 has not sent). So the runtime
creates them all at setup, before any list runs: every rank makes one small exchange on each of its
communicators in ``layout_communicators`` order (``engine.comm.warm_communicators``), a single global order in
which the lowest pending communicator always has all its ranks waiting on it. ``connect="warm"`` (the default)
models exactly that: the connects first, in that order, then the lists with nothing lazy left.

[Note: group creation]
On a world bound to a device (``init_process_group(device_id=...)``, what the NCCL runs do) torch 2.13 makes every
``new_group`` collective over the world's NCCL communicator: each rank outside the new group performs a no-color
split, the members of a group with an NCCL part join that split with their color, the members of a group without
one connect over gloo and do not join. :func:`setup_groups` lists every group the setup creates, in its order, with
members and backend -- ``engine.communicators.PipelineLinks.setup`` creates exactly that list -- and
:func:`check_group_creation` runs it under the rule: a split that some members never join leaves the ranks outside
the group waiting forever (the hang of 3+ GPU runs when the header groups were one 2-rank gloo group per link).

The simulation is exact for these rules (every rank's order is fixed, every operation has one partner, so whether
the run completes does not depend on which rank moves first) and linear in the number of actions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from lightning_paci.schedules.actions import OPT, SEND_KINDS, Action, Schedule, ScheduleError, format_grid, message_key
from lightning_paci.schedules.analysis import assign_rounds
from lightning_paci.schedules.communicators import Communicator, communicator, rank_members

__all__ = ["check_deadlock_free", "check_group_creation"]

def check_group_creation(groups: Sequence[tuple[Communicator, Sequence[int], str]], world: int, *,
                         bound: bool = True) -> None:
    """Run the creations ``groups`` (every rank creates each, in order) under torch's rule for a ``bound`` world
    ([Note: group creation]); raise :class:`ScheduleError` naming the first group whose split some ranks wait in
    forever, and who waits."""
    for index, (key, members, backend) in enumerate(groups):
        outside = [r for r in range(world) if r not in members]
        if bound and outside and "nccl" not in backend:
            raise ScheduleError(
                f"Group creation #{index} {key} (members {list(members)}, backend {backend!r}) deadlocks on a "
                f"device-bound world: ranks {outside} wait in the no-color split of the world's NCCL communicator, "
                f"which its members never join (they connect over gloo). Give it an NCCL part, create it before "
                f"binding, or make it a group of every rank ([Note: group creation]).")


CONNECTS = ("eager", "lazy", "warm")


class _Op:
    __slots__ = ("rank", "comm", "key", "sends", "partners", "step", "done")

    def __init__(self, rank: int, comm: Communicator, key: tuple[Any, ...], sends: bool, partners: tuple[int, ...],
                 step: int) -> None:
        self.rank, self.comm, self.key, self.sends, self.partners, self.step = rank, comm, key, sends, partners, step
        self.done = False

    @property
    def collective(self) -> bool:
        return self.key[0] in ("reduce", "connect")

    def __str__(self) -> str:
        if self.key[0] == "reduce":
            return f"the all-reduce before update {self.key[2]} of stage {self.key[1]}"
        if self.key[0] == "connect":
            return f"the creation of communicator {self.key[1]} (NCCL: its ranks' first operations meet)"
        channel, src, dst, index = self.key
        return f"{'SEND' if self.sends else 'RECV'}_{channel}{index} ({src}->{dst})"


# one item of a rank's program: an operation and what the host does with it
_ISSUE, _ISSUE_WAIT, _WAIT = 0, 1, 2  # post and go on; post and wait for it; wait for one posted earlier
_Item = tuple[_Op, int]
_Call = list[tuple[int, Action | None]]  # (step in the stage's list, action)


def _calls_of(actions: Sequence[Sequence[Action | None]] | Schedule, posted_ahead: bool) -> list[list[_Call]]:
    """Each stage's list cut into the runtime's calls: with receives posted ahead, a Schedule's rounds
    (``assign_rounds``: a Lightning call runs one round); otherwise, and for plain lists, one call per stage (for
    posting, the earliest a receive can be posted)."""
    if not (posted_ahead and isinstance(actions, Schedule)):
        lists = actions.actions if isinstance(actions, Schedule) else actions
        return [[list(enumerate(stage_actions))] for stage_actions in lists]
    calls: list[list[_Call]] = []
    for stage_actions, rounds in zip(actions.actions, assign_rounds(actions)):
        mine: list[_Call] = []
        for step, (action, round_) in enumerate(zip(stage_actions, rounds)):
            if len(mine) <= round_:
                mine.extend([] for _ in range(round_ + 1 - len(mine)))
            mine[round_].append((step, action))
        calls.append([call for call in mine if call])
    return calls


def _programs(calls: Sequence[Sequence[_Call]], layout: str, replicas: int, connect: str,
              posted_ahead: bool, devices: Sequence[int]) -> list[list[_Item]]:
    """Every rank's communication as the host issues it: sends, receives (with ``posted_ahead``, each call's first
    activation and gradient receive posted at the call's start and each next one when the previous was taken, as
    ``comm.ReceivesAhead`` does), the replicas' reductions, and under NCCL's rule the creation of each communicator
    (``connect``: ``"lazy"`` before a rank's first operation on it, ``"warm"`` all of them first, in the layout's
    order, as the runtime's setup does; ``"eager"``, gloo's groups, connected when created). Compute actions wait
    only for what the stream waits for, so they are left out. ``devices``: each stage's device; a message between
    two chunks of one device stays in the process and is left out too."""
    n = len(calls)
    num_stages = len(devices)
    virtual = num_stages != n  # devices holding several stages: links inside a device stay in the process
    comms: dict[tuple[str, int, int, int], Communicator] = {}
    members = {comm: tuple(replica_members)
               for comm, replica_members in rank_members(layout, num_stages, replicas, devices).items()}
    programs: list[list[_Item]] = []
    for replica in range(replicas):
        for stage, stage_calls in enumerate(calls):
            rank = replica * n + stage
            program: list[_Item] = []
            connected: set[Communicator] = set()

            def connect_item(comm: Communicator, step: int = -1) -> None:
                connected.add(comm)
                program.append((_Op(rank, ("connect", comm), ("connect", comm), False, members[comm], step),
                                _ISSUE_WAIT))

            if connect == "warm":
                for comm, ranks in members.items():
                    if rank in ranks:
                        connect_item(comm)

            def post(op: _Op, mode: int) -> None:
                if connect == "lazy" and op.comm not in connected and op.comm[0] == "p2p":
                    connect_item(op.comm, op.step)
                program.append((op, mode))

            updates: dict[int, int] = {}
            for call in stage_calls:
                ops: list[_Op | None] = []
                links: list[tuple[Any, ...] | None] = []  # a receive's link (channel, source, destination)
                for step, action in call:
                    message = message_key(action, num_stages) if action is not None else None
                    if message is None or virtual and devices[message[1]] == devices[message[2]]:
                        ops.append(None)
                        links.append(None)
                        continue
                    channel, src, dst, _ = message
                    if (channel, src, dst, replica) not in comms:
                        comms[(channel, src, dst, replica)] = communicator(layout, channel, src, dst, replica)
                    comm = comms[(channel, src, dst, replica)]
                    sends = action.kind in SEND_KINDS  # type: ignore[union-attr]
                    peer = devices[dst if sends else src]
                    ops.append(_Op(rank, comm, message, sends, (replica * n + peer,), step))
                    links.append(None if sends or channel == "T" else (channel, src, dst))
                # per link (one activation and one gradient link per stage; a device of chunks has several)
                ahead: dict[tuple[Any, ...], deque[_Op]] = {}
                if posted_ahead:
                    for op, link in zip(ops, links):
                        if link is not None:
                            ahead.setdefault(link, deque()).append(op)  # type: ignore[arg-type]
                    for first in ("F", "B"):  # posts never wait: their order among links decides nothing
                        for link, queue in ahead.items():
                            if link[0] == first:
                                post(queue[0], _ISSUE)
                for (step, action), op, link in zip(call, ops, links):
                    if op is not None:
                        posted = ahead.get(link) if link is not None else None
                        if posted and posted[0] is op:
                            program.append((op, _WAIT))
                            posted.popleft()
                            if posted:
                                post(posted[0], _ISSUE)
                        else:
                            post(op, _ISSUE if op.sends else _ISSUE_WAIT)
                    elif action is not None and action.kind is OPT and replicas > 1:
                        chunk = action.stage
                        updates[chunk] = updates.get(chunk, 0) + 1
                        group = tuple(r * n + stage for r in range(replicas))
                        program.append((_Op(rank, ("reduce", stage), ("reduce", chunk, updates[chunk]), False, group,
                                            step), _ISSUE_WAIT))
            programs.append(program)
    return programs


def check_deadlock_free(actions: Sequence[Sequence[Action | None]] | Schedule, *, layout: str = "directed",
                     replicas: int = 1, connect: str = "warm", posted_ahead: bool | None = None,
                     placement: Sequence[int] | None = None) -> None:
    """Run the lists under the strict deadlock model ([Note: deadlock model]) with ``layout``'s communicators and
    ``replicas`` data-parallel replicas; raise :class:`ScheduleError` naming the cycle if they can deadlock, or a
    communicator whose messages would be received in another order than they were sent (NCCL would pair them).

    ``connect`` says when a communicator's ranks first meet ([Note: communicator creation]): ``"warm"`` (the
    runtime: all of them at setup, in the layout's order), ``"lazy"`` (NCCL left to itself: at each rank's first
    operation on it) or ``"eager"`` (gloo: when the group is created). ``posted_ahead`` (default: what the runtime
    does, i.e. with the ``"directed"`` layout only) models the receives posted ahead of their actions, per call
    (a Schedule's rounds; a plain list set is one call). ``placement``: each stage's device, for plain lists of
    devices holding several stages ([Note: virtual stages]); a Schedule brings its own."""
    lists = actions.actions if isinstance(actions, Schedule) else actions
    if isinstance(actions, Schedule):
        placement = actions.devices
    devices = tuple(placement) if placement is not None else tuple(range(len(lists)))
    communicator(layout, "F", 0, 1)  # the layout's name is checked before any work
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"`replicas` must be an int >= 1, got {replicas!r}.")
    if connect not in CONNECTS:
        raise ValueError(f"`connect` must be one of {', '.join(map(repr, CONNECTS))}, got {connect!r}.")
    n = len(lists)
    ahead = layout == "directed" if posted_ahead is None else posted_ahead
    programs = _programs(_calls_of(actions, ahead), layout, replicas, connect, ahead, devices)
    position = [0] * len(programs)
    queues: dict[tuple[int, Communicator], deque[_Op]] = {}
    stream_waits: list[_Op | None] = [None] * len(programs)  # the operation a rank's host or stream waits for
    outstanding = [0] * len(programs)  # queued operations not completed yet
    runnable = deque(range(len(programs)))
    candidates: deque[tuple[int, Communicator]] = deque()

    def head(rank: int, comm: Communicator) -> _Op | None:
        queue = queues.get((rank, comm))
        return queue[0] if queue else None

    def complete(group: list[_Op]) -> None:
        for op in group:
            queues[(op.rank, op.comm)].popleft()
            outstanding[op.rank] -= 1
            op.done = True
            candidates.append((op.rank, op.comm))
            if stream_waits[op.rank] is op:
                stream_waits[op.rank] = None
                runnable.append(op.rank)

    while runnable or candidates:
        while runnable:
            rank = runnable.popleft()
            program = programs[rank]
            while stream_waits[rank] is None and position[rank] < len(program):
                op, mode = program[position[rank]]
                position[rank] += 1
                if mode == _WAIT:
                    if not op.done:
                        stream_waits[rank] = op
                    continue
                queue = queues.setdefault((rank, op.comm), deque())
                queue.append(op)
                outstanding[rank] += 1
                if len(queue) == 1:
                    candidates.append((rank, op.comm))
                if mode == _ISSUE_WAIT:
                    stream_waits[rank] = op
        while candidates:
            rank, comm = candidates.popleft()
            found = head(rank, comm)
            if found is None:
                continue
            op = found
            if op.collective:
                heads = [head(member, comm) for member in op.partners]
                if all(h is not None and h.key == op.key for h in heads):
                    complete(heads)  # type: ignore[arg-type]
                continue
            other = head(op.partners[0], comm)
            if other is None or other.rank != op.partners[0] or other.partners[0] != rank:
                continue  # the peer's queue is empty or its first operation involves a third rank
            if other.sends == op.sends:
                continue  # both send (or both receive): each waits for the other's next operation
            if other.key != op.key:
                stage = rank % n
                raise ScheduleError(
                    f"Stage {stage}, step {op.step}: on communicator {comm} stage {stage} has {op} first and stage "
                    f"{other.rank % n} has {other}: NCCL would pair them, the messages are in different orders.\n"
                    + format_grid(lists, error_stage=stage, error_step=op.step))
            complete([op, other])
    stuck = [r for r in range(len(programs)) if position[r] < len(programs[r]) or outstanding[r]]
    if stuck:
        lines = []
        for rank in stuck:
            waits = stream_waits[rank]
            replica, stage = divmod(rank, n)
            where = f"stage {stage}" + (f" (replica {replica})" if replicas > 1 else "")
            queued = [str(q[0]) for (r, _), q in queues.items() if r == rank and q]
            lines.append(f"{where} waits for {waits if waits is not None else 'its sends'}; first in its "
                         f"communicators: {', '.join(queued) or 'nothing'}")
        first = stuck[0]
        waits = stream_waits[first]
        step = waits.step if waits is not None and waits.step >= 0 else _first_step(lists[first % n])
        raise ScheduleError(
            f"Stage {first % n}, step {step}: deadlock under strict send-receive pairing with the {layout!r} "
            f"communicator layout and {connect!r} communicator creation ([Note: deadlock model]):\n  "
            + "\n  ".join(lines) + "\n" + format_grid(lists, error_stage=first % n, error_step=step))


def _first_step(actions: Sequence[Action | None]) -> int:
    return next((i for i, a in enumerate(actions) if a is not None), 0)
