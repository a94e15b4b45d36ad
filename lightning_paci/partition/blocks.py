"""The repeated-block container a model is cut along, and the contiguous split of its blocks.

Pipeline stages are runs of consecutive children of one ``nn.Sequential`` or ``nn.ModuleList`` (the "blocks"): a
forward written as a loop over that container then crosses each stage boundary with exactly what the next block is
called with (see [Note: stage boundaries are block inputs] in carve.py). Choosing the runs is one problem whatever the
cost -- parameter counts (plan.py) or measured seconds (profile.py): cut a row of block costs into ``N`` contiguous
runs, at least one block each, so that the most expensive run is as cheap as possible. The solver lives here, below
both users, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["balanced_boundaries", "find_block_container", "num_params"]


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
