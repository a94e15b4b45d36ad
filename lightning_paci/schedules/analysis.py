"""Facts derived from built action lists, never from a schedule's name: drift, in-flight depth, call rounds.

The monitors, the simulator and the strategy must agree with what the runtime will actually do, and the runtime
executes the lists as they are; so every figure here is read off the lists themselves. That also makes the
figures hold for hand-written lists, and it means a change to the builder cannot leave a stale formula behind.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from lightning_paci.schedules.actions import (
    OPT,
    RECV_KINDS,
    RECV_T,
    SEND_T,
    Action,
    B,
    F,
    MessageKey,
    Schedule,
    ScheduleError,
    message_key,
)

__all__ = ["DEFERRED_UPDATE_BEFORE", "activation_peaks", "assign_rounds", "chunk_drift_bounds", "derived_drift_bound",
           "drift_bound", "inflight_profile", "static_drift", "static_tied_lags"]


def drift_bound(num_stages: int, stage: int, accumulation: int) -> int:
    """PACI's per-stage bound on the version gap: ``ceil((N - 1 - s) / a)`` (see [Note: PACI order])."""
    return math.ceil((num_stages - 1 - stage) / accumulation)


def static_drift(actions: Sequence[Action], *, deferred: bool = False) -> dict[int, int]:
    """Version gap of every micro-batch on one stage: ``OPT`` actions between its ``F`` and its ``B``; with
    ``deferred``, each ``OPT``'s update counted where the runtime makes it then: at the next ``B``, ``OPT`` or
    tied-weight message ([Note: deferred update] in engine/runtime/updates.py).

    A property of the list alone: the runtime executes the list as is, so the measured gaps must equal these.
    """
    version = 0
    pending = False
    at_forward: dict[int, int] = {}
    gaps: dict[int, int] = {}
    for action in actions:
        if pending and action.kind in DEFERRED_UPDATE_BEFORE:
            version, pending = version + 1, False
        if action.kind == F:
            at_forward[action.microbatch] = version  # type: ignore[index]
        elif action.kind == B:
            gaps[action.microbatch] = version - at_forward[action.microbatch]  # type: ignore[index]
        elif action.kind == OPT:
            if deferred:
                pending = True
            else:
                version += 1
    return gaps


# the actions before which a deferred update is made, by the runtime and in this reading of the list
DEFERRED_UPDATE_BEFORE = frozenset({B, OPT, SEND_T, RECV_T})


def static_tied_lags(actions: Sequence[Action]) -> dict[int, int]:
    """On the last stage of a tied schedule: for every forward, how many tied-weight updates its replica was behind
    (the stage's ``OPT`` windows closed so far minus the updates ``RECV_T`` installed so far; see
    [Note: tied weights]). A property of the list alone: the runtime records exactly these."""
    steps = installed = 0
    lags: dict[int, int] = {}
    for action in actions:
        if action.kind == F:
            lags[action.microbatch] = steps - installed  # type: ignore[index]
        elif action.kind == OPT:
            steps += 1
        elif action.kind == RECV_T:
            installed += 1
    return lags


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


def derived_drift_bound(actions: Sequence[Action], accumulation: int, *, deferred: bool = False) -> int:
    """An upper bound on the version gap read from the list: 0 if every OPT runs with nothing in flight, else
    ``ceil((peak - 1) / a)``: with FIFO backwards, at most ``peak - 1`` other backwards fall between a
    micro-batch's F and B. For "paci" this is exactly ``drift_bound``. With ``deferred`` updates
    ([Note: deferred update]) the largest gap of ``static_drift(deferred=True)``."""
    if deferred:
        return max(static_drift(actions, deferred=True).values(), default=0)
    peak, step_while_held = inflight_profile(actions)
    return math.ceil((peak - 1) / accumulation) if step_while_held else 0


def chunk_drift_bounds(schedule: Schedule, *, deferred: bool = False) -> tuple[int, ...]:
    """The largest version gap of every stage (with virtual stages: every chunk, [Note: virtual stages]), read off
    its own actions in its device's order by ``static_drift``: what the runtime will measure, exactly. Under
    ``"paci"`` the gaps repeat once the warm-up is over, so a list of a few periods gives a stream's bound. (The
    peak-based ``derived_drift_bound`` assumes one backward between two forwards; a device that runs a group of
    one chunk's forwards in a row can stay below it.)"""
    return tuple(max(static_drift(schedule.stage_actions(s), deferred=deferred).values(), default=0)
                 for s in range(schedule.num_stages))


def activation_peaks(schedule: Schedule, stage_bytes: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per device, the most activations held at once between micro-batches' ``F`` and ``B``: each micro-batch in
    flight on stage ``s`` counts ``stage_bytes[s]`` (its chunk's activations per micro-batch, measured), by default
    ``1 / v`` -- one micro-batch through a whole device's share of the model, split evenly over its chunks. With
    one stage per device and the default it is ``inflight_profile``'s peak."""
    weights = list(stage_bytes) if stage_bytes is not None else [1 / schedule.virtual_stages] * schedule.num_stages
    peaks = []
    for actions in schedule.actions:
        held = peak = 0.0
        for action in actions:
            if action.kind is F:
                held += weights[action.stage]
                peak = max(peak, held)
            elif action.kind is B:
                held -= weights[action.stage]
        peaks.append(peak)
    return tuple(peaks)


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
    n = len(lists)
    stages = schedule.num_stages
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
                key = message_key(action, stages)
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
        raise ScheduleError("cannot assign rounds: the schedule deadlocks; run validate_schedule() for the grid")
    return tuple(tuple(r) for r in rounds)
