"""Every private Lightning symbol lightning_paci relies on, in one module, each checked.

Lightning has no public API for some of what a pipeline strategy must do (start its own process group, pick a
launcher, ask whether the next batch is followed by validation, stop the per-batch SIGTERM broadcast). Private
symbols can be renamed in any release, and a rename must never turn into a silent change of behaviour: a patch
through ``setattr`` on a renamed method would create an unused attribute, and every batch would quietly get a full
barrier again -- the very flush PACI exists to avoid. So:

* module-level symbols are resolved at import: a missing one raises :class:`LightningAPIError` naming it and the
  installed Lightning version;
* methods are patched only through :func:`patch_method`, which checks that the class defines the method with the
  expected parameters before shadowing it;
* where a fallback is correct (the early drain before validation), a missing symbol gives one warning instead.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.pytorch.strategies import ParallelStrategy

from lightning_paci.errors import LightningAPIError

__all__ = [
    "LIGHTNING_VERSION",
    "LightningAPIError",
    "ChildProcessObserver",
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "all_gather_if_available",
    "batches_started",
    "call_configure_model",
    "configured_optimizers",
    "distributed_is_initialized",
    "init_dist_connection",
    "keep_user_samplers",
    "loaded_checkpoint",
    "multiprocessing_launcher",
    "overrides_configure_model",
    "ResultMetric",
    "patch_class_method",
    "patch_method",
    "set_device_mesh",
    "should_validate_after_batch",
    "sigterm_without_a_collective",
    "step_dataloader",
    "training_dataloader",
    "whole_model_summaries",
]

LIGHTNING_VERSION = lightning.__version__


def _missing(symbol: str, detail: str) -> LightningAPIError:
    return LightningAPIError(
        f"lightning_paci relies on `{symbol}`, a private Lightning API, which lightning {LIGHTNING_VERSION} "
        f"{detail}. Install a Lightning version this release supports (see pyproject.toml: lightning>=2.5,<2.7) or "
        f"report it to lightning_paci."
    )


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}", "does not have") from None


init_dist_connection: Callable[..., None] = _require("lightning.fabric.utilities.distributed", "_init_dist_connection")
distributed_is_initialized: Callable[[], bool] = _require(
    "lightning.fabric.utilities.distributed", "_distributed_is_initialized")
all_gather_if_available: Callable[..., Any] = _require(
    "lightning.fabric.utilities.distributed", "_all_gather_ddp_if_available")
MultiProcessingLauncher: type = _require("lightning.pytorch.strategies.launchers", "_MultiProcessingLauncher")
SubprocessScriptLauncher: type = _require("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher")
# the script launcher's thread that SIGKILLs every process, itself included, once a child ended with an error
ChildProcessObserver: type = _require("lightning.fabric.strategies.launchers.subprocess_script",
                                      "_ChildProcessObserver")
for _method in ("get_extra_results", "update_main_process_results", "_wrapping_function", "_collect_rank_zero_results"):
    if not callable(getattr(MultiProcessingLauncher, _method, None)):
        raise _missing(f"lightning.pytorch.strategies.launchers._MultiProcessingLauncher.{_method}", "does not have")
_parse_optimizers: Callable[..., Any] = _require("lightning.pytorch.core.optimizer", "_configure_optimizers")


def configured_optimizers(module: Any) -> list[Any]:
    """The optimizers ``module.configure_optimizers()`` returns, in whichever form it returns them (one, a list,
    a tuple with schedulers, a dict), parsed as Lightning parses them (not validated: its check of several
    optimizers advises manual optimization, which the strategy refuses too); none for ``None``."""
    configured = module.configure_optimizers()
    return [] if configured is None else list(_parse_optimizers(configured)[0])


def multiprocessing_launcher(strategy: ParallelStrategy, start_method: str, *, send: Callable[[Any], Any],
                             receive: Callable[[Any, Any], None],
                             on_exception: Callable[[BaseException], None], freeze_heap: bool = True,
                             weights_context: Callable[[Any], Any] | None = None) -> Any:
    """Lightning's fork/spawn launcher, also handing ``send(trainer)`` (called on rank 0 after the run) to
    ``receive(trainer, sent)`` in the main process, which never ran a stage or a loop: what ``save_checkpoint``
    after ``fit`` needs there (the gathered optimizer state, the loops' progress, the callbacks' states). Under
    ``"spawn"`` the launcher and the three callables are pickled: pass functions or bound methods. ``freeze_heap``:
    see [Note: fork with a frozen heap] (``PACIConfig.freeze_gc``).

    A worker's exception also reaches ``on_exception`` before it unwinds: Lightning calls ``Strategy.on_exception``
    only around the launch in the main process, so without it a failing forked stage was noticed by the others only
    when its heartbeat stopped (20 s), and named as "stopped responding" instead of by its error.

    ``weights_context(module)``: a context around the worker's ``module.state_dict()`` for the weights handed to the
    main process (every rank takes it at once)."""
    return _PipelineLauncher(strategy, start_method=start_method, send=send, receive=receive,
                             on_exception=on_exception, freeze_heap=freeze_heap, weights_context=weights_context)


class _PipelineLauncher(MultiProcessingLauncher):
    """``multiprocessing_launcher``'s launcher: at module level, so that ``"spawn"`` can pickle it."""

    def __init__(self, strategy: ParallelStrategy, *, start_method: str, send: Callable[[Any], Any],
                 receive: Callable[[Any, Any], None], on_exception: Callable[[BaseException], None],
                 freeze_heap: bool, weights_context: Callable[[Any], Any] | None = None) -> None:
        super().__init__(strategy, start_method=start_method)
        self._send, self._receive, self._on_exception = send, receive, on_exception
        self._freeze_heap = freeze_heap
        self._weights_context = weights_context

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """[Note: fork with a frozen heap]: under ``"fork"`` every object alive in the main process is moved to the
        collector's permanent generation while the ranks start and run, so a rank's collections never walk the
        inherited heap. A full collection writes to every tracked object's header: in a forked rank that copies
        every page of the parent's heap (copy-on-write). Measured on a CPU, forking a torch + Lightning +
        transformers process: a rank's full collection 0.29 s and 31k page faults, 0.03 s and 1.5k frozen."""
        if self._start_method != "fork" or not self._freeze_heap:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        frozen_before = gc.get_freeze_count() > 0  # the caller's own freeze is left as it is (unfreeze is global)
        gc.freeze()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            if not frozen_before:
                gc.unfreeze()

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._wrapping_function(*args, **kwargs)
        except BaseException as err:
            self._on_exception(err)
            if isinstance(err, SystemExit) and type(err).__name__ == "SIGTERMException":
                # a SystemExit ends the worker with status 0, and the main process would wait for its results
                raise RuntimeError("lightning_paci: this rank stopped for a SIGTERM") from err
            raise

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        if self._weights_context is None:
            return super()._collect_rank_zero_results(trainer, results)
        with self._weights_context(trainer.lightning_module):
            return super()._collect_rank_zero_results(trainer, results)

    # through a file, as Lightning sends the weights: the main process reads the result queue only after the
    # workers exit, so a message larger than the pipe's buffer would block rank 0 forever
    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        path = os.path.join(tempfile.mkdtemp(), "lightning_paci_after_fit.pt")
        torch.save(self._send(trainer), path)
        extra["lightning_paci"] = path
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        path = extra.get("lightning_paci")
        if path is not None:
            try:
                self._receive(trainer, torch.load(path, weights_only=False))
            finally:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _check_parameters(owner: type, name: str, method: Callable[..., Any], parameters: tuple[str, ...],
                      symbol: str) -> None:
    """``method`` (``owner.name``) takes exactly ``parameters`` after ``self`` (a static method: its own)."""
    found = tuple(inspect.signature(method).parameters)
    if not isinstance(inspect.getattr_static(owner, name), staticmethod):
        found = found[1:]  # after `self`
    if found != parameters:
        raise _missing(symbol, f"defines with parameters {found} instead of {parameters}")


