"""The NCCL emulation ([Note: NCCL emulation], engine/transport/nccl_emulation.py): each rule broken on purpose
and caught by name within seconds, the group creation that hung every 3+ GPU run caught, and the fixed setup passing.

Ranks are forked with a ``file://`` rendezvous; each installs the emulation itself (the test process stays
unpatched) and writes what it raised. A rank the rule leaves waiting on a peer that raised (a member in gloo's
connect) is stopped once the expected ranks have reported.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_paci.engine.transport import nccl_emulation
from lightning_paci.engine.transport.groups import PipelineLinks, create_communicators
from lightning_paci.engine.transport.nccl_emulation import NcclRuleError

pytestmark = pytest.mark.distributed

_TIMEOUT = timedelta(seconds=20)


def _rank_main(target: Callable[[int], None], rank: int, world: int, directory: str, bound: str) -> None:
    outcome: dict[str, Any] = {"rank": rank, "rule": None, "error": None}
    try:
        torch.set_num_threads(1)
        nccl_emulation.install()
        dist.init_process_group("nccl", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world,
                                timeout=_TIMEOUT, device_id=torch.device(bound))
        target(rank)
    except NcclRuleError as err:
        outcome.update(rule=err.rule, error=str(err))
    except Exception as err:  # recorded for the assertion's message; the test names what it expects
        outcome.update(error=f"{type(err).__name__}: {err}")
    _write_atomically(Path(directory, f"outcome{rank}.json"), json.dumps(outcome))
    os._exit(0)


def _write_atomically(path: Path, text: str) -> None:
    """``path`` appears whole or not at all: the test polls for it and reads it as soon as it exists."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def _run(target: Callable[[int], None], world: int, directory: Path, *, wait_for: list[int] | None = None,
         bound: str = "cpu", limit: float = 60.0) -> dict[int, dict[str, Any]]:
    """Fork ``world`` ranks running ``target(rank)`` under the emulation; return each reporting rank's outcome once
    the ranks in ``wait_for`` (default: all) have reported, stopping the others."""
    context = mp.get_context("fork")
    processes = [context.Process(target=_rank_main, args=(target, r, world, str(directory), bound))
                 for r in range(world)]
    for process in processes:
        process.start()
    expected = list(range(world)) if wait_for is None else wait_for
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all((directory / f"outcome{r}.json").exists() for r in expected):
        time.sleep(0.05)
    elapsed = limit - (deadline - time.monotonic())
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    outcomes = {r: json.loads((directory / f"outcome{r}.json").read_text())
                for r in range(world) if (directory / f"outcome{r}.json").exists()}
    outcomes[-1] = {"seconds": elapsed}
    return outcomes


def _rank_of(stage: int, replica: int) -> int:
    return stage


def _old_header_groups(rank: int) -> None:
    # 8b97681's order: the directed layout's NCCL groups, then one 2-rank gloo group per link for the headers,
    # both after the world was bound to the device
    create_communicators(3, 1, _rank_of, backend="nccl", timeout=_TIMEOUT)
    create_communicators(3, 1, _rank_of, backend="gloo", timeout=_TIMEOUT)


def test_the_per_link_gloo_header_groups_fail_at_three_stages_naming_the_split_rule(tmp_path):
    outcomes = _run(_old_header_groups, 3, tmp_path, wait_for=[2])
    # stage 2 is outside the first header group (stages 0 and 1): it waits in the world's split, which 0 and 1,
    # connecting over gloo, never join; on a GPU nothing moves until the process-group timeout
    assert outcomes[2]["rule"] == 1, outcomes
    assert "no-color split" in outcomes[2]["error"] and "ranks [0, 1] backend 'gloo'" in outcomes[2]["error"]
    assert "cpu:gloo,cuda:nccl" in outcomes[2]["error"]  # the fix is named
    assert outcomes[-1]["seconds"] < 15


def _fixed_setup(rank: int) -> None:
    links = PipelineLinks.setup(4, 1, _rank_of, device=torch.device("cpu"), backend="nccl", timeout=_TIMEOUT)
    assert links.host is not None and links.connected == 4  # F, B in each direction, or the tied pair
    # one header on the host group with its link's tag, as DistComm sends them
    token = torch.full((4,), float(rank))
    if rank == 0:
        links.host.send([token], 1, 1).wait()
    elif rank == 1:
        links.host.recv([token], 0, 1).wait()
        assert token.tolist() == [0.0] * 4


def test_the_host_group_of_every_rank_passes_at_four_stages(tmp_path):
    outcomes = _run(_fixed_setup, 4, tmp_path)
    assert all(outcomes[r]["error"] is None for r in range(4)), outcomes


def _first_receives_cross(rank: int) -> None:
    groups = create_communicators(2, 1, _rank_of, backend="nccl", timeout=_TIMEOUT)
    activations, gradients = groups[("p2p", 0, "F", 0, 1)], groups[("p2p", 0, "B", 1, 0)]
    buffer = torch.zeros(2)
    # receives posted ahead without the warm-up: stage 0 first on the gradients' group, stage 1 on the activations'
    if rank == 0:
        gradients.recv([buffer], 1, 0)
    else:
        activations.recv([buffer], 0, 0)


