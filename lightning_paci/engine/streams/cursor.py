"""Which actions one stage runs in each Lightning call of a stream, without rebuilding the stream's schedule.

A *stream* is the run between two drains. Call ``k`` of a stream delivers mini-batch ``k``; the stage runs the
actions of round ``k`` (:func:`lightning_paci.schedules.assign_rounds`) of its list, and the drain after ``K``
calls runs the rest of the list built for exactly ``K`` mini-batches. Rebuilding all stages' lists for growing
horizons would stall every stage at once (0.7-1.0 s at call 127 of an 8-stage run, measured) and build the whole
stream again at each drain; instead a stage materialises only its own list, a round at a time, from one small
template per configuration.

[Note: periodic schedules]
Let ``P = a / gcd(a, m)`` and let ``sigma`` add ``P*m`` to every micro-batch index and ``P*m/a`` to every
tied-weight index (``OPT`` carries none). Three facts make a stream's list periodic:

1. Structure. After the warm-up, ``L[i + D] = sigma(L[i])`` on every stage. Compute orders repeat per
   micro-batch ("paci") or per mini-batch (flush schedules); the lowering is local; ``P*m`` backwards are a
   multiple of ``a``, so the ``OPT`` positions recur and ``P*m/a`` more updates (and tied exchanges) happen. Only
   the last stage's ``RECV_T`` positions depend on rounds, those of the untied lists (fact 2 for them).
2. Rounds. ``round(y) = max(round(pred y), y.microbatch // m if y is F, round(send) if y is a RECV)``, and
   ``sigma`` commutes with all three terms (it adds ``P`` rounds to the forward term). Say ``round(sigma x) =
   round(x) + P`` holds for every ``x`` of rounds ``first .. H-2-P``, and every receive of the last period
   ``H-1-P .. H-2`` waits for a send of round ``first`` or later. Then induction in ``assign_rounds``' order
   shows that the equality holds for every later action: rounds ``r >= H-1`` are ``sigma`` copies of rounds
   ``r - P``.
3. Stability. The rounds ``0 .. H-2`` of a list built for ``H`` mini-batches are those of any longer list
   (``assign_rounds``: the cool-down begins only in round ``H-1``).

``_steady_horizon`` checks both premises of fact 2 on the template (all stages; for tied lists also on the
untied ones). If a receive waits longer than the template covers (tied weights with ``N > m``), it makes the
template longer. If the lists do not repeat where they should, it looks further on, and it fails loudly rather
than guess. The cool-down of a list for ``K > H`` is the one of ``K' = K (mod P)``, ``H - P < K' <= H``, shifted
by ``(K - K') / P`` periods: the same argument applied to the end of the list. That shift is checked once per
residue, against ``K' - P``. A call then costs the size of its round, and a drain the size of the cool-down.
Templates are cached per process, so later streams build nothing. ``tests/test_cursor.py`` checks every answer
against full builds on a grid of schedules, shapes, offsets, tie settings and stages.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from lightning_paci.schedules import (
    RECV_KINDS,
    RECV_T,
    SEND_KINDS,
    SEND_T,
    Action,
    assign_rounds,
    build_schedule,
    message_key,
)

__all__ = ["StreamCursor"]

# name, devices, num_microbatches, accumulation, offset % a, tied, virtual stages, placement, whole batch
_Key = tuple[str, int, int, int, int, bool, int, str, bool]
_MAX_TRIES = 4  # how often the template may grow before the schedule is declared not periodic


def _steps(key: _Key) -> tuple[int, int, int]:
    """(P mini-batches per period, micro-batch shift, tied-weight index shift) of one period."""
    _, _, m, a, _, _, _, _, _ = key
    period = a // math.gcd(a, m)
    return period, period * m, period * m // a


def _shifted(actions: Sequence[Action], periods: int, mb_step: int, tied_step: int) -> list[Action]:
    """``sigma`` applied ``periods`` times: micro-batch indices ``+ periods * mb_step``, tied-weight indices
    ``+ periods * tied_step``; ``OPT`` has no index and stays as it is."""
    if periods == 0:
        return list(actions)
    new = tuple.__new__  # as in the builder: the lists of a long stream hold many actions
    dm, dt = periods * mb_step, periods * tied_step
    out: list[Action] = []
    for action in actions:
        stage, kind, index = action
        if index is None:  # OPT
            out.append(action)
        elif kind is SEND_T or kind is RECV_T:
            out.append(new(Action, (stage, kind, index + dt)))
        else:
            out.append(new(Action, (stage, kind, index + dm)))
    return out


def _starts(rounds: Sequence[int], count: int) -> tuple[int, ...]:
    """``starts[r]``: index of the first action of round ``r`` or later (rounds never decrease along a list)."""
    return tuple(bisect.bisect_left(rounds, r) for r in range(count))


@lru_cache(maxsize=4)
def _built(key: _Key, num_minibatches: int) -> tuple[tuple[tuple[Action, ...], ...], tuple[tuple[int, ...], ...]]:
    """All stages' lists and rounds for one horizon (a few templates per process; the stage slices are kept)."""
    name, n, m, a, offset, tied, v, placement, whole = key
    schedule = build_schedule(name, n, m, a, num_minibatches, backward_offset=offset, tied=tied, virtual_stages=v,
                              placement=placement, whole_batch=whole)
    return schedule.actions, assign_rounds(schedule)


