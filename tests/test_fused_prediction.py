"""The fused weight prediction (optim/fused_prediction.py): one compiled pass per bin each way, the multi-tensor
passes' formula within float32 rounding, back within one ulp, no compile when the scalars change, one code object
per signature. Counted on the CPU from the code inductor generates (its C++ backend: one ``cpp_fused_*`` call in the
wrapper's ``call`` is one kernel, a GPU's launch), against the multi-tensor passes metered by tests/device_meter.py.
Budgets, not timings: the counts are the same on a busy machine."""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from lightning_paci.optim import fused_prediction, weight_prediction
from lightning_paci.optim.fused_prediction import (
    ADAM,
    ADAM_KNOWN,
    AMSGRAD_KNOWN,
    ROW,
    SGD,
    SGD_KNOWN,
    FusedPass,
    PassSignature,
    chunks,
    cuts,
    fused_by_default,
)
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import WeightPrediction

from device_meter import KernelMeter
from test_device_costs import gpt2_small_block

# one GPT-2-small block with AdamW, each way: kernels per bin (the one scalar copy of a move counted in every bin)
# and bytes read + written per parameter (w, g, m, v read, w written: 20)
FUSED_KERNELS_PER_BIN, FUSED_BYTES_PER_PARAMETER = 2, 24

OPTIMIZERS = {  # every kind of pass; shapes that share one signature per kind (13 slices of 768)
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, betas=(0.8, 0.9)),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.05, amsgrad=True, maximize=True),
}
SHAPES = [(768,)] * 6 + [(3, 768), (4, 768)]  # a GPT-2-small block's small tensors: 13 slices of 768


def _stepped(name: str, seed: int = 0) -> tuple[list[nn.Parameter], StageOptimizer]:
    """Parameters (some elements tiny) after three updates, and half a window of gradient accumulated."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=gen) * (1e-4 if i == 1 else 1.0))
              for i, shape in enumerate(SHAPES)]
    optimizer = StageOptimizer(OPTIMIZERS[name](params), params)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.5
    return params, optimizer


def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def _reference(kind: str, one: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``i`` of a fused bin in float64: the step ``d`` and the magnitude of its terms (``|d|`` where nothing
    cancels: float32 rounding is relative to that)."""
    s = [float(x) for x in torch.tensor(one.rows[i], dtype=torch.float32)]  # the scalars as the pass sees them
    first = one.first[i].double()
    if kind in (SGD, SGD_KNOWN):
        g = one.grads[i].double() if kind == SGD_KNOWN else torch.zeros_like(first)
        return s[0] * (first + s[2] * g), abs(s[0]) * (first.abs() + abs(s[2]) * g.abs())
    second = one.second[i].double()
    if kind == ADAM:
        d = s[0] * first / (second.sqrt() + s[1])
        return d, d.abs()
    g = one.grads[i].double()
    moment = second + s[3] * g * g if kind == ADAM_KNOWN else torch.maximum(second * s[4] + s[3] * g * g,
                                                                           one.peak[i].double())
    den = moment.sqrt() + s[1]
    return s[0] * (g + s[2] * first) / den, abs(s[0]) * (g.abs() + abs(s[2]) * first.abs()) / den


