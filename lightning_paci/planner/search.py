"""The search behind ``plan="auto"``: every plan of the space, predicted by the simulator from measured costs,
the fastest that fits the memory budget and the drift limit chosen.

[Note: the plan search]
A *plan* is the launch layout (stages x replicas, virtual stages and their placement) and what runs on it: the
micro-batches per batch ``m``, the cut points, which stages recompute (the first ``k``: they hold the most
micro-batches in flight) and, with replicas, how gradients are reduced (in buckets during the backward, blocking
at the step, or deferred). Each plan is predicted, never run:

* **time**: every stage's forward and backward for one micro-batch of ``B / m`` samples from the measured fits
  (costs.py; a recomputing stage's backward includes its blocks' forwards again), a message's ``link_latency_s``
  plus its bytes over ``link_bytes_per_s``, a reduction's gradient bytes over the same link, fed to
  ``simulate_schedule`` on the very action lists the runtime executes; the steady time per batch is the
  difference of two simulated streams' makespans (3 and 6 batches), so a pipeline fill is not charged to every
  batch under ``"paci"`` and is under the flush schedules;
* **memory** per process: parameters, their gradients and the optimizer's state (``optimizer_factor`` bytes per
  parameter byte), plus the simulated peak number of micro-batches in flight on that stage times the activation
  bytes one micro-batch of ``ceil(B / m)`` samples keeps there (costs.py, the rule the runtime's meter counts
  by; an uneven split's larger micro-batches come first and are in flight together). Allocator slack, kernels'
  workspaces and communication buffers are not in it: the budget is the model's memory, as MemoryMonitor reads it;
* **drift**: the largest drift bound the simulated lists give (``static_drift``; with deferred updates read as
  the runtime makes them, one forward later). Plans above ``max_drift`` (the default: what the default
  micro-batches give with updates not deferred, one update under ``"paci"``) are left out; among equally fast
  plans the one with less drift wins, then the one whose updates are not deferred.

The cut points of each (``m``, recompute) pair are not enumerated: ``_cuts`` finds, by dynamic programming over
contiguous block ranges, the cut whose slowest stage is fastest among those whose every stage fits the budget
(exact for one stage per process; with virtual stages the time-balanced cut, checked against the budget after).
Options the user fixed are single points of the space. The accumulation window is not searched: it sets how
many samples each update averages, which is the training recipe, not its speed (``accumulation`` follows ``m``,
one update per batch, unless given).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_paci.planner.costs import Fit, ModelCosts
from lightning_paci.schedules import build_schedule, chunk_drift_bounds
from lightning_paci.schedules.virtual import stage_devices
from lightning_paci.simulation import SimulationResult, simulate_schedule

__all__ = ["Layout", "Link", "Plan", "Space", "search_plans", "simulate_plan"]

REDUCE_MODES = ("buckets", "blocking", "deferred")
BUCKET_BYTES = 25 * 2**20  # the default `reduce_bucket_mb`


@dataclass(frozen=True)
class Layout:
    """How the launched processes are arranged: fixed once they run (process groups are made for it)."""

    stages: int  # P processes of one replica's pipeline
    replicas: int = 1
    virtual_stages: int = 1
    placement: str = "loop"

    def describe(self) -> str:
        text = f"{self.stages} stages x {self.replicas} replicas"
        return text + (f", {self.virtual_stages} virtual ({self.placement})" if self.virtual_stages > 1 else "")


@dataclass(frozen=True)
class Link:
    """What a message costs: ``latency_s`` plus its bytes at ``bytes_per_s`` (a reduction: its bytes at the same
    rate), and the host's cost per forward or backward action (the runtime's Python, outside the device's time: 1.1-1.7
    ms per micro-batch and stage measured on 2 shared CPU cores with gloo, benchmarks/RESULTS.md; on a GPU it
    overlaps kernels longer than itself)."""

    latency_s: float = 1e-4
    bytes_per_s: float = 10e9
    action_overhead_s: float = 6e-4


@dataclass(frozen=True)
class Space:
    """The space searched: every field left None is free; a value fixes it."""

    schedule: str
    batch_size: int
    layouts: tuple[Layout, ...]
    microbatches: int | None = None
    accumulation: int | None = None
    bounds: tuple[int, ...] | None = None  # cut points, stage starts 1..S-1 (fixed by `partition=[...]`)
    recompute_stages: int | None = None  # 0: none
    reduce: str | None = None
    memory_budget: float | None = None  # bytes per process
    max_drift: int | None = None  # None: what the default micro-batches give


@dataclass(frozen=True)
class Plan:
    """One predicted plan (see [Note: the plan search])."""

    layout: Layout
    microbatches: int
    accumulation: int
    bounds: tuple[int, ...]  # 0, starts of stages 1..S-1, number of blocks
    recompute_stages: int
    reduce: str
    samples_per_s: float
    memory: tuple[float, ...]  # bytes per process
    activations: tuple[float, ...]  # of which activations
    inflight: tuple[int, ...]
    drift: int
    fits: bool = field(default=True)

    @property
    def peak_memory(self) -> float:
        return max(self.memory)


class _Model:
    """Per-range figures of ``costs``, computed once and kept (the search asks for the same ranges many times)."""

    def __init__(self, costs: ModelCosts) -> None:
        self.costs = costs
        self._act: dict[tuple[int, int, bool, bool, bool], Fit] = {}

    def activations(self, lo: int, hi: int, first: bool, last: bool, recompute: bool, samples: float) -> float:
        key = (lo, hi, first, last, recompute)
        if key not in self._act:
            sizes = self.costs.sizes
            self._act[key] = Fit.through([(s, self.costs.activation_bytes(lo, hi, s, first=first, last=last,
                                                                          recompute=recompute)) for s in sizes])
        return self._act[key].at(samples)

    def memory(self, lo: int, hi: int, first: bool, last: bool, recompute: bool, samples: float,
               inflight: int) -> tuple[float, float]:
        """(total, activation) bytes of a stage holding blocks ``lo .. hi-1``."""
        params = self.costs.stage_param_bytes(lo, hi, first=first, last=last)
        act = inflight * self.activations(lo, hi, first, last, recompute, samples)
        return params * (2 + self.costs.optimizer_factor) + act, act


def _cuts(model: _Model, n: int, num_stages: int, samples: float, recompute: Sequence[bool],
          inflight: Sequence[int], budget: float | None) -> tuple[int, ...] | None:
    """The cut (``0, b1, .., n``) minimizing the slowest stage's F+B among those fitting ``budget`` on every stage
    (dynamic programming over contiguous ranges); None where none fits."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(num_stages):
        first, last = s == 0, s == num_stages - 1
        for hi in range(s + 1, n - (num_stages - 1 - s) + 1):
            for lo in range(s, hi):
                if best[s][lo] == inf:
                    continue
                if budget is not None and model.memory(lo, hi, first, last, recompute[s], math.ceil(samples),
                                                       inflight[s])[0] > budget:
                    continue
                f, b = model.costs.stage_time(lo, hi, samples, first=first, last=last, recompute=recompute[s])
                value = max(best[s][lo], f + b)
                if value < best[s + 1][hi]:
                    best[s + 1][hi], back[s + 1][hi] = value, lo
    if best[num_stages][n] == inf:
        return None
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(back[s][bounds[-1]])
    return tuple(reversed(bounds))


