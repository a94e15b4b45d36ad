"""What a GPU would pay, counted on the CPU: kernel-launching aten operations and the bytes they move.

A sleep is not a kernel: the emulated cluster pads every block with a fixed sleep, and nothing there counts the
launches a GPU pays a few microseconds of host time for, nor the bytes it reads and writes. ``KernelMeter`` is a
``TorchDispatchMode``: it sees every aten operation below autograd, as a GPU's dispatcher would, and counts, per
phase, those that would launch a kernel on a device (views, metadata and uninitialised allocations launch none), with
the bytes of their tensor arguments (read) and of their outputs (written). A multi-tensor operation
(``torch._foreach_*``) is one operation here; on CUDA it launches one kernel per ~100 tensors or ~20M elements
(``multi_tensor_apply``), which the counts below stay far under.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["KernelMeter"]

# aten operations that allocate without writing, or only read metadata: no kernel on a device
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_",
              "_local_scalar_dense", "resize_", "record_stream"}
# host reads of a device value (the stream drains before the host goes on)
_HOST_READS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2"}


def _bytes(values: Any) -> int:
    return sum(v.numel() * v.element_size() for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))


class KernelMeter(TorchDispatchMode):
    """Counts kernel-launching aten operations, bytes read and written and host reads, per ``phase``.

    Use ``with meter.phase("F"): ...`` inside ``with meter:``; ``launches[phase]``, ``read[phase]``,
    ``written[phase]``, ``host_reads[phase]`` and ``ops[phase]`` (a Counter of operation names) hold the totals.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = "other"
        self.launches: collections.Counter[str] = collections.Counter()
        self.read: collections.Counter[str] = collections.Counter()
        self.written: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _HOST_READS:
            self.host_reads[self.current] += 1
        if name in _NO_KERNEL or func.is_view:
            return out
        self.launches[self.current] += 1
        self.ops[self.current][name] += 1
        self.read[self.current] += _bytes((args, kwargs))
        self.written[self.current] += _bytes(out) if not name.endswith("_") else _bytes(args[0])
        return out