def _periodic_lag(key: _Key, horizon: int, first: int) -> int:
    """Check that the lists built for ``horizon`` repeat on every stage over the stable rounds ``first .. H-2``
    (rounds ``r + P`` are ``sigma`` of rounds ``r``). Return how many rounds the receives of the last period wait
    for their sends at most, or -1 if the lists do not repeat there."""
    period, mb_step, tied_step = _steps(key)
    lists, rounds = _built(key, horizon)
    n = len(lists)
    num_stages = n * key[6]  # message keys name stages (chunks with virtual stages), the lists are devices'
    posted: dict[object, int] = {}
    for s in range(n):
        starts = _starts(rounds[s], horizon)
        for r in range(first + period, horizon - 1):
            earlier = lists[s][starts[r - period]:starts[r - period + 1]]
            if _shifted(earlier, 1, mb_step, tied_step) != list(lists[s][starts[r]:starts[r + 1]]):
                return -1
        for action, rnd in zip(lists[s], rounds[s]):
            if action.kind in SEND_KINDS:
                posted[message_key(action, num_stages)] = rnd
    lag = 0
    for s in range(n):
        for action, rnd in zip(lists[s], rounds[s]):
            if action.kind in RECV_KINDS and horizon - 1 - period <= rnd <= horizon - 2:
                lag = max(lag, rnd - posted[message_key(action, num_stages)])
    return lag


@lru_cache(maxsize=64)
def _steady_horizon(key: _Key) -> int:
    """The template's horizon ``H``: its stable rounds ``0 .. H-2`` hold two verified periods after the warm-up
    and cover the longest wait of a receive, so the induction in [Note: periodic schedules] applies to every
    later round. Starts at ``ceil(N/m) + 3P + 2`` (the warm-up is over by round ``ceil(N/m) + 1``)."""
    name, n, m, a, offset, tied, v, placement, whole = key
    period = _steps(key)[0]
    if tied and n > 1 and v == 1:
        # the last stage's RECV_T positions follow the untied lists' rounds: those must repeat too
        _steady_horizon((name, n, m, a, offset, False, v, placement, whole))
    first = math.ceil(n / m) + 1
    for _ in range(_MAX_TRIES):
        horizon = first + 3 * period + 1
        for _ in range(_MAX_TRIES):
            lag = _periodic_lag(key, horizon, first)
            if lag < 0 or first + period + 1 + lag <= horizon:
                break
            horizon = first + period + 1 + lag  # a receive waits for an older send than the template covers
        if 0 <= lag <= horizon - first - period - 1:
            return horizon
        first += math.ceil(n / m) + period  # the warm-up lasts longer: look further on
    raise AssertionError(f"schedule {key} does not repeat with period {period}; please report this configuration")


