"""``PACIConfig``: the strategy's options, checked once, at construction, with errors that name the fix."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from lightning_paci.engine.blocks.block_compile import COMPILE_MODES, check_backend
from lightning_paci.engine.blocks.recompute import RECOMPUTE_MODES
from lightning_paci.engine.replicas.topology import Topology, check_size_option, check_topology, resolve_sizes
from lightning_paci.optim.weight_prediction import COMPENSATIONS
from lightning_paci.partition import PartitionSpec
from lightning_paci.schedules import PLACEMENTS, SCHEDULE_NAMES, VIRTUAL_SCHEDULE_NAMES, ScheduleName
from lightning_paci.schedules.virtual import Placement, stage_devices

__all__ = ["PACIConfig", "format_bytes"]


def _positive_int(name: str, value: object, fix: str, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1{' (or None for the default)' if optional else ''}, got "
                         f"{value!r}. {fix}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}.")


@dataclass(kw_only=True, slots=True, frozen=True)
class PACIConfig:
    """What ``PACIStrategy(...)`` was asked for; every check runs here, at construction, before any process starts.

    Args:
        schedule: ``"paci"`` (default; no flush, a local optimizer step every ``accumulation`` backwards),
            ``"1f1b"`` (synchronous 1F1B with a flush per batch: the baseline), ``"gpipe"``, or ``"layered"``
            (``"gpipe"`` with a layer-major backward, [Note: layered backward] in schedules/build.py: each block's
            data-parallel reduction overlaps the backward of every block before it over the whole batch; the
            stages' backwards run one after the other); with ``virtual_stages``, ``"interleaved"`` or ``"bfs"``
            (accepted with ``virtual_stages=1`` too, where they run ``"1f1b"``'s and ``"gpipe"``'s lists).
        microbatches: micro-batches per Lightning batch (default: the number of stages). Batch sizes that do not
            divide evenly are allowed (the first ``B mod m`` micro-batches get one sample more).
        accumulation: local backwards per optimizer step on every stage (default: ``microbatches``, i.e. one step
            per batch per stage). ``Trainer(accumulate_grad_batches=k)`` multiplies it.
        partition: ``"parameters"`` (default): the split balancing parameter counts, the same on every machine and
            every run; ``"time"``: the measured forward+backward time of each block on a sample micro-batch when
            that split makes the slowest stage at least 10% faster (timing noise cannot flip it), else parameters
            -- the split then depends on the machine, so it is logged at setup, saved in checkpoints and reused
            when a run resumes from one (``"balanced"``: the same, its name in 0.3.0); ``"uniform"``; or the block
            indices where stages 1..N-1 start (the setup line prints the split as such a list). Whatever the
            partition, the setup draws the training loader's first batch once more (the sample step that finds the
            values crossing stages and a loss coupling the batch's samples): a ``collate_fn`` runs one more time
            than on one device.
        block_container: dotted path of the ``nn.Sequential``/``nn.ModuleList`` holding the repeated blocks, or
            a tuple of such paths (an encoder's and a decoder's layers), cut as one row in the order the step runs
            them (default: found automatically, every container that runs so; see [Note: several containers]).
        timeout: process-group timeout; a stage waiting longer for a neighbour fails instead of hanging.
        failure_timeout: seconds without a heartbeat after which a stage is declared dead; when a stage dies or
            raises, every other stage prints the failed stage and its reason and exits (see watchdog.py).
        nonfinite: ``"raise"`` (default) stops the run at the first NaN/inf loss or gradient with an error naming
            the stage and the step; ``"skip"`` drops a micro-batch whose loss is not finite (it contributes no
            gradient; non-finite gradients always raise).
        max_stream_batches: the pipeline also drains after this many batches without another drain (validation,
            epoch end, checkpoint). Each stage's action lists are built for the whole stream, so this bounds their
            memory and build time; the cost is one pipeline fill per ``max_stream_batches`` batches (about
            ``(N-1) / (max_stream_batches * m)`` of the time: 0.3% for N = m = 8 at the default 256).
        checkpoint_layout: ``"consolidated"``: one ordinary file, weights gathered on rank 0; ``"sharded"``: a
            directory with one file per stage plus ``meta.pt``, nothing gathered (for models too large for one
            process); ``python -m lightning_paci.checkpoint DIR FILE`` consolidates it. With
            ``tensor_parallel_size`` the sharded form is a ``torch.distributed.checkpoint`` directory, resumable on
            another layout. ``"auto"`` (default): ``"sharded"`` with ``tensor_parallel_size``, else
            ``"consolidated"``.
        freeze_gc: at the start of training, collect the young generations and move every object then alive into
            the garbage collector's permanent generation (``gc.freeze()``; undone at teardown, after which a cycle
            made before training can be collected). A full collection first would cost 0.5-0.6 s per rank: it walks
            every object of the process, and in a forked rank copies its parent's heap. A process that has imported
            torch, Lightning and transformers holds ~470k objects, and each full collection over them paused a
            stage for 1-1.5 s; in a pipeline every stage's pause stalls all the others (measured: 1.6-2.9 s steps
            instead of 0.8 s, several times per 200 steps). Objects created during training are still collected.
            Under ``start_method="fork"`` the main process's objects are also frozen while the ranks start and run
            ([Note: fork with a frozen heap] in integration/trainer/lightning_api.py), so a rank's collections during
            setup leave its parent's heap alone too.
        compensation: staleness compensation by weight prediction (see [Note: weight prediction] in
            optim/weight_prediction.py). ``"auto"`` (default): a micro-batch that will cross ``k`` local updates
            between its forward and its backward is forwarded with the weights moved ``k`` predicted steps of the
            optimizer itself ahead (SGD with momentum, Adam, AdamW; the window's gradient so far plus the momentum's
            rate for the rest), undone after the forward to within one unit in the last place: no weight copy,
            temporaries of at most the stage's largest parameter tensor, a few multi-tensor passes; a stage whose
            moves bring its forwards less than 0.1 of the way to its backwards' weights over its first 8 updates
            switches it off, saying so ([Note: the prediction's quality]); other optimizers (and weights other than
            float32 or float64) train uncompensated with a warning. ``"predict"``: the prediction on every stage,
            unmeasured, an unsupported optimizer an error (``"lookahead"``, its name up to 0.3, is accepted with a
            deprecation warning). ``"none"``: the paper's PACI, forwards with the weights as they are.
        pipeline_parallel_size, data_parallel_size: stages x replicas = ``devices x num_nodes`` (``"auto"``: what
            the other leaves; both ``"auto"``: every process a stage, one replica). The replicas of a stage average
            their gradients right before each of their local steps (data_parallel.py); see [Note: rank layout] for
            which ranks form a stage's data-parallel group.
        tensor_parallel_size: ranks per stage and replica that split each of the stage's layers (tensor
            parallelism, as Lightning's ``ModelParallelStrategy``): ``devices x num_nodes`` = stages x replicas x
            this. Given (1 included), the module's ``configure_model`` runs after the stage is cut, with
            ``self.device_mesh`` the stage's 2D sub-mesh ``("data_parallel", "tensor_parallel")``, and applies its
            own parallelism (``parallelize_module``, ``fully_shard`` over the replicas); every tensor-parallel rank
            of a stage reads the same batches, and each sends to the rank of the same coordinate in the next stage
            ([Note: rank layout], [Note: tensor parallelism in a stage]). None (default): no mesh, layers whole,
            replicas averaged by the strategy.
        local_sgd_steps: with replicas, average the replicas' parameters every this many local steps of a stage
            (and at every drain) instead of their gradients before every step (LocalSGD, as Accelerate's): fewer
            collectives for a slow interconnect, at some loss per sample (benchmarks/RESULTS.md).
        deferred_update: with replicas under ``"paci"``, an ``OPT`` only starts what is left of its reduction and
            the update is made right before the stage's next backward, so the forward in between hides the
            reduction; those micro-batches cross one more update (the drift bound read off the list, at most one
            more than PACI's; [Note: deferred update] in engine/runtime/updates.py). Default False.
        dp_shard: ``"none"`` (default) or ``"optimizer"``: with replicas, each replica of a stage updates -- and
            keeps the optimizer state of -- about ``1 / replicas`` of the stage's tensors and sends them to the others
            after each step (ZeRO stage 1, [Note: optimizer shards] in engine/replicas/optimizer_shards.py); bit for
            bit the unsharded run for per-tensor optimizers (SGD, Adam, AdamW); checkpoints hold the whole state.
        reduce_bucket_mb: with replicas (and without ``local_sgd_steps``), the gradients are averaged in buckets of
            whole blocks of about this many MiB (DDP's ``bucket_cap_mb``), each started while the backward that
            closes the window still runs the blocks before it; the step waits only for what is still in flight
            ([Note: overlapped reduction] in engine/replicas/grad_buckets.py). ``None``: one blocking average at the
            step.
        recompute: ``"off"`` (default) or ``"blocks"``: each of a stage's blocks keeps only its input between a
            micro-batch's forward and its backward and runs its forward again inside the backward (activation
            memory for compute; exact under 1f1b/gpipe, a second staleness under paci: [Note: recomputation under
            PACI] in recompute.py).
        recompute_stages: only the first this many stages recompute (they hold the most micro-batches in flight);
            None (default): every stage.
        compile: ``"off"`` (default) or ``"blocks"``: each block a stage owns runs its ``forward`` through
            ``torch.compile``; hooks, relays and recomputation stay outside the compiled region, parameter names and
            checkpoints are the eager model's ([Note: compiled blocks] in engine/blocks/block_compile.py).
        compile_backend: the ``torch.compile`` backend of ``compile="blocks"`` (default ``"inductor"``).
        process_group_backend: ``"nccl"`` on CUDA, ``"gloo"`` otherwise (default: chosen from the device).
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"`` (CPU tests,
            notebooks) or ``"forkserver"``.
        model_init: ``"stage"`` (default): a model built in ``configure_model()`` (or under
            ``trainer.init_module(empty_init=True)``) gets its parameters on the meta device, is planned there, and
            each stage materializes only its own, replaying the user's initialization bit for bit ([Note:
            stage-only construction] in partition/stage_init.py); ``configure_model`` then runs twice and must build
            the same model each time. ``"full"``: every rank builds the whole model, as in an ordinary run.
        weights: pretrained weights read per stage (partition/weights.py): a transformers directory (safetensors,
            sharded with its index or not), a ``.safetensors`` file, a consolidated ``.ckpt`` or a PACI sharded
            checkpoint directory. Keys are the module's ``state_dict()`` names, or those less one common prefix.
        virtual_stages: stages per process (default 1). With ``v > 1`` the blocks are cut into ``v x P`` stages and
            each process runs ``v`` of them ([Note: virtual stages] in schedules/virtual.py), parameter names
            unchanged: a drain and a fill cost about ``1/v`` of one stage per process; ``schedule`` is ``"paci"``,
            ``"interleaved"`` or ``"bfs"``. PACI's drift bound is taken per stage and is higher for the first
            stages (docs/virtual-stages.md).
        placement: with virtual stages, ``"loop"`` (default: stage ``c`` on process ``c mod P``) or ``"v"`` (zig-zag:
            the first and the last stage on one process, so a tied embedding and LM head share one weight and
            exchange nothing; global rank 0 then holds them).
        plan: ``"off"`` (default): the options as given. ``"auto"``: at setup, each block's forward and backward
            time and activation bytes are measured on a sample of the training data (cached by the model's
            fingerprint), every plan -- micro-batches, cut points, recomputing stages, gradient reduction -- is
            predicted on the simulator, and the fastest within ``memory_budget`` and the default drift bound is run;
            options given other than their defaults are kept. The table of it and its runners-up is printed and the
            prediction is checked against the run ([Note: the plan at setup] in integration/setup/auto_plan.py).
        memory_budget: with ``plan="auto"``, the most bytes a process may hold for parameters, gradients,
            optimizer state and activations (a number, or text such as ``"24GiB"``); None: no bound.
        whole_batch_loss: the name of the LightningModule method that ``training_step`` calls to compute a loss
            over the whole batch from per-sample tensors (a contrastive loss with in-batch negatives), and whose
            result it returns: the last stage then calls it once per batch on every micro-batch's arguments joined
            along dim 0, as one device does, and sends each micro-batch its gradient ([Note: the whole-batch loss]
            in engine/runtime/whole_batch.py). Every stage's warm-up grows by ``microbatches - 1``: ``"1f1b"`` runs
            ``"gpipe"``'s order (all of a batch's activations held), ``"paci"`` holds ``microbatches - 1`` more
            and its drift bound grows to ``ceil((N - 2 - s + microbatches) / accumulation)``. None (default): each
            micro-batch's step computes its own loss.

    Gradient clipping by norm (``Trainer(gradient_clip_val=...)``) uses the norm over every stage's gradients under
    the flush schedules, as one device; under ``"paci"`` every stage's latest norm as the pipeline's messages carry
    it ([Note: norm table] in engine/runtime/norm_table.py); with virtual stages each stage's own, said at setup ([Note:
    global-norm clipping] in integration/trainer/clipping.py).
    """

    schedule: ScheduleName = "paci"
    microbatches: int | None = None  # None: one per stage
    accumulation: int | None = None  # None: = microbatches (one step per batch per stage)
    partition: PartitionSpec = "parameters"
    block_container: str | Sequence[str] | None = None
    process_group_backend: str | None = None  # None: nccl on CUDA, gloo otherwise
    timeout: timedelta = timedelta(minutes=30)
    failure_timeout: float = 20.0
    nonfinite: Literal["raise", "skip"] = "raise"
    checkpoint_layout: Literal["auto", "consolidated", "sharded"] = "auto"  # a resolved value once checked
    max_stream_batches: int = 256
    freeze_gc: bool = True
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    compensation: Literal["auto", "predict", "none"] = "auto"
    pipeline_parallel_size: int | Literal["auto"] = "auto"
    data_parallel_size: int | Literal["auto"] = "auto"
    tensor_parallel_size: int | None = None  # None: no module mesh; an int: ModelParallelStrategy's way
    local_sgd_steps: int | None = None
    reduce_bucket_mb: float | None = 25.0
    dp_shard: Literal["none", "optimizer"] = "none"
    deferred_update: bool = False
    recompute: Literal["off", "blocks"] = "off"
    recompute_stages: int | None = None
    compile: Literal["off", "blocks"] = "off"
    compile_backend: str = "inductor"
    model_init: Literal["stage", "full"] = "stage"
    weights: str | os.PathLike[str] | None = None
    virtual_stages: int = 1
    placement: Placement = "loop"
    plan: Literal["off", "auto"] = "off"
    memory_budget: float | str | None = None  # bytes per process ("24GiB" accepted); a float once checked
    whole_batch_loss: str | None = None  # a LightningModule method's name

    def __post_init__(self) -> None:
        _choice("schedule", self.schedule, SCHEDULE_NAMES + VIRTUAL_SCHEDULE_NAMES)
        for name in ("microbatches", "accumulation"):
            _positive_int(name, getattr(self, name), f"Use e.g. `PACIStrategy({name}=8)`.", optional=True)
        _choice("nonfinite", self.nonfinite, ("raise", "skip"))
        _choice("checkpoint_layout", self.checkpoint_layout, ("auto", "consolidated", "sharded"))
        _positive_int("max_stream_batches", self.max_stream_batches,
                      "The default 256 drains the pipeline at least every 256 batches.")
        if not isinstance(self.freeze_gc, bool):
            raise ValueError(f"`freeze_gc` must be True or False, got {self.freeze_gc!r}.")
        if isinstance(self.failure_timeout, bool) or not isinstance(self.failure_timeout, (int, float)) \
                or self.failure_timeout <= 0:
            raise ValueError(f"`failure_timeout` must be > 0 seconds, got {self.failure_timeout!r}. The default 20.0 "
                             f"declares a stage dead after 20 s without a heartbeat.")
        _choice("start_method", self.start_method, ("popen", "spawn", "fork", "forkserver"))
        _check_partition_options(self)
        if self.compensation == "lookahead":  # the name of 0.3 and before
            warnings.warn("`compensation='lookahead'` is `compensation='predict'` (weight prediction); the old name "
                          "will be removed.", DeprecationWarning, stacklevel=4)
            object.__setattr__(self, "compensation", "predict")
        _choice("compensation", self.compensation, COMPENSATIONS)
        check_size_option("pipeline_parallel_size", self.pipeline_parallel_size)
        check_size_option("data_parallel_size", self.data_parallel_size)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size, "Split each layer over T ranks of its stage, "
                      "e.g. `tensor_parallel_size=2`; 1 gives each stage's module its mesh without splitting layers; "
                      "None (default) no mesh.", optional=True)
        _resolve_checkpoint_layout(self)
        if self.model_parallel and self.compensation == "predict":
            raise ValueError(f"`PACIStrategy(tensor_parallel_size={self.tensor_parallel_size})` with "
                             f"`compensation='predict'`: the weight prediction does not move DTensor shards in this "
                             f"release. Use `compensation='none'` (or 'auto', which is then off).")
        _positive_int("local_sgd_steps", self.local_sgd_steps, "Average the replicas' parameters every k local steps, "
                      "e.g. `local_sgd_steps=8`; None (default) averages gradients before every step.", optional=True)
        if self.reduce_bucket_mb is not None and (isinstance(self.reduce_bucket_mb, bool) or not isinstance(
                self.reduce_bucket_mb, (int, float)) or self.reduce_bucket_mb <= 0):
            raise ValueError(f"`reduce_bucket_mb` must be > 0 MiB or None, got {self.reduce_bucket_mb!r}. The default "
                             f"25.0 reduces the gradients in buckets of about 25 MiB during the backward; None reduces "
                             f"them all at the step.")
        if not isinstance(self.deferred_update, bool):
            raise ValueError(f"`deferred_update` must be True or False, got {self.deferred_update!r}.")
        if self.deferred_update and (self.schedule != "paci" or self.local_sgd_steps is not None
                                     or self.reduce_bucket_mb is None):
            raise ValueError(
                f"`deferred_update=True` defers PACI's update while the replicas' gradient reduction completes; it "
                f"needs `schedule='paci'` (got {self.schedule!r}), `local_sgd_steps=None` (got "
                f"{self.local_sgd_steps!r}) and a `reduce_bucket_mb` (got {self.reduce_bucket_mb!r}). Drop "
                f"`deferred_update` or change those.")
        _choice("dp_shard", self.dp_shard, ("none", "optimizer"))
        if self.dp_shard == "optimizer" and self.local_sgd_steps is not None:
            raise ValueError(f"`dp_shard='optimizer'` shards one optimizer state over replicas that step together; "
                             f"`local_sgd_steps={self.local_sgd_steps}` keeps one state per replica. Drop one of them.")
        _choice("recompute", self.recompute, RECOMPUTE_MODES)
        _positive_int("recompute_stages", self.recompute_stages, "Recompute on the first k stages, e.g. "
                      "`recompute_stages=2`; None (default) recomputes on every stage.", optional=True)
        _choice("compile", self.compile, COMPILE_MODES)
        if self.compile == "blocks":
            check_backend(self.compile_backend)
        _choice("model_init", self.model_init, ("stage", "full"))
        if self.weights is not None and not os.path.exists(self.weights):
            raise ValueError(f"`weights={os.fspath(self.weights)!r}` does not exist. Pass a transformers directory, a "
                             f"`.safetensors` file, a `.ckpt` file or a PACI sharded checkpoint directory.")
        if self.weights is not None and self.model_init == "full":
            raise ValueError("`weights=` needs `model_init='stage'`: the weights are read per stage into a model "
                             "built on the meta device. Drop `model_init='full'`, or load the weights yourself.")
        if self.schedule == "layered" and self.recompute != "off":
            raise ValueError("`schedule='layered'` cuts each block's graph at its entry and exit to run the "
                             "backward block by block; `recompute='blocks'` recomputes those blocks inside the "
                             "backward. Use one of them: `recompute='off'`, or `schedule='gpipe'`.")
        _check_virtual_stages(self)
        _choice("plan", self.plan, ("off", "auto"))
        given = self.memory_budget
        object.__setattr__(self, "memory_budget", parse_bytes("memory_budget", self.memory_budget))
        if self.memory_budget is not None and self.plan != "auto":
            raise ValueError(f"`memory_budget={given!r}` bounds the plan `plan='auto'` chooses; pass "
                             f"`plan='auto'` with it, or drop it.")
        _check_whole_batch_loss(self)
        if self.recompute_stages is not None and self.recompute == "off":
            raise ValueError(f"`recompute_stages={self.recompute_stages}` needs `recompute='blocks'`: it chooses which "
                             f"stages recompute. Pass `PACIStrategy(recompute='blocks', recompute_stages=...)`.")

    @property
    def model_parallel(self) -> bool:
        """Whether each stage's module gets its mesh and applies its own parallelism in ``configure_model``, as under
        Lightning's ``ModelParallelStrategy`` (``tensor_parallel_size`` given, 1 included)."""
        return self.tensor_parallel_size is not None

    @property
    def budget_bytes(self) -> float | None:
        """``memory_budget`` in bytes (a string like ``"24GiB"`` is parsed at construction)."""
        assert not isinstance(self.memory_budget, str)
        return self.memory_budget

    def topology(self, devices: int, num_nodes: int) -> Topology:
        """Stages x replicas over ``devices x num_nodes`` processes, checked ([Note: rank layout])."""
        world, tensor = devices * num_nodes, self.tensor_parallel_size or 1
        if world % tensor:
            raise ValueError(
                f"`Trainer(devices={devices}, num_nodes={num_nodes})` starts {world} processes, which "
                f"`tensor_parallel_size={tensor}` does not divide: stages x replicas x {tensor} must be {world}. Use "
                f"`devices` a multiple of {tensor}, or a `tensor_parallel_size` dividing {world}.")
        sizes = resolve_sizes(self.pipeline_parallel_size, self.data_parallel_size, world // tensor,
                              devices=devices, num_nodes=num_nodes)
        held = None
        if self.virtual_stages > 1:
            devices_of = stage_devices(sizes[0], self.virtual_stages, self.placement)
            held = tuple(tuple(s for s, d in enumerate(devices_of) if d == p) for p in range(sizes[0]))
        topology = Topology(*sizes, mirrored=self.virtual_stages > 1 and self.placement == "v", held=held,
                            tensor=tensor)
        return check_topology(topology, nonfinite=self.nonfinite, local_sgd_steps=self.local_sgd_steps,
                              virtual_stages=self.virtual_stages, model_parallel=self.model_parallel)


