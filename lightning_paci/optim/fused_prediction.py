"""The weight prediction's move as one compiled pass per bin: why a GPU wants it, and how it stays one.

The multi-tensor passes of the weight prediction ([Note: weight prediction in multi-tensor passes]) read and write
~120 bytes per parameter and launch a few kernels per bin each way, where the move itself needs to read ``w``, the
optimizer's moments and the gradient once and write ``w`` once (20 bytes per float32 parameter for AdamW with a
known gradient). On a GPU that difference is the prediction's whole cost, so there the move and the way back are each
one ``torch.compile``-d (inductor) pass per bin, with the multi-tensor passes as the fallback
(optim/weight_prediction.py chooses).

[Note: the fused prediction pass]
A bin here is up to 32 flat slices of *one common length*, of one kind of pass (:data:`KINDS`), dtype and device;
the pass adds ``d = scale * (numerator / denominator)`` to each slice's weights, the same formula and order as the
multi-tensor passes, every scalar of a slice in one row of a small float tensor (:data:`ROW` columns). Measured on
the CPU with torch 2.13 (tests/test_fused_prediction.py), where inductor's C++ backend stands in for the GPU:

* what counts as a kernel: the C++ backend emits all of a graph's pointwise loops into *one* ``cpp_fused_*``
  function, one call in the wrapper's ``call`` whether its loops were fused or not (7 slices of 7 sizes, or 20
  unfused ones: one call), so the analogue of a GPU launch is a *loop nest* in that function (inductor's
  ``metrics.generated_kernel_count`` counts those): the scheduler decides the loops the same way for Triton, where
  each becomes a kernel. Both are counted, and both are one per bin;
* one length per bin: loops become one loop nest (one Triton kernel) only when their lengths are equal (7 slices of
  65536 elements: 1 loop nest; 7 sizes: 7; Triton checks ``numel`` too), and the slices share no buffer the
  scheduler's memory score counts (each reads its own row), so it fuses them only with ``aggressive_fusion`` and
  ``score_fusion_memory_threshold=0`` (else 7 slices of 65536: 7 loop nests), set for this compile only with the
  fusion sizes raised to a bin's 32 slices (two scheduler nodes each). Big tensors are therefore cut into slices of
  one length (:func:`cuts`: the largest power of two from 2^16 to 2^20 dividing them all) and small ones grouped by
  a length that divides them;
* scalars as a tensor, because Python floats passed to a compiled function are specialized: a change of sign
  recompiled (~1.2 s), while the table's values change freely (second call 0.0075 s, no new kernel). The table of a
  whole move is built on the host, rows for the move and, with the scale negated, for the way back, and copied to
  the device *once* per move (a host-to-device copy: the host never waits). The way back runs the same kernel with
  ``-scale``: ``d`` has the same bits both ways (floating-point contraction is off on the CPU and
  ``emulate_precision_casts`` turns Triton's off), so [Note: weight prediction]'s one-ulp way back holds;
* one compiled function, and one *code object*, per signature (kind, slices, length, dtype, device): dynamo keeps
  its compiled entries per code object and, past ``recompile_limit`` (8) entries, silently runs the code eagerly;
  with a code object of its own a signature has exactly one entry, whatever the count of signatures, and the guards
  checked per call are that one's. A bin's pass is compiled once per process, shared by every stage;
* the compile runs before any weight is touched, on scratch weights of the bin's size (the read tensors are the
  real ones; at most the largest tensor or 2^20 elements, once): a failed compile leaves the weights as they were
  and the caller falls back, and a timed move ([Note: the prediction's budget]) never includes a compile. (After a
  ``torch._dynamo.reset()`` a pass recompiles at its next call.)

One GPT-2-small block (12 tensors, 7.1M parameters) with AdamW and a known gradient: 5 bins (4 of 27 slices of
65536, one of 13 of 768), one kernel each, and one scalar copy per move: 6 launches for the move and 5 for the way
back, 20 bytes read and written per parameter each way (16 with nothing known), against 35 operations and 60 bytes
per parameter each way on the multi-tensor passes (21 and 32 with nothing known). Compiling its two signatures took
6-16 s on a busy 2-core CPU (no cache). On the host a call costs ~70 us for 27 slices (dynamo's guards on ~110
tensors), about what the multi-tensor passes' calls cost per bin.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["AMSGRAD_KNOWN", "ADAM", "ADAM_KNOWN", "KINDS", "MOST_SLICES", "ROW", "SGD", "SGD_KNOWN", "FusedPass",
           "PassSignature", "chunks", "cuts", "fused_by_default", "fused_pass", "kind_of", "scalar_row",
           "scalar_table"]

# the kinds of pass: the step d = scale * (numerator / denominator) of
SGD = "sgd"  # -lr * buf: numerator buf, no denominator
SGD_KNOWN = "sgd_known"  # numerator buf + alpha * g
ADAM = "adam"  # numerator m, denominator sqrt(v) + eps (amsgrad: sqrt(max_exp_avg_sq) + eps)
ADAM_KNOWN = "adam_known"  # numerator g + alpha * m, denominator sqrt(v + square * g * g) + eps
AMSGRAD_KNOWN = "amsgrad_known"  # denominator sqrt(max(beta2 * v + square * beta2 * g * g, max_exp_avg_sq)) + eps
KINDS = (SGD, SGD_KNOWN, ADAM, ADAM_KNOWN, AMSGRAD_KNOWN)

ROW = 8  # scalars per slice: scale, eps, alpha, square (amsgrad: square * beta2), beta2, padding to 32 bytes
MOST_SLICES = 32  # slices per bin: per compiled kernel
_SLICE = 2**16  # the big tensors' slice length, at least
_MOST_SLICE = 2**20  # and at most
_ALIGNMENT = 16  # bytes: a cut at such an offset keeps a slice aligned as inductor assumes
_MOST_PIECES = 16  # a small tensor is cut into at most this many slices of a common length


class PassSignature(NamedTuple):
    """What one compiled pass is specialized to."""

    kind: str
    slices: int
    length: int
    dtype: torch.dtype
    device: torch.device


def kind_of(adam: bool, known: bool, amsgrad: bool) -> str:
    """The pass for an optimizer (``adam``: Adam or AdamW, else SGD) with or without a known gradient."""
    if not adam:
        return SGD_KNOWN if known else SGD
    if not known:
        return ADAM  # amsgrad: max_exp_avg_sq in the place of exp_avg_sq
    return AMSGRAD_KNOWN if amsgrad else ADAM_KNOWN


def scalar_row(kind: str, scale: float, eps: float, alpha: float, square: float, beta2: float) -> tuple[float, ...]:
    """A slice's row of the scalar table (folded on the host as the multi-tensor passes fold them)."""
    if kind == AMSGRAD_KNOWN:
        square = square * beta2  # the multi-tensor pass's value=square * beta2
    return (scale, eps, alpha, square, beta2) + (0.0,) * (ROW - 5)


