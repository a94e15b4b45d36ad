"""``PACIStrategy``: train an unchanged LightningModule with asynchronous pipeline parallelism.

``import lightning_paci`` registers ``Trainer(strategy="paci")`` (processes started like ``ddp``), ``"paci_fork"``
(forked, for CPU tests and notebooks) and ``"paci_spawn"``.

[Note: no flush per Lightning batch]
Lightning calls ``training_step`` once per batch. Each stage runs, in call ``k``, its actions of round ``k``
(see ``schedules.assign_rounds``): everything it can do before it needs mini-batch ``k + 1``. Stages then return to
Lightning at different moments and never wait for each other except for real data dependencies, so the pipeline
stays full across batches. Two per-batch synchronisations would turn this into a flush and are avoided:

* Lightning >= 2.5.2 broadcasts a SIGTERM flag from rank 0 before every batch (a full barrier on gloo). The strategy
  owns SIGTERM handling instead: the broadcast is replaced by a local check (Lightning's launchers deliver the
  signal to every process).
* Logged values live on the last stage. Instead of a broadcast per batch, ``self.log`` records travel upstream
  with the gradients, and each rank replays them with the real ``self.log`` once all micro-batches of a mini-batch
  have reached it (one call later on stage 0 than on the last stage under ``"paci"``).

The pipeline drains (runs the cool-down of the current stream) only inside the last call before validation, at the
end of an epoch, at ``max_steps``, and before a checkpoint or teardown.
"""

from __future__ import annotations

import gc
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_paci.checkpoint import (
    META_FILE,
    atomic_save,
    load_sharded,
    load_stage_optimizer_state,
    save_shard,
    stage_optimizer_state,
)
from lightning_paci.comm import DistComm, flatten, unflatten
from lightning_paci.partition import (
    BlockCosts,
    PartitionPlan,
    PartitionSpec,
    StageCarve,
    carve_stage,
    plan_partition,
    profile_block_costs,
)
from lightning_paci.program import METRIC_OPTION, LightningStageProgram, extract_loss, recording_logs
from lightning_paci.runtime import (
    LOSS_KEY,
    LogRecord,
    StageOptimizer,
    StageRuntime,
    StreamCursor,
    loss_scale_for,
    split_microbatches,
)
from lightning_paci.schedules import SCHEDULE_NAMES
from lightning_paci.supervision import StageWatchdog, connect_store

__all__ = ["PACIStrategy", "optimizer_and_step_schedulers"]

log = logging.getLogger(__name__)

_SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "64-true")


def optimizer_and_step_schedulers(output: Any) -> tuple[torch.optim.Optimizer, list[Any]]:
    """The single optimizer and the per-step LR schedulers of a ``configure_optimizers`` return value (used by the
    reference executor; the strategy reads Lightning's parsed configuration)."""
    if isinstance(output, torch.optim.Optimizer):
        return output, []
    if isinstance(output, dict):
        scheduler = output.get("lr_scheduler")
        if isinstance(scheduler, dict):
            scheduler = scheduler["scheduler"]
        return output["optimizer"], [scheduler] if scheduler is not None else []
    if isinstance(output, (list, tuple)) and len(output) == 2 and isinstance(output[0], (list, tuple)):
        return output[0][0], [s["scheduler"] if isinstance(s, dict) else s for s in output[1]]
    if isinstance(output, (list, tuple)) and len(output) == 1:
        return optimizer_and_step_schedulers(output[0])
    raise ValueError(f"Unsupported `configure_optimizers` return value for pipeline training: {type(output).__name__}.")


class _Stream:
    """State of the current stream (the run between two drains) on this stage."""

    def __init__(self, cursor: StreamCursor) -> None:
        self.cursor = cursor
        self.calls = 0  # Lightning calls (mini-batches) fed into this stream


