"""The examples run as the README says (shortened), write the monitors' TensorBoard files, and draw no warning
from lightning_paci (a showcase that warns teaches the wrong recipe)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def package_warnings(stderr: str) -> list[str]:
    """Warnings raised from lightning_paci's code: Python prints them as ``<file>:<line>: <message>``."""
    return [line for line in stderr.splitlines() if re.search(r"lightning_paci/[\w/]+\.py:\d+: ", line)]


def test_train_gpt_example_runs_and_writes_drift_and_bubble_tags(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_gpt.py"), "--devices", "2", "--max-steps", "8", "--layers", "2",
         "--batch-size", "8", "--corpus-bytes", "40000", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final validation perplexity:" in out.stdout and "TensorBoard logs:" in out.stdout
    assert package_warnings(out.stderr) == []
    assert "sync_dist=True" not in out.stderr and "LeafSpec" not in out.stderr  # Lightning's, moot here
    assert "Epoch 0/-" not in out.stdout  # a finite epoch count
    run = tmp_path / "tb" / "version_0"
    for stage in range(2):
        events = EventAccumulator(str(run / f"stage_{stage}"))
        events.Reload()
        tags = events.Tags()["scalars"]
        assert f"paci/drift_max/stage_{stage}" in tags and f"paci/bubble_fraction/stage_{stage}" in tags
    assert list((tmp_path / "checkpoints").glob("*.ckpt"))


def test_finetune_pretrained_example_runs_offline_and_exports_a_loadable_directory(tmp_path, capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import finetune_pretrained
    finally:
        sys.path.remove(str(EXAMPLES))
    finetune_pretrained.main(["--devices", "2", "--max-steps", "4", "--corpus-bytes", "60000", "--batch-size", "8",
                              "--root", str(tmp_path), "--start-method", "fork"])
    shards = json.loads((tmp_path / "pretrained" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1  # the stand-in is sharded, as a download is
    exported = json.loads((tmp_path / "finetuned" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(exported.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "fine-tuned model:" in capsys.readouterr().out


def test_the_port_example_trains_on_one_device_and_under_paci_without_a_warning_from_lightning_paci():
    out = subprocess.run([sys.executable, str(EXAMPLES / "port_existing_module.py")], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one device: train_loss=" in out.stdout and "paci, 2 stages: train_loss=" in out.stdout
    assert package_warnings(out.stderr) == []


def test_tensor_parallel_example_trains_the_llama_written_for_model_parallel_strategy(capsys, recwarn):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import tensor_parallel
    finally:
        sys.path.remove(str(EXAMPLES))
    loss = tensor_parallel.main(["--devices", "4", "--max-steps", "3", "--start-method", "fork"])
    assert 0 < loss < 10 and "final training loss:" in capsys.readouterr().out
    assert [str(w.message) for w in recwarn if "lightning_paci" in w.filename] == []
