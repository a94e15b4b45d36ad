"""The repeated-block containers a model is cut along, the order the step runs them in, and the contiguous split.

Pipeline stages are runs of consecutive blocks: children of ``nn.Sequential``/``nn.ModuleList`` containers, in the
order one step runs them (see [Note: several containers]). A forward written as a loop over a container then
crosses each stage boundary with exactly what the next block is called with (see [Note: stage boundaries are block
inputs] in carve.py). Choosing the runs is one problem whatever the cost -- parameter counts (plan.py) or measured
seconds (profile.py): cut a row of block costs into ``N`` contiguous runs, at least one block each, so that the most
expensive run is as cheap as possible. The solver lives here, below both users, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["SECONDARY_SHARE", "CallTrace", "balanced_boundaries", "call_order", "find_block_container",
           "find_block_containers", "num_params"]

# A container besides the largest is cut too when it holds at least this share of the largest one's parameters:
# smaller ones (a classification head in an nn.Sequential, a convolutional front end) run whole on one stage.
SECONDARY_SHARE = 0.1


@dataclass(frozen=True)
class CallTrace:
    """The submodules of a module in the order of their first call in one step, and how often each was called;
    ``sequence``: every call in order; ``param_uses``: parameters held directly by a module with submodules (a
    learned temperature on a two-tower model) -> the number of calls made before their first use."""

    order: tuple[str, ...]
    counts: dict[str, int]
    sequence: tuple[str, ...] = ()
    param_uses: dict[str, int] = field(default_factory=dict)


class _ParamUses(TorchFunctionMode):
    """Records the first op reading each watched parameter (a direct argument or one in a list of them)."""

    def __init__(self, watched: dict[int, str], uses: dict[str, int], calls: list[str]) -> None:
        super().__init__()
        self.watched, self.uses, self.calls = watched, uses, calls

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        for value in [*args, *(kwargs or {}).values()]:
            for item in value if isinstance(value, (list, tuple)) else (value,):
                name = self.watched.get(id(item)) if isinstance(item, torch.Tensor) else None
                if name is not None and name not in self.uses:
                    self.uses[name] = len(self.calls)
        return func(*args, **(kwargs or {}))


def call_order(module: nn.Module, run_step: Callable[[], Any]) -> CallTrace:
    """Trace the calls of ``module``'s submodules while ``run_step`` runs (one step on a sample micro-batch); a
    module registered under two names is reported under its first."""
    counts: dict[str, int] = {}
    sequence: list[str] = []
    uses: dict[str, int] = {}

    def hook(name: str) -> Callable[..., None]:
        def called(*_: Any) -> None:
            counts[name] = counts.get(name, 0) + 1
            sequence.append(name)
        return called

    watched = {id(p): f"{prefix}{'.' if prefix else ''}{n}" for prefix, sub in module.named_modules()
               if next(sub.children(), None) is not None for n, p in sub.named_parameters(recurse=False)}
    handles = [sub.register_forward_pre_hook(hook(name)) for name, sub in module.named_modules() if name]
    try:
        with _ParamUses(watched, uses, sequence) if watched else _NO_MODE:
            run_step()
    finally:
        for handle in handles:
            handle.remove()
    # a dict keeps the order of first insertion: of first calls
    return CallTrace(tuple(counts), counts, tuple(sequence), uses)


class _NoMode:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


_NO_MODE = _NoMode()


def num_params(module: nn.Module) -> int:
    """Parameter count of ``module`` (a tied tensor once): the cost the parameter split balances."""
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
        if isinstance(sub, (nn.Sequential, nn.ModuleList)) and len(sub) >= 2 and num_params(sub) > 0
    ]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no repeated-block container: no nn.Sequential or nn.ModuleList with at "
            f"least two children and parameters. Pipeline stages are cut between blocks of such a container; hold "
            f"the blocks in one (e.g. `self.blocks = nn.ModuleList([...])` looped over in `forward`) and pass "
            f"`PACIStrategy(block_container='blocks')` if it is not found automatically."
        )
    best = max(num_params(sub) for _, sub in candidates)
    name, container = min(((n, c) for n, c in candidates if num_params(c) == best), key=lambda nc: nc[0].count("."))
    return name, container


def _candidates(module: nn.Module) -> list[tuple[str, nn.Sequential | nn.ModuleList]]:
    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, (nn.Sequential, nn.ModuleList)) and len(sub) >= 2 and num_params(sub) > 0]


def find_block_containers(module: nn.Module, path: str | Sequence[str] | None = None,
                          trace: CallTrace | None = None) -> list[tuple[str, nn.Sequential | nn.ModuleList]]:
    """[Note: several containers]
    The containers whose blocks become the pipeline's blocks, in the order the step runs them. An encoder-decoder
    runs its encoder's layers and then its decoder's, a two-tower model one tower and then the other, a U-shaped
    network its down blocks, middle and up blocks: each is a container, and the pipeline cuts their concatenation,
    so no stage holds a whole encoder. Besides the largest container (``find_block_container``), every container
    not nested in another one is taken when it holds at least ``SECONDARY_SHARE`` of the largest one's parameters
    and ``trace`` (one step of the whole model) shows each of its blocks run once, the blocks of all taken containers
    running in one row: container after container, each in its index order. One that breaks that row (XLM's
    ``attentions[i]`` and ``ffns[i]``, indexed in turn) is left whole. Without a trace (a model built on the meta
    device) the largest container alone. ``path``: one dotted path (that container alone) or several (those, in the
    order the trace shows, else as given)."""
    if path is not None:
        paths = [path] if isinstance(path, str) else list(path)
        named = [find_block_container(module, p) for p in paths]
        if len(named) > 1 and trace is not None:
            ordered = _run_order(named, trace)
            if ordered is None:
                raise ValueError(
                    f"`block_container={list(paths)!r}`: in one step the blocks of these containers do not run one "
                    f"container after the other, each block once and in its index order, so they cannot be cut as "
                    f"one row. Name the containers whose blocks run that way, or one container.")
            named = ordered
        return named
    largest = find_block_container(module)
    if trace is None:
        return [largest]
    chosen = [largest]
    everything = _candidates(module)
    for name, container in sorted(everything, key=lambda nc: -num_params(nc[1])):
        if any(name == c or name.startswith(f"{c}.") or c.startswith(f"{name}.") or not name or c == ""
               for c, _ in chosen):
            continue  # the largest itself, nested in a taken one, or holding one
        if any(name.startswith(f"{other}.") for other, _ in everything if other != name and other):
            continue  # nested in another candidate: its parent is the container
        if num_params(container) < SECONDARY_SHARE * num_params(largest[1]):
            break
        if not _self_contained(name, len(container), trace):
            continue
        ordered = _run_order([*chosen, (name, container)], trace)
        if ordered is not None:
            chosen = ordered
    return chosen


def _self_contained(path: str, length: int, trace: CallTrace) -> bool:
    """Whether nothing but the container's own blocks runs from its first block's call to its last's: a module list
    indexed in the same loop (BLT's ``cross_attn_layers[i]`` next to ``layers[i]``) would have to be cut with it."""
    names = [f"{path}.{i}" for i in (0, length - 1)]
    if not all(n in trace.sequence for n in names):
        return False
    start, stop = trace.sequence.index(names[0]), trace.sequence.index(names[1])
    return all(n.startswith(f"{path}.") for n in trace.sequence[start:stop])


def _run_order(named: Sequence[tuple[str, nn.Sequential | nn.ModuleList]],
               trace: CallTrace) -> list[tuple[str, nn.Sequential | nn.ModuleList]] | None:
    """``named`` ordered as ``trace`` runs them, when their blocks run as one row (each once, container after
    container, in index order); None otherwise."""
    index = {f"{path}.{i}" if path else str(i): (k, i) for k, (path, c) in enumerate(named) for i in range(len(c))}
    row = [index[name] for name in trace.sequence if name in index]
    if len(row) != len(index) or len(set(row)) != len(row):
        return None
    order = [row[0][0]]
    for (k, i), (k_prev, i_prev) in zip(row[1:], row[:-1]):
        if k == k_prev:
            if i != i_prev + 1:
                return None
        elif i != 0 or i_prev != len(named[k_prev][1]) - 1 or k in order:
            return None
        else:
            order.append(k)
    return [named[k] for k in order]


def balanced_boundaries(costs: Sequence[float], first_extra: float, last_extra: float, num_stages: int) -> list[int]:
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
                cost = (prefix[i] - prefix[j] + (first_extra if k == 1 else 0.0)
                        + (last_extra if k == num_stages else 0.0))
                value = max(best[k - 1][j], cost)
                if value < best[k][i]:
                    best[k][i], choice[k][i] = value, j
    bounds = [n]
    i = n
    for k in range(num_stages, 0, -1):
        i = choice[k][i]
        bounds.append(i)
    return bounds[::-1]
