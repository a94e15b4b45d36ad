"""``torch.compile`` per block: each block a stage owns runs its ``forward`` through the compiler.

[Note: compiled blocks]
With ``compile="blocks"`` every block of a stage gets its own compiled ``forward`` (an instance attribute over the
class's), as torchtitan compiles each transformer block; the module, its parameters and their names are untouched,
so a state dict, a checkpoint and a resume are those of the eager model. What the pipeline installs around a
block -- the stage boundary hooks (partition/carve.py), the crossing checks and relay captures, the placeholders of
other stages' blocks, recomputation's checkpoint wrapper (engine/blocks/recompute.py, applied over the compiled forward)
-- runs in ``nn.Module.__call__``, outside the compiled region, so the compiler sees the block's own code only: one
graph per block, recompiled only when an input's form changes (a shorter last micro-batch).

The weight prediction (optim/weight_prediction.py) moves a stage's weights in place before a forward and back after
it; compiled code reads parameters as inputs (torch >= 2.5 inlines ``nn.Module``s), so it computes with the moved
values without a recompile. CUDA graphs are refused (``compile_backend="cudagraphs"``, at construction): a replay
writes its outputs where the previous replay wrote its, while a stage keeps up to N micro-batches' activations
alive between their forwards and backwards; ``torch.compile``'s default mode is what runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["COMPILE_MODES", "BlockCompile", "check_backend"]

COMPILE_MODES = ("off", "blocks")


def check_backend(backend: str) -> None:
    """Refuse a ``compile_backend`` that ``torch.compile`` does not know, naming the known ones."""
    from torch._dynamo import list_backends

    if "cudagraph" in backend:
        raise ValueError(f"`compile_backend={backend!r}`: CUDA graphs reuse their output memory at every replay, and a "
                         f"pipeline stage keeps up to N micro-batches' activations alive between their forwards and "
                         f"backwards, so a replay would overwrite them. Use the default 'inductor'.")
    known = list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"`compile_backend={backend!r}` is not a torch.compile backend; known here: "
                         f"{', '.join(sorted(known))}. The default 'inductor' generates kernels; 'aot_eager' traces "
                         f"without generating code (a quick check that a block compiles).")


class BlockCompile:
    """Give each of ``blocks`` (a stage's own block modules) a compiled ``forward``; :meth:`remove` gives them their
    class's forward back."""

    def __init__(self, blocks: Sequence[nn.Module], backend: str = "inductor") -> None:
        self._blocks = list(blocks)
        for block in self._blocks:
            block.forward = torch.compile(block.forward, backend=backend)

    def remove(self) -> None:
        for block in self._blocks:
            if "forward" in vars(block):
                del block.forward
        self._blocks = []
