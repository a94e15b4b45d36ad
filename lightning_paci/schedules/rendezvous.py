"""The strict rendezvous model of NCCL messaging, the communicator layouts, and the check of lists against both.

[Note: rendezvous]
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
send, and each send waits for the other's receive. :func:`check_rendezvous` finds that cycle in the layout 0.1
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
remove that assumption -- not done, see the issue notes); the collectives outside the lists (``sync_dist``
reductions, LocalSGD's and the drains' averages and broadcasts) are issued by every replica of a stage at the same
points of identical lists, so they pair up as long as the replicas stay in lockstep (``nonfinite="skip"`` would
break that and is refused with replicas).

The simulation is exact for these rules (every rank's order is fixed, every operation has one partner, so whether
the run completes does not depend on which rank moves first) and linear in the number of actions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

from lightning_paci.schedules.actions import OPT, SEND_KINDS, Action, Schedule, ScheduleError, format_grid, message_key

__all__ = ["LAYOUTS", "Communicator", "check_rendezvous", "communicator", "layout_communicators"]

LAYOUTS = ("directed", "shared")

Communicator = tuple[Hashable, ...]


def communicator(layout: str, channel: str, src: int, dst: int, replica: int = 0) -> Communicator:
    """The communicator that carries a message of ``channel`` (``"F"`` activations, ``"B"`` gradients, ``"T"`` tied
    weights) from stage ``src`` to stage ``dst`` of one data-parallel replica. The runtime creates one process
    group per distinct value (``processes.py``), so what this returns is what the model checks."""
    if layout == "directed":
        return ("p2p", replica, channel, src, dst)
    if layout == "shared":  # 0.1: one communicator for activations and gradients, one for the tied weights
        return ("p2p", replica, "T" if channel == "T" else "FB")
    raise ValueError(f"`layout` must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")


def layout_communicators(layout: str, num_stages: int, replicas: int = 1) -> dict[Communicator, tuple[int, ...]]:
    """Every point-to-point communicator of ``layout`` with its members' (stage) indices, per replica, in one
    deterministic order: every rank creates the process groups in this order (``torch.distributed.new_group`` is
    collective over the world)."""
    found: dict[Communicator, tuple[int, ...]] = {}
    last = num_stages - 1
    for replica in range(replicas):
        links = [(c, s, d) for s in range(last) for c, s, d in (("F", s, s + 1), ("B", s + 1, s))]
        links += [("T", 0, last), ("T", last, 0)] if num_stages > 1 else []
        for channel, src, dst in links:
            members = tuple(sorted({src, dst})) if layout == "directed" else tuple(range(num_stages))
            found.setdefault(communicator(layout, channel, src, dst, replica), members)
    return found


class _Op:
    __slots__ = ("rank", "comm", "key", "sends", "partners", "step")

    def __init__(self, rank: int, comm: Communicator, key: Hashable, sends: bool, partners: tuple[int, ...],
                 step: int) -> None:
        self.rank, self.comm, self.key, self.sends, self.partners, self.step = rank, comm, key, sends, partners, step

    def __str__(self) -> str:
        if self.key[0] == "reduce":
            return f"the all-reduce before update {self.key[2]} of stage {self.key[1]}"
        channel, src, dst, index = self.key
        return f"{'SEND' if self.sends else 'RECV'}_{channel}{index} ({src}->{dst})"


def _ops_of(lists: Sequence[Sequence[Action | None]], layout: str, replicas: int) -> list[list[_Op]]:
    """Every rank's list as its communication operations, in order (compute actions wait only for what the
    stream waits for, so they are left out)."""
    n = len(lists)
    comms: dict[tuple[str, int, int, int], Communicator] = {}
    ranks: list[list[_Op]] = []
    for replica in range(replicas):
        for stage, actions in enumerate(lists):
            rank = replica * n + stage
            ops: list[_Op] = []
            updates = 0
            for step, action in enumerate(actions):
                if action is None:
                    continue
                key = message_key(action, n)
                if key is not None:
                    channel, src, dst, _ = key
                    comm = comms.get((channel, src, dst, replica))
                    if comm is None:
                        comm = comms[(channel, src, dst, replica)] = communicator(layout, channel, src, dst, replica)
                    sends = action.kind in SEND_KINDS
                    ops.append(_Op(rank, comm, key, sends, (replica * n + (dst if sends else src),), step))
                elif action.kind is OPT and replicas > 1:
                    updates += 1
                    members = tuple(r * n + stage for r in range(replicas))
                    ops.append(_Op(rank, ("reduce", stage), ("reduce", stage, updates), False, members, step))
            ranks.append(ops)
    return ranks


def check_rendezvous(actions: Sequence[Sequence[Action | None]] | Schedule, *, layout: str = "directed",
                     replicas: int = 1) -> None:
    """Run the lists under the strict rendezvous model ([Note: rendezvous]) with ``layout``'s communicators and
    ``replicas`` data-parallel replicas; raise :class:`ScheduleError` naming the cycle if they can deadlock, or a
    communicator whose messages would be received in another order than they were sent (NCCL would pair them)."""
    lists = actions.actions if isinstance(actions, Schedule) else actions
    communicator(layout, "F", 0, 1)  # the layout's name is checked before any work
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"`replicas` must be an int >= 1, got {replicas!r}.")
    n = len(lists)
    ops = _ops_of(lists, layout, replicas)
    position = [0] * len(ops)
    queues: dict[tuple[int, Communicator], deque[_Op]] = {}
    stream_waits: list[_Op | None] = [None] * len(ops)  # the receive or reduction a rank's stream waits for
    outstanding = [0] * len(ops)  # queued operations not completed yet
    runnable = deque(range(len(ops)))
    candidates: deque[tuple[int, Communicator]] = deque()

    def head(rank: int, comm: Communicator) -> _Op | None:
        queue = queues.get((rank, comm))
        return queue[0] if queue else None

    def complete(group: list[_Op]) -> None:
        for op in group:
            queues[(op.rank, op.comm)].popleft()
            outstanding[op.rank] -= 1
            candidates.append((op.rank, op.comm))
            if stream_waits[op.rank] is op:
                stream_waits[op.rank] = None
                runnable.append(op.rank)

    while runnable or candidates:
        while runnable:
            rank = runnable.popleft()
            mine = ops[rank]
            while stream_waits[rank] is None and position[rank] < len(mine):
                op = mine[position[rank]]
                position[rank] += 1
                queue = queues.setdefault((rank, op.comm), deque())
                queue.append(op)
                outstanding[rank] += 1
                if len(queue) == 1:
                    candidates.append((rank, op.comm))
                if not op.sends:
                    stream_waits[rank] = op
        while candidates:
            rank, comm = candidates.popleft()
            op = head(rank, comm)
            if op is None:
                continue
            if op.key[0] == "reduce":
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
    stuck = [r for r in range(len(ops)) if position[r] < len(ops[r]) or outstanding[r]]
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
        step = stream_waits[first].step if stream_waits[first] is not None else len(lists[first % n]) - 1
        raise ScheduleError(
            f"Stage {first % n}, step {step}: deadlock under strict rendezvous with the {layout!r} communicator "
            f"layout ([Note: rendezvous]):\n  " + "\n  ".join(lines) + "\n"
            + format_grid(lists, error_stage=first % n, error_step=step))
