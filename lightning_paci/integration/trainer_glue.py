"""What the strategy reads from, and changes in, the Trainer: the checks at setup, gradient clipping, a sample batch
for block timing, whether the current batch is the last before a drain point, and the two patches training needs."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lightning_paci.integration import lightning_api as api
from lightning_paci.integration.lightning_program import extract_loss
from lightning_paci.integration.logs import recording_logs
from lightning_paci.partition import BlockCosts, profile_block_costs

__all__ = ["SUPPORTED_PRECISION", "check_trainer", "cuda_devices", "ends_epoch", "measure_block_costs", "must_drain",
           "patch_for_pipeline", "same_data_on_every_stage", "seed_workers_alike",
           "without_side_effects"]

log = logging.getLogger(__name__)

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "64-true")


def share_cpu_cores(device: torch.device, local_processes: int, environ: Any = os.environ) -> str | None:
    """On the CPU, give each of a node's stage processes its share of the cores for torch's intra-op threads.

    Every process otherwise starts one thread per core: 4 stages on 2 cores ran 8 compute threads, and the main
    example's 20 steps took 71 s instead of 33 s (measured; the cost doubled when the stages' compute began to
    overlap in time). torchrun sets ``OMP_NUM_THREADS=1`` for the same reason; Lightning's launchers do not. A value
    the user set (``OMP_NUM_THREADS``) is kept. Returns the log line, or None when nothing changed."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in environ or local_processes < 2:
        return None
    threads = max(1, (os.cpu_count() or 1) // local_processes)
    if torch.get_num_threads() <= threads:
        return None
    torch.set_num_threads(threads)
    return (f"lightning_paci: {local_processes} stage processes share this node's {os.cpu_count()} cores: "
            f"{threads} intra-op thread(s) each (set OMP_NUM_THREADS to choose)")


def batch_norm_warning(module: nn.Module, num_microbatches: int) -> str | None:
    """A warning when a module normalizes with batch statistics (``_BatchNorm`` in train mode) and a batch is
    split into micro-batches: each forward then normalizes its B/m samples, not the batch's B, and updates the
    running statistics m times per batch -- one device's training computes something else (measured: 57% relative
    weight difference after 6 steps under ``"1f1b"``)."""
    if num_microbatches < 2:
        return None
    names = [name for name, sub in module.named_modules()
             if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training]
    if not names:
        return None
    shown = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"lightning_paci: {shown} normalize with batch statistics, and every batch is split into "
            f"{num_microbatches} micro-batches: each forward normalizes its own micro-batch (B/{num_microbatches} "
            f"samples), not the batch, and the running statistics are updated {num_microbatches} times per batch, so "
            f"training differs from one device's under every schedule. Use GroupNorm or LayerNorm, or fewer "
            f"micro-batches (`PACIStrategy(microbatches=...)`, larger batches), if the difference matters.")


def check_trainer(trainer: Trainer, module: LightningModule, num_stages: int) -> None:
    """Refuse, at setup, what a pipeline cannot run, naming the setting and the fix."""
    if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
        raise ValueError(
            "`PACIStrategy` supports automatic optimization only (`self.automatic_optimization = True`): in "
            "manual optimization the non-last stages never reach your `optimizer.step()`. Remove "
            "`self.automatic_optimization = False` and return the loss from `training_step`."
        )
    precision = str(trainer.precision)
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"`Trainer(precision={precision!r})` is not supported by `PACIStrategy`: float16 training needs loss "
            f"scaling, and a GradScaler per stage would scale each stage differently. Use one of "
            f"{', '.join(SUPPORTED_PRECISION)} (bf16-mixed is the recommended low-precision setting)."
        )
    if trainer.state.fn == TrainerFn.FITTING and type(module).optimizer_step is not LightningModule.optimizer_step:
        warnings.warn(
            f"`{type(module).__name__}.optimizer_step` is overridden. Under `PACIStrategy` it still runs once per "
            f"Lightning batch and must call `optimizer.step(closure=optimizer_closure)` every time (the closure feeds "
            f"the batch into the pipeline), but it does not step the weights: each stage steps its own optimizer "
            f"every `accumulation` local backwards inside the schedule, so code there (learning-rate warm-up, "
            f"skipping steps) does not act on the real updates. Move per-update logic to `on_before_optimizer_step` "
            f"(runs on every stage at each local update) or a step-interval LR scheduler (stepped per local update).",
            stacklevel=2,
        )
    if num_stages < 2:
        raise ValueError(f"`PACIStrategy` needs at least 2 devices (stages), got {num_stages}. Pass "
                         f"`Trainer(devices=N)` with N >= 2.")


