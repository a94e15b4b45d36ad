"""How a run ends on every rank: together when it succeeds, with one line per other rank when one fails.

A pipeline's stages stop working at different times: the last drain, the teardown's gathers and the user's
teardown hooks run on each rank after its last step, and a failure in any of them used to reach the other ranks as
a lost connection (a traceback of the gather that lost its peer, C++ stack dumps) or not at all (a rank that
had already exited with status 0). So the failure watchdog (engine/supervision/watchdog.py) stays on from setup to the
very end of a run -- the point where Lightning's launcher gets the run's function back, every teardown hook behind it --
and the run ends there on every rank together ([Note: ending a run]):

* ``ends_together`` makes Lightning's launcher (or, where torchrun or SLURM started the processes, a launcher that
  runs the function in place) wrap each run's function: when it returns, ``leave`` waits until every rank's has;
* ``finish_fit`` is the strategy's teardown work (the drain, the patches undone, the end of fit's gathers), still
  watched: a rank that fails there is reported as in training, and the others, waiting in its gather, stop;
* ``report_failure`` is ``Strategy.on_exception``'s: the failing rank publishes its exception and waits until every
  other rank has printed its line, or, where another rank failed first, ends with its own line;
* ``end_teardown`` stops the watchdog of a failed rank that may outlive its run (a script that catches the error),
  and ends a run that Lightning ended itself before teardown (the tuner's early exit).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_paci.engine.supervision.activity import ALL, activity
from lightning_paci.engine.supervision.lost_peers import is_lost_connection
from lightning_paci.engine.supervision.watchdog import LAUNCHED, PATIENCE, is_setup_error
from lightning_paci.integration.checkpoints.checkpoint import PipelineCheckpoints
from lightning_paci.integration.processes.process_groups import LAUNCHER_PID, ProcessGroups, current_watchdog
from lightning_paci.integration.trainer import lightning_api as api

__all__ = ["EndingStage", "InPlaceLauncher", "end_teardown", "ends_together", "finish_fit", "leave", "preempted",
           "report_failure", "wait_for_launched"]


def ends_together(launcher: Any) -> Any:
    """``launcher`` (Lightning's; None where the processes were started outside Lightning), made to end each run on
    every rank together. Idempotent."""
    if launcher is None:
        return InPlaceLauncher()
    if isinstance(launcher, InPlaceLauncher) or isinstance(vars(launcher).get("launch"), _LaunchEndingTogether):
        return launcher  # already
    api.patch_method(launcher, "launch", _LaunchEndingTogether(launcher),
                     parameters=("function", "args", "trainer", "kwargs"))
    return launcher


class InPlaceLauncher:
    """For processes started outside Lightning (torchrun, SLURM, Lightning's script launcher's children): the run's
    function runs in this process, as without a launcher, and ends together with the other ranks'."""

    is_interactive_compatible = True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return _RunThenLeave(function, trainer)(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to forward a signal to: no process was started here."""


class _LaunchEndingTogether:
    """Lightning's ``launch`` of ``launcher`` with the run's function wrapped (an object, not a closure: a spawn
    launcher is pickled with it)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher

    def __call__(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks it starts know whom not to outlive (launcher_pid)
        launch = type(self.launcher).launch
        if isinstance(self.launcher, api.SubprocessScriptLauncher):
            _observe_patiently()
        return launch(self.launcher, _RunThenLeave(function, trainer), *args, trainer=trainer, **kwargs)


_PATIENT: list[_TerminateAfterTheWatchdog] = []  # installed once per process


def _observe_patiently() -> None:
    """Lightning's child-process observer made to leave a failure to the watchdogs (``_TerminateAfterTheWatchdog``),
    for this process's life: without a running watchdog it acts as Lightning's."""
    if _PATIENT:
        return
    patient = _TerminateAfterTheWatchdog()
    api.patch_class_method(api.ChildProcessObserver, "_terminate_all", patient, parameters=())
    logging.getLogger(api.ChildProcessObserver.__module__).addFilter(patient)
    _PATIENT.append(patient)


class _TerminateAfterTheWatchdog:
    """Lightning's script launcher watches its children: 5 s after one ended with an error it SIGKILLs every other
    and itself, before they can say anything (the launcher is global rank 0, a stage: its line was lost, and the
    others' were cut short). Once this process's watchdog runs (the world joined), the watchdogs name the ended
    rank and end every process, each with its line, within ``4 * failure_timeout``: Lightning's termination waits
    that long and more first, and happens only if a process is still there. Before, it runs at once, as Lightning's
    (a child that failed to start). Its line ("Forcefully terminating all other processes") is held back
    meanwhile (a logging filter): said only where the termination happens."""

    def __init__(self) -> None:
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if current_watchdog() is not None and "terminated with code" in record.getMessage():
            self.held.append(record)
            return False
        return True

    def __call__(self, terminate: Callable[[Any], None], observer: Any) -> None:
        if (watchdog := current_watchdog()) is not None:
            time.sleep(4 * watchdog.dead_after + 10.0)  # this process ends meanwhile, taking this thread with it
        for record in self.held:
            logging.getLogger(record.name).handle(record)  # (handlers, not filters: said now)
        terminate(observer)


class _RunThenLeave:
    """The run's function on one rank (``trainer._fit_impl`` and the like), then the run's common end."""

    def __init__(self, function: Callable[..., Any], trainer: Any) -> None:
        self.function, self.trainer = function, trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        strategy = getattr(self.trainer, "strategy", None)
        LAUNCHED[:] = getattr(getattr(strategy, "launcher", None), "procs", [])  # Lightning's script launcher's
        try:
            result = self.function(*args, **kwargs)
        except BaseException:
            # a failure is reported by `on_exception`; Lightning's own early exit (the tuner's) and a preemption's
            # stop tear down after this and end the run there
            if (groups := _groups(strategy)) is not None:
                groups.leave_at_teardown = True
            raise
        leave(_groups(strategy))
        return result


def wait_for_launched(failure_timeout: float, *, joined: bool) -> None:
    """At the exit of a launcher whose run failed: wait for the ranks it started, within ``PATIENCE *
    failure_timeout`` at most. Where they ``joined`` (this rank's watchdog ran), they stop by themselves, each with
    its line; where the run failed before (the store never opened), they never can learn it: they are terminated
    (still starting, or waiting for the store: nothing of theirs is lost)."""
    deadline = time.monotonic() + PATIENCE * failure_timeout
    for process in list(LAUNCHED):
        with contextlib.suppress(Exception):
            if not joined:
                process.terminate()
            process.wait(timeout=max(0.0, deadline - time.monotonic()))


def _groups(strategy: Strategy | None) -> ProcessGroups | None:
    """A ``PACIStrategy``'s groups once its processes started; None for another strategy or before the start."""
    with contextlib.suppress(AttributeError, RuntimeError):  # not a PACIStrategy, or its processes never started
        groups = getattr(strategy, "process_groups", None)
        return groups if isinstance(groups, ProcessGroups) else None
    return None


def leave(groups: ProcessGroups | None) -> None:
    """This rank's run returned: wait, watched, until every rank's has ([Note: ending a run])."""
    watchdog = None if groups is None else groups.watchdog
    if watchdog is not None:
        with activity.phase("the end of the run", waits=ALL):
            watchdog.leave()
    activity.end()  # the teardown's patient phase (finish_fit)


def preempted(groups: ProcessGroups | None, exception: BaseException) -> bool:
    """Whether ``exception`` is the stop every process agreed on for a SIGTERM ([Note: a preemption's stop] in
    engine/supervision/preemption.py): every rank stops before the same batch, so this one is no failure to report."""
    watchdog = None if groups is None else groups.watchdog
    return watchdog is not None and watchdog.preemption.stop_batch is not None and isinstance(
        exception, SIGTERMException)


def report_failure(groups: ProcessGroups | None, exception: BaseException) -> None:
    """``Strategy.on_exception``: tell every other rank which stage failed and why, before Lightning unwinds; an
    exception that follows another stage's failure ends this process with one line instead (a lost connection
    waits for that failure to be found). A setup error is the same on every rank: each reports its own (rank 0
    prints it in full, the others in one line)."""
    watchdog = groups.watchdog if groups is not None else current_watchdog()  # failed while the groups were made
    if LAUNCHED:  # this launcher ends after the ranks it started
        atexit.register(wait_for_launched, 20.0 if watchdog is None else watchdog.dead_after,
                        joined=watchdog is not None)
    if watchdog is not None:
        watchdog.fail(f"{type(exception).__name__}: {exception}", may_follow=not is_setup_error(exception),
                      lost=is_lost_connection(exception))


class EndingStage(Protocol):
    """What the end of a run needs of this process's stage (``LocalStage``, integration/stage/local_stage.py)."""

    @property
    def runtime(self) -> Any: ...  # the stage's runtime once training started, else None

    def drain(self) -> None: ...

    def optimizer_state(self, checkpoints: PipelineCheckpoints) -> dict[str, Any]: ...

    def restore_full_model(self, *, gather: bool, replicas: int = 1, materialize: bool = True,
                           group: Any = None) -> None: ...


def finish_fit(stage: EndingStage | None, *, drain: Callable[[], None], undo: list[Callable[[], None]],
               checkpoints: Callable[[], PipelineCheckpoints], schedulers: list[Any], built_on_meta: bool,
               replicas: int, group: Any, optimizer_states: bool = True) -> dict[str, list[Any]] | None:
    """Drain, undo the patches, and give every rank's module the complete trained weights again (a model built on
    meta: each rank keeps only its stage's). Returns what ``save_checkpoint`` after ``fit`` needs (the optimizer
    and scheduler states; with ``optimizer_states`` False, as for tensor-parallel stages whose checkpoints are not
    written, none), or None. Runs watched: the user's teardown hooks follow, patient, until ``leave``."""
    activity.begin("teardown", patient=True)
    try:
        drain()
    finally:  # a drain that fails is reported as one in training; the Trainer and the module are restored anyway
        for patch in reversed(undo):
            patch()
        undo.clear()
    if stage is None:
        return None
    after_fit = None
    if optimizer_states and stage.runtime is not None and api.distributed_is_initialized():
        after_fit = {"optimizer_states": [stage.optimizer_state(checkpoints())],
                     "lr_schedulers": [scheduler.state_dict() for scheduler in schedulers]}
    if built_on_meta:  # no full gather: other stages' parameters stay on the meta device
        stage.restore_full_model(gather=False, materialize=False)
    else:
        stage.restore_full_model(gather=api.distributed_is_initialized(), replicas=replicas, group=group)
    return after_fit


def end_teardown(groups: ProcessGroups | None, *, failed: bool) -> None:
    """After the strategy's teardown: a failed rank started by hand or by torchrun may live on (a script that
    catches the error), so its watchdog stops beating, which its peers read as its end; a launched fork/spawn
    worker ends right after and beats until then. A run Lightning ended before teardown (the tuner's early exit)
    ends here."""
    watchdog = None if groups is None else groups.watchdog
    if watchdog is None:
        return
    if failed and multiprocessing.parent_process() is None:
        watchdog.stop(done=False)
    elif not failed and groups is not None and groups.leave_at_teardown:
        leave(groups)
