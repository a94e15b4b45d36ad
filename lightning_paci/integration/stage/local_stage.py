"""``LocalStage``: this process's stage of the pipeline and everything that runs it.

The strategy (strategy.py) is Lightning plumbing; what a stage *is* -- its carved module, its runtime, its stream
driver, its communicators, its data-parallel replicas, its log relay, its evaluator -- is built here, once at setup,
from the connections the strategy made (:class:`~lightning_paci.integration.stage.links.StageLinks`), so that each
Lightning hook delegates in a line or two and the pieces can be read (and tested) without a Trainer.
(torch.distributed.pipelining's ``PipelineStage`` is another thing: a stage module with its own send/receive
buffers.)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_paci.config import PACIConfig
from lightning_paci.engine.blocks.block_compile import BlockCompile
from lightning_paci.engine.blocks.layered import LayerCuts, LayeredBackward
from lightning_paci.engine.blocks.recompute import BlockRecompute, recomputes
from lightning_paci.engine.replicas.data_parallel import GradientAverage, join_replicas
from lightning_paci.engine.replicas.grad_buckets import OverlappedGradientAverage, backward_order
from lightning_paci.engine.replicas.optimizer_shards import OptimizerShards, merge_replica_states
from lightning_paci.engine.runtime.device_clock import DeviceClock
from lightning_paci.engine.runtime.microbatch import loss_scale_for
from lightning_paci.engine.runtime.runtime import StageRuntime
from lightning_paci.engine.runtime.virtual_stages import DeviceRuntime
from lightning_paci.engine.runtime.whole_batch import WholeBatch
from lightning_paci.engine.streams.driver import StreamDriver
from lightning_paci.engine.supervision.activity import Doing, runtime_activity
from lightning_paci.engine.transport.collectives import gather_everywhere
from lightning_paci.integration.checkpoints.checkpoint import PipelineCheckpoints, cpu_state
from lightning_paci.integration.checkpoints.one_device_optimizer import (
    ONE_DEVICE_KEY,
    OneDeviceOptimizer,
    one_optimizer_message,
)
from lightning_paci.integration.lightning_callbacks.batch_outputs import batch_outputs, needs_every_stage_loss
from lightning_paci.integration.stage.evaluation import PipelineEvaluator
from lightning_paci.integration.stage.lightning_program import LightningHooks, LightningStageProgram
from lightning_paci.integration.stage.links import StageLinks
from lightning_paci.integration.stage.logs import LogRelay
from lightning_paci.integration.stage.setup_probe import Sample, find_relays
from lightning_paci.integration.trainer.fingerprint import BatchFingerprint
from lightning_paci.integration.trainer.fit_loop import ends_epoch, must_drain
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.optim.prediction_cost import PredictionTiming
from lightning_paci.optim.prediction_quality import costly_regime
from lightning_paci.optim.stage_optimizer import StageOptimizer
from lightning_paci.optim.weight_prediction import weight_prediction_for
from lightning_paci.partition import PartitionPlan
from lightning_paci.partition.chunks import DeviceCarve
from lightning_paci.partition.relay import RelayPlan, install_relays
from lightning_paci.schedules import build_schedule

__all__ = ["LocalStage"]

log = logging.getLogger(__name__)

_Context = Callable[[], contextlib.AbstractContextManager[Any]]


class LocalStage:
    """This process's stage (or chunks, [Note: chunks of one device]): the carved module and, once training is set
    up, its runtimes, driver and log relay.

    Args:
        module: the user's LightningModule, carved in place to this process's stages (``carve``).
        plan: the partition every process agreed on (over every stage: ``v`` per process with virtual stages).
        config: the strategy's options; num_microbatches: micro-batches per Lightning batch.
        links: this process's connections; the stage connects a communicator per use (evaluation, training).
        broadcast: ``broadcast(obj, src)`` over the pipeline's processes, for evaluation's log records.
        eval_context: the precision plugin's evaluation context.
        one_device: one device's optimizer, its param groups by name (one_device_optimizer.py): consolidated
            checkpoints then also resume on one device, and one-device checkpoints resume here.
        index: this process's place in the pipeline (its stage, or its device with virtual stages).
        shows_logs: this process's progress bar and loggers show the logged values (global rank 0; [Note: no log
            read off the logging rank]).
    """

    def __init__(self, module: LightningModule, plan: PartitionPlan, carve: DeviceCarve, *, config: PACIConfig,
                 num_microbatches: int, links: StageLinks, broadcast: Callable[[Any, int], Any],
                 eval_context: _Context, one_device: OneDeviceOptimizer | None = None,
                 index: int | None = None, shows_logs: bool = True) -> None:
        self.module, self.plan, self.carve, self.config = module, plan, carve, config
        self.one_device = one_device
        self.accumulation = num_microbatches
        self.num_microbatches = num_microbatches
        self.links = links
        self.index = carve.first.stage if index is None else index
        devices = links.devices or tuple(range(plan.num_stages))
        self.log_source = devices[plan.num_stages - 1]  # the process holding the last stage
        self.evaluator = PipelineEvaluator(module, list(carve), links.connect_chunks(carve.stages),
                                           num_microbatches=num_microbatches, broadcast=broadcast,
                                           log_source=self.log_source, context=eval_context)
        self.runtime: StageRuntime | None = None  # the first chunk's (the stage's) runtime
        self.runtimes: dict[int, StageRuntime] = {}  # every chunk's, by stage
        self.optimizer: StageOptimizer | None = None  # the process's optimizer (its chunks step views of it)
        self.driver: StreamDriver | None = None
        self.relay = LogRelay(num_microbatches, shown=shows_logs)
        self.fingerprint = BatchFingerprint(self.index)
        self._broadcast = broadcast
        self._resumed_gradients: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        # dp_shard="optimizer": this replica's share of each stage's updates, by stage
        self._shards: dict[int, OptimizerShards] = {}
        self.hooks: LightningHooks | None = None  # the last chunk's: monitors' figures and hook logs leave from it
        self.relays: RelayPlan | None = None  # values relayed past stage boundaries, found once at setup
        self._compiled = [BlockCompile(plan.block_modules(module, c.stage), config.compile_backend) for c in carve
                          if config.compile == "blocks"]  # under recomputation's wrapper: [Note: compiled blocks]
        self._recompute = [BlockRecompute(plan.block_modules(module, c.stage)) for c in carve
                           if recomputes(config.recompute, config.recompute_stages, c.stage)]

    def prepare_relays(self, strategy: PipelineStrategy, sample: Sample | None) -> None:
        """Find the values this pipeline relays past stage boundaries on ``sample`` (with every other stage) and
        install this process's part (see [Note: relayed crossings] in partition/relay.py); once per carve."""
        if self.relays is not None:
            return
        devices = self.links.devices or tuple(range(self.plan.num_stages))
        self.relays = find_relays(strategy, self.module, self.plan, list(self.carve), sample, devices)
        if self.config.model_parallel:
            _resharded(self.module)  # the probe's forward left FSDP2's roots gathered
        for carve in self.carve:
            with carve.entered():
                install_relays(self.module, carve, self.relays)
        if self.relays.relays:
            rank_zero_info(f"lightning_paci: {self.relays.describe()}")

    def start_training(self, optimizers: list[torch.optim.Optimizer], *, schedulers: list[Any], accumulation: int,
                       hooks: Callable[[int], LightningHooks] | None, train_context: _Context) -> None:
        """Wrap the stage's optimizer (see [Note: alias optimizer]) and build the runtimes and stream driver;
        ``hooks(stage)`` (Lightning's backward and optimizer hooks, clipping) run at each local backward and update;
        with data parallelism every runtime joins its stage's replicas (engine/replicas/data_parallel.py)."""
        if len(optimizers) != 1:
            raise ValueError(one_optimizer_message(len(optimizers)))
        optimizer, carves = optimizers[0], list(self.carve)
        self.accumulation = accumulation
        # what the lists need (micro-batches per loop, tied weights' placement) fails here, not at the first batch
        whole = self.config.whole_batch_loss is not None  # [Note: the whole-batch loss]
        build_schedule(self.config.schedule, self.plan.num_stages // len(carves), self.num_microbatches, accumulation,
                       1, tied=bool(self.plan.tied), virtual_stages=len(carves), placement=self.config.placement,
                       whole_batch=whole)
        chunk_hooks = {carve.stage: hooks(carve.stage) for carve in carves} if hooks is not None else {}
        self.hooks = chunk_hooks.get(carves[-1].stage)
        single = len(carves) == 1
        self.optimizer = StageOptimizer(
            optimizer, list(self.module.parameters()), schedulers=schedulers,
            before_step=self.hooks.before_step if self.hooks is not None and single else None, exclude=self.tied_copies)
        warn = rank_zero_warn if self.config.schedule == "paci" else None  # flush schedules have no drift at a = m
        if self.config.deferred_update and self.links.replicas == 1:
            raise ValueError("`deferred_update=True` defers each update while the replicas' gradient reduction "
                             "completes, and this run has one replica per stage: drop `deferred_update`, or give the "
                             "stages replicas (`data_parallel_size`).")
        sharded = self.config.dp_shard == "optimizer" and self.links.replicas > 1
        comms = self.links.connect_chunks(self.carve.stages)
        owned = self.carve.chunk_parameters(self.module)
        costly = None
        for carve in carves:
            stage, chunk_hook = carve.stage, chunk_hooks.get(carve.stage)
            view = self.optimizer if single else self.optimizer.chunk(
                owned[stage], chunk_hook.before_step if chunk_hook is not None else None)
            prediction = weight_prediction_for(self.config.compensation, optimizer, view.pairs, warn=warn)
            tensor = self.config.model_parallel
            if prediction is not None and (sharded or self.config.deferred_update or tensor):
                _refuse_or_warn_prediction(self.config.compensation, warn, sharded=sharded, tensor=tensor)
                prediction = None
            if prediction is not None and not single:
                prediction.before = view.own_hyperparameters
            program = LightningStageProgram(self.module, carve, context=train_context,
                                            whole_batch_loss=self.config.whole_batch_loss)
            whole_batch = WholeBatch(program.whole_loss, self.num_microbatches, program.whole_batch_loss) \
                if program.whole_batch_loss is not None else None
            runtime = StageRuntime(stage, self.plan.num_stages, program, comms[stage], view,
                                   loss_scale=loss_scale_for(accumulation), tied=carve.tied_params,
                                   skip_nonfinite=self.config.nonfinite == "skip", hooks=chunk_hook,
                                   prediction=prediction, whole_batch=whole_batch)
            _time_on_device(runtime, self.links.deliver, self.config.compensation)
            runtime.records.sharded_weights = tensor  # [Note: tensor parallelism in a stage]
            if self.config.schedule == "layered":  # [Note: layered backward]
                runtime.run_layer_major(LayeredBackward(LayerCuts(self.plan.block_modules(self.module, stage))))
            if warn is not None and runtime.prediction:
                costly = costly or costly_regime(optimizer, schedulers)
            self.runtimes[stage] = runtime
        if costly is not None:
            warn(costly)  # type: ignore[misc]
        self.runtime = self.runtimes[carves[0].stage]
        device = None if single else DeviceRuntime(
            self.runtimes, index=self.index, num_devices=self.plan.num_stages // len(carves),
            virtual_stages=len(carves), placement=self.config.placement)
        self.driver = StreamDriver(self.runtime, schedule=self.config.schedule, num_microbatches=self.num_microbatches,
                                   accumulation=accumulation, tied=bool(self.plan.tied),
                                   max_stream_batches=self.config.max_stream_batches,
                                   on_drain=lambda: self.fingerprint.check(self._broadcast), device=device,
                                   whole_batch=whole)
        if self.links.replicas > 1 and self.config.model_parallel:  # the module's `fully_shard` reduces them
            sync = _GradientSync(self.module)
            for runtime in self.runtimes.values():
                runtime.join_replicas(self.links.replica, None)
                runtime.sync_gradients_with(sync)
        elif self.links.replicas > 1:
            self._join_replicas()

    def _join_replicas(self) -> None:
        plan, mb = self.plan, self.config.reduce_bucket_mb
        names = {id(p): name for name, p in self.module.named_parameters()}
        for carve in self.carve:
            runtime = self.runtimes[carve.stage]
            late = (carve.tied_params or self.carve.shared_tied) if carve.is_first else ()
            shards = join_replicas(
                runtime, self.driver, self.links.replica_group, self.links.replicas, self.links.replica,
                local_sgd_steps=self.config.local_sgd_steps, last_stage=carve.is_last, names=names,
                bucket_bytes=None if mb is None else int(mb * 2**20),
                order=partial(backward_order, blocks=[plan.block_names[i] for i in plan.blocks(carve.stage)],
                              after=plan.after),
                late=late, shard_optimizer=self.config.dp_shard == "optimizer", deferred=self.config.deferred_update)
            if shards is not None:
                self._shards[carve.stage] = shards

    def activity(self) -> Callable[[], Doing | None]:
        """What the runtimes are doing, for the failure watchdog (supervision.runtime_activity)."""
        return _first_busy([runtime_activity(runtime, self.links.watched) for runtime in self.runtimes.values()])

    def train(self, batch: Any, batch_idx: int, *, label: str, drain: bool, accumulation: int,
              close_window: bool = False) -> tuple[float | torch.Tensor, int]:
        """Feed one Lightning batch (``accumulation``: the current window, used when the batch opens a stream);
        replay the logs of every mini-batch complete here; return the mean loss of the last mini-batch replayed on
        this rank and its index in the run: on the last stage (global rank 0) the batch just fed; on the stages
        before it one that came back with the gradients, ``(0.0, -1)`` before the first."""
        runtime, driver = self.runtime, self.driver
        if runtime is None or driver is None:
            raise RuntimeError("LocalStage.train before start_training")
        for chunk in self.runtimes.values():
            chunk.label(label)
        self.fingerprint.update(batch, batch_idx)
        self.fingerprint.check_first(self._broadcast)  # before any stage computes: one broadcast per fit
        driver.feed(batch, batch_idx, drain=drain, accumulation=accumulation, close_window=close_window)
        # the records of the last stage here, else of the first chunk (complete last); the others' are spent
        source = self.runtimes[self.carve.last.stage] if self.carve.holds_last else runtime
        for chunk in self.runtimes.values():
            if chunk is not source:
                _drop_spent_logs(chunk)
        self.relay.emit(self.module, source.logs)
        if self.hooks is not None and self.carve.holds_last:
            self.hooks.replay_hook_logs()
        return self.relay.last_loss, self.relay.last_minibatch

    def training_call(self, trainer: Trainer, args: tuple[Any, ...], kwargs: dict[str, Any], *, accumulation: int,
                      device: torch.device, from_last: Callable[[Any], Any]) -> dict[str, Any]:
        """``Strategy.training_step``: the Lightning batch fed (:meth:`train`; ``accumulation``: the window now,
        which a ``GradientAccumulationScheduler`` changes between epochs), a drain where the fit loop needs one, and
        what Lightning's callbacks get as the batch's outputs (``from_last``: a broadcast from the last stage, for
        callbacks that read every stage's loss)."""
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        # an epoch's end steps an open window as Lightning does when windows are whole Lightning batches; a window
        # of `accumulation` micro-batches not a multiple of the batch's is PACI's own and carries on across epochs
        closes_windows = accumulation % self.num_microbatches == 0
        loss, minibatch = self.train(batch, batch_idx,
                                     label=f"Lightning batch {batch_idx} (global step {trainer.global_step})",
                                     drain=must_drain(trainer, batch_idx), accumulation=accumulation,
                                     close_window=closes_windows and ends_epoch(trainer, batch_idx))
        return batch_outputs(loss, minibatch, precision=str(trainer.precision), device=device,
                             every_stage=needs_every_stage_loss(trainer), holds_last=self.carve.holds_last,
                             from_last=from_last)

    def evaluation_call(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``Strategy.validation_step`` / ``test_step`` / ``predict_step``: one batch through the forward-only
        pipeline (evaluation.py)."""
        batch = kwargs.pop("batch", args[0] if args else None)
        return self.evaluate(step_name, batch, args[1:] if args else tuple(kwargs.values()))

    def log_figures(self, figures: dict[str, float], step: int) -> None:
        """A monitor's figures of this stage, carried to global rank 0's loggers (LightningHooks.figures)."""
        if self.hooks is not None:
            self.hooks.figures(figures, step, last_stage=self.carve.holds_last)

    def drain(self) -> None:
        if self.driver is not None:
            self.driver.drain()

    def evaluate(self, step_name: str, batch: Any, rest: tuple[Any, ...]) -> Any:
        return self.evaluator.step(step_name, batch, rest)

    def optimizer_state(self, checkpoints: PipelineCheckpoints) -> dict[str, Any]:
        """The checkpoint's optimizer entry (see checkpoint.py): name-keyed state and the accumulation counters."""
        runtime, optimizer = self.runtime, self.optimizer
        assert runtime is not None and optimizer is not None
        for chunk in self.runtimes.values():
            if isinstance(chunk.reduce_gradients, (GradientAverage, OverlappedGradientAverage)):
                # data parallel: an open window's gradients differ per replica until the step averages them; average
                # them now (the step's average is linear: the same update), so the one copy saved is every replica's
                chunk.reduce_gradients().verify()
        open_window = (runtime.microbatch_base - runtime.window_base) % self.accumulation
        if open_window and self.config.model_parallel and self.links.replicas > 1:
            raise ValueError(
                f"A checkpoint after {open_window} of the {self.accumulation} backwards of an update window: FSDP2 "
                f"holds the window's gradients unsharded until its last backward, so they cannot be saved ([Note: "
                f"distributed checkpoints]). Use an `accumulation` that is a multiple of `microbatches` (windows "
                f"then close with each Lightning batch), or save at an update.")
        merge = None
        if self._shards:  # the stage's whole state, from its replicas' shares
            mine = set().union(*(shards.owned for shards in self._shards.values()))
            names = {id(p): n for n, p in self.module.named_parameters()}
            owned = [names[id(p)] for _, p in optimizer.pairs if id(p) in mine]
            merge = partial(merge_replica_states, owned=owned, group=self.links.replica_group,
                            host=self.links.headers)
        entry = checkpoints.optimizer_state(optimizer, self.module, backwards=runtime.microbatch_base,
                                            steps=runtime.version, tied_copies=self.tied_copies,
                                            window_start=runtime.window_base, merge=merge)
        if self.one_device is not None and checkpoints.layout == "consolidated" and entry:  # rank 0: every stage's
            entry.update(self.one_device.to_torch(entry["paci"]["params"]))
        elif self.one_device is not None and entry:  # sharded: the layout, for the file consolidated from it
            entry["paci"][ONE_DEVICE_KEY] = self.one_device.layout()
        return entry

    def load_optimizer_state(self, checkpoints: PipelineCheckpoints, checkpoint: Mapping[str, Any]) -> None:
        """Resume the optimizer state and the counters, so the next step falls where the saved run's would."""
        optimizer = self.optimizer
        assert self.runtime is not None and optimizer is not None
        if self.one_device is not None:
            checkpoint = self.one_device.as_pipeline_checkpoint(checkpoint, self.accumulation)
        resumed = checkpoints.load_optimizer_state(checkpoint, optimizer, self.module, self.tied_copies)
        for stage, shards in self._shards.items():  # keep only this replica's share of the loaded state
            stepping = self.runtimes[stage].optimizer
            assert stepping is not None
            stepping.shard(shards.owned, shards.share)
        for runtime in self.runtimes.values():
            runtime.restore(backwards=resumed.backwards, steps=resumed.steps, window_start=resumed.window_start)
            if runtime.optimizer is not optimizer and runtime.optimizer is not None:
                runtime.optimizer.resume_at(resumed.steps)
        self._resumed_gradients = resumed.gradients
        if resumed.num_stages != checkpoints.num_stages:
            rank_zero_info(f"lightning_paci: resumed a {resumed.num_stages}-stage checkpoint on "
                           f"{checkpoints.num_stages} stages (weights and optimizer state repartitioned by parameter "
                           f"name)")

    def install_resumed_gradients(self) -> None:
        """Put back the gradients of the window a checkpoint was saved in (after Lightning's ``zero_grad`` at the
        start of the run), so that a resume inside an accumulation window is exact."""
        for param, grad in self._resumed_gradients:
            param.grad = grad
        self._resumed_gradients = []

    @property
    def tied_copies(self) -> list[torch.nn.Parameter]:
        """The last stage's copies of tied weights (stage 0 owns and steps the weights; [Note: tied weights])."""
        return self.carve.last.tied_params if self.carve.holds_last else []

    def restore_full_model(self, *, gather: bool, replicas: int = 1, materialize: bool = True,
                           group: Any = None) -> None:
        """Put the other stages' modules back, holding the complete trained weights (gathered from every stage
        when ``gather``, one stage at a time through host memory over ``group``, see checkpoint.gather_everywhere;
        a failed gather leaves them as they were at carving, with a warning); with ``materialize`` False they come
        back on the meta device (a model built there: no rank holds more than its stage)."""
        full = None
        if gather:
            try:
                full = gather_everywhere(cpu_state(self.module, self.carve.foreign_buffers), replicas, group)
            except (RuntimeError, ConnectionError) as err:
                log.warning(f"lightning_paci: could not gather the full weights at teardown: {err}")
        for remove in [r.remove for r in self._recompute] + [c.remove for c in self._compiled]:
            remove()  # recomputation's wrapper first: it wraps the compiled forward
        for runtime in self.runtimes.values():
            if runtime.layered is not None:  # the layered backward's block hooks
                for handle in runtime.layered.cuts.handles:
                    handle.remove()
        self.carve.restore(self.module, full, materialize=materialize)


class _GradientSync:
    """FSDP2's gradient reduction on the backward that closes an update window only: the others accumulate the
    unsharded gradients on the rank ([Note: tensor parallelism in a stage]). Set when it changes, not per call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.modules = _fsdp_modules(module)
        self.current: bool | None = None

    def __call__(self, closes: bool) -> None:
        if closes != self.current:
            for module in self.modules:
                module.set_requires_gradient_sync(closes, recurse=False)
            self.current = closes


def _fsdp_modules(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 modules inside ``module`` (the module's own ``fully_shard`` calls)."""
    from torch.distributed.fsdp import FSDPModule

    return [sub for sub in module.modules() if isinstance(sub, FSDPModule)]


def _resharded(module: torch.nn.Module) -> None:
    """Every FSDP2 module of ``module`` back to its shards: a root does not reshard after its forward (its backward
    follows), and the setup probe's forward has none; the optimizer holds the sharded parameters."""
    for sub in _fsdp_modules(module):
        sub.reshard()


def _first_busy(watched: list[Callable[[], Doing | None]]) -> Callable[[], Doing | None]:
    """What a process running several stages is doing: the one stage with an action under way (one at a time)."""
    if len(watched) == 1:
        return watched[0]

    def now() -> Doing | None:
        return next((doing for doing in (w() for w in watched) if doing is not None), None)
    return now


def _drop_spent_logs(runtime: StageRuntime) -> None:
    """A chunk whose records are not replayed here keeps a micro-batch's only until it has sent them upstream (its
    backward and its gradient's send): so nothing grows per micro-batch."""
    base = runtime.microbatch_base
    for key in [k for k in runtime.logs if k - base not in runtime.held and k - base not in runtime.input_grads]:
        del runtime.logs[key]


def _refuse_or_warn_prediction(compensation: str, warn: Callable[[str], None] | None, *, sharded: bool,
                               tensor: bool = False) -> None:
    """The weight prediction reads every tensor's optimizer state, which ``dp_shard="optimizer"`` leaves on one
    replica each, predicts the updates at their ``OPT``, which ``deferred_update`` moves, and does not move DTensor
    shards in this release: ``"predict"`` is refused, ``"auto"`` trains uncompensated and says so."""
    if tensor:
        option = "`tensor_parallel_size`"
        rule = "the weight prediction of `compensation` does not move the DTensor shards of a stage's own parallelism"
    elif sharded:
        option = "`dp_shard='optimizer'`"
        rule = ("the weight prediction of `compensation` reads every tensor's optimizer state, and "
                "`dp_shard='optimizer'` keeps each tensor's state on one replica")
    else:
        option = "`deferred_update=True`"
        rule = "the weight prediction of `compensation` does not model the update `deferred_update=True` moves"
    if compensation == "predict":
        raise ValueError(f"`compensation='predict'` with {option}: {rule}. Pass `compensation='none'` or drop "
                         f"{option}.")
    if warn is not None:
        warn(f"lightning_paci: no staleness compensation for this run: {rule}. Pass `compensation='none'` to "
             f"silence this warning.")


def _time_on_device(runtime: StageRuntime, device: torch.device | None, compensation: str) -> None:
    """On CUDA: the monitors read device clocks ([Note: device clocks]), and ``compensation="auto"`` times its
    weight prediction against the stage's compute ([Note: the prediction's budget])."""
    if device is None or device.type != "cuda":
        return
    runtime.records.device_clock = DeviceClock(runtime.clock)
    if runtime.prediction is not None and compensation == "auto":
        runtime.prediction.timer = PredictionTiming()
