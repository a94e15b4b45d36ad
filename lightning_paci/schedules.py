"""Pipeline schedules as data: one ordered action list per stage.

Every part of lightning_paci (the runtime, the one-process reference executor, the simulator, the monitors and the
timeline pictures) reads the lists built here, so there is exactly one definition of what a stage does and when.

A schedule is built in three pure passes (no torch, no torch.distributed):

1. compute order: forwards ``F`` and backwards ``B`` per stage (``_compute_order``),
2. an ``OPT`` after every ``accumulation``-th local backward, and
3. the point-to-point messages the compute order implies (2 and 3 in one sweep, ``_lower``).

[Note: PACI order]
``"paci"`` is one-forward-one-backward (1F1B) over the *whole stream* of micro-batches with no flush between
mini-batches. Stage ``s`` runs ``w = N - 1 - s`` warm-up forwards, then alternates ``F(w + i), B(i)``, so it holds at
most ``N - s`` micro-batches between their forward and backward, and backwards are processed in forward order
(FIFO). Between ``F(j)`` and ``B(j)`` stage ``s`` runs the ``w`` backwards ``B(j - w) .. B(j - 1)``, and an ``OPT``
follows every ``a``-th backward, so at most ``ceil(w / a)`` optimizer steps fall inside that window: the drift bound
``ceil((N - 1 - s) / a)``, reached exactly in a long run::

    stage 0 (N=3):  F0 F1 F2 B0 F3 B1 F4 B2 ...      <- 3 in flight
    stage 1:           F0 F1 B0 F2 B1 F3 B2 ...      <- 2 in flight
    stage 2:              F0 B0 F1 B1 F2 B2 ...      <- 1 in flight (forward, loss, backward back to back)

``"1f1b"`` is the same rule applied to each mini-batch separately (a flush at every mini-batch boundary: the
paper's synchronous baseline); ``"gpipe"`` runs all forwards of a mini-batch, then all its backwards.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "SCHEDULE_NAMES",
    "assign_rounds",
    "build",
    "message_key",
    "derived_drift_bound",
    "drift_bound",
    "format_grid",
    "inflight_profile",
    "parse_actions",
    "stage_lists_from_text",
    "static_drift",
    "validate",
]

ActionKind = Literal["F", "B", "OPT", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "SEND_T", "RECV_T"]
ScheduleName = Literal["paci", "1f1b", "gpipe"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)

F: ActionKind = "F"
B: ActionKind = "B"
OPT: ActionKind = "OPT"
SEND_F: ActionKind = "SEND_F"
RECV_F: ActionKind = "RECV_F"
SEND_B: ActionKind = "SEND_B"
RECV_B: ActionKind = "RECV_B"
SEND_T: ActionKind = "SEND_T"  # tied weights: stage 0 -> last stage after an update; tied grads: last -> stage 0
RECV_T: ActionKind = "RECV_T"
COMPUTE_KINDS: frozenset[str] = frozenset({F, B, OPT})
_CANONICAL_KIND: dict[str, ActionKind] = {k: k for k in (F, B, OPT, SEND_F, RECV_F, SEND_B, RECV_B, SEND_T, RECV_T)}
SEND_KINDS: frozenset[str] = frozenset({SEND_F, SEND_B, SEND_T})
RECV_KINDS: frozenset[str] = frozenset({RECV_F, RECV_B, RECV_T})

_TOKEN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SEND_T|RECV_T|OPT|F|B)(\d*)$")


class Action(NamedTuple):
    """One step of one stage. ``microbatch`` is the index in the stream (``None`` for ``OPT``).

    A ``NamedTuple`` (immutable, hashable, cheap): a 64-stage, 6400-micro-batch schedule holds ~1.7M of them.
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __str__(self) -> str:
        # "1F0", "0SEND_F2", "3OPT": the stage index first, as torch.distributed.pipelining writes its tokens.
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @classmethod
    def from_str(cls, token: str) -> Action:
        """Parse the text form written by ``str(action)``."""
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ValueError(
                f"Cannot parse action token {token!r}: expected <stage><kind><microbatch> such as '1F0', '0SEND_F2' "
                f"or '3OPT', with kind one of F, B, OPT, SEND_F, RECV_F, SEND_B, RECV_B, SEND_T, RECV_T."
            )
        stage, kind, number = match.groups()
        if kind == OPT and number:
            raise ValueError(f"Cannot parse action token {token!r}: OPT takes no micro-batch index (write '{stage}OPT').")
        if kind != OPT and not number:
            raise ValueError(f"Cannot parse action token {token!r}: {kind} needs a micro-batch index, e.g. '{stage}{kind}0'.")
        # canonical constant objects: the simulator compares kinds by identity
        return cls(int(stage), _CANONICAL_KIND[kind], int(number) if number else None)