@pytest.mark.parametrize("rest", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_fused_move_is_the_formula_within_float32_rounding_and_comes_back_within_one_ulp(name: str,
                                                                                            rest: float) -> None:
    """Against the same formula in float64, the fused move and the multi-tensor passes are both off by at most
    their rounding: half an ulp of the moved weight, plus ~8 float32 roundings of the step's terms (``2**-20``
    of their magnitude, where the numerator cancels); the way back is within one ulp ([Note: weight prediction]).
    Under ``recompile_limit=1`` every signature still compiles: each has its own code object and one entry."""
    params, optimizer = _stepped(name)
    start = [p.detach().clone() for p in params]
    multi = WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=False)
    bins = multi.apply(1, rest)
    by_multi = [p.detach().clone() for p in params]
    multi.revert(bins)
    for p, s in zip(params, start):
        p.data.copy_(s)
    fused = WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=True)
    versions = [p._version for p in params]
    with torch._dynamo.config.patch(recompile_limit=1):
        bins = fused.apply(1, rest)
    assert fused.fused and bins and all(one.fused is not None for one in bins)
    assert [one.key[:3] for one in bins] == [(bins[0].key.kind, 13, 768)]  # one kernel for the 8 tensors
    assert {one.key.kind for one in bins} == {(AMSGRAD_KNOWN if "amsgrad" in name else ADAM_KNOWN) if
                                              "adam" in name and rest < 1 else ADAM if "adam" in name else
                                              SGD_KNOWN if rest < 1 else SGD}
    for one in bins:
        assert len(_debug_get_cache_entry_list(one.fused.function.__code__)) == 1
    # the reference, from the bins' slices (views of the weights, moved now: w = moved - d is not needed)
    expected = torch.cat([start_flat for start_flat in (s.flatten() for s in start)]).double()
    terms = torch.zeros_like(expected)
    offset = 0
    for one in bins:
        for i in range(len(one.weights)):
            d, magnitude = _reference(one.key.kind, one, i)
            n = d.numel()
            expected[offset:offset + n] += d
            terms[offset:offset + n] = magnitude
            offset += n
    moved = torch.cat([p.detach().flatten() for p in params])
    fused.revert(bins)
    back = torch.cat([p.detach().flatten() for p in params])
    before = torch.cat([s.flatten() for s in start])
    tolerance = _ulp(torch.maximum(before.abs(), moved.abs())).double() + terms * 2**-20
    by_multi_flat = torch.cat([m.flatten() for m in by_multi])
    worst = {path: float(((value.double() - expected).abs() / tolerance).max())
             for path, value in (("fused", moved), ("multi-tensor", by_multi_flat))}
    differ = float((moved != by_multi_flat).float().mean())
    print(f"\n{name}, rest {rest}: error / tolerance {worst}; fused != multi-tensor in {differ:.1%} of the weights, "
          f"at most {float((moved - by_multi_flat).abs().max()):.1e}")
    assert all(w <= 1.0 for w in worst.values()), worst
    larger = torch.maximum(before.abs(), moved.abs())
    assert bool(((back - before).abs() <= _ulp(larger)).all()), "the way back must land within one ulp"
    assert [p._version for p in params] == versions  # in place through .data: no autograd version counter moved
    assert fused.peak_extra_bytes <= 2**20 * 4  # the compile's scratch at most (the move: the scalar table)


def test_a_second_move_with_another_lr_and_sign_compiles_nothing() -> None:
    params, optimizer = _stepped("adamw")
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=True)
    with prediction.moved(1, 0.5):  # may compile (or find the process's compiled pass)
        pass
    graphs, kernels = counters["stats"]["unique_graphs"], torch._inductor.metrics.generated_kernel_count
    start = [p.detach().clone() for p in params]
    for group in optimizer.optimizer.param_groups:
        group["lr"] *= 0.37
    with prediction.moved(2, 0.5):  # another lr, another k; and the way back's negated scale
        moved = [p.detach().clone() for p in params]
    assert (counters["stats"]["unique_graphs"], torch._inductor.metrics.generated_kernel_count) == (graphs, kernels)
    assert any(not torch.equal(m, s) for m, s in zip(moved, start))
    larger = [torch.maximum(s.abs(), m.abs()) for s, m in zip(start, moved)]
    assert all(bool(((p.detach() - s).abs() <= _ulp(x)).all()) for p, s, x in zip(params, start, larger))


def test_cuts_and_bins() -> None:
    """Big tensors in slices of one length (the largest power of two dividing them all, 2^16 to 2^20), smaller ones
    and remainders by a length that divides them, bins as equal as possible."""
    block = [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768, 768 * 3072, 3072, 3072 * 768, 768]
    lengths: dict[int, int] = {}
    for numel, pieces in zip(block, cuts(block, 4)):
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        for lo, hi in pieces:
            lengths[hi - lo] = lengths.get(hi - lo, 0) + 1
    assert lengths == {65536: 108, 768: 13}
    assert chunks(108, 32) == [27] * 4 and chunks(13, 32) == [13] and chunks(33, 32) == [17, 16]
    assert cuts([2**22, 2**21], 4) == [[(i * 2**20, (i + 1) * 2**20) for i in range(4)],
                                       [(0, 2**20), (2**20, 2**21)]]
    # a remainder (70000 = 65536 + 4464), an odd size (10) and a size cut at 16-byte boundaries only
    assert cuts([70000, 10, 4464 * 2, 6], 4) == [[(0, 65536), (65536, 70000)], [(0, 10)],
                                                  [(0, 4464), (4464, 8928)], [(0, 6)]]


