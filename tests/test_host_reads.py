"""Host reads in the steady state, counted on the CPU with the device-form code paths forced.

On an accelerator a host read of a device value (``item``, ``float``, ``bool``, ``tolist``, ``cpu``, ``nonzero``,
...) waits for the device, so a host that reads per micro-batch can never run ahead of its GPU. A
``TorchFunctionMode`` sees every such call; counted are those made by lightning_paci's own code (the user's model
and torch's internals are not ours), per action, while every stage of the reference executor runs a second stream
(the first warmed the optimizer state up) with the losses and log values kept as tensors
([Note: no host sync per micro-batch]), the weight prediction ([Note: step counts on the host]) and the weight-drift
measurement of DriftMonitor on (its norms read when the records are read).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.schedules import OPT

from models import HFCausalLM, token_loader

_READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy", "nonzero", "equal",
          "allclose", "masked_select", "unique"}
_DISPATCH = tuple(str(Path(torch.__file__).parent / name) for name in ("overrides.py", "_tensor.py"))
_PACKAGE = str(Path(__file__).resolve().parents[1] / "lightning_paci")


class HostReads(TorchFunctionMode):
    """Counts host reads whose caller (the first frame past torch's dispatch) is lightning_paci's code, by phase.
    Reads inside torch itself are not ours: e.g. a non-fused Adam reads its ``step``, a CPU tensor even on a GPU."""

    def __init__(self, *, values_only: bool = False) -> None:
        super().__init__()
        # values_only: reads of a value alone (item, bool, float, tolist, nonzero, ...), leaving out the copies to
        # the host (cpu, numpy, to) that a CPU run cannot tell from moves of data that lives on the host anyway
        self.values_only = values_only
        self.phase = "other"
        self.counts: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in [*args[1:], *(kwargs or {}).values()])
        if self.values_only and (to_host or name in ("cpu", "numpy")):
            to_host, name = False, ""
        if name in _READS or to_host:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename in _DISPATCH:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
                self.counts[self.phase] += 1
                where = frame.f_code.co_filename[len(_PACKAGE) + 1:]
                self.sites[f"{self.phase}: {where}:{frame.f_lineno} {name}"] += 1
        return func(*args, **(kwargs or {}))


def _pipeline(schedule: str, compensation: str) -> tuple[ReferencePipeline, list[Any]]:
    L.seed_everything(0, verbose=False)
    model = HFCausalLM("gpt2", layers=4, tied=True)
    reference = ReferencePipeline(model, plan_partition(model, num_stages=4, partition="parameters"),
                                  compensation=compensation)
    for runtime in reference.runtimes:
        runtime.device_losses = True
        runtime.program.device_logs = True
        runtime.records.measure(weight_drift=True)
    return reference, list(token_loader(num_batches=4, batch_size=8, vocab=64))


def _count(reference: ReferencePipeline, schedule: Any, batches: list[Any]) -> HostReads:
    mode = HostReads()
    for runtime in reference.runtimes:
        execute = runtime.execute

        def counted(action: Any, execute: Any = execute) -> None:
            mode.phase = "update" if action.kind is OPT else "microbatch"
            try:
                execute(action)
            finally:
                mode.phase = "other"

        runtime.execute = counted  # type: ignore[method-assign]
    with mode:
        reference.run(schedule, batches)
    return mode


@pytest.mark.parametrize("schedule, compensation", [("paci", "predict"), ("1f1b", "none")])
def test_no_host_read_per_microbatch_and_at_most_one_per_update(schedule, compensation):
    reference, batches = _pipeline(schedule, compensation)
    lists = build_schedule(schedule, 4, 4, 4, num_minibatches=len(batches), tied=True)
    reference.run(lists, batches)  # first stream: optimizer state, first-use reads
    moves = sum(r.prediction.moves for r in reference.runtimes if r.prediction is not None)
    mode = _count(reference, lists, batches)
    if compensation == "predict":  # the weight prediction did run ahead in the counted stream
        assert sum(r.prediction.moves for r in reference.runtimes) > moves > 0
    updates = 4 * len(batches)  # every stage steps once per batch (a = m)
    assert mode.counts["microbatch"] == 0, mode.sites
    # per update: the one check before it (losses, gradients); the drift measurement's norms wait on
    # the device until a monitor reads the records ([Note: drift norms read when read])
    assert mode.counts["update"] <= updates, mode.sites
    assert mode.counts["other"] == 0, mode.sites
    with mode:
        drifts = [b.weight_drift for r in reference.runtimes for b in r.records.backwards]
    assert all(d is not None for d in drifts)
    assert any(d > 0 for d in drifts) == (schedule == "paci")  # 1f1b: no backward crosses an update
    assert mode.counts["other"] == 4, mode.sites  # reading them: one read per stage for all its pending updates


class _CountBatches(L.Callback):
    """Every stage forces the device forms, then counts its value reads from batch 3 to the end of training."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.mode = directory, HostReads(values_only=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime
        runtime.device_losses, runtime.program.device_logs = True, True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if index == 3:
            self.mode.phase = "batches"
            self.mode.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)
        sites = {site: count for site, count in self.mode.sites.items()
                 if "engine/transport/point_to_point.py" not in site}
        (self.directory / f"reads{trainer.global_rank}.json").write_text(json.dumps(sites))


