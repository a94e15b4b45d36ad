"""``PACIStrategy(plan="auto")`` at setup: measure, search, apply, say what was chosen, and check it against the run.

[Note: the plan at setup]
Global rank 0 measures the unchanged model on the setup's sample micro-batch ([Note: the plan's measurements] in
planner/costs.py; cached under ``<default_root_dir>/paci_plan/costs-<fingerprint>.json``, the fingerprint
being the module's class, its parameters' names, shapes and dtypes, the sample's shapes and dtypes, the device and
torch's version), every rank receives the measurements, and the search ([Note: the plan search]) runs on each
identically. The processes are already started and their groups made when the data can first be read, so the
launch layout (stages x replicas, virtual stages and their placement) is a constraint here; the search still runs
over every layout of the world's size, and when another one is predicted at least 10% faster the log names the
options that launch it (``python -m lightning_paci.plan`` prints the whole choice before any launch). The chosen
micro-batches, cut points, recomputing stages and reduction mode replace the options left at their defaults (an
option given another value is a constraint) in ``strategy.config`` on every rank, before the stages are cut.

``PlanCheck`` then counts the activation bytes each stage keeps (the runtime's meter) and times the stage's steady
batches, from the second batch to the ``CHECK_AFTER``-th (or the end of training), and logs predicted against
measured as ``paci/plan/{predicted,measured}_{samples_per_s,activation_bytes}/stage_<s>``, warning with the
numbers where they differ by more than 15%.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_paci.config import format_bytes
from lightning_paci.engine.runtime.microbatch import microbatch_size, split_microbatches
from lightning_paci.engine.transport.messages import flatten
from lightning_paci.integration.stage.lightning_program import extract_loss
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.stage.setup_probe import (
    Sample,
    cuda_devices,
    draw_sample,
    trace_call_order,
    without_side_effects,
)
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.partition.blocks import CallTrace, find_block_containers
from lightning_paci.planner import Layout, ModelCosts, Plan, Space, measure_costs, search_plans, simulate_plan
from lightning_paci.planner.table import format_plans, mismatches, plan_options
from lightning_paci.simulation.timeline import save_timeline_png

__all__ = ["CHECK_AFTER", "PlanCheck", "choose_plan", "layouts", "optimizer_factor", "plan_meta_built", "profile"]

log = logging.getLogger(__name__)

CHECK_AFTER = 8  # batches timed for the check (the first excluded: it fills the pipeline)
ADVISE_GAIN = 1.10  # another launch layout is named when predicted this much faster


def optimizer_factor(optimizer: Any) -> float:
    """Optimizer state bytes per parameter byte: Adam's two moments, SGD's momentum buffer, plain SGD none."""
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name in ("SGD", "RMSprop"):
        return float(bool(group.get("momentum", 0))) + (name == "RMSprop")
    if name in ("Adagrad",):
        return 1.0
    return 2.0


def _fingerprint(module: torch.nn.Module, data: Any, device: torch.device) -> str:
    described = [type(module).__qualname__, str(device), torch.__version__]
    described += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in module.named_parameters()]
    described += [f"{tuple(t.shape)}:{t.dtype}" for t in flatten(data)[1]]
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:16]


def profile(module: Any, data: Any, *, batch_size: int, block_container: Any, trace: CallTrace | None,
            device: torch.device, factor: float, step_context: Any = contextlib.nullcontext) -> ModelCosts:
    """[Note: the plan's measurements] of ``module`` on the micro-batch ``data`` (on ``device``) and on about half
    of it, the step run as the Trainer runs it (``self.log`` recorded and dropped; ``batch_size``: the whole
    batch's samples), leaving no trace (RNG and buffers restored)."""
    size = microbatch_size(data)
    parts = {size: data}
    if size >= 2:
        half = split_microbatches(data, 2)[-1]
        parts[microbatch_size(half)] = half

    def step(part: Any) -> Any:
        def run() -> torch.Tensor:
            with recording_logs(module, [], batch_size, "training_step"), step_context():
                return extract_loss(module.training_step(part, 0), "training_step")
        return run
    blocks = [b for _, c in find_block_containers(module, block_container, trace) for b in c]
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with without_side_effects(module, cuda_devices=cuda_devices(device)):
        return measure_costs(module, blocks, {k: step(v) for k, v in parts.items()}, optimizer_factor=factor,
                             synchronize=synchronize)


def _measure(strategy: PipelineStrategy, trainer: Trainer, module: Any, sample: Sample,
             trace: CallTrace | None) -> ModelCosts:
    """The measurements on rank 0 (from the cache when present), written to the cache."""
    data = strategy.precision_plugin.convert_input(strategy.batch_to_device(sample.data))
    fingerprint = _fingerprint(module, data, strategy.root_device)
    cache = Path(trainer.default_root_dir) / "paci_plan" / f"costs-{fingerprint}.json"
    if cache.is_file():
        rank_zero_info(f"lightning_paci: plan='auto' reads the measured costs from {cache} (delete it to measure "
                       f"again)")
        return ModelCosts.from_json(json.loads(cache.read_text()))
    optimizers = api.configured_optimizers(module)
    costs = profile(module, data, batch_size=sample.size, block_container=strategy.config.block_container,
                    trace=trace, device=strategy.root_device, step_context=strategy.precision_plugin.train_step_context,
                    factor=optimizer_factor(optimizers[0]) if optimizers else 2.0)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(costs.to_json()))
    tmp.replace(cache)
    return costs


def _space(strategy: PipelineStrategy, sample: Sample, layouts: tuple[Layout, ...]) -> Space:
    """The search space: each option left at its default is free, any other value fixes it."""
    config = strategy.config
    partition = config.partition
    reduce = None
    if config.deferred_update:
        reduce = "deferred"
    elif config.reduce_bucket_mb is None:
        reduce = "blocking"
    elif config.reduce_bucket_mb != 25.0:
        reduce = "buckets"
    recompute = None if config.recompute == "off" else (config.recompute_stages or strategy.topology.pipeline)
    return Space(schedule=config.schedule, batch_size=sample.size, layouts=layouts, microbatches=config.microbatches,
                 accumulation=config.accumulation,
                 bounds=tuple(partition) if not isinstance(partition, str) else None,
                 recompute_stages=recompute, reduce=reduce, memory_budget=config.budget_bytes)


def layouts(world: int) -> tuple[Layout, ...]:
    """Every launch layout of ``world`` processes: at least 2 stages, one or two stages per process (loop, V)."""
    return tuple(Layout(world // d, d, vv, pl) for d in range(1, world // 2 + 1) if world % d == 0
                 for vv, pl in ((1, "loop"), (2, "loop"), (2, "v")))


def choose_plan(strategy: PipelineStrategy, trainer: Trainer, module: Any, sample: Sample | None,
                trace: CallTrace | None) -> Plan | None:
    """[Note: the plan at setup]: measure, search, replace ``strategy.config``; None (logged) where nothing can be
    measured (no sample batch, a model built on the meta device)."""
    if sample is None:
        log.warning("lightning_paci: plan='auto' needs a sample batch of the training data; the options as given are "
                    "used")
        return None
    costs = _measure(strategy, trainer, module, sample, trace) if strategy.is_global_zero else None
    costs = strategy.broadcast(costs, src=0)
    topology, config = strategy.topology, strategy.config
    launched = Layout(topology.pipeline, topology.data, config.virtual_stages, config.placement)
    plans = search_plans(costs, _space(strategy, sample, (launched,)))
    if not plans:
        raise ValueError(f"`plan='auto'`: no plan of {launched.describe()} over {costs.num_blocks} blocks keeps the "
                         f"drift bound; pass `microbatches=` yourself.")
    chosen = plans[0]
    if not chosen.fits:
        raise ValueError(
            f"`memory_budget` ({format_bytes(config.budget_bytes or 0)} per process): no plan of "
            f"{launched.describe()} fits; the smallest predicted peak is "
            f"{format_bytes(min(p.peak_memory for p in plans))}. Raise the budget, or "
            f"launch more stages (`devices=`).")
    rank_zero_info(format_plans(plans, chosen, budget=config.budget_bytes))
    if strategy.is_global_zero:
        _draw(costs, chosen, config.schedule, sample.size, Path(trainer.default_root_dir) / "paci_plan" / "plan.png")
    everywhere = search_plans(costs, _space(strategy, sample, layouts(topology.world)))
    better = next((p for p in everywhere if p.fits), None)
    if better is not None and better.samples_per_s > ADVISE_GAIN * chosen.samples_per_s:
        options = plan_options(better)
        keys = ("pipeline_parallel_size", "data_parallel_size", "virtual_stages", "placement")
        rank_zero_info(f"lightning_paci: launched as {launched.describe()}; {better.layout.describe()} is predicted "
                       f"{better.samples_per_s / chosen.samples_per_s:.2f}x faster: pass "
                       + ", ".join(f"{k}={options[k]!r}" for k in keys if k in options))
    options = plan_options(chosen)
    strategy.config = replace(config, microbatches=chosen.microbatches, partition=options["partition"],
                              recompute=options["recompute"], recompute_stages=options.get("recompute_stages"),
                              reduce_bucket_mb=options.get("reduce_bucket_mb", config.reduce_bucket_mb),
                              deferred_update=options.get("deferred_update", config.deferred_update))
    trainer.callbacks.append(PlanCheck(chosen))  # type: ignore[attr-defined]  # set in Trainer.__init__
    for logger in trainer.loggers if strategy.is_global_zero else []:
        logger.log_hyperparams({"paci_plan": {k: str(v) for k, v in options.items()}
                                | {"predicted_samples_per_s": chosen.samples_per_s,
                                   "predicted_peak_memory_bytes": chosen.peak_memory}})
    return chosen


def _draw(costs: ModelCosts, plan: Plan, schedule: str, batch_size: int, path: Path) -> None:
    """The chosen plan's simulated Gantt chart (three batches), where matplotlib is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    result = simulate_plan(costs, plan, schedule, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_timeline_png(result.intervals, plan.layout.stages, path, chunks=result.interval_chunks,
                      title=f"plan: {plan.layout.describe()}, m={plan.microbatches}, cuts {list(plan.bounds[1:-1])}")
    rank_zero_info(f"lightning_paci: the chosen plan's predicted timeline: {path}")


def plan_meta_built(strategy: PipelineStrategy, module: Any, build_whole: Callable[[], None],
                    params: Sequence[torch.nn.Parameter]) -> tuple[Sample, int] | None:
    """``plan="auto"`` for a model ``configure_model`` built on the meta device, while the hook runs (the cut
    decides which parameters each stage builds): global rank 0 builds the whole model (``build_whole``: the
    user's initialization replayed) if three times its parameters fit the free memory, measures and chooses; the
    other ranks wait for the choice. Returns the sample batch and the step's forward FLOPs (``trace_call_order``)
    when a plan was chosen, else None (said once)."""
    trainer = module.trainer
    if strategy.config.plan != "auto" or trainer.state.fn != TrainerFn.FITTING:
        return None
    sample = draw_sample(trainer, strategy.num_microbatches, cuda_devices(strategy.root_device))
    total = sum(p.numel() * p.element_size() for p in params)
    room = strategy.broadcast(strategy.is_global_zero and sample is not None
                              and 3 * total < _free_memory(strategy.root_device), src=0)
    if not room:
        rank_zero_warn(f"lightning_paci: plan='auto' measures the whole model on global rank 0, and this one "
                       f"({total / 2**30:.1f} GiB of parameters, built in `configure_model`) does not fit there "
                       f"three times (or no sample batch could be drawn): the options are used as given. "
                       f"`python -m lightning_paci.plan` measures it where it fits and prints the options to pass.")
        return None
    if strategy.is_global_zero:
        build_whole()
    trace, flops = trace_call_order(strategy, module, sample)
    choose_plan(strategy, trainer, module, sample, trace)
    assert sample is not None
    return sample, flops


def _free_memory(device: torch.device) -> float:
    """Bytes free on ``device`` (the host's available memory for the CPU)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class PlanCheck(Callback):
    """Predicted against measured, per stage ([Note: the plan at setup]). The time is what the stage spends inside
    its training batches (validation, checkpoints and the drains before them are not the plan's), from the second
    batch on: the first fills the pipeline."""

    def __init__(self, plan: Plan, check_after: int = CHECK_AFTER) -> None:
        self.plan, self.check_after = plan, check_after
        self._batches = 0
        self._began = 0.0
        self._seconds = 0.0
        self._samples = 0
        self._done = False
        self._was: dict[int, bool] = {}
        self.figures: dict[str, float] = {}

    @override
    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        for stage, runtime in trainer.strategy.runtimes.items():  # type: ignore[attr-defined]
            self._was[stage] = runtime.records.activations
            runtime.records.measure(activation_bytes=True)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._began = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._done:
            return
        self._batches += 1
        if self._batches > 1:
            self._seconds += time.perf_counter() - self._began
            self._samples += microbatch_size(batch)
        if self._batches >= self.check_after:
            self._check(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not self._done and self._batches:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        self._done = True
        strategy = cast(PipelineStrategy, trainer.strategy)  # this callback is installed by PACIStrategy only
        process = strategy.stage_index
        measured = {"activation_bytes": float(sum(r.records.peak_activation_bytes for r in strategy.runtimes.values()))}
        if self._seconds > 0:
            measured["samples_per_s"] = self._samples / self._seconds
        predicted = {"samples_per_s": self.plan.samples_per_s, "activation_bytes": self.plan.activations[process]}
        self.figures = {f"paci/plan/{kind}_{key}/stage_{process}": value
                        for kind, values in (("predicted", predicted), ("measured", measured))
                        for key, value in values.items()}
        for stage, runtime in strategy.runtimes.items():
            runtime.records.measure(activation_bytes=self._was.get(stage, False))
        if trainer.loggers:
            strategy.log_figures(self.figures, trainer.global_step)
        off = mismatches(predicted, measured)
        if not off:
            return
        text = f"lightning_paci: stage {process}: the plan's prediction differs from the run by more than 15%: " \
            + "; ".join(off)
        cores = os.cpu_count() or 1
        if strategy.root_device.type == "cpu" and strategy.num_processes > cores:
            # not the user's to act on: the prediction is for one device per stage
            log.info(f"{text} ({strategy.num_processes} stage processes share {cores} CPU cores here; the prediction "
                     f"assumes a device per stage)")
        else:
            log.warning(text)
