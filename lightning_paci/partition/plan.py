"""Which blocks and which outside modules each pipeline stage owns: the ``PartitionPlan``.

A plan is computed once, from the unchanged module, identically on every rank; carving (carve.py) then only
executes it. Besides the block boundaries it fixes the owners of everything outside the block container: modules
with parameters that run before it (an embedding) go to stage 0, those that run after it (final norm, LM head) to
the last stage, parameter-free ones run everywhere. A parameter registered under two names on two stages is
supported between stage 0 and the last stage only -- an embedding tied to an LM head, an encoder-decoder's shared
embedding -- and the plan records those pairs so that carving can give the last stage one replica (see
[Note: tied weights] in schedules.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from lightning_paci.partition.blocks import balanced_boundaries, find_block_container, num_params
from lightning_paci.partition.profile import BlockCosts, prefer_time_split

__all__ = ["CallTrace", "PartitionPlan", "PartitionSpec", "call_order", "plan_partition"]

PartitionSpec = Literal["balanced", "parameters", "uniform"] | Sequence[int]


@dataclass(frozen=True)
class PartitionPlan:
    """Which blocks and outside modules each stage owns. ``boundaries[s] .. boundaries[s+1]-1`` are stage ``s``'s
    blocks; ``before`` modules live on stage 0, ``after`` modules on the last stage (dotted names)."""

    container: str
    num_blocks: int
    boundaries: tuple[int, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]
    stage_params: tuple[int, ...] = field(default=())
    tied: tuple[tuple[str, str], ...] = ()  # (a name on stage 0, a name on the last stage) of each tied weight
    note: str = ""  # how the split was chosen (measured times), for the setup log line

    @property
    def num_stages(self) -> int:
        return len(self.boundaries) - 1

    def blocks(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def describe(self) -> str:
        parts = []
        for s in range(self.num_stages):
            blocks = self.blocks(s)
            extra = (" + " + ", ".join(self.before) if s == 0 and self.before else "") + (
                " + " + ", ".join(self.after) if s == self.num_stages - 1 and self.after else "")
            count = f", {self.stage_params[s]:,} params" if self.stage_params else ""
            parts.append(f"stage {s}: {self.container}[{blocks.start}:{blocks.stop}]{extra}{count}")
        tied = f"; tied {', '.join(f'{a} = {b}' for a, b in self.tied)} (owned by stage 0)" if self.tied else ""
        return "; ".join(parts) + tied + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class CallTrace:
    """The submodules of a module in the order of their first call in one step, and how often each was called."""

    order: tuple[str, ...]
    counts: dict[str, int]


def call_order(module: nn.Module, run_step: Callable[[], Any]) -> CallTrace:
    """Trace the calls of ``module``'s submodules while ``run_step`` runs (one step on a sample micro-batch); a
    module registered under two names is reported under its first."""
    counts: dict[str, int] = {}

    def hook(name: str) -> Callable[..., None]:
        def called(*_: Any) -> None:
            counts[name] = counts.get(name, 0) + 1
        return called

    handles = [sub.register_forward_pre_hook(hook(name)) for name, sub in module.named_modules() if name]
    try:
        run_step()
    finally:
        for handle in handles:
            handle.remove()
    return CallTrace(tuple(counts), counts)  # a dict keeps the order of first insertion: of first calls


def _outside_modules(root: nn.Module, container_path: str,
                     order: Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """[Note: outside modules go where they run]
    Parameterized modules outside the container, split into those that run before its first block (stage 0) and
    after its last (the last stage). ``order`` (``call_order`` of one step) decides: OPT registers
    ``decoder.final_layer_norm`` before ``decoder.layers`` and LitGPT ``lm_head`` before ``transformer``, yet both
    run after the last block. A module the step never calls, and every module when no step could be run (a model
    built on the meta device), is placed by registration order relative to the path to the container."""
    before: list[str] = []
    after: list[str] = []
    parts = container_path.split(".") if container_path else []
    called = {name: i for i, name in enumerate(order or ())}
    first_block = called.get(f"{container_path}.0" if container_path else "0")
    node, prefix = root, ""
    for part in parts:
        if any(True for _ in node.parameters(recurse=False)):
            raise ValueError(
                f"Module `{prefix or type(root).__name__}` on the path to the block container `{container_path}` "
                f"holds parameters directly ({', '.join(n for n, _ in node.named_parameters(recurse=False))}); "
                f"they cannot be assigned to one stage. Move them into a submodule (e.g. an nn.Embedding)."
            )
        seen_path = False
        for name, child in node.named_children():
            if name == part:
                seen_path = True
                continue
            if num_params(child) == 0:
                continue  # parameter-free modules (dropout, rotary tables) run on every stage
            full = f"{prefix}{name}"  # the first call of it or of anything inside it (a ModuleList is not called)
            position = min((i for n, i in called.items() if n == full or n.startswith(full + ".")), default=None)
            runs_after = seen_path if position is None or first_block is None else position > first_block
            (after if runs_after else before).append(f"{prefix}{name}")
        node = getattr(node, part)
        prefix = f"{prefix}{part}."
    return before, after


def plan_partition(
    module: nn.Module,
    num_stages: int,
    *,
    container: str | None = None,
    partition: PartitionSpec = "balanced",
    measured: BlockCosts | None = None,
    trace: CallTrace | None = None,
) -> PartitionPlan:
    """Plan the split of ``module`` into ``num_stages`` stages.

    ``partition``: ``"balanced"`` (default) minimises the largest stage's parameter count, counting the outside
    modules on the first and last stage; with ``measured`` block times it takes the time-balanced split instead
    when that lowers the slowest stage's time by at least ``TIME_BALANCE_MIN_GAIN`` and ``TIME_BALANCE_MIN_SECONDS``
    in every measured repetition (``prefer_time_split``). ``"parameters"`` always
    balances parameter counts; ``"uniform"`` gives equal block counts; a list gives the ``num_stages - 1`` block
    indices where stages 1..N-1 start. ``trace``: ``call_order`` of one step, which places the modules outside the
    container (see [Note: outside modules go where they run]) and refuses blocks run more than once per step.
    """
    path, blocks = find_block_container(module, container)
    num_blocks = len(blocks)
    if num_blocks < num_stages:
        raise ValueError(
            f"Cannot split `{path}` ({type(blocks).__name__} of {num_blocks} blocks) of {type(module).__name__} into "
            f"{num_stages} stages: every stage needs at least one block. Use at most {num_blocks} devices, or a model "
            f"with more blocks."
        )
    prefix = f"{path}." if path else ""  # a root nn.Sequential's blocks are "0", "1", ...
    repeated = {name: n for name, n in (trace.counts if trace else {}).items()
                if n > 1 and name.startswith(prefix) and name[len(prefix):].isdigit()}
    if repeated:
        name, times = next(iter(repeated.items()))
        raise ValueError(
            f"Block `{name}` of `{path}` runs {times} times in one step of {type(module).__name__} (a looped, "
            f"recurrent-depth or weight-shared model): pipeline stages run each block once per micro-batch, in the "
            f"container's order. Train it on one device or with data parallelism, or name a container whose blocks "
            f"run once each with `block_container=`.")
    before, after = _outside_modules(module, path, trace.order if trace else None)
    first_extra = sum(num_params(module.get_submodule(n)) for n in before)
    last_extra = sum(num_params(module.get_submodule(n)) for n in after)
    timing_note = ""
    if isinstance(partition, str):
        if partition == "uniform":
            bounds = [round(s * num_blocks / num_stages) for s in range(num_stages + 1)]
        elif partition in ("balanced", "parameters"):
            bounds = balanced_boundaries([float(num_params(b)) for b in blocks], float(first_extra),
                                         float(last_extra), num_stages)
            if partition == "balanced" and measured is not None:
                if len(measured.blocks) != num_blocks:
                    raise AssertionError("measured costs do not match the container")
                bounds, timing_note = prefer_time_split(bounds, measured, num_stages)
        else:
            raise ValueError(f"`partition` must be 'balanced', 'parameters', 'uniform' or a list of {num_stages - 1} "
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
    stage_params = []
    for s in range(num_stages):
        count = sum(num_params(blocks[i]) for i in range(bounds[s], bounds[s + 1]))
        count += first_extra if s == 0 else 0
        count += last_extra if s == num_stages - 1 else 0
        stage_params.append(count)
    empty = [s for s, c in enumerate(stage_params) if c == 0]
    if empty:
        raise ValueError(
            f"Stage(s) {empty} of the split {bounds} of `{path}` own no parameters (their blocks are parameter-free, "
            f"e.g. activations), so their optimizer would be empty. Use `partition='balanced'` or give explicit "
            f"split indices that put at least one parameterized block on every stage."
        )
    tied = _find_tied(module, path, bounds, before, after)
    if tied:  # a tied weight counts once, on stage 0
        names = dict(module.named_parameters(remove_duplicate=False))
        stage_params[-1] -= sum(names[first].numel() for first in dict(tied))
    return PartitionPlan(container=path, num_blocks=num_blocks, boundaries=tuple(bounds), before=tuple(before),
                         after=tuple(after), stage_params=tuple(stage_params), tied=tied, note=timing_note)


def _owner_stage(name: str, container: str, bounds: Sequence[int], before: Sequence[str],
                 after: Sequence[str]) -> int | None:
    num_stages = len(bounds) - 1
    if any(name == b or name.startswith(b + ".") for b in before):
        return 0
    if any(name == a or name.startswith(a + ".") for a in after):
        return num_stages - 1
    prefix = f"{container}." if container else ""
    if name.startswith(prefix):
        index = int(name[len(prefix):].split(".")[0])
        return next(s for s in range(num_stages) if bounds[s] <= index < bounds[s + 1])
    return None


def _find_tied(module: nn.Module, container: str, bounds: Sequence[int], before: Sequence[str],
               after: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Parameters registered under several names on different stages: (a name on stage 0, a name on the last stage)
    for every last-stage name. Supported: users on stage 0 and on the last stage only (an embedding tied to an LM
    head; an encoder-decoder's shared embedding used by both embeddings and the head); see [Note: tied weights] in
    schedules.py."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    num_stages = len(bounds) - 1
    tied: list[tuple[str, str]] = []
    for group in names.values():
        if len(group) < 2:
            continue
        owners = {n: _owner_stage(n, container, bounds, before, after) for n in group}
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
