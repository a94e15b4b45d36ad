"""How long each Lightning call of a stream spends choosing its actions (lightning_paci.engine.cursor.StreamCursor).

    python benchmarks/cursor_speed.py [--stages 8 --microbatches 8 --accumulation 8 --calls 256 --untied]

Every stage runs its own process in a real run, so the figures are per stage: the slowest single call (the first
call builds the template; a drain builds at most a few more) and the whole stream (calls - 1 segments, then the
drain). "first stream" starts from empty caches, as a new process does; "later stream" is the next stream of the
same process.
"""

from __future__ import annotations

import argparse
import time

from lightning_paci.engine import cursor as cursor_module
from lightning_paci.engine.cursor import StreamCursor


def _stream(name: str, args: argparse.Namespace, stage: int) -> tuple[float, float]:
    """(slowest call, total) in seconds for one stage's stream."""
    cursor = StreamCursor(name, args.stages, args.microbatches, args.accumulation, stage, tied=not args.untied)
    times = []
    for call in range(args.calls - 1):
        t0 = time.perf_counter()
        cursor.segment(call)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    cursor.drain(args.calls)
    times.append(time.perf_counter() - t0)
    return max(times), sum(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedules", default="paci,1f1b,gpipe")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=8)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--untied", action="store_true", help="no tied weights (default: tied, the costlier case)")
    args = parser.parse_args()
    print(f"N={args.stages} m={args.microbatches} a={args.accumulation} tied={not args.untied}, {args.calls} calls "
          f"per stream; worst stage shown, milliseconds")
    print(f"{'schedule':>8} {'first stream: max call':>23} {'total':>8} {'later stream: max call':>23} {'total':>8}")
    for name in args.schedules.split(","):
        first, later = [], []
        for stage in range(args.stages):
            for cached in (cursor_module._built, cursor_module._steady_horizon, cursor_module._stage_template,
                           cursor_module._stage_tail):
                cached.cache_clear()
            first.append(_stream(name, args, stage))
            later.append(_stream(name, args, stage))
        print(f"{name:>8} {max(t[0] for t in first) * 1e3:>23.2f} {max(t[1] for t in first) * 1e3:>8.1f} "
              f"{max(t[0] for t in later) * 1e3:>23.2f} {max(t[1] for t in later) * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