def parse_actions(text: str) -> list[Action]:
    """Parse whitespace- or comma-separated tokens (the form :meth:`Schedule.stage_text` writes)."""
    return [Action.from_str(token) for token in re.split(r"[\s,]+", text.strip()) if token]


class ScheduleError(ValueError):
    """An action list that cannot run (bad order, unmatched message, deadlock). The message holds the grid."""


@dataclass(frozen=True)
class Schedule:
    """The action lists of all stages plus the arguments that built them.

    ``actions[s]`` is the ordered list that stage ``s`` executes as is. Micro-batch ``j`` belongs to mini-batch
    ``j // num_microbatches``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    accumulation: int
    num_minibatches: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)

    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.num_minibatches

    def compute_actions(self, stage: int) -> list[Action]:
        """The ``F``/``B``/``OPT`` actions of one stage, in order (what a timeline shows)."""
        return [action for action in self.actions[stage] if action.kind in COMPUTE_KINDS]

    def stage_text(self, stage: int, *, compute_only: bool = False) -> str:
        actions = self.compute_actions(stage) if compute_only else self.actions[stage]
        return " ".join(str(action) for action in actions)


MessageKey = tuple[str, int, int, "int | None"]  # (channel "F"/"B"/"T", source stage, destination stage, index)


def message_key(action: Action, num_stages: int) -> MessageKey | None:
    """The message a SEND or RECV action sends or waits for; ``None`` for compute actions.

    Tied-weight messages (``T``) run between stage 0 and the last stage only: stage 0 sends the tied weights after
    its update ``k`` and receives the last stage's tied-weight gradients of its window ``k``.
    """
    s, kind, index = action
    last = num_stages - 1
    if kind is SEND_F:
        return ("F", s, s + 1, index)
    if kind is RECV_F:
        return ("F", s - 1, s, index)
    if kind is SEND_B:
        return ("B", s, s - 1, index)
    if kind is RECV_B:
        return ("B", s + 1, s, index)
    if kind is SEND_T:
        return ("T", s, last if s == 0 else 0, index)
    if kind is RECV_T:
        return ("T", last if s == 0 else 0, s, index)
    return None


def _check_positive(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {value!r} of type {type(value).__name__}. {fix}")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {value}. {fix}")
    return value


def build(
    name: str,
    num_stages: int,
    num_microbatches: int,
    accumulation: int,
    num_minibatches: int,
    *,
    backward_offset: int = 0,
    tied: bool = False,
) -> Schedule:
    """Build the action list of every stage.

    Args:
        name: ``"paci"`` (asynchronous 1F1B, no flush), ``"1f1b"`` (1F1B with a flush per mini-batch) or ``"gpipe"``.
        num_stages: pipeline stages ``N``, one process each.
        num_microbatches: micro-batches ``m`` per mini-batch (any ``m >= 1``; ``m < N`` runs, it only fills less).
        accumulation: ``a``; every stage steps its optimizer after every ``a``-th local backward.
        num_minibatches: mini-batches in the stream (``K``); micro-batches are numbered ``0 .. K*m - 1``.
        backward_offset: backwards every stage already ran before this stream (after a drain), so that the
            ``OPT`` positions continue the count: an ``OPT`` follows backward number ``n`` when
            ``(backward_offset + n) % a == 0``.
        tied: the first and last stage share tied weights (an embedding and an LM head); see [Note: tied weights].

    Raises:
        ValueError / TypeError: naming the argument, its value and the fix.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"`schedule` must be one of {', '.join(map(repr, SCHEDULE_NAMES))}, got {name!r}.")
    _check_positive("num_stages", num_stages, "Use one stage per pipeline process, e.g. num_stages=4.")
    _check_positive("num_microbatches", num_microbatches, "Split each mini-batch into at least one micro-batch.")
    _check_positive("accumulation", accumulation, "Use accumulation=num_microbatches for one step per mini-batch.")
    _check_positive("num_minibatches", num_minibatches, "Run at least one mini-batch.")
    if isinstance(backward_offset, bool) or not isinstance(backward_offset, int) or backward_offset < 0:
        raise ValueError(f"`backward_offset` must be an int >= 0, got {backward_offset!r}.")

    lowered = [
        _lower(stage, num_stages, _compute_order(name, num_stages, stage, num_microbatches, num_minibatches),
               accumulation, backward_offset)
        for stage in range(num_stages)
    ]
    schedule = Schedule(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        accumulation=accumulation,
        num_minibatches=num_minibatches,
        actions=tuple(lowered),
    )
    if tied and num_stages > 1:
        schedule = _add_tied_exchange(schedule)
    return schedule