def patch_method(obj: Any, name: str, replacement: Callable[..., Any], *,
                 parameters: tuple[str, ...]) -> Callable[[], None]:
    """Shadow ``obj.name`` with an instance attribute; return the function that undoes it.

    The class of ``obj`` must define ``name`` as a method taking exactly ``parameters`` (after ``self``; a static
    method's own): a patch of a renamed or reshaped method would do nothing, silently.
    """
    owner = type(obj)
    symbol = f"{owner.__module__}.{owner.__qualname__}.{name}"
    method = getattr(owner, name, None)
    if not callable(method):
        raise _missing(symbol, "does not have")
    _check_parameters(owner, name, method, parameters, symbol)
    setattr(obj, name, replacement)

    def undo() -> None:
        if name in vars(obj):
            delattr(obj, name)

    return undo


def patch_class_method(owner: type, name: str, replacement: Callable[..., Any], *,
                       parameters: tuple[str, ...]) -> Callable[[], None]:
    """Replace the method ``name`` that ``owner`` itself defines, checked as :func:`patch_method` checks; return
    the function that restores it. ``replacement`` receives the original method first."""
    symbol = f"{owner.__module__}.{owner.__qualname__}.{name}"
    method = vars(owner).get(name)
    if not callable(method):
        raise _missing(symbol, "does not define")
    _check_parameters(owner, name, method, parameters, symbol)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(method, self, *args, **kwargs)

    setattr(owner, name, patched)

    def undo() -> None:
        if vars(owner).get(name) is patched:
            setattr(owner, name, method)

    return undo