@dataclass(frozen=True)
class _StageTemplate:
    """One stage's stable rounds ``0 .. H-2`` of the template; later rounds are shifted copies of the last period."""

    actions: tuple[Action, ...]
    starts: tuple[int, ...]  # starts[r] for r = 0 .. H-1; starts[H-1] == len(actions)
    horizon: int
    period: int
    mb_step: int
    tied_step: int

    def _fold(self, r: int) -> tuple[int, int]:
        """(round in the last template period, periods to shift) for a round past the template."""
        q = (r - (self.horizon - 1 - self.period)) // self.period
        return r - q * self.period, q

    def start(self, r: int) -> int:
        """Index in the stream's list of the first action of round ``r`` or later."""
        if r <= self.horizon - 1:
            return self.starts[r]
        base, q = self._fold(r)
        return self.starts[base] + q * (self.starts[-1] - self.starts[-1 - self.period])

    def block(self, r: int) -> list[Action]:
        """The actions of round ``r``."""
        if r <= self.horizon - 2:
            return list(self.actions[self.starts[r]:self.starts[r + 1]])
        base, q = self._fold(r)
        return _shifted(self.actions[self.starts[base]:self.starts[base + 1]], q, self.mb_step, self.tied_step)

    def round_of(self, index: int) -> int:
        """Round of the action at ``index`` (the first later non-empty round if ``index`` starts empty rounds)."""
        last = self.horizon - 1
        if index < self.starts[last]:
            return bisect.bisect_right(self.starts, index) - 1
        length = self.starts[last] - self.starts[last - self.period]
        q = (index - self.starts[last - self.period]) // length
        return bisect.bisect_right(self.starts, index - q * length, last - self.period, last + 1) - 1 + q * self.period

    def take(self, lo: int, hi: int) -> list[Action]:
        """``list[lo:hi]`` of the stream's (unbounded) list."""
        out: list[Action] = []
        r = self.round_of(lo)
        while lo < hi:
            start, block = self.start(r), self.block(r)
            out.extend(block[lo - start:hi - start])
            lo, r = start + len(block), r + 1
        return out


@lru_cache(maxsize=64)
def _stage_template(key: _Key, stage: int) -> _StageTemplate:
    """One stage's slice of the checked template: all a cursor keeps between calls."""
    horizon = _steady_horizon(key)
    period, mb_step, tied_step = _steps(key)
    lists, rounds = _built(key, horizon)
    starts = _starts(rounds[stage], horizon)
    return _StageTemplate(lists[stage][:starts[-1]], starts, horizon, period, mb_step, tied_step)


@lru_cache(maxsize=64)
def _stage_tail(key: _Key, stage: int, num_minibatches: int) -> tuple[Action, ...]:
    """The cool-down of a list built for exactly ``K`` mini-batches: its actions of rounds ``K-1`` and later."""
    lists, rounds = _built(key, num_minibatches)
    return lists[stage][bisect.bisect_left(rounds[stage], num_minibatches - 1):]