def _add_tied_exchange(schedule: Schedule) -> Schedule:
    """[Note: tied weights]
    A weight used on the first and the last stage (GPT-2's ``wte`` / ``lm_head``) is owned by stage 0, which
    applies update ``k`` with the gradient of *both* uses: before its ``k``-th ``OPT`` it receives the last stage's
    tied-weight gradient of that stage's ``k``-th window (``RECV_T``), after it sends the updated weights
    (``SEND_T``). The last stage keeps a replica that its own optimizer never steps: after its ``k``-th ``OPT`` it
    sends the replica's gradient, and it installs stage 0's weights ``k`` (``RECV_T``) right before its first
    action of the call after the one in which stage 0 sent them -- so the receive never waits for a later call
    and no flush or global collective is added. The replica therefore goes through exactly stage 0's sequence of
    weights, some updates late: under a flush schedule it is up to date before the next mini-batch's first forward
    (exact single-device semantics); under ``"paci"`` the last stage uses weights one or two updates old. The
    drain at the end of a stream installs every outstanding update, so both copies are equal afterwards.
    """
    n = schedule.num_stages
    last = n - 1
    rounds = assign_rounds(schedule)
    first, tail = list(schedule.actions[0]), list(schedule.actions[last])
    first_rounds, tail_rounds = rounds[0], rounds[last]
    new = tuple.__new__
    # stage 0: RECV_T(k) before its k-th OPT, SEND_T(k) after it; remember the round of each SEND_T
    out0: list[Action] = []
    sent_round: list[int] = []
    k = 0
    for action, rnd in zip(first, first_rounds):
        if action.kind is OPT:
            k += 1
            out0 += [new(Action, (0, RECV_T, k)), action, new(Action, (0, SEND_T, k))]
            sent_round.append(rnd)
        else:
            out0.append(action)
    # last stage: SEND_T(k) after its k-th OPT; RECV_T(k) before the first action of a round > sent_round[k]
    out_last: list[Action] = []
    pending = 0  # next weights update to install (0-based into sent_round)
    k = 0
    for action, rnd in zip(tail, tail_rounds):
        out_last.append(action)
        # right after the activation receive that opens a later round, before that forward runs
        while pending < len(sent_round) and rnd > sent_round[pending] and action.kind is RECV_F:
            pending += 1
            out_last.append(new(Action, (last, RECV_T, pending)))
        if action.kind is OPT:
            k += 1
            out_last.append(new(Action, (last, SEND_T, k)))
    while pending < len(sent_round):
        pending += 1
        out_last.append(new(Action, (last, RECV_T, pending)))
    lists = list(schedule.actions)
    lists[0], lists[last] = tuple(out0), tuple(out_last)
    return Schedule(schedule.name, n, schedule.num_microbatches, schedule.accumulation, schedule.num_minibatches,
                    tuple(lists))


def _one_f_one_b(stage: int, num_stages: int, first: int, count: int) -> list[tuple[ActionKind, int]]:
    """1F1B over micro-batches ``first .. first+count-1`` with warm-up ``N-1-s`` (capped by ``count``)."""
    warmup = min(num_stages - 1 - stage, count)
    order: list[tuple[ActionKind, int]] = [(F, first + i) for i in range(warmup)]
    for i in range(count - warmup):
        order.append((F, first + warmup + i))
        order.append((B, first + i))
    order.extend((B, first + i) for i in range(count - warmup, count))
    return order


