"""Where each stage, replica and tensor-parallel shard runs: the (pipeline x data x tensor) layout of the ranks.

[Note: rank layout]
``world = pipeline_parallel_size x data_parallel_size x tensor_parallel_size``. The ranks of one stage are
consecutive (torchtitan's ``pp``-outermost mesh), the tensor-parallel coordinate innermost: with ``devices`` a
multiple of ``D x T``, a stage shares a node, so its tensor-parallel collectives (inside every forward and backward)
and the replicas' gradient reduction before each local step stay on the node's fast links, and only activations
and gradients (small, point-to-point) cross nodes. Each (replica, tensor) coordinate of a stage is a *lane*: lane
``d * T + t`` of stage ``s`` sends to lane ``d * T + t`` of stage ``s + 1``, so each lane is a pipeline of its own
for the messages. Stages run in reverse rank order (stage ``s``, lane ``l`` on rank ``(P-1-s) * D * T + l``): global
rank 0 -- Lightning's loggers, progress bar and ``is_global_zero`` callbacks -- runs the *last* stage of lane 0,
which computes the loss (see [Note: the logging rank]).

A :class:`torch.distributed.device_mesh.DeviceMesh` with dimensions ``("pp", "dp")`` holds the layout; ``mesh["dp"]``
of a rank is its stage's replicas (the gradient reduction), ``mesh["pp"]`` its replica's pipeline (broadcasts of one
pipeline: data fingerprints, evaluation logs). With tensor parallelism its dimensions are ``("pp", "data_parallel",
"tensor_parallel")`` and each stage's module reads its own 2D sub-mesh as ``self.device_mesh``, with the dimension
names of Lightning's ``ModelParallelStrategy``. The pipeline's messages use their own point-to-point groups, one per
neighbour pair and direction ([Note: deadlock model]).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Topology", "check_size_option", "check_topology", "resolve_sizes"]


def _size(name: str, value: object) -> int | None:
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1 or 'auto', got {value!r}. With 8 devices and a model that "
                         f"fits on 2 stages: `PACIStrategy(pipeline_parallel_size=2)` (data_parallel_size='auto' "
                         f"= 4 replicas).")
    return value


def check_size_option(name: str, value: object) -> None:
    """The construction-time check of one size option (the world is not known yet)."""
    _size(name, value)


def resolve_sizes(pipeline: int | str, data: int | str, world: int, *, devices: int, num_nodes: int
                  ) -> tuple[int, int]:
    """``(pipeline size, data-parallel size)`` for ``world`` processes; ``"auto"`` takes what the other leaves
    (both ``"auto"``: every device a stage, one replica -- ``Trainer(strategy="paci", devices=8)`` is 8 stages)."""
    p, d = _size("pipeline_parallel_size", pipeline), _size("data_parallel_size", data)
    launched = f"`Trainer(devices={devices}, num_nodes={num_nodes})` starts {world} processes"
    if p is None and d is None:
        return world, 1
    if p is not None and d is not None:
        if p * d != world:
            raise ValueError(
                f"{launched}, but pipeline_parallel_size={p} x data_parallel_size={d} = {p * d}. One process runs "
                f"one stage of one replica: make the product {world}, or leave one of them 'auto'.")
        return p, d
    given, name, other = (p, "pipeline_parallel_size", "data_parallel_size") if p is not None else \
        (d, "data_parallel_size", "pipeline_parallel_size")
    assert given is not None
    if world % given:
        # only values that leave at least 2 stages: one stage is refused (check_topology)
        accepted = [k for k in range(1, world + 1)
                    if world % k == 0 and (k if name == "pipeline_parallel_size" else world // k) >= 2]
        choice = f"Use one of {accepted} for {name}" if accepted else "No value leaves 2 stages or more"
        raise ValueError(
            f"{launched}, and {name}={given} does not divide {world}: {other} would not be whole. {choice}, or "
            f"change `devices`/`num_nodes`.")
    return (given, world // given) if p is not None else (world // given, given)


@dataclass(frozen=True)
class Topology:
    """The layout of ``pipeline`` stages x ``data`` replicas x ``tensor`` shards over ``pipeline * data * tensor``
    ranks ([Note: rank layout])."""

    pipeline: int
    data: int = 1
    # the pipeline's last stage on its first process (virtual stages placed in a V): process ``p`` on the ranks of
    # ``P-1-p``, so that global rank 0 still holds the last stage ([Note: the logging rank])
    mirrored: bool = False
    # with virtual stages, the pipeline stages process ``p`` runs (``held[p]``): what errors name it by
    held: tuple[tuple[int, ...], ...] | None = None
    tensor: int = 1  # tensor-parallel ranks per stage and replica

    @property
    def lanes(self) -> int:
        """The ranks of one stage: its (replica, tensor) coordinates, each a pipeline for the messages."""
        return self.data * self.tensor

    @property
    def world(self) -> int:
        return self.pipeline * self.lanes

    def rank_of(self, stage: int, lane: int) -> int:
        """The global rank of process ``stage`` (its stage, or its device with virtual stages) of ``lane`` (the
        replica without tensor parallelism)."""
        return (stage if self.mirrored else self.pipeline - 1 - stage) * self.lanes + lane

    def stage_of(self, rank: int) -> int:
        return rank // self.lanes if self.mirrored else self.pipeline - 1 - rank // self.lanes

    def lane_of(self, rank: int) -> int:
        return rank % self.lanes

    def replica_of(self, rank: int) -> int:
        """The data-parallel coordinate of ``rank``: which shard of the data it reads."""
        return self.lane_of(rank) // self.tensor

    def tensor_of(self, rank: int) -> int:
        return self.lane_of(rank) % self.tensor

    def watch_id(self, rank: int) -> int:
        """Global rank ``rank``'s id for the failure watchdog: its stage, or the rank itself with several lanes."""
        return rank if self.lanes > 1 else self.stage_of(rank)

    def stages_on(self, process: int) -> tuple[int, ...]:
        """The pipeline stages process ``process`` runs: its own index, or with virtual stages ``held[process]``."""
        return (process,) if self.held is None else self.held[process]

    def watch_name(self, watch_id: int) -> str:
        """How errors name the process with ``watch_id``: ``stage 2``, ``stage 2 (replica 1)``, ``stage 2 (replica
        0, tensor 1)``; with virtual stages by the stages it runs, ``process 1 (stages 1 and 2)``, as the actions in
        the same messages are named."""
        process = watch_id if self.lanes == 1 else self.stage_of(watch_id)
        replica = [] if self.data == 1 else [f"replica {self.replica_of(watch_id)}"]
        replica += [] if self.tensor == 1 else [f"tensor {self.tensor_of(watch_id)}"]
        if self.held is None:
            return f"stage {process}" + "".join(f" ({r})" for r in replica)
        *first, last = self.held[process]
        stages = f"stages {', '.join(map(str, first))} and {last}" if first else f"stage {last}"
        return f"process {process} ({', '.join([stages, *replica])})"

    def mesh_ranks(self) -> list[list[int]]:
        """``mesh[stage][replica]`` = global rank: the ``DeviceMesh``'s layout, dimension names ``("pp", "dp")``."""
        return [[self.rank_of(s, r) for r in range(self.data)] for s in range(self.pipeline)]

    def mesh_ranks_3d(self) -> list[list[list[int]]]:
        """``mesh[stage][replica][tensor]`` = global rank: with tensor parallelism, dimension names ``("pp",
        "data_parallel", "tensor_parallel")``."""
        return [[[self.rank_of(s, r * self.tensor + t) for t in range(self.tensor)] for r in range(self.data)]
                for s in range(self.pipeline)]

    def describe(self) -> str:
        if self.lanes == 1:
            return f"{self.pipeline} stages"
        order = "s" if self.mirrored else "(P-1-s)"
        if self.tensor == 1:
            return (f"{self.pipeline} stages x {self.data} data-parallel replicas (stage s, replica r on rank "
                    f"{order}*{self.data}+r: a stage's replicas on consecutive ranks)")
        return (f"{self.pipeline} stages x {self.data} data-parallel replicas x {self.tensor} tensor-parallel ranks "
                f"(stage s, replica r, tensor t on rank {order}*{self.lanes}+r*{self.tensor}+t: a stage's ranks "
                f"consecutive)")


