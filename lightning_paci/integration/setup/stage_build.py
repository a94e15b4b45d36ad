"""The strategy's side of [Note: stage-only construction]: Lightning's ``tensor_init_context`` builds the model
on the meta device, plans the partition there, and gives each stage only its own parameters -- replayed from the
user's own initialization, read from ``weights=``, or left for a checkpoint.

Three ways in, by how the model is built:

* ``configure_model()`` (recommended): recorded on meta, then replayed for the stage (partition/stage_init.py);
  with ``weights=`` no replay, the stage's tensors come from the file.
* ``trainer.init_module(empty_init=True)``: parameters on meta, nothing replayed (the user's code ran once, outside
  any hook); each stage's tensors come from ``weights=`` or ``fit(ckpt_path=...)``, and without either each module's
  own ``reset_parameters()`` runs under a generator seeded by the module's name (partition-independent; not the
  one-device initialization).
* the user's ``__init__``: outside Lightning's reach; built whole on every rank, as before (a warning at setup when
  that approaches the host's memory).

[Note: a stage built in shards]
With the module's own parallelism (``tensor_parallel_size``, [Note: tensor parallelism in a stage]) a model built
on the meta device is sharded before it is materialized: the stage is cut, the module's ``configure_model`` runs
on meta (``parallelize_module`` and ``fully_shard`` make meta DTensors, no memory), and only then is each rank's
local shard given memory (``nn.Module._apply``, which FSDP2 follows). Its values come from ``weights=`` (every
rank reads each tensor of its stage and copies its own slice: no collective), a checkpoint, or each module's
``reset_parameters()`` run on the shards (DTensor's random ops: the values depend on the layout; pass ``weights=``
for the one-device start). No rank ever materializes its stage whole, and at the end of a fork/spawn run nothing
is gathered for the main process, whose model stays on meta. Measured (tests/test_tensor_parallel.py), a 1.08 GB
model at 2 stages x 2 replicas x 2 tensor-parallel ranks: each rank's memory grows by its share (128 MiB of a
513 MiB stage) when its shards are made, and by 468 MiB up to the start of training, FSDP2's gathered halves of
the setup's sample step included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_paci.integration.checkpoints.checkpoint import recorded_cut
from lightning_paci.integration.setup.auto_plan import choose_plan, plan_meta_built
from lightning_paci.integration.setup.batch_coupling import (
    check_whole_batch_loss,
    coupling_warning,
    whole_batch_method,
)
from lightning_paci.integration.setup.trainer_checks import batch_norm_warning
from lightning_paci.integration.stage.setup_probe import (
    Sample,
    cuda_devices,
    draw_sample,
    measure_block_costs,
    trace_call_order,
)
from lightning_paci.integration.trainer import lightning_api as api
from lightning_paci.integration.trainer.pipeline_strategy import PipelineStrategy
from lightning_paci.partition import PartitionPlan, plan_partition
from lightning_paci.partition.carve import removed_modules
from lightning_paci.partition.chunks import DeviceCarve
from lightning_paci.partition.plan import TIMED_PARTITIONS as TIMED
from lightning_paci.partition.stage_init import (
    Recording,
    generator_states,
    meta_load_guard,
    owned_registrations,
    replay,
    rewind_point,
)
from lightning_paci.partition.weights import WeightsFile, match_names

__all__ = ["MetaBuild", "StageBuilder", "host_memory_warning", "meta_stays_on_meta"]

log = logging.getLogger(__name__)

_LOAD_FIX = ("Build the model in `configure_model` and pass the weights as `PACIStrategy(weights=PATH)` (each stage "
             "reads only its own tensors), or resume with `trainer.fit(ckpt_path=...)`.")


@dataclass
class MetaBuild:
    """What the meta build left for setup: the plan, and how the stage's parameters get their values."""

    plan: PartitionPlan
    source: str  # "replayed" | "weights" | "empty"
    names: list[str]  # the whole model's state_dict() names (for matching a weights file)
    aliases: dict[str, list[str]]  # name -> the other names of the same parameter (ties)
    buffers: list[str]  # persistent buffers' names (a weights file may omit them)