def _compute_order(
    name: str, num_stages: int, stage: int, num_microbatches: int, num_minibatches: int
) -> list[tuple[ActionKind, int]]:
    if name == "paci":  # see [Note: PACI order]: one 1F1B over the whole stream, no flush
        return _one_f_one_b(stage, num_stages, 0, num_microbatches * num_minibatches)
    order: list[tuple[ActionKind, int]] = []
    for minibatch in range(num_minibatches):
        first = minibatch * num_microbatches
        if name == "1f1b":
            order += _one_f_one_b(stage, num_stages, first, num_microbatches)
        else:  # gpipe
            order += [(F, first + i) for i in range(num_microbatches)]
            order += [(B, first + i) for i in range(num_microbatches)]
    return order


def _lower(
    stage: int, num_stages: int, order: Iterable[tuple[ActionKind, int]], accumulation: int, backward_offset: int
) -> tuple[Action, ...]:
    """Passes 2 and 3 in one sweep: an ``OPT`` after every ``accumulation``-th backward (counting continues from
    ``backward_offset``) and the messages the compute order implies. A ``RECV`` goes right before the action that
    needs it; a ``SEND`` right after the action that produced it and before a following ``OPT``, so an optimizer
    step never delays a neighbour."""
    new = tuple.__new__  # about twice as fast as Action(...): large simulations build millions of actions
    has_prev, has_next = stage > 0, stage < num_stages - 1
    out: list[Action] = []
    append = out.append
    done = backward_offset
    for kind, microbatch in order:
        if kind is F:
            if has_prev:
                append(new(Action, (stage, RECV_F, microbatch)))
            append(new(Action, (stage, F, microbatch)))
            if has_next:
                append(new(Action, (stage, SEND_F, microbatch)))
        else:
            if has_next:
                append(new(Action, (stage, RECV_B, microbatch)))
            append(new(Action, (stage, B, microbatch)))
            if has_prev:
                append(new(Action, (stage, SEND_B, microbatch)))
            done += 1
            if done % accumulation == 0:
                append(new(Action, (stage, OPT, None)))
    return tuple(out)


# --------------------------------------------------------------------------------------------------------------
# Facts derived from the lists (never from the schedule's name)
# --------------------------------------------------------------------------------------------------------------


def drift_bound(num_stages: int, stage: int, accumulation: int) -> int:
    """PACI's per-stage bound on the version gap: ``ceil((N - 1 - s) / a)`` (see [Note: PACI order])."""
    return math.ceil((num_stages - 1 - stage) / accumulation)


def static_drift(actions: Sequence[Action]) -> dict[int, int]:
    """Version gap of every micro-batch on one stage: ``OPT`` actions between its ``F`` and its ``B``.

    A property of the list alone: the runtime executes the list as is, so the measured gaps must equal these.
    """
    version = 0
    at_forward: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for action in actions:
        if action.kind == F:
            at_forward[action.microbatch] = version  # type: ignore[index]
        elif action.kind == B:
            gaps[action.microbatch] = version - at_forward[action.microbatch]  # type: ignore[index]
        elif action.kind == OPT:
            version += 1
    return gaps


def inflight_profile(actions: Sequence[Action]) -> tuple[int, bool]:
    """(peak micro-batches held between F and B, whether any OPT runs while one is held)."""
    held = peak = 0
    step_while_held = False
    for action in actions:
        if action.kind == F:
            held += 1
            peak = max(peak, held)
        elif action.kind == B:
            held -= 1
        elif action.kind == OPT and held:
            step_while_held = True
    return peak, step_while_held


def derived_drift_bound(actions: Sequence[Action], accumulation: int) -> int:
    """An upper bound on the version gap read from the list: 0 if every OPT runs with nothing in flight, else
    ``ceil((peak - 1) / a)``: with FIFO backwards, at most ``peak - 1`` other backwards fall between a
    micro-batch's F and B. For "paci" this is exactly ``drift_bound``."""
    peak, step_while_held = inflight_profile(actions)
    return math.ceil((peak - 1) / accumulation) if step_while_held else 0


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------


