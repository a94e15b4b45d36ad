"""The layer-major backward of ``schedule="layered"`` ([Note: layered backward] in schedules/build.py).

A training forward on a stage records a cut at every entry and exit of the stage's own blocks (``LayerCuts``): the
tensors that need a gradient there are replaced by detached leaves, so each micro-batch's graph falls apart into
pieces -- after the last block (the head, the loss, the outgoing activations), each block, and the code between
blocks and before the first one -- joined only through those leaves. The first backward of a mini-batch
(``LayeredBackward.run``) then runs every piece of every held micro-batch, piece by piece from the last to the
first, each for all micro-batches in turn: the last block for every micro-batch, then the one before it. A piece
starts from the gradients its leaves have collected, and every later piece that reads them has run by then, so
each contribution is added once, in the same micro-batch order as one device's accumulation: the gradients equal
the micro-batch-major backward's. A parameter's gradient is final once its block has seen the last micro-batch,
so its bucket's reduction over replicas ([Note: overlapped reduction]) overlaps the backward of every block before
it over the whole mini-batch. The later backwards of the mini-batch only do their bookkeeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_paci.engine.transport.messages import flatten, map_leaves
from lightning_paci.schedules.actions import RECV_B

__all__ = ["LayerCuts", "LayeredBackward"]

Cut = tuple[list[torch.Tensor], list[torch.Tensor]]  # (where the graph continues, the leaves that stand for them)


class LayerCuts:
    """Forward hooks on a stage's own blocks that cut the graph at their entries and exits while ``recording``."""

    def __init__(self, blocks: Sequence[nn.Module]) -> None:
        self._cuts: list[Cut] | None = None
        self.handles = [h for block in blocks for h in (
            block.register_forward_pre_hook(self._enter, with_kwargs=True),
            block.register_forward_hook(self._exit, with_kwargs=True))]

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Cut]]:
        """Record the cuts of one forward (only where autograd records)."""
        cuts: list[Cut] = []
        self._cuts = cuts if torch.is_grad_enabled() else None
        try:
            yield cuts
        finally:
            self._cuts = None

    def _cut(self, value: Any) -> Any:
        assert self._cuts is not None
        starts: list[torch.Tensor] = []
        leaves: list[torch.Tensor] = []

        def detach(t: torch.Tensor) -> torch.Tensor:
            if not t.requires_grad:
                return t
            leaf = t.detach().requires_grad_()
            starts.append(t)
            leaves.append(leaf)
            return leaf

        out = map_leaves(value, torch.Tensor, detach)
        if starts:
            self._cuts.append((starts, leaves))
        return out

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._cuts is None:
            return None
        return self._cut((args, kwargs))

    def _exit(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return None if self._cuts is None else self._cut(output)


class LayeredBackward:
    """Runs a mini-batch's backwards layer-major at its first ``B`` (see the module docstring)."""

    def __init__(self, cuts: LayerCuts) -> None:
        self.cuts = cuts
        self.of: dict[int, list[Cut]] = {}  # micro-batch in flight -> its forward's cuts
        self.done: set[int] = set()  # micro-batches whose backward has run
        self.groups = self.depth = 0  # mini-batches run layer-major, and their cuts per micro-batch (tests)

    def run(self, runtime: Any, mb: int, held: Any) -> None:
        """Before the bookkeeping of ``B(mb)``: if ``mb``'s backward has not run, run those of every micro-batch
        held (``mb`` and ``runtime.held``), the received gradients taken from ``runtime.inbox`` (left there)."""
        if mb in self.done:
            self.done.discard(mb)
            return
        group = [(mb, held)] + sorted(runtime.held.items())
        pieces: list[tuple[list[torch.Tensor], list[torch.Tensor] | None, list[Cut]]] = []
        self.done.update(m for m, _ in group[1:])  # their B only does its bookkeeping
        for m, h in group:
            cuts = self.of.pop(m, [])
            if h.output.skipped:
                continue
            if h.output.loss is not None:
                loss = h.output.loss * runtime.loss_scale * runtime.loss_weights.get(m, 1.0)
                if runtime.hooks is not None:
                    runtime.hooks.before_backward(loss)
                pieces.append(([loss], None, cuts))
                continue
            payload = runtime.inbox[(RECV_B, m)]
            if payload.get("skip"):
                continue
            outputs = [t for t in flatten(h.output.outgoing)[1] if t.requires_grad]
            pieces.append((outputs, list(payload["grads"]), cuts))
        depth = {len(cuts) for _, _, cuts in pieces}
        if len(depth) > 1:
            raise AssertionError(f"stage {runtime.stage}: micro-batches cut at {sorted(depth)} block boundaries; "
                                 f"`schedule='layered'` needs every forward to run the same blocks")
        for outputs, grads, _ in pieces:  # after the last block: the head, the loss, the outgoing activations
            if outputs:
                torch.autograd.backward(outputs, grads)
        self.groups, self.depth = self.groups + 1, depth.pop() if depth else 0
        for c in reversed(range(self.depth)):
            for _, _, cuts in pieces:
                starts, leaves = cuts[c]
                pairs = [(s, leaf.grad) for s, leaf in zip(starts, leaves) if leaf.grad is not None]
                if pairs:
                    torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])
