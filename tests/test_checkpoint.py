"""Checkpoints: consolidated and loadable by the unchanged module, exact resume, resume onto fewer stages, atomic
writes."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_paci import PACIStrategy
from lightning_paci.integration.checkpoints.checkpoint import atomic_save

from helpers import DumpLastStageLosses
from models import HFCausalLM, SequentialMLP, regression_loader, token_loader

pytestmark = pytest.mark.distributed


def _trainer(directory, devices, epochs, schedule, accumulation=2, **kwargs):
    return L.Trainer(
        strategy=PACIStrategy(start_method="fork", schedule=schedule, microbatches=4, accumulation=accumulation,
                              partition="parameters"),
        accelerator="cpu", devices=devices, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}"),
                   DumpLastStageLosses(directory)],
        **kwargs,
    )


# flush schedules' exact resume: tests/test_emulated_nccl.py (1f1b at 3 stages and 2 x 2, gpipe at 4)
@pytest.mark.parametrize("schedule, accumulation", [("paci", 3)])  # a = 3: an open window at the checkpoint
def test_interrupted_and_resumed_run_equals_the_uninterrupted_run(tmp_path, schedule, accumulation):
    # a = 3: each epoch's 16 micro-batches leave a window open at the checkpoint (16 mod 3 = 1), its gradients
    # (and the tied replica's) are saved and restored
    loader = token_loader(num_batches=4, vocab=64, seq=10)
    torch.manual_seed(30)
    model = HFCausalLM("gpt2", layers=4, tied=True, lr=1e-2)
    first = copy.deepcopy(model)
    # uninterrupted: 3 epochs, a checkpoint (and so a drain) at the end of each
    _trainer(tmp_path / "full", 4, 3, schedule, accumulation).fit(model, loader)
    # interrupted after epoch 1, resumed from its checkpoint in a new Trainer
    _trainer(tmp_path / "part", 4, 1, schedule, accumulation).fit(first, loader)
    resumed = copy.deepcopy(first)
    _trainer(tmp_path / "part", 4, 3, schedule, accumulation).fit(resumed, loader,
                                                                  ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    full = DumpLastStageLosses(tmp_path / "full").values()
    part = DumpLastStageLosses(tmp_path / "part").values()  # both halves, keyed by micro-batch in the whole run
    assert len(full) == 48 and part == full


def test_checkpoint_loads_into_the_unchanged_module_and_resumes_on_two_stages(tmp_path):
    loader = regression_loader(num_batches=4)
    torch.manual_seed(31)
    model = SequentialMLP(depth=4)
    _trainer(tmp_path, 4, 1, "paci").fit(model, loader)
    path = tmp_path / "epoch=0.ckpt"
    loaded = SequentialMLP.load_from_checkpoint(path)  # strict load, one process, no pipeline
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["optimizer_states"][0]["paci"]["num_stages"] == 4
    # the 4-stage checkpoint resumes on 2 stages: weights and optimizer state repartitioned by name
    resumed = SequentialMLP(depth=4)
    trainer = _trainer(tmp_path / "two", 2, 2, "paci")
    trainer.fit(resumed, loader, ckpt_path=str(path))
    assert (tmp_path / "two" / "epoch=1.ckpt").exists()
    after = torch.load(tmp_path / "two" / "epoch=1.ckpt", weights_only=False)
    assert after["optimizer_states"][0]["paci"]["num_stages"] == 2
    assert after["optimizer_states"][0]["paci"]["steps"] == 2 * checkpoint["optimizer_states"][0]["paci"]["steps"]


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "last.ckpt"
    atomic_save({"version": 1, "weights": torch.ones(4)}, path)
    script = textwrap.dedent(f"""
        import io, sys, torch
        import lightning_paci.integration.checkpoints.checkpoint as ckpt
        real_save = torch.save

        def held_save(obj, fh):  # the real bytes in 50 chunks; after the fifth the writer waits, mid-write
            buffer = io.BytesIO()
            real_save(obj, buffer)
            data = buffer.getvalue()
            step = len(data) // 50 + 1
            for n, i in enumerate(range(0, len(data), step), start=1):
                fh.write(data[i:i + step])
                if n == 5:
                    fh.flush()
                    print("written", len(data), fh.tell(), flush=True)
                    sys.stdin.readline()  # held here until killed: no timing decides where the kill lands

        ckpt.torch.save = held_save
        ckpt.atomic_save({{"version": 2, "weights": torch.ones(1_000_000)}}, {str(path)!r})
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    word, total, written = child.stdout.readline().split()
    assert word == "written" and 0 < int(written) < int(total)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert torch.load(path)["version"] == 1
    # the partial temporary file stays beside it, never mistaken for the checkpoint
    (leftover,) = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert leftover.name == f".last.ckpt.tmp-{child.pid}" and leftover.stat().st_size == int(written)


