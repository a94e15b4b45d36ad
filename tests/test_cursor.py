"""StreamCursor: the periodic cursor hands out exactly what full builds of the stream give (no process group)."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest

from lightning_paci.engine.streams import cursor as cursor_module
from lightning_paci.engine.streams.cursor import StreamCursor
from lightning_paci.schedules import Action, assign_rounds, build_schedule

NAMES = ("paci", "1f1b", "gpipe")
STAGES = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 3, 4, 8)
ACCUMULATIONS = (1, 2, 3, 4, 5, 8, 16)
# The default sample (the whole grid runs with PACI_CURSOR_FULL_GRID=1, several minutes): every (N, m) pair once
# with one schedule and the accumulations spread over the pairs, plus shapes checked for all three schedules:
# N = 1, the slowest warm-up (N=8, m=1: tied receives wait 7 rounds), the longest periods (a=16 with odd m: P=16)
# and accumulations coprime to m. Every case runs all offsets {0, 1, a-1}, tied and untied, and every stage.
_PAIRS = [(n, m) for n in STAGES for m in MICROBATCHES]
_ROTATED = {(NAMES[i % 3], n, m, ACCUMULATIONS[i % len(ACCUMULATIONS)]) for i, (n, m) in enumerate(_PAIRS)}
CASES = sorted(
    (_ROTATED - {("gpipe", 8, 1, 16)})  # the slowest case (3 s): "paci" covers that shape
    | {(name, n, m, a) for name in NAMES for n, m, a in [(1, 2, 3), (3, 2, 3), (4, 3, 5), (8, 1, 2)]}
    | {("paci", 2, 3, 16), ("paci", 8, 1, 16), ("paci", 16, 2, 3), ("1f1b", 8, 3, 4), ("gpipe", 4, 4, 8)}
)
if os.environ.get("PACI_CURSOR_FULL_GRID"):
    CASES = [(name, n, m, a) for name in NAMES for n in STAGES for m in MICROBATCHES for a in ACCUMULATIONS]


def _period(m: int, a: int) -> int:
    return a // math.gcd(a, m)


def _offsets(a: int) -> list[int]:
    return sorted({0, 1 % a, a - 1})


def _check_streams(name: str, n: int, m: int, a: int, offset: int, tied: bool, lengths: list[int],
                   **layout: Any) -> None:
    """For every stage: segment(k) is round k of a long build, and segments 0..K-2 + drain(K) is build_schedule(K).
    ``layout``: ``virtual_stages`` and ``placement`` (then a "stage" is a device's list)."""
    longest = max(lengths)
    reference = build_schedule(name, n, m, a, longest + 2, backward_offset=offset, tied=tied, **layout)
    rounds = assign_rounds(reference)
    by_round: list[list[list[Action]]] = [[[] for _ in range(longest + 2)] for _ in range(n)]
    for stage in range(n):
        for action, rnd in zip(reference.actions[stage], rounds[stage]):
            by_round[stage][rnd].append(action)
    cursors = [StreamCursor(name, n, m, a, stage, backward_offset=offset, tied=tied, **layout) for stage in range(n)]
    ran: list[list[Action]] = [[] for _ in range(n)]
    for k in range(longest):  # all stages in step, as in a run (and the templates' caches are shared)
        if k + 1 in lengths:  # a drain after k + 1 calls: segments 0 .. k-1 ran
            exact = build_schedule(name, n, m, a, k + 1, backward_offset=offset, tied=tied, **layout).actions
            for stage, cursor in enumerate(cursors):
                drained = copy.copy(cursor)
                assert ran[stage] + drained.drain(k + 1) == list(exact[stage]), (offset, tied, stage, k + 1)
                assert drained.position == len(exact[stage])
        if k + 1 < longest:
            for stage, cursor in enumerate(cursors):
                segment = cursor.segment(k)
                assert segment == by_round[stage][k], (offset, tied, stage, k)
                ran[stage] += segment
                assert cursor.position == len(ran[stage])


@pytest.mark.parametrize("name,n,m,a", CASES)
def test_cursor_equals_full_builds(name, n, m, a):
    period = _period(m, a)
    for offset in _offsets(a):
        for tied in (False, True):
            # streams through the warm-up and a whole period after it (drains from exact builds), either side of
            # the template's horizon H, and every residue mod P past it (drains shifted from a template)
            horizon = cursor_module._steady_horizon((name, n, m, a, offset, tied, 1, "loop", False))
            lengths = set(range(1, math.ceil(n / m) + period + 4)) | set(range(horizon - 1, horizon + period + 2))
            _check_streams(name, n, m, a, offset, tied, sorted(lengths | {40}))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,m,a,tied", [(8, 8, 8, True), (4, 3, 5, True), (8, 1, 2, True), (3, 4, 16, False)])
def test_cursor_equals_full_builds_on_long_streams(name, n, m, a, tied):
    _check_streams(name, n, m, a, a - 1, tied, [1, 2, 64, 130])


@pytest.mark.parametrize(("name", "placement"), [("interleaved", "loop"), ("bfs", "loop"), ("paci", "loop"),
                                                 ("interleaved", "v"), ("bfs", "v"), ("paci", "v")])
@pytest.mark.parametrize(("n", "m", "a"), [(4, 4, 4), (2, 4, 3), (3, 6, 4)])
def test_cursor_equals_full_builds_over_virtual_stages(name, placement, n, m, a):
    """Each device's list of a virtual schedule ([Note: virtual stages]) in rounds and drains, as for one stage per
    device; tied weights where the placement allows them (one device holds the first and last chunk)."""
    for offset in _offsets(a):
        _check_streams(name, n, m, a, offset, placement == "v", [1, 2, 7, 20], virtual_stages=2,
                       placement=placement)


@pytest.mark.parametrize("name", ["paci", "1f1b", "gpipe"])
@pytest.mark.parametrize(("n", "m", "a", "tied"), [(2, 2, 2, False), (4, 4, 4, True), (3, 5, 2, False)])
def test_cursor_equals_full_builds_in_the_whole_batch_order(name, n, m, a, tied):
    """[Note: whole-batch order]: every warm-up longer by m - 1, in rounds and drains as the full builds."""
    for offset in _offsets(a):
        _check_streams(name, n, m, a, offset, tied, [1, 2, 3, 9, 20], whole_batch=True)


class _Rebuilding:
    """The cursor's definition, by brute force: every answer comes from full builds of the stream."""

    def __init__(self, name: str, n: int, m: int, a: int, stage: int, offset: int, tied: bool) -> None:
        self.args, self.stage, self.offset, self.tied, self.position = (name, n, m, a), stage, offset, tied, 0

    def _long(self, horizon: int) -> tuple[tuple[Action, ...], tuple[int, ...]]:
        schedule = build_schedule(*self.args, horizon, backward_offset=self.offset, tied=self.tied)
        return schedule.actions[self.stage], assign_rounds(schedule)[self.stage]

    def segment(self, call: int) -> list[Action]:
        actions, rounds = self._long(max(call + 2, 1))
        end = self.position
        while end < len(actions) and rounds[end] <= call:
            end += 1
        out, self.position = list(actions[self.position:end]), end
        return out

    def drain(self, k: int) -> list[Action]:
        if k == 0:
            return []
        actions = build_schedule(*self.args, k, backward_offset=self.offset, tied=self.tied).actions[self.stage]
        longest, _ = self._long(max(k, 8) + 2 + self.position)
        if tuple(actions[:self.position]) != tuple(longest[:self.position]):
            raise AssertionError("drained list does not extend the executed prefix")
        out, self.position = list(actions[self.position:]), len(actions)
        return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "calls",
    [
        [("drain", 5)],  # a drain without any call: the whole list
        [("drain", 0), ("segment", 0), ("drain", 0)],
        [("segment", 0), ("segment", 4), ("segment", 4), ("drain", 9)],  # skipped and repeated calls
        [("segment", 3), ("segment", 2), ("drain", 5)],  # a call number lower than the last one
        [("segment", 0), ("segment", 1), ("drain", 2)],  # a call past the cool-down's start: compared, then drained
        [("segment", 0), ("segment", 1), ("segment", 2), ("drain", 3), ("segment", 7)],
        [("segment", k) for k in range(12)] + [("drain", 13)],
    ],
)
def test_cursor_answers_like_full_builds_for_any_call_sequence(name, calls):
    for n, m, a, stage, offset, tied in [(4, 2, 3, 0, 1, True), (4, 2, 3, 3, 2, True), (3, 3, 2, 1, 0, False)]:
        cursor = StreamCursor(name, n, m, a, stage, backward_offset=offset, tied=tied)
        oracle = _Rebuilding(name, n, m, a, stage, offset, tied)
        for method, argument in calls:
            try:
                want = getattr(oracle, method)(argument)
            except AssertionError:
                with pytest.raises(AssertionError, match="does not extend"):
                    getattr(cursor, method)(argument)
                break
            assert getattr(cursor, method)(argument) == want, (n, m, a, stage, method, argument)
            assert cursor.position == oracle.position


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_stages": 0}, ValueError, "`num_stages` must be >= 1"),
        ({"accumulation": 0}, ValueError, "`accumulation` must be >= 1"),
        ({"num_microbatches": 2.5}, TypeError, "`num_microbatches` must be an int"),
        ({"name": "zb"}, ValueError, "`schedule` must be one of"),
        ({"backward_offset": -1}, ValueError, "`backward_offset` must be an int >= 0"),
    ],
)
def test_bad_arguments_raise_the_builders_errors_at_the_first_call(kwargs, error, match):
    args = {"name": "paci", "num_stages": 4, "num_microbatches": 4, "accumulation": 4, "stage": 0} | kwargs
    offset = args.pop("backward_offset", 0)
    cursor = StreamCursor(*args.values(), backward_offset=offset)  # nothing is checked before the first call
    with pytest.raises(error, match=match):
        cursor.segment(0)
    with pytest.raises(ValueError, match="`num_minibatches` must be >= 1"):
        StreamCursor("paci", 4, 4, 4, 0).drain(-1)


