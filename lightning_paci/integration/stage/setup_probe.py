"""One sample micro-batch drawn at setup, and what the strategy learns from running the user's step on it.

Three things are decided from the step as the user wrote it rather than from the module's structure: the block
times of ``partition="balanced"`` (``measure_block_costs``), the order in which modules run (which stage
an outside module belongs to, [Note: outside modules go where they run] in partition/plan.py), and the values that
must be relayed past stage boundaries ([Note: relayed crossings] in partition/relay.py). All three use one sample:
the first micro-batch of the first batch of the dataloader the run is about to iterate, drawn once on every rank
(a dataloader with side effects stays in step across ranks) with the RNG and the module's buffers restored after
each use (``without_side_effects``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

import lightning_paci.errors as errors
from lightning_paci.engine.runtime.microbatch import microbatch_size, split_microbatches
from lightning_paci.integration.stage.lightning_program import extract_loss
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.partition import BlockCosts, PartitionPlan, StageCarve, profile_block_costs
from lightning_paci.partition.blocks import find_block_containers
from lightning_paci.partition.plan import CallTrace, call_order
from lightning_paci.partition.relay import RelayPlan, StageProbe, plan_relays, probe_crossings

__all__ = ["Sample", "cuda_devices", "draw_sample", "find_relays", "measure_block_costs", "trace_call_order",
           "without_side_effects"]

log = logging.getLogger(__name__)

_LOOPS = {TrainerFn.FITTING: ("fit_loop", "training_step"), TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
          TrainerFn.TESTING: ("test_loop", "test_step"), TrainerFn.PREDICTING: ("predict_loop", "predict_step")}


@dataclass
class Sample:
    """A micro-batch of the run's first batch, and the step that will run on it."""

    data: Any
    size: int  # samples in the whole batch (what ``self.log`` is told)
    step_name: str
    whole: Any = None  # the whole first batch, until setup has checked its loss ([Note: a loss that couples ...])


def draw_sample(trainer: Any, num_microbatches: int, cuda_devices: list[int]) -> Sample | None:
    """The first micro-batch of the first batch of the dataloader ``trainer`` is about to iterate (the RNG state,
    which seeds its workers, restored); None where it cannot be drawn (an empty or one-pass iterable), which is
    logged."""
    loop, step_name = _LOOPS.get(trainer.state.fn, ("fit_loop", "training_step"))
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            batch = next(iter(api.step_dataloader(trainer, loop)))
    except (RuntimeError, ValueError, TypeError, StopIteration, api.LightningAPIError,
            MisconfigurationException) as err:
        log.warning(f"lightning_paci: no sample batch at setup ({type(err).__name__}: {err}); blocks are not timed, "
                    f"outside modules are placed by registration order and no value is relayed past a stage")
        return None
    size = microbatch_size(batch)
    return Sample(split_microbatches(batch, max(1, min(num_microbatches, size)))[0], size, step_name, whole=batch)


def run_sample(module: LightningModule, sample: Sample, context: Callable[[], Any]) -> Callable[[], Any]:
    """A function running the user's step once on ``sample`` (its ``self.log`` calls recorded and dropped)."""
    def run() -> Any:
        with recording_logs(module, [], sample.size, sample.step_name), context():
            return getattr(module, sample.step_name)(sample.data, 0)
    return run


class _ForwardTracker(ModuleTracker):
    """The module tracking of a FLOP count for a step run without gradients: which modules an op runs inside,
    from the forward hooks alone. torch's tracker also hooks the gradient of every module's inputs and outputs to
    follow the backward; without gradients there is none, and a module input that is a view of a parameter made
    under ``no_grad`` (Mamba's, Jamba's, Zamba's convolution weights) requires grad without a gradient node, where
    that hook fails inside torch (``AssertionError: Expected gradient function to be set``)."""

    def _fw_pre_hook(self, mod: Any, input: Any) -> None:
        self._get_append_fn(self._get_mod_name(mod), False)()

    def _fw_post_hook(self, mod: Any, input: Any, output: Any) -> None:
        self._get_pop_fn(self._get_mod_name(mod), False)()