def test_sharded_layout_writes_one_file_per_stage_resumes_and_consolidates(tmp_path):
    loader = regression_loader(num_batches=4)
    torch.manual_seed(32)
    model = SequentialMLP(depth=4)

    def trainer(directory, epochs):
        return L.Trainer(
            strategy=PACIStrategy(start_method="fork", microbatches=4, partition="parameters",
                                  checkpoint_layout="sharded"),
            accelerator="cpu", devices=4, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
            callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}")],
        )

    trainer(tmp_path, 1).fit(model, loader)
    directory = tmp_path / "epoch=0.ckpt"
    assert sorted(p.name for p in directory.iterdir()) == ["meta.pt"] + [f"stage_{s:03d}.pt" for s in range(4)]
    # each stage file holds that stage's weights only
    shard = torch.load(directory / "stage_000.pt", weights_only=False)
    assert set(shard["state_dict"]) < set(model.state_dict())
    # the documented command consolidates it into a file the unchanged module loads
    out = subprocess.run([sys.executable, "-m", "lightning_paci.checkpoint", str(directory),
                          str(tmp_path / "one.ckpt")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = SequentialMLP.load_from_checkpoint(tmp_path / "one.ckpt")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    # the file resumes on one device (torch's optimizer form beside the pipeline's) as a consolidated save does
    one = SequentialMLP(depth=4)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False).fit(one, loader, ckpt_path=tmp_path / "one.ckpt")
    entry = torch.load(tmp_path / "one.ckpt", weights_only=False)["optimizer_states"][0]
    assert "paci" in entry and len(entry["param_groups"][0]["params"]) == len(list(model.parameters()))
    # and the directory resumes directly
    resumed = SequentialMLP(depth=4)
    trainer(tmp_path / "again", 2).fit(resumed, loader, ckpt_path=str(directory))
    assert (tmp_path / "again" / "epoch=1.ckpt" / "meta.pt").exists()


class _SaveAndRecordGathers(L.Callback):
    """At the end of training every rank saves a consolidated checkpoint while recording what each collective
    hands it: non-zero ranks must send their own stage and receive nothing."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        import json

        import torch.distributed as dist

        received: list[str] = []
        send, recv = dist.send_object_list, dist.recv_object_list

        def recording_send(objects, dst=None, **kwargs):
            received.append(f"send:{dst}")
            return send(objects, dst=dst, **kwargs)

        def recording_recv(objects, src=None, **kwargs):
            received.append(f"recv:{src}")
            return recv(objects, src=src, **kwargs)

        def forbidden(name):
            def call(*args, **kwargs):
                received.append(name)
                raise AssertionError(f"{name} during a consolidated save hands every rank every stage's tensors")
            return call

        originals = {n: getattr(dist, n) for n in ("all_gather_object", "broadcast_object_list", "scatter_object_list",
                                                   "gather_object")}
        dist.send_object_list, dist.recv_object_list = recording_send, recording_recv
        for name in originals:
            setattr(dist, name, forbidden(name))
        try:
            weights = trainer.strategy.lightning_module_state_dict()
            optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
            trainer.save_checkpoint(self.directory / "gathered.ckpt")
        finally:
            dist.send_object_list, dist.recv_object_list = send, recv
            for name, original in originals.items():
                setattr(dist, name, original)
        own = sorted(k for k in pl_module.state_dict())
        record = {"weights": sorted(weights), "optimizer": sorted(optimizer.get("paci", {}).get("params", {})),
                  "received": received, "own": own}
        (self.directory / f"gathers{trainer.global_rank}.json").write_text(json.dumps(record))


def test_consolidated_save_gathers_to_rank_zero_only(tmp_path):
    import json

    torch.manual_seed(33)
    model = SequentialMLP(depth=8)
    full_keys = sorted(model.state_dict())
    trainer = L.Trainer(
        strategy=PACIStrategy(start_method="fork", microbatches=4, partition="parameters"), accelerator="cpu",
        devices=4, max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, callbacks=[_SaveAndRecordGathers(tmp_path)])
    trainer.fit(model, regression_loader(num_batches=4))
    records = [json.loads((tmp_path / f"gathers{rank}.json").read_text()) for rank in range(4)]
    assert records[0]["weights"] == full_keys  # rank 0 holds the whole model ...
    assert len(records[0]["optimizer"]) == len([k for k in full_keys if "weight" in k or "bias" in k])
    for rank, record in enumerate(records[1:], start=1):  # ... every other rank only ever held its own stage
        assert record["weights"] == [] and record["optimizer"] == []
        assert set(record["received"]) == {"send:0"}, f"rank {rank}: {record['received']}"  # sends, never receives
        assert record["own"] and set(record["own"]) < set(full_keys)
    assert sorted(records[0]["received"]) == sorted(["recv:1", "recv:2", "recv:3"] * 4)  # a stage at a time
    saved = torch.load(tmp_path / "gathered.ckpt", weights_only=False)
    assert sorted(saved["state_dict"]) == full_keys


def test_storage_options_are_refused_with_the_default_checkpoint_io(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    from lightning_paci.integration.checkpoints.checkpoint import PipelineCheckpoints

    checkpoints = PipelineCheckpoints("consolidated", 0, 2, TorchCheckpointIO())
    with pytest.raises(TypeError, match=r"storage_options=\{'a': 1\}.*custom `CheckpointIO`"):
        checkpoints.save({"state_dict": {}}, tmp_path / "x.ckpt", storage_options={"a": 1})
    assert not (tmp_path / "x.ckpt").exists()


def test_a_custom_checkpoint_io_writes_the_consolidated_file(tmp_path):
    from lightning.fabric.plugins import TorchCheckpointIO

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            (tmp_path / "calls.txt").open("a").write(f"{path} {storage_options}\n")
            super().save_checkpoint(checkpoint, path)

    torch.manual_seed(34)
    model = SequentialMLP()
    trainer = L.Trainer(
        strategy=PACIStrategy(start_method="fork", microbatches=4, partition="parameters", checkpoint_io=Recording()),
        accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="last")])
    trainer.fit(model, regression_loader(num_batches=2))
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    # rank 0 wrote the checkpoint once (the fork launcher also hands rank 0's weights back through the same IO)
    assert [c for c in calls if c.startswith(str(tmp_path))] == [f"{tmp_path / 'last.ckpt'} None"]
    assert sorted(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]) == sorted(model.state_dict())


class _FusedAdamW(SequentialMLP):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_fused_adamw_resumes_exactly(tmp_path):
    loader = regression_loader(num_batches=4)
    torch.manual_seed(31)
    model = _FusedAdamW(depth=6)
    first = copy.deepcopy(model)
    _trainer(tmp_path / "full", 3, 2, "paci").fit(model, loader)
    _trainer(tmp_path / "part", 3, 1, "paci").fit(first, loader)
    resumed = copy.deepcopy(first)
    _trainer(tmp_path / "part", 3, 2, "paci").fit(resumed, loader, ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("options", [{"fused": True}, {"capturable": True}, {}], ids=["fused", "capturable", "plain"])
def test_optimizer_state_is_placed_as_load_state_dict_places_it(options):
    # a saved `step` of another dtype (a non-fused run's float64, say) and a float64 moment on float32 parameters:
    # torch's own load_state_dict casts `step` to float32 for fused/capturable optimizers only, and every other
    # tensor to the parameter's dtype; the pipeline's name-keyed restore must give the same tensors
    from lightning_paci.integration.checkpoints.checkpoint import load_stage_optimizer_state
    from lightning_paci.optim.stage_optimizer import StageOptimizer

    module = torch.nn.Linear(3, 2)
    saved = {name: {"state": {"step": torch.tensor(5.0, dtype=torch.float64),
                              "exp_avg": torch.ones_like(p, dtype=torch.float64),
                              "exp_avg_sq": torch.ones_like(p, dtype=torch.float64)},
                    "group": {"lr": 1e-2}} for name, p in module.named_parameters()}
    stage = StageOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-2, **options), list(module.parameters()))
    load_stage_optimizer_state(stage, module, saved)
    expected = torch.optim.AdamW(module.parameters(), lr=1e-2, **options)
    expected.load_state_dict({"state": {i: saved[n]["state"] for i, (n, _) in enumerate(module.named_parameters())},
                              "param_groups": [{**expected.state_dict()["param_groups"][0]}]})
    for (alias, _), param in zip(stage.pairs, module.parameters()):
        for key, value in expected.state[param].items():
            got = stage.optimizer.state[alias][key]
            assert (got.dtype, got.device) == (value.dtype, value.device), (options, key)
            torch.testing.assert_close(got, value, rtol=0, atol=0)
