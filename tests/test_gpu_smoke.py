"""tests/gpu_smoke.py runs from a checkout as it is: from any directory, with ``lightning_paci`` not installed (a
GPU machine has its own torch, lightning and transformers and no package index); without CUDA it says so and exits
at once, and ``--rehearse`` runs the checks a CPU can run and writes their figures as it goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().with_name("gpu_smoke.py")


def bare_python(cwd: Path) -> tuple[list[str], dict[str, str]]:
    """An interpreter that cannot import ``lightning_paci`` from site-packages: ``-S`` (the editable install's
    path hook is never read) with site-packages itself on ``PYTHONPATH`` (torch, lightning and transformers stay
    importable, as a machine's own are); the check that the package is not importable so runs with it."""
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    command = [sys.executable, "-S"]
    probe = subprocess.run(command + ["-c", "import lightning_paci"], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'lightning_paci'" in probe.stderr, probe.stderr
    return command, env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU: the script would run its checks")
def test_without_a_device_it_says_so_and_exits_at_once_from_any_directory(tmp_path):
    command, env = bare_python(tmp_path)
    began = time.monotonic()
    done = subprocess.run(command + [str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [json.dumps({"device": None, "note": "gpu_smoke: no CUDA device found; nothing "
                                                    "to check (run with --rehearse to exercise it on the CPU)"})]
    assert list(tmp_path.iterdir()) == []  # no figures file where nothing was measured
    assert time.monotonic() - began < 60  # a hang guard: nothing is started, a busy machine imports in seconds


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.timeout(360)
def test_rehearsal_without_the_package_installed_runs_the_cpu_checks_and_writes_their_figures(tmp_path):
    command, env = bare_python(tmp_path)
    # the longest first (a check starts only with half its allowance left); the budget bounds a busy machine's run
    checks = ["nccl_world_size_1", "gloo_four_processes", "syncs", "prediction_cost", "memory_per_microbatch",
              "split_wire"]
    done = subprocess.run(command + [str(SCRIPT), "--rehearse", "--budget", "300", "--only", *checks], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=330)
    written = tmp_path / "gpu_smoke.json"  # the default: under the working directory
    assert written.exists(), done.stderr[-3000:]
    figures = json.loads(written.read_text())
    assert done.returncode == 0, (done.stderr[-2000:], {name: figures.get(name) for name in checks})
    assert json.loads(done.stdout.splitlines()[-1]) == figures
    assert figures["status"] == "done" and figures["running"] is None
    assert Path(figures["lightning_paci_path"]) == SCRIPT.parents[1] / "lightning_paci"  # the checkout's copy
    assert {name: figures[name]["ok"] for name in checks} == {**dict.fromkeys(checks, True), "nccl_world_size_1": None}
    assert figures["nccl_world_size_1"]["skipped"] == "needs CUDA"
    # the compensated steady state ran (on a GPU it is audited under the sync-debug modes)
    assert figures["syncs"]["compensated_forwards"] > 0 and figures["syncs"]["sync_debug"].startswith("skipped")
    for stage in ("gpt2_small", "llama_layer_quarter_width"):
        cost = figures["prediction_cost"][stage]
        assert cost["forward_backward_ms"] > 0 and cost["ratio_prediction_to_forward_backward"] > 0
        assert cost["aten_ops_per_apply_revert"] > 0 and cost["weights_moved_fraction"] > 0.5
        assert cost["restore_max_ulps"] <= 1
    memory = figures["memory_per_microbatch"]
    # autocast entered per forward keeps one bf16 copy of the weights per micro-batch in flight (biases stay fp32)
    assert 0.95 * memory["bf16_weight_bytes"] <= memory["weight_copy_bytes_per_microbatch"] <= memory[
        "bf16_weight_bytes"]
    four = figures["gloo_four_processes"]
    assert four["bit_identical"] and four["losses_max_abs_diff"] == 0.0  # against the reference executor
    assert [four["drift"][f"stage_{s}"]["bound"] for s in range(4)] == [1, 1, 1, 0]
    assert all(four["drift"][f"stage_{s}"]["compensated_forwards"] > 0 for s in range(3))


def test_a_check_that_does_not_fit_in_what_is_left_of_the_budget_is_skipped_and_said_so(tmp_path, capsys):
    import gpu_smoke

    out = tmp_path / "figures" / "smoke.json"
    # in a rehearsal split_wire may take 45 s and prediction_cost 270: with 60 s the first runs, the second not
    assert gpu_smoke.main(["--rehearse", "--budget", "60", "--only", "split_wire", "prediction_cost",
                           "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["split_wire"]["ok"] is True and figures["split_wire"]["equal"]
    assert figures["prediction_cost"]["ok"] is None and "budget" in figures["prediction_cost"]["skipped"]
    assert figures["status"] == "done" and [p.name for p in out.parent.iterdir()] == ["smoke.json"]
    assert json.loads(capsys.readouterr().out) == figures


def test_worker_processes_are_killed_when_their_time_is_up(tmp_path):
    from gpu_processes import TimeUp, run_processes

    sleeper = [sys.executable, "-S", "-c", "import time; time.sleep(60)"]
    began = time.monotonic()
    with pytest.raises(TimeUp, match="2 of 2 worker processes still running"):
        run_processes([sleeper, sleeper], [dict(os.environ)] * 2, [tmp_path / "a.log", tmp_path / "b.log"],
                      deadline=time.monotonic() + 1.0)
    assert time.monotonic() - began < 50  # a hang guard, not a speed: unkilled, the sleepers would hold it 60 s


def test_one_failing_worker_stops_the_others_and_its_output_is_reported(tmp_path):
    from gpu_processes import run_processes

    failing = [sys.executable, "-S", "-c", "import sys; print('the failing rank'); sys.exit(3)"]
    sleeper = [sys.executable, "-S", "-c", "import time; time.sleep(60)"]
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)process 0 exited with 3:\nthe failing rank.*processes \[1\] killed"):
        run_processes([failing, sleeper], [dict(os.environ)] * 2, [tmp_path / "a.log", tmp_path / "b.log"],
                      deadline=time.monotonic() + 50)
    assert time.monotonic() - began < 45  # a hang guard, not a speed: unkilled, the sleeper would hold it 50-60 s
