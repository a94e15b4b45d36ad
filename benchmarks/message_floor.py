"""The machine's ceiling for a flush-free 1F1B on the emulated cluster: every stage's list of ``build("paci", ...)``
executed with nothing but the emulated kernels (emulated.sleep_until) and one raw 16 KiB gloo message per ``SEND``
(directed process groups, each receive posted as soon as the previous one on its link completed): no framing, no
model, no Lightning, no records. Whatever a real runtime adds comes on top of this.

    cd benchmarks && python message_floor.py --stages 4 8 [--forward-ms 10 --backward-ms 20]

On the 2-core machine it is well below 1: after each emulated kernel the host's caches are cold (the first torch call
after a 10 ms sleep takes ~30 us instead of ~2 us) and in a 1F1B steady state every message is on the critical loop
(two hops per stage and micro-batch, ``2 (N - 1) / N`` per micro-batch on stage 0's loop).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_paci.schedules import RECV_B, RECV_F, SEND_B, SEND_F, B, F, build

from emulated import add_shape_arguments, sleep_until

_BYTES = 16384


def _stage(rank: int, n: int, m: int, k: int, forward_s: float, backward_s: float, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    # one group per neighbour pair and direction, created in the same order on every rank
    links = {(kind, s): dist.new_group([s, s + 1]) for s in range(n - 1) for kind in ("F", "B")}
    actions = build("paci", n, m, m, k).actions[rank]
    peer_of = {SEND_F: rank + 1, SEND_B: rank - 1, RECV_F: rank - 1, RECV_B: rank + 1}
    link_of = {SEND_F: ("F", rank), SEND_B: ("B", rank - 1), RECV_F: ("F", rank - 1), RECV_B: ("B", rank)}
    remaining = {kind: sum(a.kind is kind for a in actions) for kind in (RECV_F, RECV_B)}
    posted: dict[str, tuple[object, torch.Tensor]] = {}

    def post(kind: str) -> None:
        group = links[link_of[kind]]
        buffer = torch.empty(_BYTES, dtype=torch.uint8)
        posted[kind] = (group.recv([buffer], dist.get_group_rank(group, peer_of[kind]), 0), buffer)

    message = torch.zeros(_BYTES, dtype=torch.uint8)
    sends = []
    starts: dict[int, float] = {}
    for kind in (RECV_F, RECV_B):
        if remaining[kind]:
            post(kind)
    dist.barrier()
    for action in actions:
        kind = action.kind
        if kind is F:
            starts[action.microbatch] = time.perf_counter()
            sleep_until(starts[action.microbatch] + forward_s)
        elif kind is B:
            sleep_until(time.perf_counter() + backward_s)
        elif kind is SEND_F or kind is SEND_B:
            group = links[link_of[kind]]
            sends.append(group.send([message], dist.get_group_rank(group, peer_of[kind]), 0))
        elif kind is RECV_F or kind is RECV_B:
            work, _ = posted.pop(kind)
            work.wait()  # type: ignore[attr-defined]
            remaining[kind] -= 1
            if remaining[kind]:
                post(kind)
    for work in sends:
        work.wait()
    if rank == 0:
        steady = starts[(k - 1) * m] - starts[m]
        with open(out, "w") as fh:
            fh.write(str((k - 2) * m * (forward_s + backward_s) / steady))
    dist.barrier()
    dist.destroy_process_group()


def floor_efficiency(num_stages: int, num_microbatches: int = 8, num_minibatches: int = 10,
                     forward_ms: float = 10.0, backward_ms: float = 20.0) -> float:
    """Steady efficiency (stage 0, mini-batches 1 .. K-1, as ``emulated.steady_seconds``) of the bare message loop."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "efficiency")
        mp.start_processes(_stage, args=(num_stages, num_microbatches, num_minibatches, forward_ms / 1e3,
                                         backward_ms / 1e3, os.path.join(tmp, "rdv"), out),
                           nprocs=num_stages, start_method="fork")
        with open(out) as fh:
            return float(fh.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    args = parser.parse_args()
    for n in args.stages:
        efficiency = floor_efficiency(n, args.microbatches, args.minibatches, args.forward_ms, args.backward_ms)
        print(f"N = {n}, m = {args.microbatches}, F/B {args.forward_ms:g}/{args.backward_ms:g} ms: steady efficiency "
              f"of the bare message loop {efficiency:.3f}")


if __name__ == "__main__":
    main()