def forward_flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` for a step under ``torch.no_grad()`` (see ``_ForwardTracker``)."""
    counter = FlopCounterMode(display=False)
    if callable(getattr(ModuleTracker, "_fw_pre_hook", None)) and callable(getattr(ModuleTracker, "_fw_post_hook",
                                                                                   None)):
        counter.mod_tracker = _ForwardTracker()  # (a torch without these hooks keeps its own tracker)
    return counter


def trace_call_order(strategy: PipelineStrategy, module: LightningModule, sample: Sample | None
                     ) -> tuple[CallTrace | None, int]:
    """The order of the modules' first calls in one step of the whole model, and their counts (rank 0, no
    gradient; shared); and, on rank 0, the floating-point operations of that step's forward scaled to the whole
    batch (0 elsewhere), for the model summary, which counts none without an ``example_input_array``."""
    order: CallTrace | None = None
    flops = 0
    if sample is not None and strategy.is_global_zero:
        try:
            counter = forward_flop_counter()
            with without_side_effects(module, cuda_devices=cuda_devices(strategy.root_device)), torch.no_grad():
                with counter:
                    order = call_order(module, run_sample(module, sample, strategy.precision_plugin.train_step_context))
            flops = round(counter.get_total_flops() * sample.size / max(1, microbatch_size(sample.data)))
        except (RuntimeError, ValueError, TypeError) as err:
            log.warning(f"lightning_paci: the step could not run on a sample batch ({type(err).__name__}: {err}); "
                        f"outside modules are placed by registration order")
    return strategy.broadcast(order, src=0), flops


def find_relays(strategy: PipelineStrategy, module: LightningModule, plan: PartitionPlan, carves: Sequence[StageCarve],
                sample: Sample | None, devices: Sequence[int]) -> RelayPlan:
    """Probe this process's stages (``carves``) on ``sample`` and combine every stage's needs (one broadcast per
    stage from its process, ``devices[stage]`` in the pipeline); a failed probe is raised on every process."""
    # a stage whose probe failed: (stage, the error's class name, its message)
    probes: dict[int, StageProbe | tuple[int, str, str]] = {carve.stage: StageProbe({}, {}) for carve in carves}
    if sample is not None:
        data = strategy.precision_plugin.convert_input(strategy.batch_to_device(sample.data))  # as the loops do
        shifted = Sample(data, sample.size, sample.step_name)
        context = (strategy.precision_plugin.train_step_context if sample.step_name == "training_step"
                   else strategy.precision_plugin.val_step_context)
        for carve in carves:
            try:
                with without_side_effects(module, cuda_devices=cuda_devices(strategy.root_device)), carve.entered():
                    probes[carve.stage] = probe_crossings(module, carve, run_sample(module, shifted, context))
            except (RuntimeError, ValueError, TypeError, AttributeError) as err:
                probes[carve.stage] = (carve.stage, type(err).__name__, str(err))
    everyone = {s: strategy.pipeline_broadcast(probes.get(s), devices[s]) for s in range(plan.num_stages)}
    failed = [n for n in everyone.values() if isinstance(n, tuple)]
    if failed:
        stage, name, message = failed[0]
        raise _same_kind(name)(f"lightning_paci: running the step on a sample batch to find the values crossing the "
                               f"stages failed: stage {stage}: {name}: {message}")
    return plan_relays(plan, {s: n for s, n in everyone.items() if isinstance(n, StageProbe)})


def _same_kind(name: str) -> type[Exception]:
    """The class of a stage's failed probe, raised on every process: the package's own errors (``except
    CrossingError`` catches what the stage that found it raised) and the built-in kinds caught above; a class
    only its module knows becomes a RuntimeError, its name kept in the message."""
    found = getattr(errors, name, None) or {"ValueError": ValueError, "TypeError": TypeError,
                                            "AttributeError": AttributeError}.get(name)
    return found if isinstance(found, type) and issubclass(found, Exception) else RuntimeError


def measure_block_costs(strategy: PipelineStrategy, trainer: Trainer, sample: Any,
                        trace: CallTrace | None = None) -> BlockCosts | None:
    """Time every block's forward+backward on the sample micro-batch (setup_probe.Sample: drawn once, the same on
    every rank) of the training data (the unchanged module, before any carving); rank 0 measures and shares the
    result, so every rank plans the same split. Measuring leaves no trace (``without_side_effects``): the run that
    follows is the one it would be without profiling. A module or step that cannot be timed falls back to
    parameter counts (logged)."""
    if trainer.state.fn != TrainerFn.FITTING or sample is None:
        return None
    module = strategy.lightning_module
    assert module is not None
    # a model without a container is refused here, on every rank, as the plan would refuse it: not first said to
    # fall back to parameter counts
    find_block_containers(module, strategy.config.block_container, trace)
    costs: BlockCosts | None = None
    with without_side_effects(module, cuda_devices=cuda_devices(strategy.root_device)):
        try:
            def run_step() -> None:
                with recording_logs(module, [], sample.size, "training_step"), \
                        strategy.precision_plugin.train_step_context():
                    loss = extract_loss(module.training_step(sample.data, 0), "training_step")
                loss.backward()
                module.zero_grad(set_to_none=True)

            if strategy.is_global_zero:
                costs = profile_block_costs(module, strategy.config.block_container, run_step, trace=trace)
        except (RuntimeError, ValueError, TypeError) as err:  # no grads, ...
            log.warning(f"lightning_paci: block timing not possible ({type(err).__name__}: {err}); balancing by "
                        f"parameter count")
    return strategy.broadcast(costs, src=0)


def cuda_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG a side-effect-free run on ``device`` forks (none on the CPU)."""
    return [device.index or 0] if device.type == "cuda" else []


@contextlib.contextmanager
def without_side_effects(module: torch.nn.Module, *, cuda_devices: list[int]) -> Iterator[None]:
    """Undo what a profiling step changes besides the time it takes: the CPU RNG state and that of this rank's CUDA
    device (data order, dropout masks) and the module's buffers (BatchNorm running statistics and batch counts)."""
    buffers = [(buf, buf.detach().clone()) for buf in module.buffers()]
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, saved in buffers:
                    buf.copy_(saved)