def same_data_on_every_stage(trainer: Trainer, broadcast: Callable[[Any, int], Any], replicas: int = 1) -> None:
    """Every stage iterates the same batches, in the order one device would: the user's samplers are kept (no
    ``DistributedSampler(num_replicas=1)``: a pure pipeline has one data-parallel replica; with ``replicas`` > 1
    Lightning's ``DistributedSampler`` shards by the data-parallel coordinate only, ``distributed_sampler_kwargs``,
    so every stage of one replica still sees the same samples), and every rank adopts
    rank 0's states of torch's, Python's ``random`` and NumPy's global generators, from which a ``RandomSampler``
    draws each epoch's order, a ``collate_fn`` its masks and the dataloader its workers' seeds (ranks started
    without a common seed would otherwise differ). The forwards never advance those states (see [Note: randomness
    per micro-batch] in engine/microbatch.py), so the ranks stay in step; fingerprint.py checks that they did."""
    if replicas == 1:
        api.keep_user_samplers(trainer)
    np_random = _numpy_random()
    states = broadcast((torch.random.get_rng_state(), random.getstate(),
                        np_random.get_state() if np_random is not None else None), 0)
    torch.random.set_rng_state(states[0])
    random.setstate(states[1])
    if np_random is not None and states[2] is not None:
        np_random.set_state(states[2])


def _numpy_random() -> Any:
    """NumPy's global generator module, or None where NumPy is not installed."""
    try:
        import numpy.random
    except ImportError:
        return None
    return numpy.random


def seed_workers_alike(dataloader: Any, replica: int = 0) -> Any:
    """Seed the dataloader's workers by the data-parallel rank (0 in a pure pipeline), not the global rank:
    ``seed_everything(..., workers=True)`` otherwise gives each stage's workers other random augmentations or masks
    (Lightning adds its worker seeding right after ``Strategy.process_dataloader``, only where none is set)."""
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = functools.partial(pl_worker_init_function, rank=replica)
    return dataloader


def measure_block_costs(strategy: Any, trainer: Trainer, sample: Any) -> BlockCosts | None:
    """Time every block's forward+backward on the sample micro-batch (setup_probe.Sample: drawn once, the same on
    every rank) of the training data (the unchanged module, before any carving); rank 0 measures and shares the
    result, so every rank plans the same split. Measuring leaves no trace (``without_side_effects``): the run that
    follows is the one it would be without profiling. A module or step that cannot be timed falls back to
    parameter counts (logged)."""
    if trainer.state.fn != TrainerFn.FITTING or sample is None:
        return None
    module = strategy.lightning_module
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
                costs = profile_block_costs(module, strategy.config.block_container, run_step)
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


def ends_epoch(trainer: Trainer, batch_idx: int) -> bool:
    """Whether this batch is the epoch's last: Lightning then steps the optimizer whatever the accumulation."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return bool(last) or batch_idx + 1 >= trainer.num_training_batches


def must_drain(trainer: Trainer, batch_idx: int) -> bool:
    """Whether this call is the last before validation, an epoch end or the end of training."""
    if trainer.should_stop or ends_epoch(trainer, batch_idx):
        return True
    # Lightning counts a step every `accumulate_grad_batches` batches (aligned to the epoch start)
    closes_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
    max_steps = trainer.max_steps
    if max_steps is not None and max_steps >= 0 and closes_step and trainer.global_step + 1 >= max_steps:
        return True
    return api.should_validate_after_batch(trainer)


def patch_for_pipeline(trainer: Trainer, module: LightningModule,
                       owned_schedulers: list[Any]) -> list[Callable[[], None]]:
    """Patch what would break a flush-free pipeline; return the functions that undo the patches.

    * ``module.lr_scheduler_step`` skips the "step"-interval schedulers the stage optimizer steps itself (per local
      update; Lightning would step them once per Lightning optimizer step);
    * the epoch loop's per-batch SIGTERM broadcast from rank 0 (a full barrier on gloo) becomes a local check
      (Lightning's launchers deliver the signal to every process).
    """
    original = module.lr_scheduler_step

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        if not any(scheduler is s for s in owned_schedulers):
            original(scheduler, metric)

    def local_sigterm_check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    return [
        api.patch_method(module, "lr_scheduler_step", lr_scheduler_step, parameters=("scheduler", "metric")),
        api.patch_method(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", local_sigterm_check,
                         parameters=()),
    ]
