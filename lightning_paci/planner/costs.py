"""What a plan is predicted from: each block's forward and backward time and the activation bytes a micro-batch
keeps alive, measured once on the unchanged model at two micro-batch sizes.

[Note: the plan's measurements]
One profiling pass runs the user's own training step on a sample micro-batch of ``size`` samples and on one of
about half as many, and records, per *region* (what runs before the first block, each block, what runs after the
last one):

* forward and backward seconds, from hooks on the blocks (the step's forward and ``loss.backward()`` are timed by
  the pass itself); a cost is fitted as ``fixed + per_sample * samples`` over the two sizes, so that a device's
  launch-bound small micro-batches (``fixed``) and its throughput-bound large ones (``per_sample``) are both seen --
  the trade-off behind the choice of micro-batches;
* the storages autograd saves for the backward (``saved_tensors_hooks``, parameters left out), each with its
  bytes, *all* of them per region (a tensor saved by several blocks -- a rotary table, a mask -- is listed in each),
  and the storages of each block's inputs and outputs. A stage holding blocks ``lo .. hi-1`` then keeps alive the
  union of its regions' storages, its received inputs and its outgoing outputs, each storage once: the rule the
  runtime's ``ActivationMeter`` counts by (engine/runtime/records.py), so the prediction is the meter's figure;
* the bytes of each block's parameters, and of the modules run before and after the blocks (the first and the last
  stage hold those).

The pass runs under ``without_side_effects`` (RNG and buffers restored) and leaves no hook behind.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.transport.messages import flatten

__all__ = ["Fit", "ModelCosts", "Region", "measure_costs"]


@dataclass(frozen=True)
class Fit:
    """``fixed + per_sample * samples`` (seconds or bytes)."""

    fixed: float
    per_sample: float

    def at(self, samples: float) -> float:
        return max(0.0, self.fixed + self.per_sample * samples)

    @staticmethod
    def through(points: Sequence[tuple[int, float]]) -> Fit:
        """The line through two measured ``(samples, value)`` points (one point: proportional to the samples)."""
        (s1, v1), (s2, v2) = points[0], points[-1]
        if s1 == s2:
            return Fit(0.0, v1 / s1)
        slope = max(0.0, (v1 - v2) / (s1 - s2))
        return Fit(max(0.0, v1 - slope * s1), slope)


@dataclass(frozen=True)
class Region:
    """One region's measurements at each profiled size: ``storages[k]`` maps a storage's id to its bytes (saved
    tensors; for a block also its inputs under ``inputs`` and outputs under ``outputs``)."""

    forward: Fit
    backward: Fit
    param_bytes: int
    storages: tuple[dict[int, int], ...]
    inputs: tuple[dict[int, int], ...]
    outputs: tuple[dict[int, int], ...]


@dataclass(frozen=True)
class ModelCosts:
    """The measurements a plan is predicted from ([Note: the plan's measurements]). ``regions[0]`` is what runs
    before the blocks, ``regions[1 .. n]`` the blocks, ``regions[-1]`` what runs after them; ``sizes`` the profiled
    micro-batch sizes (samples), largest first."""

    regions: tuple[Region, ...]
    sizes: tuple[int, ...]
    optimizer_factor: float  # optimizer state bytes per parameter byte (Adam: 2, SGD with momentum: 1, SGD: 0)

    @property
    def num_blocks(self) -> int:
        return len(self.regions) - 2

    def stage_time(self, lo: int, hi: int, samples: float, *, first: bool, last: bool,
                   recompute: bool = False) -> tuple[float, float]:
        """Forward and backward seconds of a stage holding blocks ``lo .. hi-1`` for one micro-batch of ``samples``
        (a recomputing stage runs its blocks' forwards again inside the backward)."""
        blocks = self.regions[1 + lo:1 + hi]
        forward = sum(r.forward.at(samples) for r in blocks)
        backward = sum(r.backward.at(samples) for r in blocks) + (forward if recompute else 0.0)
        for edge, region in ((first, self.regions[0]), (last, self.regions[-1])):
            if edge:
                forward += region.forward.at(samples)
                backward += region.backward.at(samples)
        return forward, backward

    def stage_param_bytes(self, lo: int, hi: int, *, first: bool, last: bool) -> int:
        return (sum(r.param_bytes for r in self.regions[1 + lo:1 + hi])
                + (self.regions[0].param_bytes if first else 0) + (self.regions[-1].param_bytes if last else 0))

    def activation_bytes(self, lo: int, hi: int, samples: float, *, first: bool, last: bool,
                         recompute: bool = False) -> float:
        """Bytes one micro-batch of ``samples`` keeps alive on a stage holding blocks ``lo .. hi-1``, from its
        forward to its backward: the union of its regions' saved storages, received inputs and outgoing outputs
        (a recomputing stage keeps each block's inputs instead of what the blocks save), fitted over the sizes."""
        points = []
        for k, size in enumerate(self.sizes):
            seen: dict[int, int] = dict(self.regions[0].storages[k]) if first else {}
            for region in self.regions[1 + lo:1 + hi]:
                seen.update(region.inputs[k] if recompute else region.storages[k])
            seen.update(self.regions[-1].storages[k] if last else self.regions[hi].outputs[k])
            if not first:
                seen.update(self.regions[1 + lo].inputs[k])
            points.append((size, float(sum(seen.values()))))
        return Fit.through(points).at(samples)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ModelCosts:
        def region(r: dict[str, Any]) -> Region:
            def keyed(maps: list[dict[Any, int]]) -> tuple[dict[int, int], ...]:
                return tuple({int(k): int(v) for k, v in m.items()} for m in maps)
            return Region(Fit(**r["forward"]), Fit(**r["backward"]), int(r["param_bytes"]), keyed(r["storages"]),
                          keyed(r["inputs"]), keyed(r["outputs"]))
        return ModelCosts(tuple(region(r) for r in data["regions"]), tuple(data["sizes"]),
                          float(data["optimizer_factor"]))


class _Recorder:
    """The hooks of one profiling run: which region runs, what it saves, and when each block starts and ends."""

    def __init__(self, blocks: Sequence[nn.Module], params: set[int], clock: Callable[[], float]) -> None:
        self.blocks, self.params, self.clock = blocks, params, clock
        n = len(blocks)
        self.region = 0
        self.saved: list[dict[int, int]] = [{} for _ in range(n + 2)]
        self.inputs: list[dict[int, int]] = [{} for _ in range(n)]
        self.outputs: list[dict[int, int]] = [{} for _ in range(n)]
        self.marks: dict[str, float] = {}
        self.keep: list[torch.Tensor] = []  # every recorded tensor, alive to the end: no storage id is reused
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _storages(self, structure: Any) -> dict[int, int]:
        out = {}
        for t in flatten(structure)[1]:
            self.keep.append(t)
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params:
                out[storage.data_ptr()] = storage.nbytes()
        return out

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            self.saved[self.region].update(self._storages(tensor))
        return tensor

    def install(self) -> list[Any]:
        handles = []
        for i, block in enumerate(self.blocks):
            def pre(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
                self.region = 1 + i
                self.inputs[i].update(self._storages((args, kwargs)))
                self.marks[f"f{i}"] = self.clock()

            def post(_m: Any, _args: Any, output: Any, i: int = i) -> None:
                self.outputs[i].update(self._storages(output))
                self.marks[f"F{i}"] = self.clock()
                if i == len(self.blocks) - 1:
                    self.region = len(self.blocks) + 1

            def bpre(*_: Any, i: int = i) -> None:
                self.marks[f"b{i}"] = self.clock()

            def bpost(*_: Any, i: int = i) -> None:
                self.marks[f"B{i}"] = self.clock()
            handles += [block.register_forward_pre_hook(pre, with_kwargs=True), block.register_forward_hook(post),
                        block.register_full_backward_pre_hook(bpre), block.register_full_backward_hook(bpost)]
        return handles


def _outside_param_bytes(module: nn.Module, blocks: Sequence[nn.Module], run: Callable[[], Any]) -> tuple[int, int]:
    """Bytes of the parameters the modules outside the blocks hold, used before the first block and after the last
    (a tied embedding and head: in both)."""
    inside = {id(m) for b in blocks for m in b.modules()}
    used: list[set[int]] = [set(), set()]
    phase = [0]  # 1 once the last block has run

    def seen(m: nn.Module, *_: Any) -> None:
        if id(m) not in inside:
            used[phase[0]].update(id(p) for p in m.parameters(recurse=False))
    handles = [m.register_forward_pre_hook(seen) for m in module.modules()]
    handles.append(blocks[-1].register_forward_hook(lambda *_: phase.__setitem__(0, 1)))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    sizes = {id(p): p.numel() * p.element_size() for p in module.parameters()}
    return sum(sizes.get(i, 0) for i in used[0]), sum(sizes.get(i, 0) for i in used[1])


def measure_costs(module: nn.Module, blocks: Sequence[nn.Module], steps: dict[int, Callable[[], torch.Tensor]], *,
                  optimizer_factor: float, repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
                  synchronize: Callable[[], None] = lambda: None) -> ModelCosts:
    """Profile ``blocks`` (in the step's order) with ``steps``: micro-batch size -> a function running the forward
    and returning the loss (the pass calls ``backward``). The median of ``repeats`` timed runs after a warm-up, per
    size. ``clock`` and ``synchronize`` (``torch.cuda.synchronize`` on a GPU) make the times what the device spends."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    n = len(blocks)
    sizes = sorted(steps, reverse=True)
    timed: dict[int, list[list[float]]] = {}
    recorded: dict[int, _Recorder] = {}
    for size in sizes:
        runs = []
        for attempt in range(repeats + 1):
            rec = _Recorder(blocks, params, clock)
            handles = rec.install()
            try:
                synchronize()
                start = clock()
                with rec.hooks:
                    loss = steps[size]()
                synchronize()
                forward_end = clock()
                with warnings.catch_warnings():  # block 0's input needs no gradient: its backward hook fires early,
                    # and its backward's time counts in the region before the blocks -- on stage 0, as block 0
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
                synchronize()
                end = clock()
            finally:
                for h in handles:
                    h.remove()
                rec.keep.clear()
                module.zero_grad(set_to_none=True)
            m = rec.marks
            if not all(f"{k}{i}" in m for k in "fFbB" for i in range(n)):
                raise RuntimeError("not every block ran a forward and a backward in the sample step")
            row = [m["f0"] - start, forward_end - m[f"F{n - 1}"], m[f"b{n - 1}"] - forward_end, end - m["B0"]]
            row += [m[f"F{i}"] - m[f"f{i}"] for i in range(n)] + [m[f"B{i}"] - m[f"b{i}"] for i in range(n)]
            if attempt:
                runs.append(row)
            recorded[size] = rec
        timed[size] = [[statistics.median(col) for col in zip(*runs)]]
    before, after = _outside_param_bytes(module, blocks, steps[sizes[0]])
    block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]

    def fit(index: int) -> Fit:
        return Fit.through([(s, timed[s][0][index]) for s in sizes])

    def region(k: int, forward: Fit, backward: Fit, param_bytes: int) -> Region:
        io = (k - 1) if 1 <= k <= n else None
        return Region(forward, backward, param_bytes, tuple(recorded[s].saved[k] for s in sizes),
                      tuple(recorded[s].inputs[io] if io is not None else {} for s in sizes),
                      tuple(recorded[s].outputs[io] if io is not None else {} for s in sizes))
    regions = [region(0, fit(0), fit(3), before)]
    regions += [region(1 + i, fit(4 + i), fit(4 + n + i), block_bytes[i]) for i in range(n)]
    regions.append(region(n + 1, fit(1), fit(2), after))
    return ModelCosts(tuple(regions), tuple(sizes), optimizer_factor)
