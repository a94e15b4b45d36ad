"""Partition an unchanged module into pipeline stages, in place, keeping every parameter's name.

[Note: stage boundaries are block inputs]
A model's ``forward`` is left as the user wrote it. Stage ``s`` owns the blocks ``start .. end-1`` of the repeated-
block container (an ``nn.Sequential``, or an ``nn.ModuleList`` that ``forward`` loops over); every other block is
replaced by a parameter-free ``_Placeholder`` so that the union of the stages' state dicts is the full state dict.
Two forward pre-hooks mark the boundaries:

* ingress (stage ``s > 0``, on block ``start``): replaces that block's ``(args, kwargs)`` by the ones received from
  stage ``s - 1``;
* egress (stage ``s < N - 1``, on the placeholder at block ``end``): captures the ``(args, kwargs)`` the next stage's
  first block would get and ends the forward by raising ``StageDone``.

What crosses a boundary is therefore exactly what the next block is called with: hidden states, attention masks,
rotary position embeddings, ``None`` caches, ints. Modules with parameters registered before the container (an
embedding) live on stage 0, those registered after it (final norm, LM head) on the last stage; parameter-free
modules stay everywhere. On other stages they are placeholders that pass their first argument through, which the
ingress hook then replaces::

    stage 0:  embed -> [b0 b1] -> (egress: capture args of b2, stop)
    stage 1:  (placeholder) -> [pass pass] -> (ingress: args of b2) b2 b3 -> norm -> head -> loss
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["BlockCosts", "PartitionPlan", "profile_block_costs", "stage_costs", "StageCarve", "StageDone", "carve_stage", "find_block_container", "plan_partition"]

PartitionSpec = Literal["balanced", "parameters", "uniform"] | Sequence[int]


class StageDone(BaseException):
    """Raised by the egress hook to end a non-last stage's forward inside the user's code.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """


class _Placeholder(nn.Module):
    """Parameter-free stand-in for a module another stage owns.

    It must return what the real module would return in *form* (structure, shapes, dtypes), or the user's code
    between it and this stage's first block may fail (an embedding's output dtype feeds mask construction, a block
    may return a tuple). It runs the original module on the meta device -- no compute, no memory -- and returns
    zeros of that form. A block whose output has the form of its first argument is learned once and passed through
    afterwards (its value is replaced at this stage's ingress anyway).
    """

    def __init__(self, owner: str, shadow: nn.Module | None = None, *, may_pass_through: bool = False) -> None:
        super().__init__()
        self.owner = owner
        # kept outside nn.Module registration: the shadow's meta parameters must not appear in state_dict()
        self.__dict__["_shadow"] = shadow
        self._may_pass_through = may_pass_through
        self._pass_through = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()), None)
        shadow = self.__dict__["_shadow"]
        if shadow is None or self._pass_through:
            return first
        from lightning_paci.comm import map_tensors

        device = next((t.device for t in _tensors((args, kwargs))), torch.device("cpu"))
        try:
            with torch.no_grad():
                out = shadow(*map_tensors(args, _to_meta), **map_tensors(kwargs, _to_meta))
        except Exception as err:  # an op without a meta kernel: fall back to passing the input through
            raise RuntimeError(
                f"Could not infer the output form of {type(shadow).__name__} (owned by {self.owner}) on the meta "
                f"device: {err}. Move the code that uses its output into a module on the same stage, or place the "
                f"module explicitly with `partition=`."
            ) from err
        if self._may_pass_through and isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor) and (
            out.shape == first.shape and out.dtype == first.dtype
        ):
            self._pass_through = True
            return first
        return map_tensors(out, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device))

    def extra_repr(self) -> str:
        return f"lives on {self.owner}"


def _to_meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("meta")


def _tensors(structure: Any) -> list[torch.Tensor]:
    from lightning_paci.comm import flatten

    return flatten(structure)[1]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_block_container(module: nn.Module, path: str | None = None) -> tuple[str, nn.Sequential | nn.ModuleList]:
    """The repeated-block container: ``path`` if given, else the ``nn.Sequential``/``nn.ModuleList`` with at least
    two children that holds the most parameters (the shallowest one on a tie)."""
    if path is not None:
        try:
            found = module.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"`block_container={path!r}` does not name a submodule of {type(module).__name__}: {err}. "
                f"Give the dotted attribute path of the nn.Sequential or nn.ModuleList holding the blocks, "
                f"e.g. 'model.transformer.h'."
            ) from None
        if not isinstance(found, (nn.Sequential, nn.ModuleList)):
            raise ValueError(
                f"`block_container={path!r}` is a {type(found).__name__}, not an nn.Sequential or nn.ModuleList. "
                f"Name the container whose children are the repeated blocks."
            )
        return path, found
    candidates = [
        (name, sub) for name, sub in module.named_modules()
        if isinstance(sub, (nn.Sequential, nn.ModuleList)) and len(sub) >= 2 and _num_params(sub) > 0
    ]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no repeated-block container: no nn.Sequential or nn.ModuleList with at "
            f"least two children and parameters. Pipeline stages are cut between blocks of such a container; hold "
            f"the blocks in one (e.g. `self.blocks = nn.ModuleList([...])` looped over in `forward`) and pass "
            f"`PACIStrategy(block_container='blocks')` if it is not found automatically."
        )
    best = max(_num_params(sub) for _, sub in candidates)
    name, container = min(((n, c) for n, c in candidates if _num_params(c) == best), key=lambda nc: nc[0].count("."))
    return name, container  # type: ignore[return-value]


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
    tied: tuple[tuple[str, str], ...] = ()  # (name on stage 0, name on the last stage) of each tied weight
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


def _outside_modules(root: nn.Module, container_path: str) -> tuple[list[str], list[str]]:
    """Parameterized modules outside the container, split by registration order relative to the path to it."""
    before: list[str] = []
    after: list[str] = []
    parts = container_path.split(".") if container_path else []
    node, prefix = root, ""
    for depth, part in enumerate(parts):
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
            if _num_params(child) == 0:
                continue  # parameter-free modules (dropout, rotary tables) run on every stage
            (after if seen_path else before).append(f"{prefix}{name}")
        node = getattr(node, part)
        prefix = f"{prefix}{part}."
        del depth
    return before, after


def _balanced_boundaries(costs: Sequence[float], first_extra: float, last_extra: float, num_stages: int) -> list[int]:
    """Contiguous split minimising the largest stage cost (stage 0 also pays ``first_extra``, the last stage
    ``last_extra``), every stage at least one block. Exact dynamic programme, O(N * L^2): L is tens of blocks."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max cost placing blocks [0, i) on stages [0, k); choice[k][i]: start of stage k-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0) + (last_extra if k == num_stages else 0.0)
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    bounds = [n]
    i = n
    for k in range(num_stages, 0, -1):
        i = choice[k][i]
        bounds.append(i)
    return bounds[::-1]


@dataclass(frozen=True)
class BlockCosts:
    """Measured forward+backward seconds of each block, and of what runs before (embedding) and after (head, loss).
    ``repeats`` keeps every measured repetition (the fields above are the median one)."""

    blocks: tuple[float, ...]
    before: float
    after: float
    repeats: tuple[BlockCosts, ...] = ()


def profile_block_costs(module: nn.Module, container: str | None, run_step: Callable[[], None],
                        *, repeats: int = 3) -> BlockCosts:
    """Time each block's forward and backward while ``run_step`` runs one full forward+backward of the unchanged
    module (on a sample micro-batch); the median over ``repeats`` runs after one warm-up."""
    _, blocks = find_block_container(module, container)
    n = len(blocks)
    marks: dict[str, float] = {}
    handles = []
    clock = time.perf_counter

    def mark(key: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            marks[key] = clock()
        return hook

    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(mark(f"f{i}")))
        handles.append(block.register_forward_hook(mark(f"F{i}")))
        handles.append(block.register_full_backward_pre_hook(mark(f"b{i}")))
        handles.append(block.register_full_backward_hook(mark(f"B{i}")))
    samples: list[tuple[list[float], float, float]] = []
    try:
        for attempt in range(repeats + 1):
            marks.clear()
            start = clock()
            run_step()
            end = clock()
            if not all(f"{k}{i}" in marks for k in "fFbB" for i in range(n)):
                raise RuntimeError("not every block ran a forward and a backward in the sample step")
            costs = [(marks[f"F{i}"] - marks[f"f{i}"]) + (marks[f"B{i}"] - marks[f"b{i}"]) for i in range(n)]
            # before: up to block 0's forward, and after block 0's backward; after: the rest
            before = (marks["f0"] - start) + (end - marks["B0"])
            after = (end - start) - before - sum(costs)
            if attempt:
                samples.append((costs, before, max(after, 0.0)))
    finally:
        for handle in handles:
            handle.remove()
    each = tuple(BlockCosts(tuple(c), b, a) for c, b, a in samples)
    mid = sorted(range(len(each)), key=lambda k: sum(each[k].blocks))[len(each) // 2]
    return BlockCosts(each[mid].blocks, each[mid].before, each[mid].after, repeats=each)


def stage_costs(bounds: Sequence[int], costs: BlockCosts) -> list[float]:
    """Per-stage cost of a split: its blocks, plus the outside parts on the first and last stage."""
    out = [sum(costs.blocks[bounds[s]:bounds[s + 1]]) for s in range(len(bounds) - 1)]
    out[0] += costs.before
    out[-1] += costs.after
    return out


# The measured-time split replaces the parameter-count split only when it is clearly better -- in every measured
# repetition, by at least 10% and 1 ms of the slowest stage's time -- so that timing noise cannot flip the partition
# between runs (the partition decides which blocks drift by how much under "paci").
TIME_BALANCE_MIN_GAIN = 0.10
TIME_BALANCE_MIN_SECONDS = 1e-3


def _canonical_time_split(sample: BlockCosts, num_stages: int, tolerance: float = 0.05) -> list[int]:
    """A time-balanced split that small timing noise does not move: the optimal slowest-stage time ``M`` from the
    exact programme, then stages filled greedily from the front up to ``M * (1 + tolerance)``."""
    optimal = _balanced_boundaries(list(sample.blocks), sample.before, sample.after, num_stages)
    limit = max(stage_costs(optimal, sample)) * (1 + tolerance)
    n = len(sample.blocks)
    bounds, i = [0], 0
    for stage in range(num_stages - 1):
        cost = sample.before if stage == 0 else 0.0
        j = i
        while j < n - (num_stages - 1 - stage) and (j == i or cost + sample.blocks[j] <= limit):
            cost += sample.blocks[j]
            j += 1
        bounds.append(j)
        i = j
    bounds.append(n)
    return bounds if max(stage_costs(bounds, sample)) <= limit else optimal


def _time_split_wins(by_params: list[int], measured: BlockCosts, num_stages: int) -> list[int] | None:
    """The time split of the median repetition, if it beats the parameter split in *every* repetition."""
    timed = _canonical_time_split(measured, num_stages)
    for sample in measured.repeats or (measured,):
        slow_params, slow_time = max(stage_costs(by_params, sample)), max(stage_costs(timed, sample))
        if slow_time > (1 - TIME_BALANCE_MIN_GAIN) * slow_params or slow_params - slow_time < TIME_BALANCE_MIN_SECONDS:
            return None
    return timed


def plan_partition(
    module: nn.Module,
    num_stages: int,
    *,
    container: str | None = None,
    partition: PartitionSpec = "balanced",
    measured: BlockCosts | None = None,
) -> PartitionPlan:
    """Plan the split of ``module`` into ``num_stages`` stages.

    ``partition``: ``"balanced"`` (default) minimises the largest stage's parameter count, counting the outside
    modules on the first and last stage; with ``measured`` block times it takes the time-balanced split instead
    when that lowers the slowest stage's time by at least ``TIME_BALANCE_MIN_GAIN``. ``"parameters"`` always
    balances parameter counts; ``"uniform"`` gives equal block counts; a list gives the ``num_stages - 1`` block
    indices where stages 1..N-1 start.
    """
    path, blocks = find_block_container(module, container)
    num_blocks = len(blocks)
    if num_blocks < num_stages:
        raise ValueError(
            f"Cannot split `{path}` ({type(blocks).__name__} of {num_blocks} blocks) of {type(module).__name__} into "
            f"{num_stages} stages: every stage needs at least one block. Use at most {num_blocks} devices, or a model "
            f"with more blocks."
        )
    before, after = _outside_modules(module, path)
    first_extra = sum(_num_params(module.get_submodule(n)) for n in before)
    last_extra = sum(_num_params(module.get_submodule(n)) for n in after)
    timing_note = ""
    if isinstance(partition, str):
        if partition == "uniform":
            bounds = [round(s * num_blocks / num_stages) for s in range(num_stages + 1)]
        elif partition in ("balanced", "parameters"):
            bounds = _balanced_boundaries([float(_num_params(b)) for b in blocks], float(first_extra),
                                          float(last_extra), num_stages)
            if partition == "balanced" and measured is not None:
                if len(measured.blocks) != num_blocks:
                    raise AssertionError("measured costs do not match the container")
                timed = _canonical_time_split(measured, num_stages)
                winner = _time_split_wins(bounds, measured, num_stages)
                by_params, by_time = stage_costs(bounds, measured), stage_costs(timed, measured)
                timing_note = (f"measured F+B ms per stage: by parameters {[round(1e3 * c, 1) for c in by_params]}, "
                               f"by time {[round(1e3 * c, 1) for c in by_time]} -> using "
                               f"{'time' if winner is not None else 'parameters'}")
                bounds = winner if winner is not None else bounds
        else:
            raise ValueError(f"`partition` must be 'balanced', 'parameters', 'uniform' or a list of {num_stages - 1} "
                             f"split indices, got {partition!r}.")
    else:
        splits = list(partition)
        bounds = [0, *splits, num_blocks]
        if len(splits) != num_stages - 1 or any(not isinstance(b, int) for b in splits) or any(
            bounds[i] >= bounds[i + 1] for i in range(num_stages)
        ):
            raise ValueError(
                f"`partition={partition!r}` must list the {num_stages - 1} strictly increasing block indices where "
                f"stages 1..{num_stages - 1} start, each in 1..{num_blocks - 1} (e.g. {[round(s * num_blocks / num_stages) for s in range(1, num_stages)]})."
            )
    stage_params = []
    for s in range(num_stages):
        count = sum(_num_params(blocks[i]) for i in range(bounds[s], bounds[s + 1]))
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
        stage_params[-1] -= sum(names[last].numel() for _, last in tied)
    return PartitionPlan(container=path, num_blocks=num_blocks, boundaries=tuple(bounds), before=tuple(before),
                         after=tuple(after), stage_params=tuple(stage_params), tied=tied, note=timing_note)


def _owner_stage(name: str, container: str, bounds: Sequence[int], before: Sequence[str], after: Sequence[str]) -> int | None:
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
    """Parameters registered under several names on different stages. Supported: one user on stage 0 and one on
    the last stage (an embedding tied to an LM head); see [Note: tied weights] in schedules.py."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    num_stages = len(bounds) - 1
    tied = []
    for group in names.values():
        if len(group) < 2:
            continue
        owners = {n: _owner_stage(n, container, bounds, before, after) for n in group}
        stages = set(owners.values())
        if len(stages) == 1:
            continue  # every user on one stage: nothing crosses a boundary
        first = [n for n, s in owners.items() if s == 0]
        last = [n for n, s in owners.items() if s == num_stages - 1]
        if len(group) == 2 and len(first) == 1 and len(last) == 1:
            tied.append((first[0], last[0]))
            continue
        raise ValueError(
            f"Parameter {group} is used on stages {sorted(s for s in stages if s is not None)}: only weights tied "
            f"between the first and the last stage (an embedding and an LM head) are supported. Untie it, or choose "
            f"`partition=` split indices that keep all its users on one stage."
        )
    return tuple(tied)


@dataclass
class BoundaryState:
    """Per-forward state the hooks share with the runtime."""

    incoming: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # (args, kwargs) for the first local block
    outgoing: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # captured (args, kwargs) for the next stage


@dataclass
class StageCarve:
    """A module carved down to one stage, with what is needed to put it back together."""

    plan: PartitionPlan
    stage: int
    boundary: BoundaryState
    removed: dict[str, nn.Module]
    handles: list[Any]
    tied_params: list[nn.Parameter] = field(default_factory=list)  # stage 0: the owned weights; last: replicas

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.plan.num_stages - 1

    def restore(self, module: nn.Module, full_state: dict[str, torch.Tensor] | None = None) -> None:
        """Remove the hooks and put the removed modules back (materialised from ``full_state`` when given)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for name, original in self.removed.items():
            parent_name, _, child = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            placeholder = parent._modules[child]
            device = next((p.device for p in module.parameters() if p.device.type != "meta"), torch.device("cpu"))
            original.to_empty(device=device)
            parent._modules[child] = original
            del placeholder
        self.removed.clear()
        if full_state is not None:
            module.load_state_dict(full_state, strict=False)
        for first, last_name in self.plan.tied:  # tie again: one Parameter object under both names
            owner_name, _, attr = last_name.rpartition(".")
            setattr(module.get_submodule(owner_name), attr, module.get_parameter(first))


def carve_stage(module: nn.Module, plan: PartitionPlan, stage: int) -> StageCarve:
    """Keep only ``stage``'s parameters in ``module`` (in place) and install the boundary hooks.

    Removed modules are moved to the meta device (their memory is freed) and kept for :meth:`StageCarve.restore`.
    """
    container = module.get_submodule(plan.container)
    last = plan.num_stages - 1
    keep = set(plan.blocks(stage))
    removed: dict[str, nn.Module] = {}
    # untie first: the last stage's user gets its own copy (a replica), so moving the other user's module to the
    # meta device cannot take the shared tensor with it
    for _, last_name in plan.tied:
        owner_name, _, attr = last_name.rpartition(".")
        owner = module.get_submodule(owner_name)
        shared = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad))

    def swap(name: str, owner: str, *, is_block: bool = False) -> None:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        original = parent._modules[child]
        assert original is not None
        removed[name] = original.to("meta")
        parent._modules[child] = _Placeholder(owner, removed[name], may_pass_through=is_block)

    for i in range(plan.num_blocks):
        if i not in keep:
            owner = next(s for s in range(plan.num_stages) if i in plan.blocks(s))
            swap(f"{plan.container}.{i}" if plan.container else str(i), f"stage {owner}", is_block=True)
    if stage != 0:
        for name in plan.before:
            swap(name, "stage 0")
    if stage != last:
        for name in plan.after:
            swap(name, f"stage {last}")
    _check_no_shared_parameters(module, removed)

    boundary = BoundaryState()
    handles = []
    blocks = plan.blocks(stage)
    if stage > 0:
        def ingress(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if boundary.incoming is None:
                raise AssertionError(f"stage {stage}: block {blocks.start} ran without a received input")
            return boundary.incoming

        handles.append(container[blocks.start].register_forward_pre_hook(ingress, with_kwargs=True))
    if stage < last:
        def egress(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            boundary.outgoing = (tuple(args), dict(kwargs))
            raise StageDone

        handles.append(container[blocks.stop].register_forward_pre_hook(egress, with_kwargs=True))
    names = dict(module.named_parameters())
    tied_local = [names[first if stage == 0 else last_name] for first, last_name in plan.tied
                  if stage in (0, last)] if plan.tied else []
    return StageCarve(plan=plan, stage=stage, boundary=boundary, removed=removed, handles=handles,
                      tied_params=tied_local)


def _check_no_shared_parameters(module: nn.Module, removed: dict[str, nn.Module]) -> None:
    # A parameter used by two stages (tied embedding / LM head) would have been moved to meta under the other user.
    meta = [name for name, p in module.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"Parameters {meta[:4]} are shared with modules another stage owns ({', '.join(sorted(removed)[:4])}...): "
            f"tied weights across pipeline stages are not supported yet. Untie them (e.g. "
            f"`config.tie_word_embeddings=False`) or keep both users on one stage."
        )

