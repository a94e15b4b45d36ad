"""Checkpoints: consolidated and loadable by the unchanged module, exact resume, resume onto fewer stages, atomic
writes."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_paci import PACIStrategy
from lightning_paci.checkpoint import atomic_save

from helpers import DumpLastStageLosses
from models import HFCausalLM, SequentialMLP, regression_loader, token_loader

pytestmark = pytest.mark.distributed


def _trainer(directory, devices, epochs, schedule, **kwargs):
    return L.Trainer(
        strategy=PACIStrategy(start_method="fork", schedule=schedule, microbatches=4, accumulation=2,
                              partition="parameters"),
        accelerator="cpu", devices=devices, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}"), DumpLastStageLosses(directory)],
        **kwargs,
    )


@pytest.mark.parametrize("schedule", ["paci", "1f1b"])
def test_interrupted_and_resumed_run_equals_the_uninterrupted_run(tmp_path, schedule):
    loader = token_loader(num_batches=4, vocab=64, seq=10)
    torch.manual_seed(30)
    model = HFCausalLM("gpt2", layers=4, tied=True, lr=1e-2)
    first = copy.deepcopy(model)
    # uninterrupted: 3 epochs, a checkpoint (and so a drain) at the end of each
    _trainer(tmp_path / "full", 4, 3, schedule).fit(model, loader)
    # interrupted after epoch 1, resumed from its checkpoint in a new Trainer
    _trainer(tmp_path / "part", 4, 1, schedule).fit(first, loader)
    resumed = copy.deepcopy(first)
    _trainer(tmp_path / "part", 4, 3, schedule).fit(resumed, loader, ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
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
        import io, time, torch
        import lightning_paci.checkpoint as ckpt
        real_save = torch.save

        def slow_save(obj, fh):  # the real bytes, written in chunks slowly: the kill lands mid-write
            buffer = io.BytesIO()
            real_save(obj, buffer)
            data = buffer.getvalue()
            print("writing", flush=True)
            for i in range(0, len(data), len(data) // 50 + 1):
                fh.write(data[i:i + len(data) // 50 + 1])
                time.sleep(0.1)

        ckpt.torch.save = slow_save
        ckpt.atomic_save({{"version": 2, "weights": torch.ones(1_000_000)}}, {str(path)!r})
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    time.sleep(0.5)  # about 5 of the 50 chunks are written
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert torch.load(path)["version"] == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    for name in leftovers:  # a partial temporary file may remain; it is never mistaken for the checkpoint
        assert name.startswith(".last.ckpt.tmp-")


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
    out = subprocess.run([sys.executable, "-m", "lightning_paci.checkpoint", str(directory), str(tmp_path / "one.ckpt")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    loaded = SequentialMLP.load_from_checkpoint(tmp_path / "one.ckpt")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    # and the directory resumes directly
    resumed = SequentialMLP(depth=4)
    trainer(tmp_path / "again", 2).fit(resumed, loader, ckpt_path=str(directory))
    assert (tmp_path / "again" / "epoch=1.ckpt" / "meta.pt").exists()