class StageBuilder:
    """Owns the meta build of one strategy (``strategy`` gives the module, the stage, the devices and options)."""

    def __init__(self, strategy: PipelineStrategy) -> None:
        self.strategy = strategy
        self.built: MetaBuild | None = None
        self.weights_report: WeightsFile | None = None
        self.sample: Sample | None = None  # one micro-batch drawn at setup (integration/stage/setup_probe.py)
        self.planned = False  # plan="auto" chose the options while `configure_model` ran
        self.flops = 0  # the step's forward on the first batch, for the model summary (setup_probe.trace_call_order)

    def take_sample(self) -> Sample | None:
        """The setup's sample micro-batch, once: it is not kept past setup."""
        sample, self.sample = self.sample, None
        return sample

    @contextlib.contextmanager
    def context(self, empty_init: bool | None, base: Callable[[], contextlib.AbstractContextManager[Any]]
                ) -> Iterator[None]:
        """``tensor_init_context``: ``base`` is Lightning's own (root device, precision dtype)."""
        strategy, module = self.strategy, self.strategy.lightning_module
        if empty_init is False or strategy.config.model_init == "full" or self.built is not None or (
                module is None and not empty_init):
            with base():
                yield
            return
        if empty_init:  # `init_module(empty_init=True)`: parameters on meta; planned at setup (adopt)
            with base(), Recording(active=lambda: True).recording():
                yield
            return
        assert module is not None
        recording = Recording(active=lambda: module._current_fx_name == "configure_model")
        restore_generators, rewind = generator_states(), rewind_point(module)
        with base(), recording.recording(), meta_load_guard(_LOAD_FIX):
            yield
        if not recording.params:
            return  # `init_module()` around an ordinary build, or a configure_model that built nothing
        restore_generators()  # the recording drew some numbers (tensors made real first); the replay draws all
        built = self.adopt(module, source="weights" if strategy.config.weights is not None else "replayed")
        if built.source != "replayed":
            return

        def build(owned: Callable[[str], bool]) -> None:  # configure_model again, these parameters real
            keep = owned_registrations(recording.params, module, owned)
            rewind()
            previous, module._current_fx_name = module._current_fx_name, "configure_model"
            try:
                with base(), strategy.precision_plugin.module_init_context(), \
                        replay(recording.params, keep, strategy.root_device), meta_load_guard(_LOAD_FIX):
                    module.configure_model()
            finally:
                module._current_fx_name = previous
        planned = plan_meta_built(strategy, module, lambda: build(lambda _: True), recording.params)
        if planned is not None:  # [Note: the plan at setup]: global rank 0 measured the whole model it holds now
            (self.sample, self.flops), self.planned = planned, True
            built = self.adopt(module, source="replayed")  # the chosen cut
            if strategy.is_global_zero:
                return
        mine = strategy.topology.stages_on(strategy.stage_index)  # (virtual stages)
        dropped = set.intersection(*(set(removed_modules(built.plan, s)) for s in mine))
        build(lambda n: not any(n.startswith(r + ".") for r in dropped))

    def adopt(self, module: nn.Module, *, source: str) -> MetaBuild:
        """Plan the meta-built ``module`` and record what setup needs (``source``: how the stage gets its values)."""
        plan = self.plan_on_meta(module)
        names = list(module.state_dict(keep_vars=True))
        params = dict(module.named_parameters(remove_duplicate=False))
        aliases = {n: [m for m, q in params.items() if q is p and m != n] for n, p in params.items()}
        buffers = [n for n in names if n not in params]
        self.built = MetaBuild(plan, source, names, {n: a for n, a in aliases.items() if a}, buffers)
        log.info(f"lightning_paci: model built on the meta device ({source}); stage {self.strategy.stage_index} "
                 f"holds only its own parameters")
        return self.built

    def built_on_meta(self) -> bool:
        """Whether this run's model was built on the meta device and each stage given only its own parameters."""
        return self.built is not None

    def on_meta(self, module: nn.Module | None) -> bool:
        """Whether ``module`` takes the meta path: built by ``configure_model`` here, or with meta parameters
        (``init_module(empty_init=True)``, or a model built under ``torch.device("meta")``)."""
        return self.built is not None or (module is not None and self.strategy.config.model_init == "stage" and any(
            p.is_meta for p in module.parameters()))

    def materialize(self, module: nn.Module, carve: DeviceCarve, *, has_checkpoint: bool) -> None:
        """After carving: give the process's stages' meta parameters memory on the device and their values."""
        built = self.built
        if built is None:
            return
        device = self.strategy.root_device
        if built.source == "replayed":
            return  # owned parameters are real already
        # [Note: a stage built in shards]: DTensor shards, made by the module's `configure_model` on meta, are given
        # memory where FSDP2 and the plan expect it; plain meta parameters one by one (ties kept)
        sharded = self.strategy.config.model_parallel
        made = _shards_to_device_empty(module, device) if sharded else _to_device_empty(module, device)
        for chunk in carve:  # the carve kept the meta objects
            chunk.tied_params = [made.get(id(p), p) for p in chunk.tied_params]
        carve.shared_tied[:] = [made.get(id(p), p) for p in carve.shared_tied]
        weights = self.strategy.config.weights
        if weights is not None:
            self._load(module, carve, os.fspath(weights))
        elif not has_checkpoint:
            _reset_by_name(module)

    def _load(self, module: nn.Module, carve: DeviceCarve, path: str) -> None:
        built = self.built
        assert built is not None
        source = WeightsFile.open(path)
        prefix, mapping = match_names(built.names, built.aliases, built.buffers, source.keys(), path=path)
        if prefix:
            log.info(f"lightning_paci: `weights=` keys are the module's names less the prefix {prefix!r}")
        state = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in state.items():
                if name in carve.foreign_buffers or name not in mapping:
                    continue
                _copy_into(tensor, source.read(mapping[name]))
        source.close()
        self.weights_report = source

    def plan_stages(self, trainer: Any, module: Any) -> PartitionPlan:
        """The plan of a model built on the meta device, or one planned here from the whole model (timing blocks
        for ``"time"``, unless the checkpoint resumed from recorded its split; a warning when every local rank
        holding the whole model nears the host's memory); the setup's sample micro-batch is drawn here
        (setup_probe.py) and kept for the relays."""
        strategy = self.strategy
        if strategy.config.whole_batch_loss is not None:
            whole_batch_method(module, strategy.config.whole_batch_loss)
        whole = trainer.state.fn == TrainerFn.FITTING and strategy.is_global_zero
        if whole and (warning := batch_norm_warning(module, strategy.num_microbatches)) is not None:
            rank_zero_warn(warning)
        built = self.built
        if built is None and self.on_meta(module):
            built = self.adopt(module, source="weights" if strategy.config.weights is not None else "empty")
        measured = trace = None
        config = strategy.config
        recorded = recorded_cut(api.loaded_checkpoint(trainer), len(strategy.stage_devices))
        timed = config.partition in TIMED and recorded is None
        if self.sample is None:  # drawn already where plan="auto" planned a model built in `configure_model`
            self.sample = draw_sample(trainer, strategy.num_microbatches, cuda_devices(strategy.root_device))
        if built is None:
            if (warning := host_memory_warning(module, strategy.num_processes)) is not None:
                rank_zero_warn(warning)
            trace, self.flops = trace_call_order(strategy, module, self.sample)
            if whole and self.sample is not None and self.sample.whole is not None:
                context, devices = strategy.precision_plugin.train_step_context, cuda_devices(strategy.root_device)
                if config.whole_batch_loss is not None:  # [Note: the whole-batch loss]
                    check_whole_batch_loss(module, config.whole_batch_loss, self.sample.whole, context=context,
                                           cuda_devices=devices)
                elif (warning := coupling_warning(module, self.sample.whole, strategy.num_microbatches,
                                                  context=context, cuda_devices=devices)) is not None:
                    rank_zero_warn(warning)  # [Note: a loss that couples a batch's samples]
            if strategy.config.plan == "auto" and trainer.state.fn == TrainerFn.FITTING:
                choose_plan(strategy, trainer, module, self.sample, trace)  # replaces strategy.config
            elif timed:
                measured = measure_block_costs(strategy, trainer, self.sample, trace)
        elif strategy.config.plan == "auto" and not self.planned:
            rank_zero_warn("lightning_paci: plan='auto' measures the whole model on a sample batch; this one is built "
                           "on the meta device, so the options are used as given (`python -m lightning_paci.plan` "
                           "measures it wherever it fits in one process, and prints the options to pass)")
        if self.sample is not None:
            self.sample.whole = None  # (checked, or not to be)
        if whole:  # before carving: the whole model (on meta when built there)
            strategy.undo_at_teardown(api.whole_model_summaries(trainer, module, self.flops))
        config = strategy.config  # (plan="auto" replaced it)
        partition = recorded if config.partition in TIMED and recorded is not None else config.partition
        plan = built.plan if built is not None else plan_partition(
            module, len(strategy.stage_devices), container=config.block_container, partition=partition,
            measured=measured, trace=trace)
        if partition is recorded:
            plan = replace(plan, note=f"the split the checkpoint recorded, partition={recorded}")
        topology, v = strategy.topology, config.virtual_stages
        layout = topology.describe() if v == 1 else (
            f"{v * topology.pipeline} stages, {v} on each of {topology.pipeline} processes (placement="
            f"{config.placement!r})" + (f" x {topology.data} data-parallel replicas" if topology.data > 1 else ""))
        rank_zero_info(f"lightning_paci: {layout}, schedule={config.schedule!r}, "
                       f"microbatches={strategy.num_microbatches}, accumulation={strategy.accumulation}; "
                       f"{plan.describe()}")
        return plan

    def plan_on_meta(self, module: nn.Module) -> PartitionPlan:
        """The partition of a model built on the meta device (no forward to time: parameter counts)."""
        config = self.strategy.config
        if config.partition in TIMED and config.plan != "auto":  # (the plan replaces the split)
            rank_zero_info(f"lightning_paci: the model is built on the meta device, so `partition="
                           f"{config.partition!r}` splits by parameter count (no block can be timed before it is "
                           f"materialized)")
        return plan_partition(module, len(self.strategy.stage_devices), container=config.block_container,
                              partition=config.partition, measured=None)

    @property
    def weights_read(self) -> dict[str, list[str]] | None:
        """What ``weights=`` made this stage read: ``{"files": [...], "keys": [...]}`` (None without ``weights=``)."""
        report = self.weights_report
        return None if report is None else {"files": list(report.opened), "keys": list(report.read_keys)}


