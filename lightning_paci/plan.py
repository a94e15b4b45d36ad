"""``python -m lightning_paci.plan``: the plan ``plan="auto"`` would choose, printed without training.

    python -m lightning_paci.plan my_package.my_module:MyLightningModule --devices 8 \\
        [--num-nodes 1] [--memory-budget 24GiB] [--schedule paci] [--accelerator cpu|cuda] [--costs costs.json]

``MODULE:NAME`` names a ``LightningModule`` class built with no arguments, or a function returning a
``LightningModule`` (or a ``(module, train_dataloader)`` pair); the first batch of its training data is the sample.
The module is measured on this machine ([Note: the plan's measurements]; ``--costs`` reads the measurements from a
file, or writes them there when it does not exist), every launch layout of ``devices x num_nodes`` processes is
searched ([Note: the plan search]) and the table is printed with the ``PACIStrategy`` options of the choice.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_paci.config import parse_bytes
from lightning_paci.planner import ModelCosts, Space, search_plans
from lightning_paci.planner.table import format_plans, plan_options

__all__ = ["main"]


def _load(spec: str) -> tuple[Any, Any]:
    """The module and its training data from ``MODULE:NAME``."""
    if ":" not in spec:
        raise SystemExit(f"`{spec}`: give the LightningModule as MODULE:NAME, e.g. my_package.model:GPT")
    module_name, attr = spec.split(":", 1)
    sys.path.insert(0, str(Path.cwd()))
    made = getattr(importlib.import_module(module_name), attr)()
    module, loader = made if isinstance(made, tuple) else (made, None)
    return module, loader if loader is not None else module.train_dataloader()


def _costs(args: argparse.Namespace, world: int) -> tuple[ModelCosts, int]:
    """The measurements (from ``--costs`` when it exists) and the batch size."""
    from lightning_paci.engine.runtime.microbatch import microbatch_size, split_microbatches
    from lightning_paci.integration.setup.auto_plan import optimizer_factor, profile
    from lightning_paci.integration.stage.logs import recording_logs
    from lightning_paci.optim.stage_optimizer import optimizer_and_step_schedulers
    from lightning_paci.partition.blocks import call_order

    module, loader = _load(args.module)
    batch = next(iter(loader))
    size = microbatch_size(batch)
    if args.costs is not None and args.costs.is_file():
        return ModelCosts.from_json(json.loads(args.costs.read_text())), size
    device = torch.device(args.accelerator)
    module.to(device)
    batch = [t.to(device) if isinstance(t, torch.Tensor) else t for t in batch] if isinstance(batch, (list, tuple)) \
        else batch
    data = split_microbatches(batch, max(1, min(world, size)))[0]

    def run() -> Any:
        with recording_logs(module, [], size, "training_step"), torch.no_grad():
            return module.training_step(data, 0)
    optimizer, _ = optimizer_and_step_schedulers(module.configure_optimizers())
    costs = profile(module, data, batch_size=size, block_container=None, trace=call_order(module, run),
                    device=device, factor=optimizer_factor(optimizer))
    if args.costs is not None:
        args.costs.write_text(json.dumps(costs.to_json()))
    return costs, size


def main(argv: Sequence[str] | None = None) -> int:
    from lightning_paci.integration.setup.auto_plan import layouts

    parser = argparse.ArgumentParser(prog="python -m lightning_paci.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", help="MODULE:NAME of a LightningModule class or factory")
    parser.add_argument("--devices", type=int, required=True, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--memory-budget", default=None, help="bytes per process, e.g. 24GiB")
    parser.add_argument("--schedule", default="paci")
    parser.add_argument("--accelerator", default="cpu", help="where to measure: cpu or cuda")
    parser.add_argument("--costs", type=Path, default=None, help="read the measurements here, or write them")
    parser.add_argument("--runners-up", type=int, default=5)
    args = parser.parse_args(argv)
    world = args.devices * args.num_nodes
    budget = parse_bytes("--memory-budget", args.memory_budget)
    costs, batch_size = _costs(args, world)
    plans = search_plans(costs, Space(schedule=args.schedule, batch_size=batch_size, layouts=layouts(world),
                                      memory_budget=budget))
    if not plans:
        print(f"no plan over {world} processes keeps the drift bound for {costs.num_blocks} blocks", file=sys.stderr)
        return 1
    print(format_plans(plans, plans[0], runners_up=args.runners_up, budget=budget))
    if not plans[0].fits:
        print(f"nothing fits --memory-budget {args.memory_budget}: the smallest predicted peak is "
              f"{min(p.peak_memory for p in plans):.0f} bytes per process", file=sys.stderr)
        return 1
    options = ", ".join(f"{k}={v!r}" for k, v in plan_options(plans[0]).items())
    print(f"\nPACIStrategy(schedule={args.schedule!r}, {options})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
