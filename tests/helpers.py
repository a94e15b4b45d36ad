"""Shared helpers: a fork-launched Trainer run and a callback that dumps each stage's runtime records."""

from __future__ import annotations

import gc
import json
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_paci import PACIStrategy, ReferencePipeline, build_schedule, plan_partition

from models import SequentialMLP


def _parameter_storages() -> dict[int, int]:
    """Every real parameter storage alive in the process (not meta, not a compiler's fake tensor or a dead proxy
    left by a ``torch.compile`` in the same process)."""
    from torch._subclasses.fake_tensor import FakeTensor

    alive: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.nn.Parameter) or isinstance(obj, FakeTensor) or obj.device.type == "meta":
                continue
            alive[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        except (ReferenceError, RuntimeError):  # a weak proxy whose referent is gone; a tensor without storage
            continue
    return alive


class DumpStageRecords(Callback):
    """On every rank: version gaps, peak in-flight, and whether any parameter storage appeared while micro-batches
    were in flight (a weight stash or copy would). A forked rank also holds its parent's objects, hence the
    baseline taken at the start of training rather than an absolute count."""

    def __init__(self, directory: Path, *, activation_bytes: bool = False) -> None:
        self.directory = Path(directory)
        self.extra_bytes = 0
        self.activation_bytes = activation_bytes

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # digest of every tied-weight version (tied models)
        trainer.strategy.runtime.records.measure(activation_bytes=self.activation_bytes, tied_fingerprints=True)
        self.baseline = _parameter_storages()
        own = {p.untyped_storage().data_ptr() for p in pl_module.parameters()}
        optimized = {p.untyped_storage().data_ptr() for g in trainer.optimizers[0].param_groups for p in g["params"]}
        self.optimizer_shares_storage = optimized == own

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        extra = {k: v for k, v in _parameter_storages().items() if k not in self.baseline}
        self.extra_bytes = max(self.extra_bytes, sum(extra.values()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime
        records = runtime.records
        record = {
            "stage": trainer.strategy.stage_index,
            "gaps": {str(k): v for k, v in records.version_gaps.items()},
            "peak_inflight": records.peak_inflight,
            "peak_activation_bytes": records.peak_activation_bytes,
            "peak_relayed_bytes": records.peak_relayed_bytes,
            "relays": trainer.strategy.stage.relays.describe(),
            "own_param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "extra_param_bytes_in_flight": self.extra_bytes,
            "optimizer_shares_storage": self.optimizer_shares_storage,
            "optimizer_steps": runtime.version,
            "plan": trainer.strategy.plan.describe(),
            "tied_fingerprints": list(records.tied_fingerprints or []),
            "tied_lags": {str(k): v for k, v in records.tied_lags.items()},
        }
        (self.directory / f"stage{record['stage']}.json").write_text(json.dumps(record))


def read_stage_records(directory: Path, num_stages: int) -> list[dict[str, Any]]:
    return [json.loads((Path(directory) / f"stage{s}.json").read_text()) for s in range(num_stages)]


def fit(model: L.LightningModule, loader: Any, *, devices: int, max_steps: int = 5, callbacks: list[Any] | None = None,
        trainer_kwargs: dict[str, Any] | None = None, ckpt_path: str | None = None, val_dataloaders: Any = None,
        **strategy_kwargs: Any) -> L.Trainer:
    strategy = PACIStrategy(start_method="fork", timeout=timedelta(seconds=60), **strategy_kwargs)
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, max_steps=max_steps, enable_checkpointing=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=callbacks or [],
    )
    kwargs.update(trainer_kwargs or {})
    trainer = L.Trainer(strategy=strategy, **kwargs)
    trainer.fit(model, loader, val_dataloaders, ckpt_path=ckpt_path)
    return trainer


class RecordLosses(Callback):
    """Rank 0 appends ``callback_metrics[key]`` after every batch to ``directory/losses.txt`` (forked ranks cannot
    hand Python objects back to the test)."""

    def __init__(self, directory: Path, key: str = "train_loss") -> None:
        self.path = Path(directory) / "losses.txt"
        self.key = key

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and self.key in trainer.callback_metrics:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(f"{float(trainer.callback_metrics[self.key])}\n")

    def values(self) -> list[float]:
        return [float(line) for line in self.path.read_text().split()] if self.path.exists() else []


class DumpLastStageLosses(Callback):
    """The last stage writes every micro-batch's loss (keyed by its index in the whole run) at the end of fit."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if strategy.stage_index == strategy.num_stages - 1:
            losses = strategy.runtime.records.losses
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / f"losses_from_{min(losses)}.json").write_text(json.dumps(losses))

    def values(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for path in sorted(self.directory.glob("losses_from_*.json")):
            out.update({int(k): v for k, v in json.loads(path.read_text()).items()})
        return out


class KeepVersion(Callback):
    """Every stage saves its weights right after its ``version``-th update (the runtime's ``update_hooks``, no
    drain) to ``directory/stage<s>.pt`` and the versions its hook saw to ``directory/versions<s>.json``."""

    def __init__(self, directory: Path, version: int) -> None:
        self.directory, self.version = Path(directory), version

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stage = trainer.strategy.stage_index
        self.seen: list[int] = []

        def keep(version: int) -> None:
            self.seen.append(version)
            if version == self.version:
                weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
                torch.save(weights, self.directory / f"stage{stage}.pt")

        trainer.strategy.runtime.update_hooks.append(keep)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        (self.directory / f"versions{trainer.strategy.stage_index}.json").write_text(json.dumps(self.seen))


class RecordFreezeCount(Callback):
    """Every rank writes ``gc.get_freeze_count()`` seen at its setup (what it inherited frozen: a forked rank its
    parent's heap), during training and at its teardown."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.at_setup = self.during = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.at_setup = gc.get_freeze_count()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.during = gc.get_freeze_count()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        path = self.directory / f"freeze{trainer.strategy.stage_index}.json"
        path.write_text(json.dumps({"at_setup": self.at_setup, "during": self.during,
                                   "teardown": gc.get_freeze_count()}))


# -- comparisons with one device and the reference executor (tests/test_one_device*.py) --------------------

def one_device(max_epochs: int = 1, **trainer_kwargs) -> L.Trainer:
    """`Trainer(devices=1)` as a user runs it, without the extras (logger, checkpoints, progress bar, summary)."""
    kwargs = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**kwargs, **trainer_kwargs})


def reference_run(initial, schedule: str, stages: int, m: int, a: int, batches, *, tied: bool = False):
    """The one-process reference executor run on ``batches`` with the split the tests' runs use."""
    reference = ReferencePipeline(initial, plan_partition(initial, stages, partition="parameters"))
    reference.run(build_schedule(schedule, stages, m, a, len(batches), tied=tied), list(batches))
    return reference


class Momentum(SequentialMLP):
    """SGD with momentum: a lost optimizer state changes every later update."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def assert_same_weights(actual, expected) -> None:
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(actual.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


class KeepMetrics(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({k: float(v) for k, v in trainer.callback_metrics.items()}))


class RecordSetupWarnings(L.Callback):
    """Rank 0 writes the warnings raised from setup to the start of training (forked ranks' warnings never reach
    the test's own recorder)."""

    def __init__(self, path) -> None:
        self.path = path

    def setup(self, trainer, pl_module, stage) -> None:  # before the strategy's setup
        self._catcher = warnings.catch_warnings(record=True)
        self.seen = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module) -> None:
        self._catcher.__exit__(None, None, None)
        if trainer.is_global_zero:
            self.path.write_text(json.dumps([str(w.message) for w in self.seen]))


def run_forked_ranks(target: Any, world: int, rendezvous: Path, timeout: float = 50.0) -> None:
    """Run ``target(rank, rendezvous_path, errors)`` in ``world`` forked processes and fail with the first rank's
    traceback a worker put on ``errors`` (a process that dies without one fails the exit-code check)."""
    context = mp.get_context("fork")
    errors = context.Queue()
    processes = [context.Process(target=target, args=(r, str(rendezvous), errors)) for r in range(world)]
    for p in processes:  # with the heap conftest.py froze: [Note: fork with a frozen heap]
        p.start()
    for p in processes:
        p.join(timeout)
    assert errors.empty(), errors.get()
    assert [p.exitcode for p in processes] == [0] * world


class RecordBatches(L.Callback):
    """Stage 0 of every replica saves the batches it trained on (``batches<replica>.pt``)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.seen = directory, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.strategy.stage_index == 0:
            self.seen.append(tuple(t.clone() for t in batch))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.stage_index == 0:
            torch.save(self.seen, self.directory / f"batches{trainer.strategy.replica_index}.pt")


def replica_batches(directory: Path, loader: DataLoader, replicas: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """What each replica trained on, checked to be disjoint shards of the dataset (Lightning's
    ``DistributedSampler`` by the data-parallel coordinate only)."""
    out = [torch.load(directory / f"batches{r}.pt") for r in range(replicas)]
    rows = [tuple(x.tolist()) for batches in out for batch in batches for x in batch[0]]
    dataset_rows = {tuple(x.tolist()) for x in loader.dataset.tensors[0]}  # type: ignore[attr-defined]
    assert len(set(rows)) == len(rows) and set(rows) <= dataset_rows  # no sample twice, all from the dataset
    return out