@pytest.mark.distributed
@pytest.mark.parametrize("replicas, bucket_mb", [(1, None), (2, None), (2, 1e-6)])
def test_through_the_trainer_with_the_monitors_reads_stay_per_update(tmp_path, replicas, bucket_mb):
    # the Trainer's path (log replay, fingerprints, the monitors at every step) on 4 forked processes: 4 stages, or
    # 2 stages x 2 replicas whose reduction (blocking, or overlapped in buckets) reads nothing; the gloo wire's
    # NumPy framing (engine/transport/point_to_point.py) is the CPU transport's, which NCCL runs replace by
    # split_wire.py
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_paci import BubbleMonitor, DriftMonitor

    from helpers import fit

    torch.manual_seed(0)
    fit(HFCausalLM("gpt2", layers=4, tied=True), token_loader(num_batches=8, batch_size=8, vocab=64), devices=4,
        max_steps=8, microbatches=4, partition="parameters", data_parallel_size=replicas, reduce_bucket_mb=bucket_mb,
        callbacks=[DriftMonitor(), BubbleMonitor(), _CountBatches(tmp_path)],
        trainer_kwargs={"logger": TensorBoardLogger(tmp_path), "log_every_n_steps": 1,
                        "use_distributed_sampler": replicas > 1})
    for stage in range(4):
        sites = json.loads((tmp_path / f"reads{stage}.json").read_text())
        allowed = ("optim/stage_optimizer.py", "engine/runtime/records.py", "integration/trainer/fingerprint.py")
        assert all(site.split(": ")[1].startswith(allowed) for site in sites), (stage, sites)
        per_file = collections.Counter({f: 0 for f in allowed})
        for site, count in sites.items():
            per_file[site.split(": ")[1].split(":")[0]] += count
        # batches 3..7: the check before each of the stage's updates (5, and the drain's; with replicas the
        # reduction's presence flags join it), the drift norms once per logged step (DriftMonitor reads the
        # records), the data fingerprint once per drain (the end of training; with 2 replicas each epoch is 4
        # batches, so also the first epoch's end)
        assert per_file["optim/stage_optimizer.py"] <= 6 and per_file["engine/runtime/records.py"] <= 5, (stage, sites)
        assert per_file["integration/trainer/fingerprint.py"] <= (1 if replicas == 1 else 2), (stage, sites)


_LOGGING = (str(Path(L.__file__).parent / "pytorch" / "trainer" / "connectors" / "logger_connector"),
            str(Path(_PACKAGE) / "integration" / "stage" / "logs.py"))


class LoggingReads(TorchFunctionMode):
    """Counts value reads (``item``, ``float``, ``tolist``, ...) made anywhere below Lightning's logger connector
    or lightning_paci's log replay: what logging costs a rank per batch, whoever's code makes the read."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _READS - {"cpu", "numpy"}:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(_LOGGING):
                frame = frame.f_back
            self.count += frame is not None
        return func(*args, **(kwargs or {}))


class _CountLoggingReads(L.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory, self.mode = directory, LoggingReads()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime
        runtime.device_losses, runtime.program.device_logs = True, True  # the device forms, on the CPU

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if index == 1:  # from the second batch: every rank has replayed records by then
            self.mode.__enter__()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.mode.__exit__(None, None, None)
        record = {"reads": self.mode.count, "stage": trainer.strategy.stage_index,
                  "bar": sorted(trainer.progress_bar_metrics), "callback": sorted(trainer.callback_metrics)}
        (self.directory / f"logging{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
def test_no_device_read_from_logging_on_the_stage_that_does_not_show_the_progress_bar(tmp_path):
    # [Note: no log read off the logging rank]: `self.log("train_loss", loss, prog_bar=True)` (SequentialMLP), its
    # values kept on the device; Lightning reads every prog_bar value at every batch's end on every rank it is
    # logged on. Rank 0 (the last stage, which shows the bar) reads it once per batch; stage 0 never does, and
    # its callback_metrics still hold the value
    from helpers import fit
    from models import SequentialMLP, regression_loader

    torch.manual_seed(0)
    fit(SequentialMLP(depth=4), regression_loader(num_batches=6), devices=2, max_steps=6, partition="parameters",
        callbacks=[_CountLoggingReads(tmp_path)], trainer_kwargs={"log_every_n_steps": 1})
    shown, upstream = (json.loads((tmp_path / f"logging{r}.json").read_text()) for r in (0, 1))
    assert shown["stage"] == 1 and upstream["stage"] == 0
    assert shown["reads"] >= 5 and shown["bar"] == ["train_loss"]  # the counter sees the bar's reads
    assert upstream["reads"] == 0 and upstream["bar"] == [] and "train_loss" in upstream["callback"]