def format_grid(
    actions: Sequence[Sequence[Action | None]],
    *,
    error_stage: int | None = None,
    error_step: int | None = None,
    window: int = 12,
) -> str:
    """Step x stage grid, one column per stage; the bad cell is marked ``<-- ERROR HERE``.

    Long schedules are cut to ``window`` steps either side of the error.
    """
    num_steps = max((len(stage_actions) for stage_actions in actions), default=0)
    lo, hi = 0, num_steps
    if error_step is not None:
        lo, hi = max(0, error_step - window), min(num_steps, error_step + window + 1)
    width = max([8] + [len(str(a)) for stage_actions in actions for a in stage_actions[lo:hi] if a is not None]) + 2
    lines = ["step  " + "".join(f"stage {s}".ljust(width) for s in range(len(actions)))]
    if lo > 0:
        lines.append("...")
    for step in range(lo, hi):
        cells = []
        for stage_actions in actions:
            action = stage_actions[step] if step < len(stage_actions) else None
            cells.append(("." if action is None else str(action)).ljust(width))
        marker = ""
        if step == error_step:
            marker = f"  <-- ERROR HERE (stage {error_stage})"
        lines.append(f"{step:<6}" + "".join(cells).rstrip() + marker)
    if hi < num_steps:
        lines.append("...")
    return "\n".join(lines)


def _fail(actions: Sequence[Sequence[Action | None]], stage: int, step: int, message: str) -> ScheduleError:
    grid = format_grid(actions, error_stage=stage, error_step=step)
    return ScheduleError(f"Stage {stage}, step {step}: {message}\n{grid}")


def validate(actions: Sequence[Sequence[Action | None]] | Schedule) -> None:
    """Reject impossible lists: backward before forward, a micro-batch run twice, an unmatched send or receive,
    and any circular wait (deadlock) under the runtime's semantics (sends never block, receives do).

    ``None`` entries are deliberate bubbles and are skipped. Raises :class:`ScheduleError` with the grid.
    """
    lists = actions.actions if isinstance(actions, Schedule) else actions
    num_stages = len(lists)
    last = num_stages - 1
    # 1. per-stage order rules
    for stage, stage_actions in enumerate(lists):
        forwards: set[int] = set()
        backwards: set[int] = set()
        received: set[tuple[str, int]] = set()
        for step, action in enumerate(stage_actions):
            if action is None:
                continue
            if action.stage != stage:
                raise _fail(lists, stage, step, f"action {action} names stage {action.stage} but sits in stage {stage}'s list.")
            kind, mb = action.kind, action.microbatch
            if kind == F:
                if mb in forwards:
                    raise _fail(lists, stage, step, f"forward of micro-batch {mb} runs twice.")
                if stage > 0 and (RECV_F, mb) not in received:
                    raise _fail(lists, stage, step, f"forward of micro-batch {mb} runs before its activation is received (RECV_F).")
                forwards.add(mb)  # type: ignore[arg-type]
            elif kind == B:
                if mb not in forwards:
                    raise _fail(lists, stage, step, f"backward of micro-batch {mb} runs before its forward.")
                if mb in backwards:
                    raise _fail(lists, stage, step, f"backward of micro-batch {mb} runs twice.")
                if stage < last and (RECV_B, mb) not in received:
                    raise _fail(lists, stage, step, f"backward of micro-batch {mb} runs before its gradient is received (RECV_B).")
                backwards.add(mb)  # type: ignore[arg-type]
            elif kind in (RECV_F, RECV_B):
                if (kind == RECV_F and stage == 0) or (kind == RECV_B and stage == last):
                    raise _fail(lists, stage, step, f"{kind} on stage {stage}: there is no neighbour to receive from.")
                received.add((kind, mb))  # type: ignore[arg-type]
            elif kind == SEND_F and (stage == last or mb not in forwards):
                raise _fail(lists, stage, step, f"SEND_F of micro-batch {mb} before its forward or from the last stage.")
            elif kind == SEND_B and (stage == 0 or mb not in backwards):
                raise _fail(lists, stage, step, f"SEND_B of micro-batch {mb} before its backward or from stage 0.")
            elif kind in (SEND_T, RECV_T) and (stage not in (0, last) or num_stages < 2):
                raise _fail(lists, stage, step, f"{kind} on stage {stage}: tied weights travel between stage 0 and the last stage only.")
    # 2. every message has exactly one partner
    sends: dict[MessageKey, tuple[int, int]] = {}
    recvs: dict[MessageKey, tuple[int, int]] = {}
    for stage, stage_actions in enumerate(lists):
        for step, action in enumerate(stage_actions):
            key = None if action is None else message_key(action, num_stages)
            if key is not None:
                (sends if action.kind in SEND_KINDS else recvs)[key] = (stage, step)  # type: ignore[union-attr]
    for key, (stage, step) in recvs.items():
        if key not in sends:
            raise _fail(lists, stage, step, f"receive of {key[0]} message {key[3]} has no matching send on stage {key[1]}.")
    for key, (stage, step) in sends.items():
        if key not in recvs:
            raise _fail(lists, stage, step, f"send of {key[0]} message {key[3]} has no matching receive on stage {key[2]}.")
    # 3. deadlock: run the lists with unbounded send buffers
    position = [0] * num_stages
    posted: set[MessageKey] = set()
    waiting: dict[MessageKey, int] = {}
    ready = deque(range(num_stages))
    while ready:
        stage = ready.popleft()
        stage_actions = lists[stage]
        while position[stage] < len(stage_actions):
            action = stage_actions[position[stage]]
            key = None if action is None else message_key(action, num_stages)
            if key is not None:
                if action.kind in RECV_KINDS:  # type: ignore[union-attr]
                    if key not in posted:
                        waiting[key] = stage
                        break
                else:
                    posted.add(key)
                    if key in waiting:
                        ready.append(waiting.pop(key))
            position[stage] += 1
    stuck = [s for s in range(num_stages) if position[s] < len(lists[s])]
    if stuck:
        cycle = ", ".join(f"stage {s} waits at {lists[s][position[s]]}" for s in stuck)
        raise _fail(lists, stuck[0], position[stuck[0]], f"deadlock: {cycle}.")