def _microbatch_choices(space: Space, layout: Layout) -> list[int]:
    if space.microbatches is not None:
        return [space.microbatches]
    p, b = layout.stages * layout.virtual_stages, space.batch_size
    picks = {1, 2, 4, p // 2, p, 3 * p // 2, 2 * p, 3 * p, 4 * p, 6 * p, 8 * p}
    return sorted(m for m in picks if 1 <= m <= b)


@dataclass(frozen=True)
class _Inputs:
    """What the simulator is given for one plan, and the memory it is predicted to take."""

    forward: list[float]
    backward: list[float]
    comm: float
    reduce_cost: float
    buckets: int
    memory: list[float]
    activations: list[float]


def _inputs(model: _Model, schedule: str, batch_size: int, layout: Layout, m: int, a: int, bounds: tuple[int, ...],
            k: int, reduce: str, link: Link, inflight: Sequence[int]) -> _Inputs:
    costs = model.costs
    chunks = layout.stages * layout.virtual_stages
    samples = batch_size / m
    devices = stage_devices(layout.stages, layout.virtual_stages, layout.placement)
    fwd, bwd, memory, act, grads = [], [], [0.0] * layout.stages, [0.0] * layout.stages, [0.0] * layout.stages
    for c in range(chunks):
        first, last, process = c == 0, c == chunks - 1, devices[c]
        recompute = process < k
        f, b = costs.stage_time(bounds[c], bounds[c + 1], samples, first=first, last=last, recompute=recompute)
        fwd.append(f + link.action_overhead_s)
        bwd.append(b + link.action_overhead_s)
        # the first micro-batches of an uneven split are the larger ones, and they are in flight together
        total, a_bytes = model.memory(bounds[c], bounds[c + 1], first, last, recompute, math.ceil(samples),
                                      inflight[process])
        memory[process] += total
        act[process] += a_bytes
        grads[process] += costs.stage_param_bytes(bounds[c], bounds[c + 1], first=first, last=last)
    # the largest activation message: the outputs of a chunk's last block (regions[j + 1] is block j)
    boundary = max((sum(costs.regions[bounds[c + 1]].outputs[0].values()) for c in range(chunks - 1)), default=0)
    comm = link.latency_s + boundary * samples / costs.sizes[0] / link.bytes_per_s
    reduce_cost = max(grads) / link.bytes_per_s if layout.replicas > 1 else 0.0
    buckets = max(1, math.ceil(max(grads) / BUCKET_BYTES)) if reduce in ("buckets", "deferred") else 0
    return _Inputs(fwd, bwd, comm, reduce_cost, buckets, memory, act)


def _simulate(schedule: str, plan_shape: tuple[Layout, int, int, str], inputs: _Inputs,
              batches: int) -> SimulationResult:
    layout, m, a, reduce = plan_shape
    built = build_schedule(schedule, layout.stages, m, a, batches, virtual_stages=layout.virtual_stages,
                           placement=layout.placement)
    return simulate_schedule(built, forward_cost=inputs.forward, backward_cost=inputs.backward,
                             comm_cost=inputs.comm, reduce_cost=inputs.reduce_cost,
                             reduce_buckets=inputs.buckets if inputs.reduce_cost else 0,
                             deferred=reduce == "deferred" and inputs.reduce_cost > 0)


def _predict(model: _Model, space: Space, layout: Layout, m: int, a: int, bounds: tuple[int, ...], k: int,
             reduce: str, link: Link, inflight: Sequence[int]) -> Plan:
    inputs = _inputs(model, space.schedule, space.batch_size, layout, m, a, bounds, k, reduce, link, inflight)
    shape = (layout, m, a, reduce)
    per_batch = (_simulate(space.schedule, shape, inputs, 6).makespan
                 - _simulate(space.schedule, shape, inputs, 3).makespan) / 3
    fits = space.memory_budget is None or max(inputs.memory) <= space.memory_budget
    samples = space.batch_size * layout.replicas  # each replica's loader gives its own batch
    return Plan(layout, m, a, bounds, k, reduce, samples / per_batch if per_batch > 0 else math.inf,
                tuple(inputs.memory), tuple(inputs.activations), tuple(inflight), 0, fits)


def simulate_plan(costs: ModelCosts, plan: Plan, schedule: str, batch_size: int, *, batches: int = 3,
                  link: Link = Link()) -> SimulationResult:
    """``plan`` on the simulator over ``batches`` batches: its timeline, for the picture of the chosen plan."""
    inputs = _inputs(_Model(costs), schedule, batch_size, plan.layout, plan.microbatches, plan.accumulation,
                     plan.bounds, plan.recompute_stages, plan.reduce, link, plan.inflight)
    return _simulate(schedule, (plan.layout, plan.microbatches, plan.accumulation, plan.reduce), inputs, batches)


def _shape(space: Space, layout: Layout, m: int, a: int) -> tuple[list[int], int, int]:
    """Peak micro-batches in flight per process, and the largest drift bound read off the lists, without and with
    deferred updates (a deferred update is made one forward later: [Note: deferred update])."""
    schedule = build_schedule(space.schedule, layout.stages, m, a, 4, virtual_stages=layout.virtual_stages,
                              placement=layout.placement)
    result = simulate_schedule(schedule)
    deferred = max(chunk_drift_bounds(schedule, deferred=True)) if space.schedule == "paci" else 0
    return [r.peak_inflight for r in result.stages], max(r.drift_bound for r in result.stages), deferred


def search_plans(costs: ModelCosts, space: Space, link: Link = Link()) -> list[Plan]:
    """Every plan of ``space``, fitting plans first, fastest first ([Note: the plan search])."""
    model = _Model(costs)
    n = costs.num_blocks
    plans: list[Plan] = []
    for layout in space.layouts:
        chunks = layout.stages * layout.virtual_stages
        if chunks > n or not _runs(space.schedule, layout):
            continue
        limit = space.max_drift
        if limit is None:
            p = layout.stages * layout.virtual_stages
            limit = _shape(space, layout, p, space.accumulation or p)[1]  # the default's, updates not deferred
        reduces = [space.reduce] if space.reduce is not None else (
            ["buckets"] if layout.replicas == 1 else
            [r for r in REDUCE_MODES if r != "deferred" or space.schedule == "paci"])
        ks = [space.recompute_stages] if space.recompute_stages is not None else list(range(layout.stages + 1))
        for m in _microbatch_choices(space, layout):
            a = space.accumulation or m
            inflight, exact_drift, deferred_drift = _shape(space, layout, m, a)
            if exact_drift > limit:
                continue
            samples = space.batch_size / m
            for k in ks:
                recompute = [d < k for d in stage_devices(layout.stages, layout.virtual_stages, layout.placement)]
                if space.bounds is not None:
                    bounds: tuple[int, ...] | None = (0, *space.bounds, n)
                elif layout.virtual_stages == 1:
                    bounds = _cuts(model, n, chunks, samples, recompute, inflight, space.memory_budget)
                    if bounds is None:  # nothing fits: the time-balanced cut, reported over the budget
                        bounds = _cuts(model, n, chunks, samples, recompute, inflight, None)
                else:
                    bounds = _cuts(model, n, chunks, samples, recompute, [1] * chunks, None)
                assert bounds is not None
                for reduce in reduces:
                    drift = deferred_drift if reduce == "deferred" else exact_drift
                    if drift > limit:  # a deferred update's micro-batches cross one more: above the bound
                        continue
                    plan = _predict(model, space, layout, m, a, bounds, k, reduce, link, inflight)
                    plans.append(replace(plan, drift=drift))
    # among equally fast plans the least drift, then updates made where the list puts them, then fewer recomputing
    # stages and micro-batches
    plans.sort(key=lambda p: (not p.fits, -p.samples_per_s, p.drift, p.reduce == "deferred", p.recompute_stages,
                              p.microbatches))
    return plans


def _runs(schedule: str, layout: Layout) -> bool:
    """Whether ``schedule`` runs on ``layout`` (the flush schedules of one stage per process do not take virtual
    stages)."""
    try:
        build_schedule(schedule, layout.stages, 1, 1, 1, virtual_stages=layout.virtual_stages,
                       placement=layout.placement)
    except ValueError:
        return False
    return True