def _clear_caches() -> None:
    for cached in (cursor_module._built, cursor_module._steady_horizon, cursor_module._stage_template,
                   cursor_module._stage_tail):
        cached.cache_clear()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n,m,a", [(8, 8, 8), (8, 1, 16), (4, 3, 5)])
def test_work_per_call_is_bounded(monkeypatch, name, n, m, a):
    """Nothing is built after the first call of a 300-call stream, and the drain only builds small templates."""
    built: list[int] = []
    ranked: list[int] = []
    real_build, real_rounds = cursor_module.build_schedule, cursor_module.assign_rounds

    def counting_build(*args, **kwargs):
        built.append(args[4])
        return real_build(*args, **kwargs)

    def counting_rounds(schedule):
        ranked.append(schedule.num_minibatches)
        return real_rounds(schedule)

    monkeypatch.setattr(cursor_module, "build_schedule", counting_build)
    monkeypatch.setattr(cursor_module, "assign_rounds", counting_rounds)
    _clear_caches()
    try:
        stage = n // 2
        cursor = StreamCursor(name, n, m, a, stage, backward_offset=a - 1, tied=True)
        assert built == [] and ranked == []  # construction is free
        cursor.segment(0)
        after_first = (len(built), len(ranked))
        template = max(built)
        period = _period(m, a)
        assert template <= 3 * (math.ceil(n / m) + 3 * period + 2)  # a few periods, whatever the stream's length
        for k in range(1, 299):
            cursor.segment(k)
        assert (len(built), len(ranked)) == after_first  # no rebuild while the stream runs
        position = cursor.position
        rest = cursor.drain(300)
        assert max(built) <= template and max(ranked) <= template  # the cool-down comes from templates
        # and it is still exact: one full build with the real builder
        full = real_build(name, n, m, a, 300, backward_offset=a - 1, tied=True).actions[stage]
        assert rest == list(full[position:])
    finally:
        _clear_caches()  # start the other tests from empty caches, as a new process would
