"""The pipeline's communicators under NCCL's creation rule.

NCCL creates a group's point-to-point communicator at a rank's first operation on it and holds the host there
until the peer's first operation on the same group ([Note: communicator creation]); gloo connects at group
creation, so a plain CPU run never shows it. Under the NCCL emulation ([Note: NCCL emulation]) it does: training
and evaluation through the Trainer complete because the setup connects every communicator in one global order
(without that warm-up the receives posted ahead hang at batch 0, as the deadlock model's lazy mode shows and
tests/test_nccl_emulation.py catches); tests/test_no_cache.py runs a tied GPT-2 and a Llama under it too.
"""

from __future__ import annotations

import json
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_paci.engine.transport import nccl_emulation
from lightning_paci.engine.transport.groups import create_communicators, header_tag, warm_communicators
from lightning_paci.engine.transport.point_to_point import DistComm
from lightning_paci.schedules import layout_communicators

from helpers import fit, run_forked_ranks
from models import SequentialMLP, regression_loader

pytestmark = pytest.mark.distributed


class _Connected(Callback):
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        emulation = nccl_emulation.emulation()
        assert emulation is not None
        record = {"connected": trainer.strategy.process_groups.links.connected, "stage": trainer.strategy.stage_index,
                  "met": emulation.met}
        (self.directory / f"connected{dist.get_rank()}.json").write_text(json.dumps(record))


def test_training_and_evaluation_complete_under_nccls_communicator_creation(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PACI_EMULATE_NCCL", "1")
    torch.manual_seed(0)
    fit(SequentialMLP(), regression_loader(num_batches=4), devices=4, max_steps=4, microbatches=4,
        accumulation=2, callbacks=[_Connected(tmp_path)],
        val_dataloaders=regression_loader(num_batches=2), trainer_kwargs={"limit_val_batches": 2,
                                                                        "val_check_interval": 2})
    # every rank connected its 4 communicators at setup (both directions to each neighbour; stages 0 and 3 both
    # directions of the tied exchange, created whether or not the model ties weights): the first operations met
    # there, on those 4 and no other pair
    records = [json.loads(p.read_text()) for p in tmp_path.glob("connected*.json")]
    assert {r["stage"]: (r["connected"], r["met"]) for r in records} == {s: (4, 4) for s in range(4)}
    assert sum(r["met"] for r in records) == 2 * len(layout_communicators("directed", 4)) == 16


def _staging_worker(rank: int, path: str, errors: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        groups = create_communicators(2, 1, lambda s, r: s, backend="gloo", timeout=timedelta(seconds=30))
        assert warm_communicators(groups, lambda s, r: s, device=torch.device("cpu")) == 4
        # ``deliver``: received tensors go to the compute device (here "meta", the only other device a CPU
        # machine has), the wire stays on the host
        comm = DistComm([0, 1], groups=groups, device=torch.device("cpu"), deliver=torch.device("meta"))
        if rank == 0:
            comm.send({"x": torch.arange(6.0).reshape(2, 3), "n": 3}, 1)
            comm.flush()
        else:
            got = comm.recv(0)
            assert got["n"] == 3 and got["x"].device.type == "meta" and got["x"].shape == (2, 3)
        dist.barrier()
    except BaseException:
        errors.put(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_received_tensors_are_delivered_to_the_compute_device(tmp_path):
    run_forked_ranks(_staging_worker, 2, tmp_path / "rendezvous")


def test_one_cuda_hardware_queue_is_warned_about_under_nccl():
    from lightning_paci.engine.transport.groups import connections_warning

    cuda = torch.device("cuda", 0)
    message = connections_warning("nccl", cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert message is not None and "CUDA_DEVICE_MAX_CONNECTIONS=1 is set" in message and "Unset it" in message
    assert connections_warning("nccl", cuda, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert connections_warning("nccl", cuda, {}) is None
    assert connections_warning("gloo", torch.device("cpu"), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None


def test_header_tags_differ_for_every_link_and_kind_and_stay_in_gloos_range():
    # [Note: one tag per link]: the loop placement's 0 -> 1 and 2 -> 3 (2 processes), the V's 0 -> 1 and 4 -> 5 (3
    # virtual stages) join the same two processes in the same direction, so a tag per kind let headers cross
    for num_stages in (2, 4, 6, 12):
        keys = [(kind, src, dst) for kind in ("F", "B", "T") for src in range(num_stages) for dst in range(num_stages)
                if src != dst]
        tags = [header_tag(kind, src, dst, num_stages) for kind, src, dst in keys]
        assert len(set(tags)) == len(keys) and min(tags) >= 1 and max(tags) <= 3 * num_stages**2  # 0: objects
    assert header_tag("F", 0, 1, 4) != header_tag("F", 2, 3, 4) != header_tag("B", 3, 2, 4)
    assert header_tag("T", 0, 1, 2) != header_tag("F", 0, 1, 2)  # two stages: the tied pair is also F's link
    with pytest.raises(ValueError, match=r"`kind` must be one of 'F', 'B', 'T', got 'X'"):
        header_tag("X", 0, 1, 2)
    with pytest.raises(ValueError, match=r"two different stages of the 2, got `src=1`, `dst=1`"):
        header_tag("F", 1, 1, 2)
    with pytest.raises(ValueError, match=r"past gloo's 2147483647: use at most 26754 stages"):
        header_tag("F", 30000, 30001, 30002)