# -- one GPT-2-small block: kernels and bytes per parameter, fused against the multi-tensor passes ----------------

_ARG_TYPES = re.compile(r"(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[([^\]]*)\]")
_ITEMSIZE = {"float": 4, "double": 8, "int64_t": 8, "int32_t": 4, "bool": 1}


def _kernels_and_bytes(code: str) -> tuple[int, int, int]:
    """The kernel calls in the generated wrapper's ``call``, the loop nests in their C++ (the GPU's kernels: see
    [Note: the fused prediction pass]) and the bytes the calls' pointer arguments read and write (each argument's
    numel from the wrapper's example inputs, its element size and direction from the kernel's C++ signature)."""
    body = code[code.index("def call("):code.index("return ()", code.index("def call("))]
    calls = re.findall(r"^\s+((?:cpp_fused_|extern_kernels\.|aten\.|torch\.ops\.)[\w.]*)\(([^)]*)\)", body, re.M)
    nests = len(re.findall(r"for\(int64_t x0=", code))  # the outermost loop of each loop nest
    types = {name: [t.strip(" '") for t in listed.split(",")] for name, listed in _ARG_TYPES.findall(code)}
    moved = 0
    for name, args in calls:
        for arg, kind in zip([a.strip() for a in args.split(",")], types[name], strict=True):
            shape = re.search(rf"\b{arg} = (?:rand_strided|torch\.as_strided)\((?:_shared_storage_\d+, )?"
                              rf"\(([\d, ]*)\)", code)
            assert shape is not None, arg
            numel = math.prod(int(x) for x in shape.group(1).split(",") if x.strip())
            moved += numel * _ITEMSIZE[kind.replace("const ", "").rstrip("*")]
    return len(calls), nests, moved


def _slices_and_length(code: str) -> tuple[int, int]:
    """The signature a generated module was compiled for: its scalar table's rows and its slices' length."""
    table = re.search(rf"rand_strided\(\((\d+), {ROW}\), \({ROW}, 1\)", code)
    length = re.search(r"(?:as_strided\(_shared_storage_\d+, |rand_strided\()\((\d+), \), \(1, \)", code)
    assert table is not None and length is not None
    return int(table.group(1)), int(length.group(1))


@pytest.mark.parametrize("rest", [0.5, 1.0])
def test_a_gpt2_small_block_moves_in_one_kernel_per_bin(rest: float) -> None:
    """AdamW on one GPT-2-small block, with half a window of gradient known (``rest=0.5``) or none: per bin one
    ``cpp_fused_*`` kernel, per move one scalar copy (none on the CPU: a GPU's host-to-device copy, counted), 20
    (16) bytes per parameter each way; printed against the multi-tensor passes."""
    params, stage = gpt2_small_block("adamw")
    elements = sum(p.numel() for p in params)
    multi = WeightPrediction(stage.optimizer, stage.pairs, fused=False)
    with multi.moved(1, rest):  # reads the step counts once
        pass
    meter = KernelMeter()
    with meter:
        multi.revert(multi.apply(1, rest))
    multi_launches = meter.launches["other"] / 2
    multi_bytes = (meter.read["other"] + meter.written["other"]) / elements / 2

    prediction = WeightPrediction(stage.optimizer, stage.pairs, fused=True)
    before = [p.detach().clone() for p in params]
    bins, codes = run_and_get_code(prediction.apply, 1, rest)  # resets dynamo: every signature compiles here
    moved = [p.detach().clone() for p in params]
    graphs = counters["stats"]["unique_graphs"]
    prediction.revert(bins)
    assert counters["stats"]["unique_graphs"] == graphs  # the way back: the same kernels
    counted = {_slices_and_length(code): _kernels_and_bytes(code) for code in codes}
    assert sorted(counted) == sorted({one.key[1:3] for one in bins}), "one generated module per signature"
    calls = sum(counted[one.key[1:3]][0] for one in bins)
    kernels = sum(counted[one.key[1:3]][1] for one in bins) + 1  # + the move's scalar copy (a GPU's)
    moved_bytes = sum(counted[one.key[1:3]][2] for one in bins) / elements
    print(f"\nadamw, rest {rest}, each way: fused {len(bins)} bins {[one.key[1:3] for one in bins]}, {calls} "
          f"cpp_fused calls, {kernels} kernels (loop nests, with the move's scalar copy), {moved_bytes:.1f} B per "
          f"parameter; multi-tensor {multi_launches:.0f} launches, {multi_bytes:.1f} B per parameter")
    assert all(counted[one.key[1:3]][:2] == (1, 1) for one in bins)  # one call, one loop nest
    assert kernels <= FUSED_KERNELS_PER_BIN * len(bins)
    assert moved_bytes <= FUSED_BYTES_PER_PARAMETER
    assert kernels < multi_launches and moved_bytes < multi_bytes
    assert any(not torch.equal(m, b) for m, b in zip(moved, before))
    larger = [torch.maximum(b.abs(), m.abs()) for b, m in zip(before, moved)]
    assert all(bool(((p.detach() - b).abs() <= _ulp(x)).all()) for p, b, x in zip(params, before, larger))