def stage_lists_from_text(rows: Mapping[int, str] | Iterable[str]) -> list[list[Action]]:
    """Build lists from text rows (one row per stage); handy for golden tests and hand-written schedules."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    table: dict[int, list[Action]] = defaultdict(list)
    for stage, text in items:
        table[stage] = parse_actions(text)
    return [table[s] for s in range(max(table) + 1)] if table else []


def assign_rounds(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """The Lightning call ("round") in which each action can run, for every stage.

    Round ``k`` is the training call that delivers mini-batch ``k``. An action's round is the smallest one that is
    at least its predecessor's on the same stage, at least ``microbatch // m`` for a forward (its data arrives
    then), and at least the round of the send it receives. Each stage executes, in call ``k``, exactly its actions
    of round ``k``: it never waits for data a later call brings, and free-runs otherwise (no flush per call).
    In a list built for ``K`` mini-batches the rounds ``0 .. K-2`` are those of any longer list (the cool-down
    only starts after the last forward, which is in round ``K-1``).
    """
    lists = schedule.actions
    m = schedule.num_microbatches
    n = schedule.num_stages
    rounds: list[list[int]] = [[] for _ in range(n)]
    current = [0] * n
    posted: dict[MessageKey, int] = {}
    waiting: dict[MessageKey, int] = {}
    ready = deque(range(n))
    while ready:
        s = ready.popleft()
        stage_actions, out = lists[s], rounds[s]
        while len(out) < len(stage_actions):
            action = stage_actions[len(out)]
            kind = action.kind
            if kind is F:
                current[s] = max(current[s], action.microbatch // m)  # type: ignore[operator]
            elif kind is not B and kind is not OPT:
                key = message_key(action, n)
                assert key is not None
                if kind in RECV_KINDS:
                    if key not in posted:
                        waiting[key] = s
                        break
                    current[s] = max(current[s], posted[key])
                else:
                    posted[key] = current[s]
                    if key in waiting:
                        ready.append(waiting.pop(key))
            out.append(current[s])
    if any(len(rounds[s]) < len(lists[s]) for s in range(n)):
        raise ScheduleError("cannot assign rounds: the schedule deadlocks; run validate() for the grid")
    return tuple(tuple(r) for r in rounds)