def scalar_table(rows: Sequence[tuple[float, ...]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[2, len(rows), ROW]``: the move's rows and the way back's (the scale negated, exactly), on ``device`` with
    one host-to-device copy (from pinned memory on CUDA: the host does not wait)."""
    values = [*rows, *((-row[0], *row[1:]) for row in rows)]
    pinned = device.type == "cuda"
    table = torch.tensor(values, dtype=dtype, pin_memory=pinned).view(2, len(rows), ROW)
    return table.to(device, non_blocking=True) if table.device != device else table


def _move(kind: str, weights: list[torch.Tensor], first: list[torch.Tensor], second: list[torch.Tensor],
          peak: list[torch.Tensor], grads: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """Add ``d = scale * (numerator / denominator)`` to every slice of ``weights`` in place (traced per signature:
    the branches on ``kind`` are resolved at compile time)."""
    for i, weight in enumerate(weights):
        s = scalars[i]
        if kind == SGD:
            step = first[i]
        elif kind == SGD_KNOWN:
            step = first[i] + s[2] * grads[i]
        elif kind == ADAM:
            step = first[i] / (second[i].sqrt() + s[1])
        elif kind == ADAM_KNOWN:
            g = grads[i]
            step = (g + s[2] * first[i]) / ((second[i] + s[3] * g * g).sqrt() + s[1])
        else:
            g = grads[i]
            moment = torch.maximum(second[i] * s[4] + s[3] * g * g, peak[i])
            step = (g + s[2] * first[i]) / (moment.sqrt() + s[1])
        weight.add_(s[0] * step)


def _options(device: torch.device) -> dict[str, Any]:
    """Inductor settings for this compile only (those the installed torch knows)."""
    from torch._inductor import config

    # the slices share no buffer the scheduler counts (each reads its own row), so it fuses them only when told
    # to: same-length loops into one loop nest, one kernel (two nodes per slice: the step and the copy into w)
    wanted: dict[str, Any] = {"size_asserts": False,  # dynamo's guards already check every input's size
                              "aggressive_fusion": True, "score_fusion_memory_threshold": 0,
                              "max_fusion_size": 4 * MOST_SLICES, "cpp.max_horizontal_fusion_size": 4 * MOST_SLICES}
    if device.type != "cpu":
        wanted["emulate_precision_casts"] = True  # no fused multiply-add: d rounded, the same bits both ways

    def known(name: str) -> bool:
        owner: Any = config
        *path, last = name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        return owner is not None and hasattr(owner, last)

    return {name: value for name, value in wanted.items() if known(name)}


class FusedPass:
    """The compiled pass of one signature (its own code object, see [Note: the fused prediction pass])."""

    def __init__(self, signature: PassSignature) -> None:
        self.signature = signature
        self.compiled = False
        self.failed: Exception | None = None  # what its compile raised: raised again at once (no second try)
        name = f"fused_prediction_{signature.kind}_{signature.slices}x{signature.length}"
        code = _move.__code__.replace(co_name=name, co_qualname=name) if hasattr(_move.__code__, "co_qualname") \
            else _move.__code__.replace(co_name=name)
        self.function = types.FunctionType(code, _move.__globals__, name)  # dynamo's entry is on its code
        self._fn: Callable[..., None] | None = None

    def __call__(self, weights: list[torch.Tensor], first: list[torch.Tensor], second: list[torch.Tensor],
                 peak: list[torch.Tensor], grads: list[torch.Tensor], scalars: torch.Tensor) -> None:
        assert self._fn is not None, "compile first"
        self._fn(self.signature.kind, weights, first, second, peak, grads, scalars)

    @torch.no_grad()
    def compile(self, first: list[torch.Tensor], second: list[torch.Tensor], peak: list[torch.Tensor],
                grads: list[torch.Tensor]) -> int:
        """Compile on scratch weights (the real read tensors, zero scalars); returns the scratch's bytes. Raises
        what the compiler raised (this process's first try's error, after that)."""
        if self.failed is not None:
            raise self.failed
        kind, slices, length, dtype, device = self.signature
        scratch = [torch.empty(length, dtype=dtype, device=device) for _ in range(slices)]
        try:
            self._fn = torch.compile(self.function, fullgraph=True, dynamic=False, options=_options(device))
            self(scratch, first, second, peak, grads, torch.zeros(slices, ROW, dtype=dtype, device=device))
        except Exception as error:
            self.failed = error
            raise
        self.compiled = True
        return slices * length * scratch[0].element_size()


_PASSES: dict[PassSignature, FusedPass] = {}
_LOCK = threading.Lock()


def fused_pass(signature: PassSignature) -> FusedPass:
    """The process's pass for ``signature`` (compiled at its :meth:`FusedPass.compile`; shared by every stage)."""
    with _LOCK:
        found = _PASSES.get(signature)
        if found is None:
            found = _PASSES[signature] = FusedPass(signature)
        return found


def fused_by_default(devices: Sequence[torch.device]) -> bool:
    """Whether the fused pass is the default: on CUDA, where ``torch.compile`` generates Triton kernels."""
    if not devices or any(device.type != "cuda" for device in devices):
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - an older torch
        return False
    return bool(has_triton())


def cuts(numels: Sequence[int], itemsize: int) -> list[list[tuple[int, int]]]:
    """Each tensor's flat slices ``[lo, hi)``, of few common lengths: the tensors of at least 2^16 elements cut into
    slices of the largest power of two from 2^16 to 2^20 dividing them all; their remainders and the smaller tensors
    each cut into slices of a length already taken that divides it (at most 16 slices, at 16-byte boundaries), the
    longest such, else whole (its size becomes a length)."""
    big = [n for n in numels if n >= _SLICE]
    length = _SLICE
    while big and length < _MOST_SLICE and all(n % (2 * length) == 0 for n in big):
        length *= 2
    out: list[list[tuple[int, int]]] = []
    rests: list[tuple[int, int, int]] = []  # tensor, offset, size
    for i, n in enumerate(numels):
        whole = n // length if n >= _SLICE else 0
        out.append([(j * length, (j + 1) * length) for j in range(whole)])
        if n > whole * length:
            rests.append((i, whole * length, n - whole * length))
    taken: list[int] = []
    piece: dict[int, int] = {}
    for size in sorted({size for _, _, size in rests}):
        fits = [t for t in taken if size % t == 0 and size // t <= _MOST_PIECES and t * itemsize % _ALIGNMENT == 0]
        piece[size] = max(fits) if fits else size
        if not fits:
            taken.append(size)
    for i, offset, size in rests:
        step = piece[size]
        out[i] += [(offset + lo, offset + lo + step) for lo in range(0, size, step)]
    return out


def chunks(count: int, most: int) -> list[int]:
    """``count`` slices in as few bins of at most ``most`` as can hold them, as equal as possible (at most two
    sizes: at most two signatures per length)."""
    if count <= 0:
        return []
    bins = -(-count // most)
    q, r = divmod(count, bins)
    return [q + 1] * r + [q] * (bins - r)