def _resolve_checkpoint_layout(config: PACIConfig) -> None:
    """``"auto"``: sharded where the stages apply their own parallelism (no rank holds a stage whole, nothing is
    gathered), else one file; a consolidated file of DTensor stages is refused."""
    if config.checkpoint_layout == "auto":
        object.__setattr__(config, "checkpoint_layout", "sharded" if config.model_parallel else "consolidated")
    elif config.model_parallel and config.checkpoint_layout == "consolidated":
        raise ValueError(
            f"`checkpoint_layout='consolidated'` with `tensor_parallel_size={config.tensor_parallel_size}`: a "
            f"stage's DTensor shards are not gathered into one file in this release. Use "
            f"`checkpoint_layout='sharded'` (a torch.distributed.checkpoint directory, the default 'auto' with "
            f"tensor parallelism).")


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def format_bytes(count: float) -> str:
    """A byte count as a user writes one: ``24 GiB``, ``500 MiB`` (3 significant digits)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def parse_bytes(name: str, value: object) -> float | None:
    """A byte count given as a number or as text with a unit (``"24GiB"``, ``"500 MB"``); None stays None."""
    if value is None:
        return None
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        try:
            number = float(text[:-len(unit)] if unit else text) * _UNITS[unit or "B"]
        except ValueError:
            number = None
    if number is None or number <= 0:
        raise ValueError(f"`{name}={value!r}` must be a positive number of bytes or a size such as '24GiB' or "
                         f"'500MB' (per process).")
    return number


def _check_partition_options(config: PACIConfig) -> None:
    """``partition``, ``block_container``, ``process_group_backend`` and ``timeout``, each by its rule."""
    partition = config.partition
    if isinstance(partition, str):
        _choice("partition", partition, ("parameters", "time", "balanced", "uniform"))
    elif not isinstance(partition, Sequence) or not partition or any(
            isinstance(i, bool) or not isinstance(i, int) for i in partition) or any(
            b <= a for a, b in zip([0, *partition], partition)):
        raise ValueError(f"`partition={partition!r}` must be 'parameters', 'time', 'uniform' or the strictly "
                         f"increasing block indices (>= 1) where stages 1..N-1 start, e.g. `partition=[6, 12, 18]` "
                         f"for 4 stages of 24 blocks.")
    container = config.block_container
    if container is not None and not isinstance(container, str):
        if not isinstance(container, Sequence) or not container or not all(
                isinstance(c, str) for c in container):
            raise ValueError(f"`block_container={container!r}` must be None (found automatically), the dotted "
                             f"path of the blocks' nn.Sequential/nn.ModuleList (e.g. 'model.layers') or a tuple of "
                             f"such paths in the order the step runs them.")
        object.__setattr__(config, "block_container", tuple(container))
    backend = config.process_group_backend
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"`process_group_backend={backend!r}`: the pipeline's messages run on 'gloo' or 'nccl'. "
                         f"Pass one of them, or None (default: 'nccl' on CUDA, 'gloo' otherwise).")
    if not isinstance(config.timeout, timedelta) or config.timeout.total_seconds() <= 0:
        raise ValueError(f"`timeout={config.timeout!r}` must be a positive `datetime.timedelta` (the process groups' "
                         f"timeout), e.g. `timeout=timedelta(minutes=30)` (default).")


def _check_whole_batch_loss(config: PACIConfig) -> None:
    name = config.whole_batch_loss
    if name is None:
        return
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"`whole_batch_loss` names a method of the LightningModule, e.g. "
                         f"`whole_batch_loss='contrastive_loss'`, got {name!r}.")
    refused = [(bad, fix) for bad, fix in (
        (config.schedule not in ("paci", "1f1b", "gpipe"), f"schedule={config.schedule!r}: use 'paci', '1f1b' or "
                                                            f"'gpipe'"),
        (config.virtual_stages > 1, f"virtual_stages={config.virtual_stages}: use 1"),
        (config.model_parallel, f"tensor_parallel_size={config.tensor_parallel_size}: drop it"),
        (config.plan == "auto", "plan='auto' (its search builds the lists without the whole-batch order): give the "
                                "plan's options yourself")) if bad]
    if refused:
        raise ValueError(f"`whole_batch_loss={name!r}` computes the loss once per batch on the last stage, which "
                         f"this release runs with one stage per process, unsharded, under 'paci', '1f1b' or "
                         f"'gpipe'; got {'; '.join(fix for _, fix in refused)}.")


def _check_virtual_stages(config: PACIConfig) -> None:
    _positive_int("virtual_stages", config.virtual_stages, "Use e.g. `virtual_stages=2` for two stages per device; "
                  "1 (default) runs one stage per device.")
    _choice("placement", config.placement, PLACEMENTS)
    v = config.virtual_stages
    if v > 1 and config.schedule in ("1f1b", "gpipe", "layered"):
        fix = {"1f1b": "'interleaved'", "gpipe": "'bfs'", "layered": "'bfs'"}[config.schedule]
        raise ValueError(f"`schedule={config.schedule!r}` runs one stage per device, got `virtual_stages={v}`: use "
                         f"`schedule={fix}` (its order over several stages per device), or `virtual_stages=1`.")