@contextlib.contextmanager
def meta_stays_on_meta(module: nn.Module | None) -> Iterator[None]:
    """Around Lightning's teardown, which moves the module to the CPU, which a meta tensor cannot do: the other
    stages' parameters of a model built on meta (and a failed run's whole model) stay there, the rest moves."""
    if module is None or not any(p.is_meta for p in module.parameters()):
        yield
        return
    module.__dict__["cpu"] = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())
    try:
        yield
    finally:
        module.__dict__.pop("cpu", None)


def _to_device_empty(module: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Replace every meta parameter by an uninitialized one on ``device`` (one Parameter per object: ties stay);
    return the new Parameters by the id of the meta ones they replace."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device=device),
                                                   requires_grad=param.requires_grad)
                sub._parameters[name] = made[id(param)]
    return made


def _shards_to_device_empty(module: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Give every meta tensor of ``module`` uninitialized memory on ``device`` through ``nn.Module._apply``, which
    an FSDP2 module follows (it re-registers its sharded parameters); a DTensor gets its local shard only. Return
    the new Parameters by the id of the meta ones they replace."""
    before = [(sub, name, p) for sub in module.modules() for name, p in sub._parameters.items()
              if p is not None and p.is_meta]
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    return {id(p): param for sub, name, p in before if (param := sub._parameters[name]) is not None}


def _copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a weights file's ``whole`` tensor into ``target``; into a DTensor, only its local shard's slice (each
    rank cuts its own from the tensor it read: no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        part = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(whole)


def _reset_by_name(module: nn.Module) -> None:
    """No weights and no checkpoint after ``init_module(empty_init=True)``: each module's ``reset_parameters()``,
    under a generator seeded by the module's name and ``torch.initial_seed()`` (the same on any partition)."""
    for name, sub in module.named_modules():
        if sub._parameters and any(p is not None for p in sub._parameters.values()):
            reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)  # (attention)
            if reset is None:
                raise ValueError(
                    f"`{name}` ({type(sub).__name__}) has parameters but no `reset_parameters()`, and the model was "
                    f"built with `trainer.init_module(empty_init=True)`: nothing can initialize them. Pass "
                    f"`PACIStrategy(weights=PATH)` or `fit(ckpt_path=...)`, or build the model in `configure_model`.")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed((torch.initial_seed() ^ zlib.crc32(name.encode())) & 0xFFFF_FFFF)
                reset()


def host_memory_warning(module: nn.Module, local_ranks: int) -> str | None:
    """A warning when every local rank holding the whole model approaches the host's memory (a model built in
    ``__init__``)."""
    total = sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return None
    if total * local_ranks < 0.5 * host:
        return None
    return (f"lightning_paci: every one of the {local_ranks} processes of this node builds the whole model "
            f"({total / 2**30:.1f} GiB of parameters each, {total * local_ranks / 2**30:.1f} GiB together, the host "
            f"has {host / 2**30:.1f} GiB). Build it in `LightningModule.configure_model()` instead: each stage then "
            f"holds only its own parameters.")