def test_rule_2_first_operations_waiting_for_each_other_are_named(tmp_path):
    outcomes = _run(_first_receives_cross, 2, tmp_path)
    assert outcomes[0]["rule"] == outcomes[1]["rule"] == 2, outcomes
    assert "in a cycle" in outcomes[0]["error"] and "rank 1" in outcomes[0]["error"]
    assert outcomes[-1]["seconds"] < 15


def _collectives_out_of_order(rank: int) -> None:
    value = torch.ones(3)
    if rank == 0:
        dist.all_reduce(value)
        dist.broadcast(value, src=0)
    else:
        dist.broadcast(value, src=0)
        dist.all_reduce(value)


def test_rule_3_collectives_in_different_orders_are_named(tmp_path):
    outcomes = _run(_collectives_out_of_order, 2, tmp_path)
    assert outcomes[0]["rule"] == outcomes[1]["rule"] == 3, outcomes
    assert "allreduce" in outcomes[0]["error"] and "broadcast" in outcomes[0]["error"]


def _host_tensor_to_nccl(rank: int) -> None:
    groups = create_communicators(2, 1, _rank_of, backend="nccl", timeout=_TIMEOUT)
    group = groups[("p2p", 0, "F", 0, 1)]
    if rank == 0:
        group.send([torch.zeros(4)], 1, 0)  # a host tensor, the world being bound to cuda:0
    else:
        group.recv([torch.zeros(4)], 0, 0)


def test_rule_4_a_host_tensor_in_an_nccl_operation_is_named(tmp_path):
    # the world bound to a device this machine does not have: the emulation holds the binding, gloo the bytes
    outcomes = _run(_host_tensor_to_nccl, 2, tmp_path, bound="cuda:0")
    assert outcomes[0]["rule"] == outcomes[1]["rule"] == 4, outcomes
    assert "tensor on cpu" in outcomes[0]["error"] and "cuda:0" in outcomes[0]["error"]


def _non_contiguous(rank: int) -> None:
    value = torch.arange(8.0)[::2]
    dist.all_reduce(value)


def test_rule_4_a_non_contiguous_tensor_is_named(tmp_path):
    outcomes = _run(_non_contiguous, 2, tmp_path)
    assert outcomes[0]["rule"] == 4 and "non-contiguous" in outcomes[0]["error"], outcomes


def _objects_on_the_nccl_world(rank: int) -> None:
    parts: list[Any] = [None, None]
    dist.all_gather_object(parts, {"rank": rank})  # torch would run it, through device memory


def test_rule_4_an_object_collective_on_an_nccl_group_is_named(tmp_path):
    outcomes = _run(_objects_on_the_nccl_world, 2, tmp_path)
    assert outcomes[0]["rule"] == outcomes[1]["rule"] == 4, outcomes
    assert "all_gather_object on NCCL group" in outcomes[0]["error"] and "host group" in outcomes[0]["error"]


def _objects_over_the_host_group(rank: int) -> None:
    from lightning_paci.engine.replicas.optimizer_shards import merge_replica_states
    from lightning_paci.engine.transport.collectives import broadcast_objects, gather_objects

    host = dist.new_group([0, 1, 2, 3], backend="gloo", timeout=_TIMEOUT)  # every rank: nobody splits (rule 1)
    replicas = [dist.new_group(pair, backend="nccl", timeout=_TIMEOUT) for pair in ([0, 1], [2, 3])]
    pair = [0, 1] if rank < 2 else [2, 3]
    # two subsets exchange at once on the one host group, each on its own
    assert gather_objects({"rank": rank}, pair, host, what="a test") == [{"rank": r} for r in pair]
    assert broadcast_objects(f"from {pair[1]}" if rank == pair[1] else None, pair[1], pair, host,
                             what="a test") == f"from {pair[1]}"
    # a stage's replicas merge their optimizer-state shards over the host group, not their NCCL group: each owns
    # one name, both end with the owners' entries
    local = {"a": {"state": {"step": torch.tensor(float(rank))}}, "b": {"state": {"step": torch.tensor(-1.0)}}}
    merged = merge_replica_states(local, ["a"] if rank == pair[0] else ["b"], replicas[rank // 2], host=host)
    assert float(merged["a"]["state"]["step"]) == pair[0] and float(merged["b"]["state"]["step"]) == -1.0


def test_object_exchanges_of_a_subset_of_the_ranks_pass_over_the_host_group(tmp_path):
    outcomes = _run(_objects_over_the_host_group, 4, tmp_path)
    assert all(outcomes[r]["error"] is None for r in range(4)), outcomes


def test_the_switch_reads_the_environment():
    assert nccl_emulation.enabled({"LIGHTNING_PACI_EMULATE_NCCL": "1"})
    assert nccl_emulation.enabled({"LIGHTNING_PACI_EMULATE_NCCL": "true"})
    assert not nccl_emulation.enabled({"LIGHTNING_PACI_EMULATE_NCCL": "0"})
    assert not nccl_emulation.enabled({})
