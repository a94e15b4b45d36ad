"""Where each stage and replica runs: the (pipeline x data-parallel) layout of the ranks.

[Note: rank layout]
``world = pipeline_parallel_size x data_parallel_size``. The replicas of one stage hold consecutive global ranks
(the data-parallel coordinate varies fastest, torchtitan's ``pp``-outermost mesh): with ``devices`` a multiple of
the data-parallel size, a stage's replicas share a node, so the one collective PACI adds -- each stage's gradient
all-reduce before its local step -- stays on the node's fast links, and only activations and gradients (small,
point-to-point) cross nodes. Stages run in reverse rank order (stage ``s`` of replica ``r`` on rank ``(P-1-s) * D
+ r``): global rank 0 -- Lightning's loggers, progress bar and ``is_global_zero`` callbacks -- runs the *last*
stage of replica 0, which computes the loss (see [Note: the logging rank]).

A :class:`torch.distributed.device_mesh.DeviceMesh` with dimensions ``("pp", "dp")`` holds the layout;
``mesh["dp"]`` of a rank is its stage's replicas (the gradient reduction), ``mesh["pp"]`` its replica's pipeline
(broadcasts of one pipeline: data fingerprints, evaluation logs). The pipeline's messages use their own
point-to-point groups, one per neighbour pair and direction ([Note: deadlock model]).
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
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        raise ValueError(
            f"{launched}, and {name}={given} does not divide {world}: {other} would not be whole. Use one of "
            f"{divisors} for {name}, or change `devices`/`num_nodes`.")
    return (given, world // given) if p is not None else (world // given, given)


@dataclass(frozen=True)
class Topology:
    """The layout of ``pipeline`` stages x ``data`` replicas over ``pipeline * data`` ranks ([Note: rank layout])."""

    pipeline: int
    data: int = 1
    # the pipeline's last stage on its first process (virtual stages placed in a V): process ``p`` on the ranks of
    # ``P-1-p``, so that global rank 0 still holds the last stage ([Note: the logging rank])
    mirrored: bool = False
    # with virtual stages, the pipeline stages process ``p`` runs (``held[p]``): what errors name it by
    held: tuple[tuple[int, ...], ...] | None = None

    @property
    def world(self) -> int:
        return self.pipeline * self.data

    def rank_of(self, stage: int, replica: int) -> int:
        """The global rank of process ``stage`` (its stage, or its device with virtual stages) of ``replica``."""
        return (stage if self.mirrored else self.pipeline - 1 - stage) * self.data + replica

    def stage_of(self, rank: int) -> int:
        return rank // self.data if self.mirrored else self.pipeline - 1 - rank // self.data

    def replica_of(self, rank: int) -> int:
        return rank % self.data

    def watch_id(self, rank: int) -> int:
        """Global rank ``rank``'s id for the failure watchdog: its stage, or the rank itself with replicas."""
        return rank if self.data > 1 else self.stage_of(rank)

    def stages_on(self, process: int) -> tuple[int, ...]:
        """The pipeline stages process ``process`` runs: its own index, or with virtual stages ``held[process]``."""
        return (process,) if self.held is None else self.held[process]

    def watch_name(self, watch_id: int) -> str:
        """How errors name the process with ``watch_id``: ``stage 2``, ``stage 2 (replica 1)``; with virtual stages
        by the stages it runs, ``process 1 (stages 1 and 2)``, as the actions in the same messages are named."""
        process = watch_id if self.data == 1 else self.stage_of(watch_id)
        replica = [] if self.data == 1 else [f"replica {self.replica_of(watch_id)}"]
        if self.held is None:
            return f"stage {process}" + "".join(f" ({r})" for r in replica)
        *first, last = self.held[process]
        stages = f"stages {', '.join(map(str, first))} and {last}" if first else f"stage {last}"
        return f"process {process} ({', '.join([stages, *replica])})"

    def mesh_ranks(self) -> list[list[int]]:
        """``mesh[stage][replica]`` = global rank: the ``DeviceMesh``'s layout, dimension names ``("pp", "dp")``."""
        return [[self.rank_of(s, r) for r in range(self.data)] for s in range(self.pipeline)]

    def describe(self) -> str:
        if self.data == 1:
            return f"{self.pipeline} stages"
        order = "s" if self.mirrored else "(P-1-s)"
        return (f"{self.pipeline} stages x {self.data} data-parallel replicas (stage s, replica r on rank "
                f"{order}*{self.data}+r: a stage's replicas on consecutive ranks)")


def check_topology(topology: Topology, *, nonfinite: str, local_sgd_steps: int | None) -> Topology:
    """Refuse what data parallelism cannot run with (or what needs it), naming the fix; return ``topology``."""
    if topology.data > 1 and topology.pipeline < 2:
        raise ValueError(
            f"`PACIStrategy` splits the model into `pipeline_parallel_size` >= 2 stages, got {topology.pipeline} "
            f"stage x {topology.data} replicas. Use `pipeline_parallel_size=2` or more (for data parallelism "
            f"alone, use Lightning's `strategy='ddp'`).")
    if topology.data > 1 and nonfinite == "skip":
        raise ValueError(
            "`PACIStrategy(nonfinite='skip')` is not supported with data parallelism: a micro-batch skipped on "
            "one replica and not on another would leave the replicas' gradients and logged values out of step. "
            "Use `nonfinite='raise'` (the default) or `data_parallel_size=1`.")
    if topology.data == 1 and local_sgd_steps is not None:
        raise ValueError(
            f"`PACIStrategy(local_sgd_steps={local_sgd_steps})` averages data-parallel replicas, but this run has "
            f"one ({topology.describe()}). Set `data_parallel_size` (or a `pipeline_parallel_size` smaller than the "
            f"{topology.world} processes), or drop `local_sgd_steps`.")
    return topology