def test_a_pass_that_does_not_compile_falls_back_to_the_multi_tensor_passes_said_once(monkeypatch) -> None:
    monkeypatch.setattr(fused_prediction, "_PASSES", {})
    tries: list[PassSignature] = []

    def fail(self: FusedPass, *args: Any) -> int:
        tries.append(self.signature)
        raise RuntimeError("no compiler here\n(details)")

    monkeypatch.setattr(FusedPass, "compile", fail)
    params, optimizer = _stepped("adamw")
    start = [p.detach().clone() for p in params]
    with WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=False).moved(1, 0.5):
        expected = [p.detach().clone() for p in params]
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=True)
    with pytest.warns(UserWarning, match=r"did not compile \(RuntimeError: no compiler here\); the weight "
                                         r"prediction runs in multi-tensor passes instead"):
        with prediction.moved(1, 0.5):
            moved = [p.detach().clone() for p in params]
    assert not prediction.fused and len(tries) == 1
    assert all(torch.equal(m, e) for m, e in zip(moved, expected))  # the multi-tensor passes' bits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with prediction.moved(1, 0.5):
            pass
    assert len(tries) == 1
    assert all(bool(((p.detach() - s).abs() <= _ulp(torch.maximum(s.abs(), e.abs()))).all())
               for p, s, e in zip(params, start, expected))


def test_a_timed_move_compiles_before_its_first_mark(monkeypatch) -> None:
    """[Note: the prediction's budget] times the first compensated forward's move and way back: the compile of its
    signatures runs before the first mark; the scalar copy within the move."""
    monkeypatch.setattr(fused_prediction, "_PASSES", {})
    log: list[str] = []

    def compile(self: FusedPass, *args: Any) -> int:
        log.append("compile")
        self.compiled = True
        return 0

    monkeypatch.setattr(FusedPass, "compile", compile)
    monkeypatch.setattr(FusedPass, "__call__", lambda self, *args: log.append("pass"))
    monkeypatch.setattr(fused_prediction, "scalar_table", lambda *args: log.append("copy") or torch.zeros(2, 13, ROW))
    monkeypatch.setattr(weight_prediction, "scalar_table", fused_prediction.scalar_table)

    class Timer:
        timing = True

        def mark(self) -> None:
            log.append("mark")

    params, optimizer = _stepped("adamw")
    prediction = WeightPrediction(optimizer.optimizer, optimizer.pairs, fused=True)
    prediction.timer = Timer()
    with prediction.moved(1, 0.5):
        log.append("forward")
    assert log == ["compile", "mark", "copy", "pass", "mark", "forward", "mark", "pass", "mark"]


def test_the_fused_pass_is_the_default_on_cuda_only() -> None:
    params, optimizer = _stepped("sgd_nesterov")
    assert WeightPrediction(optimizer.optimizer, optimizer.pairs).fused is False  # the CPU: multi-tensor passes
    assert not fused_by_default([torch.device("cpu")]) and not fused_by_default([])
