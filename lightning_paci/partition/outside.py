"""Where the modules and parameters outside every block container run, relative to the blocks.

[Note: outside modules go where they run]
Everything with parameters that is not a block -- an embedding, an encoder's final norm between its layers and the
decoder's, a pooler, an LM head, a learned temperature held directly by a two-tower model -- gets a *position*: the
number of blocks the step has started before its first use (0: before every block; ``L``: after the last). The
plan then gives it to the stage running the block before it (stage 0 for position 0), which is the stage that runs
that code: a stage ends at the next stage's first block (carve.py), so the code between two blocks belongs to the
earlier one. ``call_order`` (one traced step) gives the positions: OPT registers ``decoder.final_layer_norm`` before
``decoder.layers`` and LitGPT ``lm_head`` before ``transformer``, yet both run after the last block. A module the
step never calls, and every module when no step could be run (a model built on the meta device), is placed by
registration order relative to the path to the first container (before it: 0; after it: ``L``).

A module registered under several names (T5's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` are
one ``nn.Embedding``) is placed once, under its first name, by its first call; the others are its *aliases*. Its
later calls run on the same stage, after that stage's end, and reach the stages that read them as relayed values
([Note: late relays] in relay.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_paci.partition.blocks import CallTrace, num_params

__all__ = ["OutsidePlacement", "place_outside"]


@dataclass(frozen=True)
class OutsidePlacement:
    """``modules``: (first name, position) of every module with parameters outside the containers, in registration
    order; ``aliases``: (another name, first name); ``direct``: (parameter name, position) of parameters held
    directly by a module on the path to a container."""

    modules: tuple[tuple[str, int], ...]
    aliases: tuple[tuple[str, str], ...]
    direct: tuple[tuple[str, int], ...]


def place_outside(root: nn.Module, containers: Sequence[str], block_names: Sequence[str],
                  trace: CallTrace | None) -> OutsidePlacement:
    """The positions of everything with parameters outside ``containers`` (see the note above)."""
    num_blocks = len(block_names)
    inside, blocks = set(containers), set(block_names)
    ancestors = {""}
    for path in containers:
        parts = path.split(".") if path else []
        ancestors.update(".".join(parts[:k]) for k in range(len(parts)))
    first_name = {id(sub): name for name, sub in root.named_modules()}
    running = _running_block_counts(block_names, trace)
    sequence = trace.sequence if trace is not None else ()

    def position_of(name: str, registered_after: bool) -> int:
        at = next((j for j, n in enumerate(sequence) if n == name or n.startswith(name + ".")), None)
        if at is None:
            return num_blocks if registered_after else 0
        return running[at]

    modules: list[tuple[str, int]] = []
    aliases: list[tuple[str, str]] = []
    direct: list[tuple[str, int]] = []
    placed: set[str] = set()
    first_path = containers[0].split(".") if containers and containers[0] else []

    def visit(node: nn.Module, prefix: str, depth: int) -> None:
        for pname, _ in node.named_parameters(recurse=False):
            full = f"{prefix}{pname}"
            if trace is None:
                raise ValueError(
                    f"Module `{prefix.rstrip('.') or type(root).__name__}` on the path to the block container "
                    f"`{containers[0]}` holds parameters directly ({full}), and no step of the model could be run to "
                    f"find the stage that uses them (a model built on the meta device). Move them into a submodule, "
                    f"or build the model where a sample step can run.")
            direct.append((full, running[trace.param_uses[full]] if full in trace.param_uses else 0))
        seen_path = False
        for name, child in node.named_children():
            full = f"{prefix}{name}"
            if full in inside or full in blocks:  # (the blocks of a root nn.Sequential)
                seen_path = seen_path or (depth < len(first_path) and name == first_path[depth])
                continue
            if full in ancestors:
                seen_path = seen_path or (depth < len(first_path) and name == first_path[depth])
                visit(child, f"{full}.", depth + 1)
                continue
            if num_params(child) == 0:
                continue  # parameter-free modules (dropout, rotary tables) run on every stage
            canonical = first_name.get(id(child), full)
            if canonical != full and canonical in placed:
                aliases.append((full, canonical))
                continue
            modules.append((full, position_of(canonical, seen_path)))
            placed.add(full)

    visit(root, "", 0)
    return OutsidePlacement(tuple(modules), tuple(aliases), tuple(direct))


def _running_block_counts(block_names: Sequence[str], trace: CallTrace | None) -> list[int]:
    """For every index ``j`` of ``trace.sequence`` (and one past its end): how many blocks started before call ``j``
    -- 1 + the index of the last block called, so that a module running after block ``i`` has position ``i + 1``."""
    index = {name: i for i, name in enumerate(block_names)}
    out, count = [], 0
    for name in trace.sequence if trace is not None else ():
        out.append(count)
        if name in index:
            count = index[name] + 1
    out.append(count)
    return out
