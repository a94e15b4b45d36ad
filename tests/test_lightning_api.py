"""Lightning's private API: every symbol checked, no per-batch WORLD collective, a renamed method fails loudly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.multiprocessing import ProcessRaisedException

from lightning_paci.integration.trainer.lightning_api import LightningAPIError, patch_method

from helpers import fit
from models import SequentialMLP, regression_loader

_COLLECTIVES = ("broadcast", "all_reduce", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
                "gather", "gather_object", "reduce", "scatter", "scatter_object_list", "all_to_all", "reduce_scatter",
                "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")


class CountCollectives(Callback):
    """Every rank counts the torch.distributed collectives issued between consecutive training batches' ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.per_batch: list[int] = []
        self._count = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def counting(name: str, original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._count += 1
                return original(*args, **kwargs)
            return wrapper

        for name in _COLLECTIVES:  # forked rank: the patch lives and dies with this process
            setattr(dist, name, counting(name, getattr(dist, name)))
        self._count = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.per_batch.append(self._count)
        self._count = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = self.directory / f"collectives{trainer.strategy.stage_index}.json"
        path.write_text(json.dumps(self.per_batch))


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_a_training_stream_issues_no_collective_per_batch(tmp_path, schedule):
    torch.manual_seed(31)
    fit(SequentialMLP(depth=4), regression_loader(num_batches=12), devices=4, max_steps=12,
        callbacks=[CountCollectives(tmp_path)], schedule=schedule, partition="parameters")
    for stage in range(4):
        per_batch = json.loads((tmp_path / f"collectives{stage}.json").read_text())
        assert len(per_batch) == 12
        # the first window starts at on_train_start; every later one spans exactly one batch of the stream; the
        # last batch drains the stream, and a drain compares the stages' data fingerprints (one broadcast)
        assert per_batch[1:] == [0] * 10 + [1], f"stage {stage}: collectives per batch {per_batch}"


@pytest.mark.distributed
def test_setup_fails_loudly_when_a_patched_lightning_method_is_renamed(tmp_path, monkeypatch):
    # as if a Lightning release renamed the per-batch SIGTERM broadcast: patching it would silently do nothing
    monkeypatch.delattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    with pytest.raises(ProcessRaisedException, match=r"_TrainingEpochLoop\._broadcast_sigterm_tensor.*lightning 2\."):
        fit(SequentialMLP(), regression_loader(), devices=2, max_steps=2, partition="parameters")


def test_patch_method_checks_the_parameters_and_undoes_itself():
    class Loop:
        def step(self, batch: Any, index: int) -> str:
            return "original"

    loop = Loop()
    with pytest.raises(LightningAPIError, match=r"Loop\.step.*with parameters \('batch', 'index'\) instead of "
                                                r"\('batch',\)"):
        patch_method(loop, "step", lambda batch: "patched", parameters=("batch",))
    with pytest.raises(LightningAPIError, match=r"Loop\.missing.*does not have"):
        patch_method(loop, "missing", lambda: None, parameters=())
    undo = patch_method(loop, "step", lambda batch, index: "patched", parameters=("batch", "index"))
    assert loop.step(0, 0) == "patched"
    undo()
    assert loop.step(0, 0) == "original"
