"""``compile="blocks"`` against eager: one stage's blocks, forward and backward, per micro-batch.

What the option changes is each block's own code; the pipeline around it (messages, hooks, the schedule) is the
same. So this times what a stage runs per micro-batch -- its blocks' forward and backward -- eager and compiled with
``BlockCompile`` (engine/blocks/block_compile.py), in one process on one thread, alternating the two over ``--repeats``
rounds after a warm-up that includes the compilation, and reports the median time and the ratio. The compile time
(first forward and backward) is reported on its own. The blocks are examples/train_gpt.py's GPT-2 (transformers).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import Benchmark, print_table


def _blocks(width: int, layers: int) -> torch.nn.ModuleList:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=256, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).transformer.h


def _step(blocks: torch.nn.ModuleList, x: torch.Tensor) -> None:
    h = x
    for block in blocks:
        out = block(h)
        h = out[0] if isinstance(out, tuple) else out
    h.square().mean().backward()


def _time(blocks: torch.nn.ModuleList, x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        _step(blocks, x)
    return (time.perf_counter() - start) / steps


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from lightning_paci.engine.blocks.block_compile import BlockCompile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for backend in args.backends:
        eager = _blocks(args.width, args.layers)
        compiled = _blocks(args.width, args.layers)
        compiled.load_state_dict(eager.state_dict())
        BlockCompile(list(compiled), backend=backend)
        x = torch.randn(args.batch, args.seq, args.width, requires_grad=True)
        began = time.perf_counter()
        _step(compiled, x)  # the compilation
        compile_s = time.perf_counter() - began
        _step(eager, x)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            times["eager"].append(_time(eager, x, args.steps))
            times["compiled"].append(_time(compiled, x, args.steps))
        eager_ms, compiled_ms = (1e3 * statistics.median(times[k]) for k in ("eager", "compiled"))
        rows.append({"backend": backend, "eager_ms": eager_ms, "compiled_ms": compiled_ms,
                     "speedup": eager_ms / compiled_ms, "compile_s": compile_s})
    print_table(f"{args.layers} GPT-2 blocks of width {args.width}, micro-batch {args.batch} x {args.seq}, forward + "
                f"backward, one thread, median of {args.repeats} rounds of {args.steps}", rows,
                [("backend", "s"), ("eager_ms", ".1f"), ("compiled_ms", ".1f"), ("speedup", ".2f"),
                 ("compile_s", ".1f")])
    return rows


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", nargs="+", default=["inductor"], help="torch.compile backends")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="blocks of the stage")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)


compile = Benchmark(_arguments, run, __doc__ or "")
