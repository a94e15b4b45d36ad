"""Clipping by norm under ``"paci"`` without a collective: each stage's latest squared norms, carried by its messages.

[Note: norm table]
Under ``"paci"`` the stages update at different times, and a collective at every update would be the global
synchronisation PACI removes. So each stage keeps a table of every stage's squared gradient norm at that stage's
latest update, with its update number, and the table rides on the messages the stage sends anyway -- the
activations downstream (``SEND_F``) and the input gradients upstream (``SEND_B``)::

    stage 0 --F: (0: u0, 1: u1, 2: ..)--> stage 1 --F--> stage 2
    stage 0 <--B: (.., 1: u1, 2: u2)---- stage 1 <--B-- stage 2

On receipt a stage takes, for every *other* stage, the entry with the newer update number (a stage's own entry is
always its own); an entry no message has brought yet is 0. At its update a stage computes its own squared norm
(one multi-tensor norm, on the device), puts it in its table and clips by ``sqrt(sum of the table)`` with torch's
rule ``min(1, c / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``). The other stages' entries are as old as
the messages that brought them -- a few updates at most, the drift bound's distance -- and which entries a stage
holds at each update is a function of the action lists alone (a receive merges at its place in the list), so the
reference executor computes the same bits (``ReferencePipeline(gradient_clip_val=...)``).

The squared norms stay on the device as one ``(num_stages,)`` tensor and the update numbers on the host, so
nothing is read back: a merge concatenates slices of the two tables, chosen from the host-side numbers (one
launch). The numbers travel as floats, which the wire sends as values after the header, and the tensor's shape
never changes, so a link's header still repeats ([Note: header reuse] in wire.py). Without clipping by norm a stage
has no table and its messages are exactly as before. A table is never changed in place (each change makes a new
tensor), so a message holding one is never altered after its send.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["NormTable", "carried", "clip_scale", "merged", "squared_norm"]

Entries = tuple[torch.Tensor, list[float]]  # (num_stages,) squared norms on the device, update numbers on the host


class NormTable:
    """One stage's view of every stage's latest squared gradient norm ([Note: norm table]).

    Args:
        stage, num_stages: this stage's index and the pipeline's length.
        device, dtype: where the squared norms live and their precision (``for_parameters``: the stage's).
    """

    def __init__(self, stage: int, num_stages: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if not 0 <= stage < num_stages:
            raise AssertionError(f"stage {stage} of a pipeline of {num_stages} stages")
        self.stage, self.num_stages = stage, num_stages
        self.squares = torch.zeros(num_stages, dtype=dtype, device=device)  # (num_stages,), replaced, never mutated
        self.updates = [0] * num_stages  # host: the update each entry is from; 0: none known yet

    @classmethod
    def for_parameters(cls, stage: int, num_stages: int, params: Iterable[torch.Tensor]) -> NormTable:
        """A table on the parameters' device, in the widest of their floating dtypes and float32 (a float64 model's
        norms in float64, a bfloat16 model's in float32)."""
        params = list(params)
        dtypes = [p.dtype for p in params if p.is_floating_point()]
        device = params[0].device if params else torch.device("cpu")
        return cls(stage, num_stages, device=device, dtype=functools.reduce(torch.promote_types, dtypes, torch.float32))

    def entries(self) -> Entries:
        """What a message carries: the squared norms (this table's tensor, never changed later) and their update
        numbers."""
        return self.squares, [float(update) for update in self.updates]

    def merge(self, entries: Entries) -> None:
        """Take, for every other stage, the received entry if its update number is newer than the one held."""
        squares, updates = entries
        newer = [s != self.stage and int(update) > self.updates[s] for s, update in enumerate(updates)]
        if len(newer) != self.num_stages:
            raise AssertionError(f"stage {self.stage}: a norm table of {len(newer)} stages, expected "
                                 f"{self.num_stages}")
        if not any(newer):
            return
        self.squares = _pick(self.squares, squares.to(self.squares.device, self.squares.dtype), newer)
        for s, take in enumerate(newer):
            if take:
                self.updates[s] = int(updates[s])

    def record(self, square: torch.Tensor) -> None:
        """This stage's update: its own squared norm (a 0-dim tensor on the table's device) replaces its entry."""
        own = [s == self.stage for s in range(self.num_stages)]
        self.squares = _pick(self.squares, square.to(self.squares.dtype).reshape(1).expand(self.num_stages), own)
        self.updates[self.stage] += 1

    def clip(self, params: Iterable[torch.Tensor], clip_val: float) -> None:
        """Clip ``params``' gradients (the stage's, at its update) by the norm over every stage's latest: record this
        stage's squared norm, then scale by ``min(1, clip_val / (norm + 1e-6))``; no host read."""
        grads = [p.grad for p in params if p.grad is not None]
        self.record(squared_norm(grads, self.squares.dtype) if grads else self.squares.new_zeros(()))
        scale = clip_scale(self.squares.sum().sqrt(), clip_val)
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].dtype))


def squared_norm(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The squared norm over ``grads`` (non-empty) in ``dtype``, 0-dim, on their device: one multi-tensor norm."""
    return torch.stack(torch._foreach_norm(grads)).to(dtype).square().sum()  # (tensors,) -> ()


def clip_scale(total: torch.Tensor, clip_val: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s factor for a total norm: ``min(1, clip_val / (total + 1e-6))``."""
    return torch.clamp(clip_val / (total + 1e-6), max=1.0)


def _pick(mine: torch.Tensor, theirs: torch.Tensor, take: list[bool]) -> torch.Tensor:
    """A new table: entry ``s`` from ``theirs`` where ``take[s]``, else from ``mine``; one concatenation of the
    runs of consecutive entries from the same side (host-side choices, no index tensor to copy to the device)."""
    pieces, start = [], 0
    for s in range(1, len(take) + 1):
        if s == len(take) or take[s] != take[start]:
            pieces.append((theirs if take[start] else mine)[start:s])
            start = s
    return torch.cat(pieces)


def carried(table: NormTable | None, message: Any) -> Any:
    """The message as sent: itself, or ``(message, the table's entries)`` when the stage clips by a table."""
    return message if table is None else (message, table.entries())


def merged(table: NormTable | None, received: Any) -> Any:
    """The message a ``carried`` one held, its table merged into ``table`` (the receiver's)."""
    if table is None:
        return received
    message, entries = received
    table.merge(entries)
    return message