def check_topology(topology: Topology, *, nonfinite: str, local_sgd_steps: int | None,
                   virtual_stages: int = 1, model_parallel: bool = False) -> Topology:
    """Refuse what data or tensor parallelism cannot run with (or what needs it), naming the fix; return
    ``topology``."""
    if topology.tensor > 1 and topology.pipeline < 2:
        raise ValueError(
            f"`PACIStrategy` splits the model into `pipeline_parallel_size` >= 2 stages, got {topology.pipeline} "
            f"stage x tensor_parallel_size={topology.tensor}. Use `pipeline_parallel_size=2` or more (for tensor "
            f"parallelism alone, use Lightning's `ModelParallelStrategy`).")
    if model_parallel and virtual_stages > 1:
        raise ValueError(
            f"`PACIStrategy(tensor_parallel_size={topology.tensor}, virtual_stages={virtual_stages})`: a process "
            f"runs one stage with the module's own parallelism in this release. Use `virtual_stages=1`, or leave "
            f"`tensor_parallel_size` unset.")
    if topology.data > 1 and topology.pipeline < 2:
        raise ValueError(
            f"`PACIStrategy` splits the model into `pipeline_parallel_size` >= 2 stages, got {topology.pipeline} "
            f"stage x {topology.data} replicas. Use `pipeline_parallel_size=2` or more (for data parallelism "
            f"alone, use Lightning's `strategy='ddp'`).")
    if model_parallel and nonfinite == "skip":
        raise ValueError(
            "`PACIStrategy(nonfinite='skip')` is not supported with `tensor_parallel_size`: each rank checks its "
            "own shard, and a micro-batch skipped on one rank of a stage and not on another would split the stage. "
            "Use `nonfinite='raise'` (the default) or leave `tensor_parallel_size` unset.")
    if topology.data > 1 and nonfinite == "skip":
        raise ValueError(
            "`PACIStrategy(nonfinite='skip')` is not supported with data parallelism: a micro-batch skipped on "
            "one replica and not on another would leave the replicas' gradients and logged values out of step. "
            "Use `nonfinite='raise'` (the default) or `data_parallel_size=1`.")
    if model_parallel and local_sgd_steps is not None:
        raise ValueError(
            f"`PACIStrategy(tensor_parallel_size={topology.tensor}, local_sgd_steps={local_sgd_steps})`: with the "
            f"module's own parallelism its replicas are sharded by its `configure_model` (`fully_shard`), not "
            f"averaged by the strategy. Drop `local_sgd_steps`, or `tensor_parallel_size`.")
    if topology.data == 1 and local_sgd_steps is not None:
        raise ValueError(
            f"`PACIStrategy(local_sgd_steps={local_sgd_steps})` averages data-parallel replicas, but this run has "
            f"one ({topology.describe()}). Set `data_parallel_size` (or a `pipeline_parallel_size` smaller than the "
            f"{topology.world} processes), or drop `local_sgd_steps`.")
    return topology
