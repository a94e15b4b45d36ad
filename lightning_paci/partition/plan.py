"""Which blocks and which outside modules each pipeline stage owns: the ``PartitionPlan``.

A plan is computed once, from the unchanged module, identically on every rank; carving (carve.py) then only
executes it. Besides the block boundaries (over every container's blocks in the order the step runs them, [Note:
several containers] in blocks.py) it fixes the owners of everything outside the containers: the stage running the
code where it is used ([Note: outside modules go where they run] in outside.py); parameter-free modules run
everywhere. A parameter registered under two names on two stages is supported between stage 0 and the last stage
-- an embedding tied to an LM head, an encoder-decoder's shared embedding -- and the plan records those pairs so
that carving can give the last stage one replica (see [Note: tied weights] in schedules.py). A module tied so
that would land on a stage between them (a decoder's input embedding tied to the encoder's, or to the LM head) is
given to stage 0, which makes its output after its own part of the step ([Note: late relays] in relay.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from lightning_paci.partition.blocks import (
    CallTrace,
    balanced_boundaries,
    call_order,
    find_block_containers,
    num_params,
)
from lightning_paci.partition.outside import OutsidePlacement, place_outside
from lightning_paci.partition.profile import BlockCosts, prefer_time_split

__all__ = ["TIMED_PARTITIONS", "CallTrace", "PartitionPlan", "PartitionSpec", "call_order", "plan_partition"]

PartitionSpec = Literal["parameters", "time", "balanced", "uniform"] | Sequence[int]
TIMED_PARTITIONS = ("time", "balanced")  # the splits measured on the machine ("balanced": the name in 0.3.0)


@dataclass(frozen=True)
class PartitionPlan:
    """Which blocks and outside modules each stage owns. ``block_names`` are every container's blocks in the order
    the step runs them; ``boundaries[s] .. boundaries[s+1]-1`` index stage ``s``'s. ``outside``: (name, owner stage)
    of the modules outside the containers; ``aliases``: (another name, its module's name in ``outside``);
    ``direct``: (name, owner stage) of the parameters held directly by a module on the path to a container."""

    containers: tuple[str, ...]
    block_names: tuple[str, ...]
    boundaries: tuple[int, ...]
    outside: tuple[tuple[str, int], ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    direct: tuple[tuple[str, int], ...] = ()
    stage_params: tuple[int, ...] = field(default=())
    tied: tuple[tuple[str, str], ...] = ()  # (a name on stage 0, a name on the last stage) of each tied weight
    note: str = ""  # how the split was chosen (measured times), for the setup log line

    @property
    def container(self) -> str:
        """The containers' dotted paths, for messages (one path for a model cut along one container)."""
        return " + ".join(self.containers)

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def before(self) -> tuple[str, ...]:
        """The outside modules stage 0 owns."""
        return tuple(name for name, owner in self.outside if owner == 0)

    @property
    def after(self) -> tuple[str, ...]:
        """The outside modules the last stage owns (and no other, for one stage)."""
        last = self.num_stages - 1
        return tuple(name for name, owner in self.outside if owner == last and last > 0)

    def blocks(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def block_modules(self, module: nn.Module, stage: int) -> list[nn.Module]:
        """Stage ``stage``'s block modules in ``module`` (a copy of the partitioned model)."""
        return [module.get_submodule(self.block_names[i]) for i in self.blocks(stage)]

    def block_stage(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if index < self.boundaries[s + 1])

    @property
    def cut(self) -> list[int]:
        """The block indices where stages 1..N-1 start: ``partition=`` pins this split."""
        return list(self.boundaries[1:-1])

    def describe(self) -> str:
        parts = []
        for s in range(self.num_stages):
            runs: dict[str, list[int]] = {}
            for i in self.blocks(s):
                path, _, index = self.block_names[i].rpartition(".")
                runs.setdefault(path, []).append(int(index))
            run = " + ".join(f"{path}[{idx[0]}:{idx[-1] + 1}]" for path, idx in runs.items())
            mine = [n for n, o in (*self.outside, *self.direct) if o == s]
            extra = (" + " + ", ".join(mine)) if mine else ""
            count = f", {self.stage_params[s]:,} params" if self.stage_params else ""
            parts.append(f"stage {s}: {run}{extra}{count}")
        tied = f"; tied {', '.join(f'{a} = {b}' for a, b in self.tied)} (owned by stage 0)" if self.tied else ""
        note = f" ({self.note})" if self.note else ""
        return "; ".join(parts) + tied + note + f"; split partition={self.cut}"  # (what pins it)


def plan_partition(
    module: nn.Module,
    num_stages: int,
    *,
    container: str | Sequence[str] | None = None,
    partition: PartitionSpec = "parameters",
    measured: BlockCosts | None = None,
    trace: CallTrace | None = None,
) -> PartitionPlan:
    """Plan the split of ``module`` into ``num_stages`` stages.

    ``partition``: ``"parameters"`` (default) minimises the largest stage's parameter count, counting each outside
    module on the stage that runs it: the same split on every machine. ``"time"`` (``"balanced"``, its name in
    0.3.0) does the same without ``measured`` block times; with them it takes the time-balanced split instead
    when that lowers the slowest stage's time by at least ``TIME_BALANCE_MIN_GAIN`` and ``TIME_BALANCE_MIN_SECONDS``
    in every measured repetition (``prefer_time_split``). ``"uniform"`` gives equal block counts; a list gives the
    ``num_stages - 1`` block indices where stages 1..N-1 start (over the blocks of every container, in the order
    the step runs them).
    ``trace``: ``call_order`` of one step, which finds the containers after the largest ([Note: several
    containers] in blocks.py), places the modules outside them (see [Note: outside modules go where they run] in
    outside.py) and refuses blocks run more than once per step.
    """
    found = find_block_containers(module, container, trace)
    paths = tuple(path for path, _ in found)
    names = tuple(f"{path}.{i}" if path else str(i) for path, c in found for i in range(len(c)))
    blocks = [module.get_submodule(name) for name in names]
    num_blocks = len(names)
    where = paths[0] if len(paths) == 1 else " + ".join(paths)
    if num_blocks < num_stages:
        kind = type(found[0][1]).__name__ if len(found) == 1 else "containers"
        raise ValueError(
            f"Cannot split `{where}` ({kind} of {num_blocks} blocks) of {type(module).__name__} into "
            f"{num_stages} stages: every stage needs at least one block. Use at most {num_blocks} devices, or a model "
            f"with more blocks."
        )
    repeated = {name: n for name, n in (trace.counts if trace else {}).items() if n > 1 and name in set(names)}
    if repeated:
        name, times = next(iter(repeated.items()))
        path = next(p for p in paths if name.startswith(f"{p}.") or not p)
        raise ValueError(
            f"Block `{name}` of `{path}` runs {times} times in one step of {type(module).__name__} (a looped, "
            f"recurrent-depth or weight-shared model): pipeline stages run each block once per micro-batch, in the "
            f"container's order. Train it on one device or with data parallelism, or name a container whose blocks "
            f"run once each with `block_container=`.")
    placement = place_outside(module, paths, names, trace)
    positions = dict(placement.modules)
    at_first = _tied_to_stage0(module, placement, num_blocks)
    sizes = {name: num_params(module.get_submodule(name)) for name in positions}
    named_params = dict(module.named_parameters(remove_duplicate=False))
    sizes.update({name: named_params[name].numel() for name, _ in placement.direct})
    first_extra, last_extra = 0.0, 0.0
    attached = [float(num_params(b)) for b in blocks]  # each block with what runs right after it
    for name, position in [*placement.modules, *placement.direct]:
        if position == 0 or name in at_first:
            first_extra += sizes[name]
        elif position == num_blocks:
            last_extra += sizes[name]
        else:
            attached[position - 1] += sizes[name]
    timing_note = ""
    if isinstance(partition, str):
        if partition == "uniform":
            bounds = [round(s * num_blocks / num_stages) for s in range(num_stages + 1)]
        elif partition in ("parameters", "time", "balanced"):
            bounds = balanced_boundaries(attached, first_extra, last_extra, num_stages)
            if partition in ("time", "balanced") and measured is not None:
                if len(measured.blocks) != num_blocks:
                    raise AssertionError("measured costs do not match the containers")
                bounds, timing_note = prefer_time_split(bounds, measured, num_stages)
        else:
            raise ValueError(f"`partition` must be 'parameters', 'time', 'uniform' or a list of {num_stages - 1} "
                             f"split indices, got {partition!r}.")
    else:
        splits = list(partition)
        bounds = [0, *splits, num_blocks]
        if len(splits) != num_stages - 1 or any(not isinstance(b, int) for b in splits) or any(
            bounds[i] >= bounds[i + 1] for i in range(num_stages)
        ):
            example = [round(s * num_blocks / num_stages) for s in range(1, num_stages)]
            raise ValueError(
                f"`partition={partition!r}` must list the {num_stages - 1} strictly increasing block indices where "
                f"stages 1..{num_stages - 1} start, each in 1..{num_blocks - 1} (e.g. {example})."
            )

    def owner(name: str, position: int) -> int:
        if position == 0 or name in at_first:
            return 0
        return next(s for s in range(num_stages) if position - 1 < bounds[s + 1])

    outside = tuple((name, owner(name, position)) for name, position in placement.modules)
    direct = tuple((name, owner(name, position)) for name, position in placement.direct)
    stage_params = [sum(num_params(blocks[i]) for i in range(bounds[s], bounds[s + 1])) for s in range(num_stages)]
    for name, stage in (*outside, *direct):
        stage_params[stage] += sizes[name]
    empty = [s for s, c in enumerate(stage_params) if c == 0]
    if empty:
        raise ValueError(
            f"Stage(s) {empty} of the split {bounds} of `{where}` own no parameters (their blocks are parameter-free, "
            f"e.g. activations), so their optimizer would be empty. Use `partition='parameters'` or give explicit "
            f"split indices that put at least one parameterized block on every stage."
        )
    plan = PartitionPlan(containers=paths, block_names=names, boundaries=tuple(bounds), outside=outside,
                         aliases=placement.aliases, direct=direct, note=timing_note)
    tied = _find_tied(module, plan)
    if tied:  # a tied weight counts once, on stage 0
        stage_params[-1] -= sum(named_params[first].numel() for first in dict(tied))
    return PartitionPlan(containers=paths, block_names=names, boundaries=tuple(bounds), outside=outside,
                         aliases=placement.aliases, direct=direct, stage_params=tuple(stage_params), tied=tied,
                         note=timing_note)


def _tied_to_stage0(module: nn.Module, placement: OutsidePlacement, num_blocks: int) -> set[str]:
    """Outside modules between the first and the last block whose parameters are also used under another name (a
    decoder's input embedding tied to the encoder's or to the LM head; a module's own aliases do not count): they
    go to stage 0, where the tie can hold (see the module docstring)."""
    aliases = tuple(f"{alias}." for alias, _ in placement.aliases)
    users = Counter(id(p) for name, p in module.named_parameters(remove_duplicate=False)
                    if not name.startswith(aliases))
    return {name for name, position in placement.modules if 0 < position < num_blocks
            and any(users[id(p)] > 1 for p in module.get_submodule(name).parameters())}


def owner_stage(plan: PartitionPlan, name: str) -> int | None:
    """The stage owning parameter or module ``name`` (a dotted name under the root), None if every stage runs it."""
    aliases = dict(plan.aliases)
    for alias, canonical in aliases.items():
        if name == alias or name.startswith(alias + "."):
            name = canonical + name[len(alias):]
    for module_name, stage in (*plan.outside, *plan.direct):
        if name == module_name or name.startswith(module_name + "."):
            return stage
    for index, block in enumerate(plan.block_names):
        if name == block or name.startswith(block + "."):
            return plan.block_stage(index)
    return None


def _find_tied(module: nn.Module, plan: PartitionPlan) -> tuple[tuple[str, str], ...]:
    """Parameters registered under several names on different stages: (a name on stage 0, a name on the last stage)
    for every last-stage name. Supported: users on stage 0 and on the last stage only (an embedding tied to an LM
    head; an encoder-decoder's shared embedding used by both embeddings and the head); see [Note: tied weights] in
    schedules.py."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    num_stages = plan.num_stages
    tied: list[tuple[str, str]] = []
    for group in names.values():
        if len(group) < 2:
            continue
        owners = {n: owner_stage(plan, n) for n in group}
        stages = set(owners.values())
        if len(stages) == 1:
            continue  # every user on one stage: nothing crosses a boundary
        first = [n for n, s in owners.items() if s == 0]
        last = [n for n, s in owners.items() if s == num_stages - 1]
        if first and last and len(first) + len(last) == len(group):
            tied.extend((first[0], name) for name in last)  # every name on the last stage shares one replica
            continue
        where = ", ".join(f"{n} (stage {s})" for n, s in owners.items())
        raise ValueError(
            f"Parameter {group[0]} is used under the names {where}: weights are tied only between the first and "
            f"the last stage (an embedding and an LM head, an encoder-decoder's shared embedding). Choose "
            f"`partition=` split indices that put every user on the first or the last stage, or untie it."
        )
    return tuple(tied)
