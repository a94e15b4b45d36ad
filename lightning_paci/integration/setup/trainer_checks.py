"""What a pipeline cannot run, refused at setup naming the setting and the fix, and what it runs differently from
one device, warned about: automatic optimization only, the callbacks a stage cannot run (batch_outputs.py),
the supported precisions, an overridden ``optimizer_step``, at least two stages, and batch statistics split into
micro-batches."""

from __future__ import annotations

import warnings

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_paci.integration.lightning_callbacks.batch_outputs import check_callbacks

__all__ = ["MOOT_WARNINGS", "SUPPORTED_PRECISION", "batch_norm_warning", "check_trainer", "quiet_moot_warnings"]

# Lightning's messages that a pipeline run makes moot, so that what reaches the screen is what the user can act on:
# * the advice to log epoch-level values with `sync_dist=True`: the pipeline's evaluation logs each value once, from
#   the last stage (global rank 0); a sync would average it with the other stages' placeholders' values;
# * the `LeafSpec` deprecation Lightning's own tree utilities raise under torch >= 2.10 on every batch transfer,
#   which no user code can change.
MOOT_WARNINGS = (
    r"It is recommended to use `self\.log\('.*', \.\.\., sync_dist=True\)`",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)


def quiet_moot_warnings() -> None:
    """Filter ``MOOT_WARNINGS`` in this process (every rank calls it at setup)."""
    for message in MOOT_WARNINGS:
        warnings.filterwarnings("ignore", message=message)

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "64-true")


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


def check_trainer(trainer: Trainer, module: LightningModule, num_stages: int, start_method: str = "popen") -> None:
    """Refuse, at setup, what a pipeline cannot run, naming the setting and the fix (and quiet what it makes
    moot: ``quiet_moot_warnings``)."""
    quiet_moot_warnings()
    tuners = [type(c).__name__ for c in trainer.callbacks  # type: ignore[attr-defined]  # set in Trainer.__init__
              if isinstance(c, (LearningRateFinder, BatchSizeFinder))]
    if tuners and start_method != "popen":
        raise ValueError(
            f"`{tuners[0]}` (Lightning's Tuner) with `PACIStrategy(start_method={start_method!r})`: the finder ends "
            f"its run by raising in the launched processes, and its result would stay there, not in the process "
            f"that called the Tuner. Use the default launcher (`strategy='paci'`, `start_method='popen'`) or "
            f"torchrun for the Tuner."
        )
    if trainer.state.fn == TrainerFn.FITTING:
        check_callbacks(trainer, module)
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