ResultMetric: type = _require("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric")


def keep_user_samplers(trainer: Any) -> None:
    """Stop Lightning from replacing every dataloader's sampler with ``DistributedSampler(num_replicas=1)``.

    A pure pipeline has one data-parallel replica: every stage must iterate the same batches, in the order the
    user's own sampler gives on one device. The injected sampler (``Trainer(use_distributed_sampler=True)``, the
    default) keeps the samples but not a ``RandomSampler``'s order. Lightning reads the setting when it sets up the
    dataloaders, after the strategy's ``setup``.
    """
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None or not isinstance(getattr(connector, "use_distributed_sampler", None), bool):
        raise _missing("lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector"
                       ".use_distributed_sampler", "does not have")
    connector.use_distributed_sampler = False


def sigterm_without_a_collective(trainer: Any, request: Callable[[], None] | None = None) -> Callable[[], None]:
    """Lightning's SIGTERM handler without its broadcast; return the function that undoes it.

    Lightning's handler broadcasts a flag from rank 0 inside the signal handler: a collective that only the
    signalled process joins when the others are not signalled too (torchrun signals the ranks of one node when one
    of them died), so it fails or waits inside whatever that process was doing -- its failure report included. The
    handler here forwards the signal to the processes this one launched and sets the flag the per-batch check
    reads (fit_loop.py), as Lightning's does, with no collective. With ``request`` (a watchdog's preemption
    agreement, engine/supervision/preemption.py) it asks for a stop that every process agrees on instead of setting the
    flag, which Lightning reads after every batch and would stop this process alone. Lightning registers it after the
    strategy's ``setup``.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        raise _missing("lightning.pytorch.trainer.Trainer._signal_connector", "does not have")

    def notify(signum: Any, _: Any) -> None:
        first = not (connector.received_sigterm or notified)
        if first and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)
        notified.append(signum)
        if request is not None:
            request()
        else:
            connector.received_sigterm = True

    notified: list[Any] = []

    return patch_method(connector, "_sigterm_notifier_fn", notify, parameters=("signum", "_"))


def training_dataloader(trainer: Any) -> Any:
    """The training dataloader of a fitting Trainer, before the fit loop has iterated it."""
    return step_dataloader(trainer, "fit_loop")


def step_dataloader(trainer: Any, loop: str) -> Any:
    """The dataloader (or the first of several) that ``trainer.<loop>`` (``fit_loop``, ``validate_loop``,
    ``test_loop``, ``predict_loop``) will iterate, before it has."""
    source = getattr(getattr(trainer, loop), "_data_source", None)
    if source is None or not callable(getattr(source, "dataloader", None)):
        raise _missing(f"lightning.pytorch.loops.{loop}._data_source.dataloader", "does not have")
    loaders = source.dataloader()
    if isinstance(loaders, (list, tuple)):
        return loaders[0]
    if isinstance(loaders, dict):
        return next(iter(loaders.values()))
    return loaders


_warned_validation = False


def loaded_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint ``fit(ckpt_path=...)`` loaded before ``strategy.setup`` (``{}`` without one, or where the
    model is restored after setup). Fallback when the private attribute is gone: ``{}``, so a recorded split is
    not reused and ``partition="time"`` measures again (said where it is read)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    loaded = getattr(connector, "_loaded_checkpoint", None)
    return loaded if isinstance(loaded, dict) else {}


def batches_started(trainer: Any) -> int:
    """The training batches started over the run (resumed runs included): the index of the next one, the same on
    every rank (each iterates the same batches)."""
    progress = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "batch_progress", None)
    ready = getattr(getattr(progress, "total", None), "ready", None)
    if not isinstance(ready, int):
        raise _missing("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop.batch_progress.total.ready",
                       "does not have")
    return ready


def should_validate_after_batch(trainer: Any) -> bool:
    """Whether Lightning runs validation right after the current training batch.

    Fallback when the private method is gone: False, with one warning. That is correct, only slower: the pipeline
    then drains in ``on_validation_start`` (one more call than needed) instead of inside the last batch's call.
    """
    global _warned_validation
    epoch_loop = trainer.fit_loop.epoch_loop
    check = getattr(type(epoch_loop), "_should_check_val_fx", None)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if check is None or fetcher is None:
        if not _warned_validation:
            warnings.warn(
                f"lightning_paci: lightning {LIGHTNING_VERSION} has no `_TrainingEpochLoop._should_check_val_fx` / "
                f"`_FitLoop._data_fetcher`; the pipeline drains at the start of validation instead of inside the "
                f"batch before it (correct, slightly slower).", stacklevel=2)
            _warned_validation = True
        return False
    return bool(check(epoch_loop, fetcher))


class _FrozenSummary:
    """What ``ModelSummary.on_fit_start`` reads from a summary, taken from the whole module before carving (a live
    summary counts ``module.parameters()`` when read: after carving, only this stage's)."""

    def __init__(self, summary: Any) -> None:
        self._data = summary._get_summary_data()
        self.total_parameters = summary.total_parameters
        self.trainable_parameters = summary.trainable_parameters
        self.model_size = summary.model_size
        self.total_training_modes = summary.total_training_modes
        self.total_flops = getattr(summary, "total_flops", 0)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._data


def whole_model_summaries(trainer: Any, module: Any, flops: int = 0) -> list[Callable[[], None]]:
    """Make every ``ModelSummary`` callback (``RichModelSummary`` too) report the whole model, summarized now --
    call it before carving. ``flops``: the step's forward on the first batch, reported where the summary counts
    none (no ``example_input_array``). Returns the functions that undo the patches."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import summarize

    undo = []
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelSummary):
            continue
        depth = getattr(callback, "_max_depth", None)
        if not isinstance(depth, int):
            raise _missing("lightning.pytorch.callbacks.ModelSummary._max_depth", "does not have")
        if depth:
            frozen = _FrozenSummary(summarize(module, max_depth=depth))
            frozen.total_flops = frozen.total_flops or flops
            undo.append(patch_method(callback, "_summary", lambda trainer, pl_module, frozen=frozen: frozen,
                                     parameters=("trainer", "pl_module")))
    return undo


def overrides_configure_model(module: Any) -> bool:
    """Whether ``module``'s class defines its own ``configure_model``."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return bool(is_overridden("configure_model", module))


def set_device_mesh(module: Any, mesh: Any) -> None:
    """What ``ModelParallelStrategy`` does for ``module.device_mesh``: the property reads ``_device_mesh``."""
    if not hasattr(module, "_device_mesh") or not isinstance(inspect.getattr_static(type(module), "device_mesh",
                                                                                     None), property):
        raise _missing("lightning.pytorch.core.module.LightningModule._device_mesh",
                       "does not define (read by the `device_mesh` property)")
    module._device_mesh = mesh


def call_configure_model(module: Any) -> None:
    """``module.configure_model()`` as Lightning's hook call makes it (``_current_fx_name`` set around it)."""
    if not hasattr(module, "_current_fx_name"):
        raise _missing("lightning.pytorch.core.module.LightningModule._current_fx_name", "does not define")
    previous, module._current_fx_name = module._current_fx_name, "configure_model"
    try:
        module.configure_model()
    finally:
        module._current_fx_name = previous
