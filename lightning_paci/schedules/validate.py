"""Validation of action lists: reject what cannot run, and show where, before any process starts.

Built schedules are valid by construction; this module exists for hand-written lists and for tests that pin the
builder down. A rejected list raises :class:`ScheduleError` whose message holds a step x stage grid with the bad
cell marked, because a deadlock or an unmatched message is far easier to read off the grid than off a traceback
on N processes.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence

from lightning_paci.schedules.actions import (
    RECV_B,
    RECV_F,
    RECV_KINDS,
    RECV_T,
    SEND_B,
    SEND_F,
    SEND_KINDS,
    SEND_T,
    Action,
    B,
    F,
    MessageKey,
    Schedule,
    ScheduleError,
    format_grid,
    message_key,
    parse_actions,
)
from lightning_paci.schedules.deadlock import check_deadlock_free

__all__ = ["stage_lists_from_text", "validate_schedule"]


def _fail(actions: Sequence[Sequence[Action | None]], stage: int, step: int, message: str) -> ScheduleError:
    grid = format_grid(actions, error_stage=stage, error_step=step)
    return ScheduleError(f"Stage {stage}, step {step}: {message}\n{grid}")


def validate_schedule(actions: Sequence[Sequence[Action | None]] | Schedule, *, communicators: str | None = None,
                      replicas: int = 1, placement: Sequence[int] | None = None) -> None:
    """Reject impossible lists: backward before forward, a micro-batch run twice, an unmatched send or receive,
    and any circular wait (deadlock) under the runtime's semantics (sends never block, receives do).

    ``communicators``: also run the lists under the strict model of NCCL ([Note: deadlock model]) with that
    communicator layout (``"directed"``, what the runtime uses, or ``"shared"``, one communicator per pair of
    neighbours for both directions) and ``replicas`` data-parallel replicas per stage, whose gradient all-reduce
    precedes every ``OPT``.

    ``placement``: the device of every stage when lists are devices' lists holding several stages each ([Note:
    virtual stages]); a Schedule brings its own. ``None`` entries are deliberate bubbles and are skipped. Raises
    :class:`ScheduleError` with the grid.
    """
    lists = actions.actions if isinstance(actions, Schedule) else actions
    if isinstance(actions, Schedule):
        placement = actions.devices
    devices = tuple(placement) if placement is not None else tuple(range(len(lists)))
    num_stages = len(devices)
    last = num_stages - 1
    # 1. per-stage order rules (per chunk: a device's list holds several stages' actions)
    forwards_of: dict[int, set[int]] = defaultdict(set)
    backwards_of: dict[int, set[int]] = defaultdict(set)
    received_of: dict[int, set[tuple[str, int]]] = defaultdict(set)
    for device, stage_actions in enumerate(lists):
        for step, action in enumerate(stage_actions):
            if action is None:
                continue
            stage = action.stage
            if not 0 <= stage < num_stages or devices[stage] != device:
                where = "no device" if not 0 <= stage < num_stages else f"device {devices[stage]}"
                raise _fail(lists, device, step,
                            f"action {action} names stage {stage} ({where}) but sits in "
                            f"{'stage' if placement is None else 'device'} {device}'s list.")
            forwards, backwards, received = forwards_of[stage], backwards_of[stage], received_of[stage]
            kind, mb = action.kind, action.microbatch
            if kind == F:
                if mb in forwards:
                    raise _fail(lists, device, step, f"forward of micro-batch {mb} runs twice.")
                if stage > 0 and (RECV_F, mb) not in received:
                    raise _fail(lists, device, step,
                                f"forward of micro-batch {mb} runs before its activation is received (RECV_F).")
                forwards.add(mb)  # type: ignore[arg-type]
            elif kind == B:
                if mb not in forwards:
                    raise _fail(lists, device, step, f"backward of micro-batch {mb} runs before its forward.")
                if mb in backwards:
                    raise _fail(lists, device, step, f"backward of micro-batch {mb} runs twice.")
                if stage < last and (RECV_B, mb) not in received:
                    raise _fail(lists, device, step,
                                f"backward of micro-batch {mb} runs before its gradient is received (RECV_B).")
                backwards.add(mb)
            elif kind in (RECV_F, RECV_B):
                if (kind == RECV_F and stage == 0) or (kind == RECV_B and stage == last):
                    raise _fail(lists, device, step,
                                f"{kind} on stage {stage}: there is no neighbour to receive from.")
                received.add((kind, mb))  # type: ignore[arg-type]
            elif kind == SEND_F and (stage == last or mb not in forwards):
                raise _fail(lists, device, step,
                            f"SEND_F of micro-batch {mb} before its forward or from the last stage.")
            elif kind == SEND_B and (stage == 0 or mb not in backwards):
                raise _fail(lists, device, step, f"SEND_B of micro-batch {mb} before its backward or from stage 0.")
            elif kind in (SEND_T, RECV_T) and (stage not in (0, last) or num_stages < 2):
                raise _fail(lists, device, step,
                            f"{kind} on stage {stage}: tied weights travel between stage 0 and the last stage only.")
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
            raise _fail(lists, stage, step,
                        f"receive of {key[0]} message {key[3]} has no matching send on stage {key[1]}.")
    for key, (stage, step) in sends.items():
        if key not in recvs:
            raise _fail(lists, stage, step,
                        f"send of {key[0]} message {key[3]} has no matching receive on stage {key[2]}.")
    # 3. deadlock: run the lists with unbounded send buffers
    position = [0] * len(lists)
    posted: set[MessageKey] = set()
    waiting: dict[MessageKey, int] = {}
    ready = deque(range(len(lists)))
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
    stuck = [s for s in range(len(lists)) if position[s] < len(lists[s])]
    if stuck:
        cycle = ", ".join(f"stage {s} waits at {lists[s][position[s]]}" for s in stuck)
        raise _fail(lists, stuck[0], position[stuck[0]], f"deadlock: {cycle}.")
    if communicators is not None:
        check_deadlock_free(actions, layout=communicators, replicas=replicas,
                            placement=None if isinstance(actions, Schedule) else placement)


def stage_lists_from_text(rows: Mapping[int, str] | Iterable[str]) -> list[list[Action]]:
    """Build lists from text rows (one row per stage); handy for golden tests and hand-written schedules."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    table: dict[int, list[Action]] = defaultdict(list)
    for stage, text in items:
        table[stage] = parse_actions(text)
    return [table[s] for s in range(max(table) + 1)] if table else []
