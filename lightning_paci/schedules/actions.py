"""The vocabulary of schedules: action kinds, one ``Action``, its text form, a ``Schedule`` of per-stage lists, and
an ``Interval`` (an action placed in time).

Everything that reads or writes action lists (the builder, the validator, the runtime, the simulator, the
monitors) shares these types, so they live apart from any one algorithm over them. The message identity of a
send or receive (``message_key``) is here too: it is what pairs a ``SEND`` on one stage with a ``RECV`` on another,
and both the validator and the executors must agree on it. So is the step x stage grid (``format_grid``) that
every error about a list draws, the validator's, the deadlock model's and the simulator's alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from lightning_paci.errors import ScheduleError

__all__ = [
    "COMPUTE_KINDS",
    "OPT",
    "RECV_B",
    "RECV_F",
    "RECV_KINDS",
    "RECV_T",
    "SEND_B",
    "SEND_F",
    "SEND_KINDS",
    "SEND_T",
    "Action",
    "ActionKind",
    "B",
    "F",
    "Interval",
    "MessageKey",
    "Schedule",
    "ScheduleError",
    "format_grid",
    "message_key",
    "parse_actions",
]


class ActionKind(str, Enum):
    """What one action does. A ``str`` mixin, so a kind equals, hashes and prints like its bare value
    (``ActionKind.F == "F"``, ``f"{ActionKind.SEND_F}" == "SEND_F"``): text forms, JSON, dictionaries keyed by
    ``"F"`` and the timeline colours keep working. Every list built here holds the members themselves, so the hot
    loops (runtime, simulator, rounds) compare kinds by identity: ``action.kind is F``.

    ``str``/``format`` are pinned to the value because ``Enum`` changed both across Python versions (3.10 prints
    ``ActionKind.F``); ``StrEnum`` would need 3.11.
    """

    F = "F"
    B = "B"
    OPT = "OPT"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    SEND_T = "SEND_T"  # tied weights: stage 0 -> last stage after an update; tied grads: last -> stage 0
    RECV_T = "RECV_T"

    # the C-level str hash (cached in the object) instead of Enum's Python-level hash(self._name_): kinds are
    # looked up in frozensets for every action of every simulated stage
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


F = ActionKind.F
B = ActionKind.B
OPT = ActionKind.OPT
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
SEND_T = ActionKind.SEND_T
RECV_T = ActionKind.RECV_T
COMPUTE_KINDS: frozenset[ActionKind] = frozenset({F, B, OPT})
SEND_KINDS: frozenset[ActionKind] = frozenset({SEND_F, SEND_B, SEND_T})
RECV_KINDS: frozenset[ActionKind] = frozenset({RECV_F, RECV_B, RECV_T})

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
            raise ValueError(
                f"Cannot parse action token {token!r}: OPT takes no micro-batch index (write '{stage}OPT')."
            )
        if kind != OPT and not number:
            raise ValueError(
                f"Cannot parse action token {token!r}: {kind} needs a micro-batch index, e.g. '{stage}{kind}0'."
            )
        # the member itself, never the parsed string: the simulator and the runtime compare kinds by identity
        return cls(int(stage), ActionKind(kind), int(number) if number else None)


class Interval(NamedTuple):
    """An action placed in time: what one stage did (an action kind, ``F``, ``B``, ``OPT``, ...) or waited for
    (``WAIT_F``, ``WAIT_B``), from ``start`` to ``end`` -- seconds when a runtime measured it, cost units when the
    simulator predicted it. Records, the simulator and the pictures share it."""

    stage: int
    kind: str
    microbatch: int | None
    start: float
    end: float


def parse_actions(text: str) -> list[Action]:
    """Parse whitespace- or comma-separated tokens (the form :meth:`Schedule.stage_text` writes)."""
    return [Action.from_str(token) for token in re.split(r"[\s,]+", text.strip()) if token]


@dataclass(frozen=True)
class Schedule:
    """The action lists of all devices plus the arguments that built them.

    ``actions[d]`` is the ordered list that device ``d`` executes as is. With one stage per device (``placement``
    empty) device ``d`` runs stage ``d``; with virtual stages ([Note: virtual stages] in virtual.py) ``num_stages``
    counts the chunks in pipeline order, ``placement[s]`` is stage ``s``'s device, and every action names its chunk.
    Micro-batch ``j`` belongs to mini-batch ``j // num_microbatches``.
    """

    name: str
    num_stages: int
    num_microbatches: int
    accumulation: int
    num_minibatches: int
    actions: tuple[tuple[Action, ...], ...] = field(repr=False)
    placement: tuple[int, ...] = ()

    @property
    def total_microbatches(self) -> int:
        return self.num_microbatches * self.num_minibatches

    @property
    def num_devices(self) -> int:
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        """Stages per device (``v``)."""
        return self.num_stages // max(len(self.actions), 1)

    @property
    def devices(self) -> tuple[int, ...]:
        """The device of every stage (``placement``, or stage ``s`` on device ``s``)."""
        return self.placement or tuple(range(self.num_stages))

    def stage_actions(self, stage: int) -> list[Action]:
        """Stage ``stage``'s own actions, in its device's order (all of the device's list when it holds one stage)."""
        actions = self.actions[self.devices[stage]]
        return list(actions) if not self.placement else [a for a in actions if a.stage == stage]

    def compute_actions(self, device: int) -> list[Action]:
        """The ``F``/``B``/``OPT`` actions of one device's list, in order (what a timeline shows)."""
        return [action for action in self.actions[device] if action.kind in COMPUTE_KINDS]

    def stage_text(self, device: int, *, compute_only: bool = False) -> str:
        actions = self.compute_actions(device) if compute_only else self.actions[device]
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