class StreamCursor:
    """Which actions of its list one stage runs in each Lightning call of a *stream* (the run between two drains).

    ``segment(k)`` runs the actions of round ``k`` (:func:`lightning_paci.schedules.assign_rounds`) of the stream's
    list, whose rounds up to ``k`` are those of any list built for at least ``k + 2`` mini-batches; ``drain(K)``
    runs the rest of the list built for exactly ``K``. Only this stage's actions are materialised, a round at a
    time, from a small periodic template (see [Note: periodic schedules]): a call costs the size of its round and
    a drain the size of the cool-down, however long the stream.
    """

    def __init__(self, name: str, num_stages: int, num_microbatches: int, accumulation: int, stage: int,
                 *, backward_offset: int = 0, tied: bool = False, virtual_stages: int = 1,
                 placement: str = "loop", whole_batch: bool = False) -> None:
        self.args = (name, num_stages, num_microbatches, accumulation)
        self.stage = stage  # the device's list, with virtual stages (``num_stages``: the devices)
        self.backward_offset = backward_offset
        self.tied = tied
        self.virtual_stages, self.placement = virtual_stages, placement
        self.whole_batch = whole_batch  # [Note: whole-batch order]
        self.position = 0  # actions of the stream's list already handed out
        self._key: _Key | None = None
        self._stage_template: _StageTemplate | None = None  # fetched at the first call

    def _template(self) -> _StageTemplate:
        if self._stage_template is None:
            # the builder's own argument checks, with its messages, before anything is derived from the arguments
            build_schedule(*self.args, 1, backward_offset=self.backward_offset, tied=self.tied,
                           virtual_stages=self.virtual_stages, placement=self.placement,
                           whole_batch=self.whole_batch)
            name, n, m, a = self.args
            # only the offset mod a matters
            self._key = (name, n, m, a, self.backward_offset % a, bool(self.tied), self.virtual_stages,
                         self.placement, self.whole_batch)
            self._stage_template = _stage_template(self._key, self.stage)
        return self._stage_template

    def segment(self, call: int) -> list[Action]:
        """The actions from the current position up to the last one of round ``call``."""
        template = self._template()
        out: list[Action] = []
        position = self.position
        r = template.round_of(position)
        while r <= call:
            start, block = template.start(r), template.block(r)
            out.extend(block[position - start:])
            position, r = start + len(block), r + 1
        self.position = position
        return out

    def drain(self, num_minibatches: int) -> list[Action]:
        """The rest of the list built for exactly ``num_minibatches`` mini-batches (all of it if nothing ran)."""
        if num_minibatches == 0:
            return []
        if isinstance(num_minibatches, bool) or not isinstance(num_minibatches, int) or num_minibatches < 1:
            build_schedule(*self.args, num_minibatches, backward_offset=self.backward_offset, tied=self.tied,
                           virtual_stages=self.virtual_stages, placement=self.placement,
                           whole_batch=self.whole_batch)  # raises
        template = self._template()
        cut = template.start(num_minibatches - 1)  # where the cool-down starts: rounds 0..K-2 are the stream's
        if self.position > cut:  # a call past the cool-down's start ran already: build and compare
            return self._drain_rebuilt(template, num_minibatches)
        out = template.take(self.position, cut)
        tail = self._cool_down(template, num_minibatches)
        out += tail
        self.position = cut + len(tail)
        return out

    def _cool_down(self, template: _StageTemplate, num_minibatches: int) -> list[Action]:
        """Rounds ``K-1`` and later of the list for ``K``: built directly up to the template's horizon, beyond it
        shifted from the horizon ``K' = K (mod P)`` at most ``H`` (after checking the shift once at ``K' - P``)."""
        assert self._key is not None
        horizon, period = template.horizon, template.period
        if num_minibatches <= horizon:
            return list(_stage_tail(self._key, self.stage, num_minibatches))
        base = horizon - (horizon - num_minibatches) % period
        tail = _stage_tail(self._key, self.stage, base)
        earlier = _stage_tail(self._key, self.stage, base - period)
        if _shifted(earlier, 1, template.mb_step, template.tied_step) != list(tail):
            raise AssertionError(f"the cool-down of schedule {self._key} does not repeat with period {period}")
        return _shifted(tail, (num_minibatches - base) // period, template.mb_step, template.tied_step)

    def _drain_rebuilt(self, template: _StageTemplate, num_minibatches: int) -> list[Action]:
        """Drain after a call that ran part of round ``K-1`` or later: only correct if the list built for ``K``
        starts with what ran, which is checked against the full list (never the case in a strategy's stream)."""
        schedule = build_schedule(*self.args, num_minibatches, backward_offset=self.backward_offset, tied=self.tied,
                                  virtual_stages=self.virtual_stages, placement=self.placement,
                           whole_batch=self.whole_batch)
        own = schedule.actions[self.stage]
        if tuple(own[:self.position]) != tuple(template.take(0, self.position)):
            raise AssertionError("drained list does not extend the executed prefix")
        out = list(own[self.position:])
        self.position = len(own)
        return out
