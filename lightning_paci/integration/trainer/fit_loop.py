"""How Lightning's fit loop feeds a pipeline: every stage iterates the same batches in one order, each call knows
whether it is the last before a drain point (validation, an epoch's end, the end of training), and two patches keep
the loop from synchronizing the stages per batch."""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_paci.engine.supervision.preemption import StopAgreement
from lightning_paci.engine.supervision.watchdog import say
from lightning_paci.integration.trainer import lightning_api as api

__all__ = ["ends_epoch", "must_drain", "patch_for_pipeline", "same_data_on_every_stage", "seed_workers_alike"]

def same_data_on_every_stage(trainer: Trainer, broadcast: Callable[[Any, int], Any], replicas: int = 1) -> None:
    """Every stage iterates the same batches, in the order one device would: the user's samplers are kept (no
    ``DistributedSampler(num_replicas=1)``: a pure pipeline has one data-parallel replica; with ``replicas`` > 1
    Lightning's ``DistributedSampler`` shards by the data-parallel coordinate only, ``distributed_sampler_kwargs``,
    so every stage of one replica still sees the same samples), and every rank adopts
    rank 0's states of torch's, Python's ``random`` and NumPy's global generators, from which a ``RandomSampler``
    draws each epoch's order, a ``collate_fn`` its masks and the dataloader its workers' seeds (ranks started
    without a common seed would otherwise differ). The forwards never advance those states (see [Note: randomness
    per micro-batch] in engine/runtime/microbatch.py), so the ranks stay in step; fingerprint.py checks that they
    did."""
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


def patch_for_pipeline(trainer: Trainer, module: LightningModule, owned_schedulers: list[Any],
                       stop: StopAgreement | None = None, patience: float = 20.0) -> list[Callable[[], None]]:
    """Patch what would break a flush-free pipeline; return the functions that undo the patches.

    * ``module.lr_scheduler_step`` skips the "step"-interval schedulers the stage optimizer steps itself (per local
      update; Lightning would step them once per Lightning optimizer step);
    * the epoch loop's per-batch SIGTERM broadcast from rank 0 (a full barrier on gloo) becomes a local check
      (Lightning's launchers deliver the signal to every process); with ``stop`` (the watchdog's), the check of
      the batch every process agreed to stop before ([Note: a preemption's stop] in engine/supervision/preemption.py),
      waited for at most ``patience`` seconds;
    * a logged value's move to the device it is already on returns at once (``already_there``).
    """
    original = module.lr_scheduler_step

    def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
        if not any(scheduler is s for s in owned_schedulers):
            original(scheduler, metric)

    def local_sigterm_check() -> None:
        if stop is not None and stop.before_batch(batch := api.batches_started(trainer), timeout=patience):
            say(f"lightning_paci: global rank {trainer.global_rank} stops for a SIGTERM before training batch "
                f"{batch}, where every rank stops")
            raise SIGTERMException()
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    return [
        api.patch_method(module, "lr_scheduler_step", lr_scheduler_step, parameters=("scheduler", "metric")),
        api.patch_method(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", local_sigterm_check,
                         parameters=()),
        api.patch_class_method(api.ResultMetric, "to", already_there, parameters=("args", "kwargs")),
    ]


def already_there(to: Callable[..., Any], result: Any, *args: Any, **kwargs: Any) -> Any:
    """Lightning's ``_ResultMetric.to(device)``, which every ``self.log`` call makes with the value's device,
    rebuilding the metric's whole state (its metadata deep-copied): about 0.4 ms a call, on every stage, for every
    key of every Lightning batch (each stage replays the logs, logs.py). Where every tensor of the state already is
    on ``device`` and it holds no module (a logged torchmetrics ``Metric``), nothing would change: return at once."""
    device = args[0] if len(args) == 1 and not kwargs else kwargs.get("device") if len(kwargs) == 1 else None
    if isinstance(device, torch.device) and _all_on(vars(result), device):
        return result
    return to(result, *args, **kwargs)


def _all_on(node: Any, device: torch.device) -> bool:
    """Whether every tensor in ``node`` (nested dicts, lists, tuples) is on ``device`` and no module is."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.device != device:
                return False
        elif isinstance(item, torch.nn.Module):
            return False
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return True
