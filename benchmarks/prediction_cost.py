"""The weight prediction's cost against a stage's forward+backward on a GPU, by arithmetic from bytes counted here.

``python -m benchmarks prediction``: a compensated forward moves the stage's weights ahead and back
([Note: weight prediction]); that reads and writes every weight, both Adam moments and the window's gradient, so on
a GPU its time is its bytes over the memory bandwidth, while a stage's forward+backward is ~6 FLOPs per parameter
and token plus attention. The bytes per parameter are counted on this CPU for both paths, on a real GPT-2-small
block with AdamW state and half a window of gradient: the multi-tensor passes from every aten operation's inputs
and outputs (a ``TorchDispatchMode``), the fused pass ([Note: the fused prediction pass]) from its bins (each slice
read once per input and its weights written once, as its one kernel per bin does: tests/test_fused_prediction.py
counts the kernels). The ratio to forward+backward then follows for GPT-2-small and a Llama-7B-shaped layer at
several tokens per micro-batch, on an assumed device: an H100 SXM at 40% of its 989 TFLOP/s bf16 peak for the
compute and 80% of its 3.35 TB/s for the passes (148 FLOPs per byte). Not measured on a GPU: the smoke script
(tests/gpu_smoke.py, ``prediction_cost``) times both paths with CUDA events where a GPU is lent.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.harness import Benchmark, print_table

PEAK_FLOPS, MFU = 989e12, 0.40  # H100 SXM, dense bf16; the share a stage's forward+backward reaches
BANDWIDTH, BANDWIDTH_SHARE = 3.35e12, 0.80  # HBM3 bytes/s; the share a streaming pass reaches
# (name, parameters, hidden width, layers, sequence length) of one stage's worth of each model
SHAPES = [("gpt2-small block", 7_087_872, 768, 1, 1024), ("llama-7b layer", 202_383_360, 4096, 1, 4096)]


class _Bytes(TorchDispatchMode):
    """Bytes of every aten operation's tensor inputs (read) and outputs (written); views move none."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "alias", "empty", "empty_like", "empty_strided", "_local_scalar_dense"):
            return out
        written = args[0] if name.endswith("_") else out  # an in-place operation writes its first argument
        self.moved += _bytes((args, kwargs)) + _bytes(written)
        return out


def _bytes(values: Any) -> int:
    return sum(v.numel() * v.element_size() for v in tree_flatten(values)[0] if isinstance(v, torch.Tensor))


def _block() -> tuple[list[torch.nn.Parameter], Any]:
    """A GPT-2-small block with AdamW state (two updates) and half a window of gradient."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from lightning_paci.optim.stage_optimizer import StageOptimizer

    torch.manual_seed(0)
    block = GPT2Block(GPT2Config(n_embd=768, n_head=12, n_positions=64))
    params = list(block.parameters())
    stage = StageOptimizer(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1), params)
    x = torch.randn(2, 16, 768)
    for _ in range(2):
        block(x)[0].sum().backward()
        stage.step()
    block(x)[0].sum().backward()
    return params, stage


def bytes_per_parameter(rest: float = 0.5) -> dict[str, float]:
    """Bytes read and written per parameter by one move (the way back is the same): multi-tensor, fused."""
    from lightning_paci.optim.weight_prediction import WeightPrediction

    params, stage = _block()
    elements = sum(p.numel() for p in params)
    multi = WeightPrediction(stage.optimizer, stage.pairs, fused=False)
    bins = multi.apply(1, rest)  # the step counts read once
    multi.revert(bins)
    counter = _Bytes()
    with counter:
        bins = multi.apply(1, rest)
    multi.revert(bins)
    fused = 0
    for one in bins:  # the fused kernel reads each slice of every input once and writes its weights once
        for group in (one.weights, one.first, one.second, one.peak, one.grads, one.weights):
            fused += sum(t.numel() * t.element_size() for t in group)
    return {"multi-tensor": counter.moved / elements, "fused": fused / elements}


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768],
                        help="tokens per micro-batch")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    counted = {rest: bytes_per_parameter(rest) for rest in (0.5, 1.0)}
    print_table("bytes read and written per parameter, one move (the way back the same), AdamW, float32", [
        {"gradient": "half a window known" if rest < 1 else "none known", **figures}
        for rest, figures in counted.items()], [("gradient", "s"), ("multi-tensor", ".1f"), ("fused", ".1f")])
    compute, bandwidth = PEAK_FLOPS * MFU, BANDWIDTH * BANDWIDTH_SHARE
    rows = []
    for name, parameters, width, layers, seq in SHAPES:
        for tokens in args.tokens:
            flops = 6 * parameters * tokens + 12 * layers * width * seq * tokens  # weights, then attention
            seconds = flops / compute
            row: dict[str, Any] = {"stage": name, "tokens": tokens, "F+B ms": 1e3 * seconds}
            for path, per_parameter in counted[0.5].items():
                row[path] = 2 * per_parameter * parameters / bandwidth / seconds  # the move and the way back
            rows.append(row)
    print_table(f"a compensated forward's move and way back against the stage's forward+backward, by arithmetic "
                f"({compute / bandwidth:.0f} FLOPs per byte; 'auto' switches the prediction off above 10%)", rows,
                [("stage", "s"), ("tokens", "d"), ("F+B ms", ".2f"), ("multi-tensor", ".1%"), ("fused", ".1%")])
    return {"bytes_per_parameter": {str(k): v for k, v in counted.items()}, "ratios": rows,
            "device": {"flops": compute, "bandwidth": bandwidth}}


prediction = Benchmark(_arguments, _run, __doc__ or "")
