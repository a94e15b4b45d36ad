"""Virtual stages: where a pipeline's chunks sit on the devices, and in what order a device runs its chunks' work.

[Note: virtual stages]
With ``v`` virtual stages per device the block container is cut into ``S = v * P`` chunks in pipeline order, and
device ``d`` holds ``v`` of them (Lamy-Poirier, arXiv 2106.02679; Narayanan et al., Megatron's interleaved
schedule). An ``Action``'s ``stage`` is then the chunk's index in the pipeline (``0 .. S-1``), so every message
keeps its meaning (``SEND_F`` from chunk ``s`` goes to chunk ``s + 1``, wherever that sits) and a device's list
names, in every action, the chunk it runs. Two placements:

* ``"loop"``: chunk ``c`` on device ``c mod P``; a micro-batch loops through the devices ``v`` times, and the last
  device sends to the first (the wrap-around link)::

      P = 4, v = 2:  device 0: chunks 0, 4   device 1: 1, 5   device 2: 2, 6   device 3: 3, 7

* ``"v"``: a zig-zag, chunk ``c`` of round ``c // P`` on device ``c mod P`` in even rounds and ``P - 1 - c mod P``
  in odd ones; with ``v = 2`` device 0 holds the first and the last chunk (an embedding and a tied LM head on one
  device, no tied-weight exchange) and device ``P - 1`` two neighbours (their message never leaves the device)::

      P = 4, v = 2:  device 0: chunks 0, 7   device 1: 1, 6   device 2: 2, 5   device 3: 3, 4

A device's compute order (``device_orders``), for ``v > 1``:

* ``"bfs"`` (breadth-first, arXiv 2211.05953): per mini-batch, every micro-batch's forward through the device's first
  chunk, then through its second, ...; then the backwards, last chunk first. With ``"loop"`` and ``m >= P`` a
  flush schedule's bubble falls from ``(P-1)/(m+P-1)`` to ``(P-1)/(v*m+P-1)``.
* ``"interleaved"`` with ``"loop"``: Megatron's interleaved 1F1B. The device's work is a sequence of *units*:
  forward unit ``k`` runs micro-batch ``(k // (P*v)) * P + k % P`` through local chunk ``(k // P) mod v`` -- groups of
  ``P`` micro-batches per chunk, so a micro-batch is back from its loop when the device turns to the next chunk --
  and backward unit ``k`` the same micro-batch through local chunk ``v - 1 - (k // P) mod v``; ``2(P-1-d) + (v-1)P``
  forward units warm up, then one forward unit and one backward unit alternate. Same bubble as ``"bfs"``, with
  1F1B's memory. It needs ``m`` to be a multiple of ``P`` (whole groups).
* ``"paci"`` with ``"loop"``: the same units over the whole stream, no flush ([Note: PACI order]).
* ``"interleaved"`` and ``"paci"`` with ``"v"``: each chunk runs 1F1B over ``S`` stages (per mini-batch, or over
  the stream), and a device merges its chunks' lists by a list schedule on unit costs (forward 1, backward 2):
  the chunk whose next action can start earliest runs next, backwards first on ties. A pure function of the
  arguments, like every builder here; each chunk's own order is 1F1B's, so its drift is 1F1B's over ``S`` stages.

Chunk 0 holds more micro-batches in flight than stage 0 of a one-chunk pipeline: about ``2P`` under
``"interleaved"``/``"paci"`` with ``"loop"`` (its groups of ``P`` forwards run a loop ahead of their backwards),
``S`` under ``"v"``. The builder does not promise a bound; ``schedules.analysis.chunk_drift_bounds`` reads each
chunk's from the lists, and the docs quote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, get_args

from lightning_paci.schedules.actions import ActionKind, B, F

__all__ = ["PLACEMENTS", "Placement", "device_orders", "stage_devices"]

Placement = Literal["loop", "v"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)

Unit = tuple[int, ActionKind, int]  # (chunk's stage index, F or B, micro-batch)


def stage_devices(num_devices: int, virtual_stages: int, placement: str) -> tuple[int, ...]:
    """The device of every stage ``0 .. v*P - 1`` under ``placement`` ([Note: virtual stages])."""
    if placement not in PLACEMENTS:
        raise ValueError(f"`placement` must be one of {', '.join(map(repr, PLACEMENTS))}, got {placement!r}.")
    out = []
    for chunk in range(virtual_stages * num_devices):
        rnd, position = divmod(chunk, num_devices)
        out.append(position if placement == "loop" or rnd % 2 == 0 else num_devices - 1 - position)
    return tuple(out)


def device_orders(name: str, devices: Sequence[int], num_microbatches: int, num_minibatches: int,
                  one_f_one_b: Callable[[int, int, int, int], list[Unit]],
                  placement: str) -> list[list[Unit]]:
    """Every device's compute order for ``name`` in ``"bfs"``, ``"interleaved"``, ``"paci"`` over the stages placed
    on ``devices`` (``devices[s]``: stage ``s``'s device). ``one_f_one_b(stage, num_stages, first, count)`` is the
    builder's 1F1B of one stage."""
    num_devices = max(devices) + 1
    num_stages = len(devices)
    v = num_stages // num_devices
    m, total = num_microbatches, num_microbatches * num_minibatches
    mine = [[s for s in range(num_stages) if devices[s] == d] for d in range(num_devices)]
    if name == "bfs":
        orders: list[list[Unit]] = []
        for stages in mine:
            order: list[Unit] = []
            for minibatch in range(num_minibatches):
                batch = range(minibatch * m, (minibatch + 1) * m)
                order += [(s, F, mb) for s in stages for mb in batch]
                order += [(s, B, mb) for s in reversed(stages) for mb in batch]
            orders.append(order)
        return orders
    spans = [(0, total)] if name == "paci" else [(k * m, m) for k in range(num_minibatches)]
    if placement == "loop":
        return [[unit for first, count in spans for unit in _units(stages, d, num_devices, v, first, count)]
                for d, stages in enumerate(mine)]
    chunk_orders = [[unit for first, count in spans for unit in one_f_one_b(s, num_stages, first, count)]
                    for s in range(num_stages)]
    return _merged(chunk_orders, devices, num_devices)


def _units(stages: Sequence[int], device: int, num_devices: int, v: int, first: int, count: int) -> list[Unit]:
    """Megatron's interleaved order of one device over micro-batches ``first .. first+count-1`` (``count`` a multiple
    of ``P``; [Note: virtual stages])."""
    group = num_devices * v
    units = v * count

    def unit(k: int, kind: ActionKind) -> Unit:
        block, within = divmod(k, group)
        local = within // num_devices
        return (stages[local if kind is F else v - 1 - local], kind, first + block * num_devices + within % num_devices)

    warmup = min(2 * (num_devices - 1 - device) + (v - 1) * num_devices, units)
    order = [unit(k, F) for k in range(warmup)]
    for k in range(units - warmup):
        order += [unit(warmup + k, F), unit(k, B)]
    order += [unit(k, B) for k in range(units - warmup, units)]
    return order


def _merged(chunk_orders: Sequence[Sequence[Unit]], devices: Sequence[int], num_devices: int) -> list[list[Unit]]:
    """Merge each device's chunk orders by a list schedule on unit costs ([Note: virtual stages]). Each chunk keeps
    its own order, so the merge can only wait where the chunks' pipeline would: it never deadlocks."""
    num_stages = len(chunk_orders)
    position = [0] * num_stages
    finished: dict[Unit, int] = {}  # (stage, kind, micro-batch) -> when it ends
    clock = [0] * num_devices
    out: list[list[Unit]] = [[] for _ in range(num_devices)]
    left = sum(len(order) for order in chunk_orders)
    mine = [[s for s in range(num_stages) if devices[s] == d] for d in range(num_devices)]
    while left:
        best: tuple[tuple[int, int, int, int], int] | None = None
        for d in range(num_devices):
            for s in mine[d]:
                if position[s] == len(chunk_orders[s]):
                    continue
                _, kind, mb = chunk_orders[s][position[s]]
                if kind is F:
                    needs = (s - 1, F, mb) if s > 0 else None
                else:
                    needs = (s + 1, B, mb) if s < num_stages - 1 else (s, F, mb)
                ready = 0 if needs is None else finished.get(needs)
                if ready is None:
                    continue
                key = (max(ready, clock[d]), kind is F, -s if kind is B else s, d)
                if best is None or key < best[0]:
                    best = (key, s)
        if best is None:
            raise AssertionError("merging chunk orders stalled on orders whose pipeline is valid")
        (start, _, _, d), s = best
        unit = chunk_orders[s][position[s]]
        clock[d] = finished[unit] = start + (1 if unit[1] is F else 2)
        out[d].append(unit)
        position[s] += 1
        left -= 1
    return out