class PACIStrategy(ParallelStrategy):
    """Pipeline-parallel training with PACI's asynchronous, flush-free 1F1B schedule (one process per stage).

    Args:
        schedule: ``"paci"`` (default; no flush, a local optimizer step every ``accumulation`` backwards),
            ``"1f1b"`` (synchronous 1F1B with a flush per batch: the baseline) or ``"gpipe"``.
        microbatches: micro-batches per Lightning batch (default: the number of stages). Batch sizes that do not
            divide evenly are allowed (the first ``B mod m`` micro-batches get one sample more).
        accumulation: local backwards per optimizer step on every stage (default: ``microbatches``, i.e. one step
            per batch per stage). ``Trainer(accumulate_grad_batches=k)`` multiplies it.
        partition: ``"balanced"`` (default): parameter counts, or the measured forward+backward time of each block
            on a sample micro-batch when that split makes the slowest stage at least 10% faster (timing noise cannot
            flip it); ``"parameters"``, ``"uniform"``, or the block indices where stages 1..N-1 start. The chosen
            split is logged at setup; pin it with explicit indices to reproduce a run exactly. ``"balanced"`` draws
            one sample batch from the training dataloader at setup (RNG state restored): a dataloader or
            ``collate_fn`` with side effects sees one extra batch; use ``"parameters"`` to avoid that.
        block_container: dotted path of the ``nn.Sequential``/``nn.ModuleList`` holding the repeated blocks
            (default: found automatically).
        timeout: process-group timeout; a stage waiting longer for a neighbour fails instead of hanging.
        failure_timeout: seconds without a heartbeat after which a stage is declared dead; when a stage dies or
            raises, every other stage prints the failed stage and its reason and exits (see supervision.py).
        nonfinite: ``"raise"`` (default) stops the run at the first NaN/inf loss or gradient with an error naming
            the stage and the step; ``"skip"`` drops a micro-batch whose loss is not finite (it contributes no
            gradient; non-finite gradients always raise).
        max_stream_batches: the pipeline also drains after this many batches without another drain (validation,
            epoch end, checkpoint). Each stage's action lists are built for the whole stream, so this bounds their
            memory and build time; the cost is one pipeline fill per ``max_stream_batches`` batches (about
            ``(N-1) / (max_stream_batches * m)`` of the time: 0.3% for N = m = 8 at the default 256).
        checkpoint_layout: ``"consolidated"`` (default): one ordinary file, weights gathered on rank 0;
            ``"sharded"``: a directory with one file per stage plus ``meta.pt``, nothing gathered (for models too
            large for one process); ``python -m lightning_paci.checkpoint DIR FILE`` consolidates it.
        freeze_gc: at the start of training, collect once and move every object then alive into the garbage
            collector's permanent generation (``gc.freeze()``; undone at teardown). A process that has imported
            torch, Lightning and transformers holds ~470k objects, and each full collection over them paused a
            stage for 1-1.5 s; in a pipeline every stage's pause stalls all the others (measured: 1.6-2.9 s steps
            instead of 0.8 s, several times per 200 steps). Objects created during training are still collected.

    Raises:
        ValueError: at construction for bad options, at setup for modules or Trainer settings that cannot run.

    Gradient clipping (``Trainer(gradient_clip_val=...)``) is applied per stage to the stage's own gradients; there
    is no cross-stage global norm (that would need a per-step collective). ``on_before_backward`` /
    ``on_after_backward`` / ``on_before_optimizer_step`` hooks are not called: backwards and steps happen inside
    the schedule.

    Example::

        import lightning as L, lightning_paci
        trainer = L.Trainer(strategy="paci", devices=4)
        trainer.fit(model)
    """

    strategy_name = "paci"

    def __init__(
        self,
        *,
        schedule: Literal["paci", "1f1b", "gpipe"] = "paci",
        microbatches: int | None = None,
        accumulation: int | None = None,
        partition: PartitionSpec = "balanced",
        block_container: str | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        failure_timeout: float = 20.0,
        nonfinite: Literal["raise", "skip"] = "raise",
        checkpoint_layout: Literal["consolidated", "sharded"] = "consolidated",
        max_stream_batches: int = 256,
        freeze_gc: bool = True,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if schedule not in SCHEDULE_NAMES:
            raise ValueError(f"`schedule` must be one of {', '.join(map(repr, SCHEDULE_NAMES))}, got {schedule!r}.")
        for name, value in (("microbatches", microbatches), ("accumulation", accumulation)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`{name}` must be an int >= 1 (or None for the default), got {value!r}. "
                                 f"Use e.g. `PACIStrategy({name}=8)`.")
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"`nonfinite` must be 'raise' or 'skip', got {nonfinite!r}.")
        if checkpoint_layout not in ("consolidated", "sharded"):
            raise ValueError(f"`checkpoint_layout` must be 'consolidated' or 'sharded', got {checkpoint_layout!r}.")
        self._checkpoint_layout = checkpoint_layout
        if isinstance(max_stream_batches, bool) or not isinstance(max_stream_batches, int) or max_stream_batches < 1:
            raise ValueError(f"`max_stream_batches` must be an int >= 1, got {max_stream_batches!r}. The default "
                             f"256 drains the pipeline at least every 256 batches.")
        self._max_stream_batches = max_stream_batches
        if not isinstance(freeze_gc, bool):
            raise ValueError(f"`freeze_gc` must be True or False, got {freeze_gc!r}.")
        self._freeze_gc = freeze_gc
        self._froze_gc = False
        if failure_timeout <= 0:
            raise ValueError(f"`failure_timeout` must be > 0 seconds, got {failure_timeout}.")
        self._schedule = schedule
        self._failure_timeout = failure_timeout
        self._nonfinite = nonfinite
        self._watchdog: StageWatchdog | None = None
        self._failed = False
        self._microbatches = microbatches
        self._accumulation = accumulation
        self._partition = partition
        self._block_container = block_container
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._p2p_groups: list[dist.ProcessGroup | None] = [None, None]
        self._plan: PartitionPlan | None = None
        self._carve: StageCarve | None = None
        self._runtime: StageRuntime | None = None
        self._stream: _Stream | None = None
        self._trainer: Trainer | None = None
        self._owned_schedulers: list[Any] = []
        self._last_loss = float("nan")
        self._logged_minibatches: set[int] = set()
        self._patched: list[tuple[Any, str]] = []
        self._eval_comm: DistComm | None = None

    # -- topology -------------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_stages(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def stage_index(self) -> int:
        return self.global_rank

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # pure pipeline parallelism: every stage must see the same batches
        return {"num_replicas": 1, "rank": 0}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def schedule_name(self) -> str:
        return self._schedule

    @property
    def num_microbatches(self) -> int:
        return self._microbatches or self.num_stages

    @property
    def accumulation(self) -> int:
        """Local backwards per optimizer step, Trainer's ``accumulate_grad_batches`` included."""
        base = self._accumulation or self.num_microbatches
        factor = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
        return base * factor

    @property
    def runtime(self) -> StageRuntime:
        if self._runtime is None:
            raise RuntimeError("PACIStrategy.runtime is only available after `trainer.fit` has set up the stage.")
        return self._runtime

    @property
    def plan(self) -> PartitionPlan:
        if self._plan is None:
            raise RuntimeError("PACIStrategy.plan is only available after setup.")
        return self._plan

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:  # torchrun, SLURM, ...: check before rendezvous
            expected = self.cluster_environment.world_size()
            if self.num_processes * self.num_nodes != expected:
                raise ValueError(
                    f"`Trainer(devices={self.num_processes}, num_nodes={self.num_nodes})` starts "
                    f"{self.num_processes * self.num_nodes} pipeline stages, but the launcher started "
                    f"{expected} processes (WORLD_SIZE={expected}). One process runs one stage: pass "
                    f"`devices={max(1, expected // self.num_nodes)}` (per node) or launch {self.num_processes * self.num_nodes} processes."
                )
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        # pipeline messages on their own communicators, apart from Lightning's collectives: one for activations and
        # gradients, one for the tied-weight exchange (independent message order, also under NCCL)
        self._p2p_groups = [dist.new_group(backend=self._process_group_backend, timeout=self._timeout)
                            for _ in range(2)]
        store = connect_store()
        if store is not None:
            self._watchdog = StageWatchdog(self.stage_index, self.num_stages, store, dead_after=self._failure_timeout)
            self._watchdog.start()
        else:
            log.warning("lightning_paci: no rendezvous store reachable (MASTER_ADDR/MASTER_PORT); a dead stage "
                        "will only be noticed after the process-group timeout")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- collectives (never per training batch) -------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        # Pure pipeline parallelism has one data-parallel replica: a reduce over it is the identity. Logged values
        # are already identical on every rank (see [Note: no flush per Lightning batch]).
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not _distributed_is_initialized():
            return decision
        value = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return bool(value == self.world_size) if all else bool(value > 0)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    # -- setup ----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._check_trainer(trainer)
        module = self.lightning_module
        assert module is not None
        if self._carve is None:
            measured = self._measure_block_costs(trainer) if self._partition == "balanced" else None
            self._plan = plan_partition(module, self.num_stages, container=self._block_container,
                                        partition=self._partition, measured=measured)
            rank_zero_info(f"lightning_paci: {self.num_stages} stages, schedule={self._schedule!r}, "
                           f"microbatches={self.num_microbatches}, accumulation={self.accumulation}; "
                           f"{self._plan.describe()}")
            self._carve = carve_stage(module, self._plan, self.stage_index)
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_training(trainer)

    def _measure_block_costs(self, trainer: Trainer) -> BlockCosts | None:
        """Time every block's forward+backward on one sample micro-batch of the training data (the unchanged module,
        before any carving). Every rank draws the same sample, so a dataloader with side effects stays in step
        across ranks; rank 0 measures and shares the result, so every rank plans the same split. The RNG state is
        restored afterwards. Any failure falls back to parameter counts."""
        if trainer.state.fn != TrainerFn.FITTING:
            return None
        module = self.lightning_module
        assert module is not None
        costs: BlockCosts | None = None
        cpu_rng = torch.random.get_rng_state()
        try:
            loader = trainer.fit_loop._data_source.dataloader()
            batch = next(iter(loader))
            torch.random.set_rng_state(cpu_rng)  # measuring must not change the data order or dropout masks
            size = flatten(batch)[1][0].shape[0]
            sample = split_microbatches(batch, max(1, min(self.num_microbatches, size)))[0]

            def run_step() -> None:
                with recording_logs(module, [], size, "training_step"), self.precision_plugin.train_step_context():
                    loss = extract_loss(module.training_step(sample, 0), "training_step")
                loss.backward()
                module.zero_grad(set_to_none=True)

            if self.is_global_zero:
                costs = profile_block_costs(module, self._block_container, run_step)
        except Exception as err:  # a private Lightning API moved, an iterable dataset, a model without grads
            log.info(f"lightning_paci: block timing not possible ({err}); balancing by parameter count")
        finally:
            torch.random.set_rng_state(cpu_rng)
        return self.broadcast(costs, src=0)

    def _check_trainer(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise MisconfigurationException(
                "`PACIStrategy` supports automatic optimization only (`self.automatic_optimization = True`): in "
                "manual optimization the non-last stages never reach your `optimizer.step()`. Remove "
                "`self.automatic_optimization = False` and return the loss from `training_step`."
            )
        precision = str(trainer.precision)
        if precision not in _SUPPORTED_PRECISION:
            raise MisconfigurationException(
                f"`Trainer(precision={precision!r})` is not supported by `PACIStrategy`: float16 training needs loss "
                f"scaling, and a GradScaler per stage would scale each stage differently. Use one of "
                f"{', '.join(_SUPPORTED_PRECISION)} (bf16-mixed is the recommended low-precision setting)."
            )
        if self.num_stages < 2:
            raise MisconfigurationException(f"`PACIStrategy` needs at least 2 devices (stages), got {self.num_stages}.")

    def _setup_training(self, trainer: Trainer) -> None:
        module = self.lightning_module
        assert module is not None and self._carve is not None
        if len(self.optimizers) != 1:
            raise MisconfigurationException(
                f"`configure_optimizers` returned {len(self.optimizers)} optimizers; `PACIStrategy` steps exactly one "
                f"optimizer per stage. Return a single optimizer (param groups may differ per submodule)."
            )
        optimizer = self.optimizers[0]
        self._owned_schedulers = [cfg.scheduler for cfg in self.lr_scheduler_configs if cfg.interval == "step"]
        clip = self._clip_function(trainer)
        replicas = self._carve.tied_params if self.stage_index == self.num_stages - 1 else []
        stage_optimizer = StageOptimizer(optimizer, list(module.parameters()), schedulers=self._owned_schedulers,
                                         clip=clip, exclude=replicas)
        program = LightningStageProgram(module, self._carve, context=self.precision_plugin.train_step_context)
        ranks = list(range(self.world_size))
        comm = DistComm(ranks, groups=self._p2p_groups, device=self.root_device)
        self._runtime = StageRuntime(self.stage_index, self.num_stages, program, comm, stage_optimizer,
                                     loss_scale=loss_scale_for(self.accumulation), tied=self._carve.tied_params,
                                     skip_nonfinite=self._nonfinite == "skip")
        self._stream = None
        self._logged_minibatches.clear()
        # Lightning steps "step"-interval schedulers after each of its optimizer steps; ours step per local update.
        owned = self._owned_schedulers
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if not any(scheduler is s for s in owned):
                original(scheduler, metric)

        self._patch(module, "lr_scheduler_step", lr_scheduler_step)
        # see [Note: no flush per Lightning batch]: no per-batch SIGTERM broadcast
        self._patch(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor", self._local_sigterm_check)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)  # instance attribute shadows the class attribute; undone in teardown
        self._patched.append((obj, name))

    def _local_sigterm_check(self) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if self._trainer is not None and getattr(self._trainer, "received_sigterm", False):
            raise SIGTERMException()

    @staticmethod
    def _clip_function(trainer: Trainer) -> Callable[[list[torch.nn.Parameter]], None] | None:
        value = trainer.gradient_clip_val
        if not value:
            return None
        algorithm = trainer.gradient_clip_algorithm or "norm"

        def clip(params: list[torch.nn.Parameter]) -> None:
            if algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, value)
            else:
                torch.nn.utils.clip_grad_norm_(params, value)

        return clip

    # -- training -------------------------------------------------------------------------------------------------
    def _new_stream(self) -> _Stream:
        runtime = self.runtime
        done = runtime.microbatch_base  # backwards run so far on every stage (streams end drained)
        cursor = StreamCursor(self._schedule, self.num_stages, self.num_microbatches, self.accumulation,
                              self.stage_index, backward_offset=done % self.accumulation, tied=bool(self.plan.tied))
        return _Stream(cursor)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch = kwargs.get("batch", args[0] if args else None)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
        runtime = self.runtime
        if self._stream is None:
            self._stream = self._new_stream()
            runtime.set_phase("startup")  # the new stream fills the pipeline
        stream = self._stream
        runtime.step_label = f"Lightning batch {batch_idx} (global step {self._trainer.global_step if self._trainer else 0})"
        m = self.num_microbatches
        for i, part in enumerate(split_microbatches(batch, m)):
            runtime.add_microbatch(stream.calls * m + i, part, batch_idx)
        stream.calls += 1
        if self._must_drain(batch_idx):
            self._drain()
        else:
            runtime.run(stream.cursor.segment(stream.calls - 1))
        self._emit_logs()
        return torch.tensor(self._last_loss, device=self.root_device)

    def _must_drain(self, batch_idx: int) -> bool:
        """Whether this call is the last before validation, an epoch end or the end of training."""
        trainer = self._trainer
        assert trainer is not None
        epoch_loop = trainer.fit_loop.epoch_loop
        if trainer.should_stop or epoch_loop.batch_progress.is_last_batch:
            return True
        if self._stream is not None and self._stream.calls >= self._max_stream_batches:
            return True
        if batch_idx + 1 >= trainer.num_training_batches:
            return True
        # Lightning counts a step every `accumulate_grad_batches` batches (aligned to the epoch start)
        closes_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if trainer.max_steps is not None and trainer.max_steps >= 0 and closes_step and trainer.global_step + 1 >= trainer.max_steps:
            return True
        try:
            return bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        except Exception:  # a private Lightning API: if it changes, the on_validation_start drain still holds
            return False

    def _drain(self) -> None:
        """Run the cool-down of the current stream on this stage and wait for its sends."""
        stream, runtime = self._stream, self._runtime
        if stream is None or runtime is None:
            return
        runtime.set_phase("drain")
        runtime.run(stream.cursor.drain(stream.calls))
        runtime.comm.flush()
        if runtime.held or runtime.data:
            raise AssertionError(f"stage {self.stage_index}: drain left {len(runtime.held)} micro-batches in flight")
        runtime.microbatch_base += stream.calls * self.num_microbatches
        self._stream = None
        runtime.set_phase("outside")  # validation, checkpoints, epoch ends: not pipeline time

    def _emit_logs(self) -> None:
        """Replay the last stage's ``self.log`` records of every mini-batch complete on this rank, once per key."""
        runtime = self._runtime
        module = self.lightning_module
        if runtime is None or module is None:
            return
        m = self.num_microbatches
        complete = sorted({mb // m for mb in runtime.logs} - self._logged_minibatches)
        complete = [k for k in complete if all(k * m + i in runtime.logs for i in range(m))]
        if not complete:
            return
        records: list[LogRecord] = []
        for k in complete:
            for i in range(m):
                records.extend(runtime.logs.pop(k * m + i))
            self._logged_minibatches.add(k)
        loss = _replay_logs(module, records)
        if loss is not None:
            self._last_loss = loss

    # -- evaluation -----------------------------------------------------------------------------------------------
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", args, kwargs)

    def _evaluate(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Forward-only pipeline over the batch's micro-batches (stage s works on micro-batch i while stage s+1
        works on i-1). Evaluation is synchronous, so the last stage shares its log records with one broadcast."""
        module, carve = self.lightning_module, self._carve
        assert module is not None and carve is not None
        batch = kwargs.pop("batch", args[0] if args else None)
        rest = args[1:] if args else tuple(kwargs.values())
        program = LightningStageProgram(module, carve, step_name=step_name, context=self.precision_plugin.val_step_context)
        if self._eval_comm is None:
            self._eval_comm = DistComm(list(range(self.world_size)), groups=self._p2p_groups, device=self.root_device)
        comm = self._eval_comm
        size = flatten(batch)[1][0].shape[0] if flatten(batch)[1] else 1
        parts = split_microbatches(batch, max(1, min(self.num_microbatches, size)))
        results, records = [], []
        for part in parts:
            received = comm.recv(self.stage_index - 1) if not carve.is_first else None
            out = program.forward(part, *rest, received=received)
            if carve.is_last:
                results.append(out.result)
                records.extend(out.logs)
            else:
                comm.send(out.outgoing, self.stage_index + 1)
        output = _merge_microbatch_outputs(results) if carve.is_last else None
        if step_name == "predict_step":
            # predictions are returned on global rank 0 (stage 0), in order: one message from the last stage
            if carve.is_last and not carve.is_first:
                comm.send(output, 0)
            elif carve.is_first and not carve.is_last:
                output = comm.recv(self.num_stages - 1)
            comm.flush()
            return output if carve.is_first else None
        comm.flush()
        records = self.broadcast(records, src=self.num_stages - 1)
        _replay_logs(module, records)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # the schedule already ran every backward inside training_step
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # the stage optimizer steps inside the schedule (OPT actions); Lightning's closure runs training_step
        return closure()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._freeze_gc and not self._froze_gc:
            gc.collect()
            gc.freeze()  # see `freeze_gc`: full collections then skip everything alive now
            self._froze_gc = True

    @override
    def on_validation_start(self) -> None:
        self._drain()

    @override
    def on_train_end(self) -> None:
        self._drain()

    # -- checkpoint state -----------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._drain()
        module = self.lightning_module
        assert module is not None
        local = _cpu_state(module)
        if not _distributed_is_initialized() or self._checkpoint_layout == "sharded":
            return local
        full = self._gather_union(local)
        return full if self.is_global_zero else {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Every stage's optimizer state keyed by parameter name, gathered on rank 0 (see checkpoint.py)."""
        self._drain()
        runtime = self._runtime
        module = self.lightning_module
        if runtime is None or runtime.optimizer is None or module is None:
            return super().optimizer_state(optimizer)
        local = stage_optimizer_state(runtime.optimizer, module)
        counters = {"num_stages": self.num_stages, "backwards": runtime.microbatch_base, "steps": runtime.version}
        if self._checkpoint_layout == "sharded":
            return {"paci": {**counters, "params": local}}
        params = self._gather_union(local)
        return {"paci": {**counters, "params": params}} if self.is_global_zero else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        states = checkpoint["optimizer_states"]
        runtime, module = self._runtime, self.lightning_module
        if not states or "paci" not in states[0] or runtime is None or runtime.optimizer is None or module is None:
            raise ValueError(
                "This checkpoint has no pipeline optimizer state (it was not written by PACIStrategy). Load its "
                "weights with `Model.load_from_checkpoint(path)` and start a new run instead of `ckpt_path=`."
            )
        saved = states[0]["paci"]
        load_stage_optimizer_state(runtime.optimizer, module, saved["params"])
        # the accumulation counter and step count continue where the checkpoint stopped
        runtime.microbatch_base = int(saved["backwards"])
        runtime.version = int(saved["steps"])
        if saved["num_stages"] != self.num_stages:
            rank_zero_info(f"lightning_paci: resumed a {saved['num_stages']}-stage checkpoint on {self.num_stages} "
                           f"stages (weights and optimizer state repartitioned by parameter name)")

    def _gather_union(self, local: dict[str, Any]) -> dict[str, Any]:
        """Every stage's name-keyed dict, merged, on every rank (stage dicts have disjoint keys)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return {k: v for part in gathered for k, v in part.items()}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._checkpoint_layout == "consolidated":
            if self.is_global_zero:
                atomic_save(checkpoint, filepath)
            return
        # sharded: every stage writes its own file; rank 0 adds the rest (see checkpoint.py)
        states = checkpoint.get("optimizer_states") or [{}]
        save_shard(filepath, self.stage_index, checkpoint["state_dict"], states[0].get("paci", {}))
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta["paci_num_stages"] = self.num_stages
            atomic_save(meta, Path(filepath) / META_FILE)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if Path(checkpoint_path).is_dir():
            return load_sharded(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    # -- failures and teardown -------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell every other stage (through the store) which stage failed and why, before Lightning unwinds."""
        self._failed = True
        if self._watchdog is not None:
            self._watchdog.report(self.stage_index, f"{type(exception).__name__}: {exception}")
            self._watchdog.stop(done=False)

    @override
    def teardown(self) -> None:
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        module = self.lightning_module
        if self._watchdog is not None and not self._failed:
            self._watchdog.stop(done=True)  # before the final gather: a clean exit is not a failure
        if self._failed:  # neighbours may be gone: no drain, no gather, no restore
            self._runtime = self._stream = None
            super().teardown()
            return
        try:
            self._drain()
        except Exception as err:  # a failing neighbour: do not mask the original error
            log.warning(f"lightning_paci: drain at teardown failed: {err}")
        for obj, name in reversed(self._patched):
            if name in vars(obj):
                delattr(obj, name)
        self._patched.clear()
        if module is not None and self._carve is not None:
            full = None
            if _distributed_is_initialized():
                try:
                    full = self._gather_union(_cpu_state(module))
                except Exception as err:
                    log.warning(f"lightning_paci: could not gather the full weights at teardown: {err}")
            self._carve.restore(module, full)
            self._carve = None
        self._runtime = None
        self._stream = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries = (
            ("paci", "popen", "PACI asynchronous pipeline parallelism, one process per stage"),
            ("paci_spawn", "spawn", "PACI, processes started with spawn"),
            ("paci_fork", "fork", "PACI, processes forked (CPU tests, notebooks)"),
        )
        for name, start_method, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, start_method=start_method)


def _cpu_state(module: LightningModule) -> dict[str, Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _merge_microbatch_outputs(results: list[Any]) -> Any:
    """Concatenate the micro-batches' step outputs along dim 0 (tensors, possibly nested); anything else is returned
    as the list of per-micro-batch outputs."""
    if len(results) == 1:
        return results[0]
    skeletons = [flatten(r) for r in results]
    first_skeleton, first_tensors = skeletons[0]
    if first_tensors and all(len(t) == len(first_tensors) for _, t in skeletons) and all(
        t.dim() > 0 for t in first_tensors
    ):
        try:
            return unflatten(first_skeleton, [torch.cat(parts, dim=0) for parts in zip(*(t for _, t in skeletons))])
        except RuntimeError:
            pass
    return results


def _replay_logs(module: LightningModule, records: list[LogRecord]) -> float | None:
    """Call the real ``self.log`` once per key with the batch-size-weighted mean; return the loss record's mean."""
    totals: dict[str, list[Any]] = {}
    for record in records:
        options = dict(record.options)
        if METRIC_OPTION in options:
            module.log(record.name, module.get_submodule(options.pop(METRIC_OPTION)), **options)
            continue
        entry = totals.setdefault(record.name, [0.0, 0, record.options])
        entry[0] += record.value * record.batch_size
        entry[1] += record.batch_size
    loss = None
    for name, (weighted, size, options) in totals.items():
        if name == LOSS_KEY:
            loss = weighted / size
            continue
        module.log(name, weighted / size, batch_size=size, **dict(options))
    return loss


PACIStrategy.register_strategies(StrategyRegistry)

