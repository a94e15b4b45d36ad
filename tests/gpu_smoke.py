"""On one GPU, check what a CPU machine cannot: one script, at most 7 minutes, its figures in a JSON file.

    python tests/gpu_smoke.py [--out gpu_smoke.json] [--budget 375]   # on a machine with CUDA
    python tests/gpu_smoke.py --rehearse                               # the checks that can, on the CPU

It runs from a checkout as it is: the checkout (and tests/) go on ``sys.path`` first, so ``lightning_paci`` need not
be installed, and nothing is installed (the machine's own torch >= 2.11, lightning 2.6 and transformers 5.x). The
JSON file (``--out``, ``./gpu_smoke.json`` by default) is rewritten after every check through a temporary file and
``os.replace``: a run killed at its time limit leaves every figure measured so far, and ``"running"`` names the check
it stopped in. The same object is printed on stdout at the end.

Checks, each independent (one failing does not stop the others; the exit status is 1 if any failed). Each has a
time allowance (three times as long in a rehearsal); one is skipped when less than half of it is left of
``--budget`` (375 s: with start-up and the hard stop below, the run ends within 7 minutes), stopped when its
allowance or the budget runs out (its worker processes killed), and the whole run ends 10 s after the budget even
inside a hung call:

* ``reference_bf16``: the one-process reference executor on the device, a tied transformers GPT-2 (4 stages, paci),
  with bf16 autocast entered around each forward as the strategy's precision plugin does (one autocast around the
  whole run would cache each weight's first bf16 copy, so later updates would never reach the forwards), run twice
  with deterministic algorithms on (losses must be equal bit for bit, and must change from update to update; the
  operations torch names as nondeterministic are listed) and once off (the difference is printed); host vs device
  time per micro-batch (CUDA events around the whole run);
* ``syncs``: the reference run with ``compensation="predict"`` (the forwards run with the weights moved ahead are
  counted: > 0), every action under ``torch.cuda.set_sync_debug_mode("warn")``, its device synchronisations
  counted per action kind and per site (the package's line, or the model's, or torch's); then every action but the
  updates under ``"error"``: a synchronisation inside a forward, backward or message raises, naming its action and
  site (0 per micro-batch is the design; the updates' own reads, the pre-update check, are counted); and one
  compensated forward+backward of a GPT-2-small block through the public surface under ``"error"`` as a whole;
* ``split_wire``: the NCCL runs' message framing on the device ([Note: headers on a host side channel]): a payload
  framed on the GPU with a host header, parsed back, under ``"error"`` (no synchronisation), equal to what was sent;
* ``prediction_cost``: ``WeightPrediction.moved(k=1, rest=0.5)`` enter+exit against one forward+backward of the
  same stage (CUDA events; host time beside), on 2 GPT-2-small blocks (8 x 1024 tokens) and on one
  Llama-7B-shaped decoder layer (2 x 1024 tokens), AdamW with state and half a window of gradient; the aten
  operations per apply+revert (a ``TorchDispatchMode``), the weights moved and back within one unit in the last
  place (tests/gpu_stage_checks.py); on CUDA both paths, the multi-tensor passes and the fused pass (the default
  there, ``*_fused``: every bin compiled, [Note: the fused prediction pass]);
* ``nccl_world_size_1``: NCCL initialised on one rank bound to the GPU, a gloo host group of every rank created after
  binding (what the strategy does under NCCL), GPU memory per communicator (free-memory deltas), the number of
  point-to-point communicators a rank of an N-stage pipeline creates (4 for N >= 2); a send to itself and its
  receive in one ``batch_isend_irecv`` behind a spinning kernel (NCCL loops back only within one group call):
  pending until ``wait()``, which orders the current stream after it without holding the host, the send buffer
  freed before completion and whether the allocator handed its block out again before then, the data received
  intact;
* ``memory_per_microbatch``: a GPT-2-small stage (2 blocks, 8 x 1024 tokens) holding 1, 2 and 4 micro-batches'
  graphs: ``memory_allocated`` / ``max_memory_allocated`` deltas and the bytes autograd saved, autocast around each
  forward against one around all (the difference: one bf16 weight copy per micro-batch in flight);
* ``gloo_four_processes``: four processes sharing the GPU over gloo (messages staged through host memory), a tied
  transformers GPT-2 through ``PACIStrategy`` (``"paci"``, ``compensation="predict"``, ``precision="bf16-mixed"``,
  a ``DriftMonitor``), launched as four single-process nodes; weights and losses against the reference executor
  on the same device with the same compensation (``"auto"`` could switch itself off from a CUDA timing in the
  Trainer run and never in the reference), each stage's drift within its bound, compensated forwards on the stages
  that have drift;
* ``gloo_two_processes``: two processes, 2 stages under 1f1b against ``Trainer(devices=1)`` on the GPU (SGD, rel
  1e-5);
* ``fused_adamw_resume``: the same two processes with ``AdamW(fused=True)``: fit 2 epochs, and fit 1 + save + resume
  to 2, equal weights (the optimizer's ``step`` restored as float32 on the device, as ``load_state_dict`` places it).

What one GPU cannot show: two NCCL ranks (one GPU cannot host both ends of a communicator), so NCCL's point-to-point
and group-creation rules are checked on the CPU under ``LIGHTNING_PACI_EMULATE_NCCL=1`` (docs/launching.md) and by
the deadlock model. Without CUDA (and without ``--rehearse``) it prints that no device was found and exits 0 at
once, writing nothing. ``--rehearse`` runs every check on the CPU; those that need CUDA say so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
# the checkout's package and test helpers first: an installed copy, or none, is not what is checked
for _path in (str(HERE.parent), str(ROOT)):
    while _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS possible

import torch  # noqa: E402
from gpu_processes import (  # noqa: E402
    Results,
    TimeUp,
    count_moves,
    gpt2_batches,
    gpt2_model,
    kill_all,
    run_workers,
    time_limit,
    worker,
    worker_threads,
)
from gpu_stage_checks import (  # noqa: E402
    check_memory_per_microbatch,
    check_prediction_cost,
    gpt2_stage,
    sync_site,
)

BUDGET_S = 375.0  # the checks' seconds; start-up and the hard stop's grace keep the run within 7 minutes
GRACE_S = 10.0  # past the budget, the run stops even inside a hung call
CPU_ALLOWANCE = 3.0  # a rehearsal's checks may take this many times their GPU allowance (a shared 2-core machine)
NO_DEVICE = {"device": None, "note": "gpu_smoke: no CUDA device found; nothing to check (run with --rehearse to "
                                     "exercise it on the CPU)"}


def _device(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the reference executor on the device ----------------------------------------------------------------------
def _reference(device: torch.device, *, deterministic: bool, lr: float = 3e-3, compensation: str = "auto",
               autocast_on_cpu: bool = False, audit: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The reference executor on 4 stages under paci (m = a = 4, 6 mini-batches), bf16 autocast around each
    forward; ``audit`` (CUDA): every action under ``set_sync_debug_mode("warn")``, its synchronisations counted
    per action kind and site, or every action but the updates under ``"error"`` (the updates under ``"warn"``)."""
    from lightning_paci import ReferencePipeline, build_schedule, plan_partition

    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    model = gpt2_model(lr).to(device)
    reference = ReferencePipeline(model, plan_partition(model, num_stages=4, partition="parameters"),
                                  compensation=compensation)
    data = [tuple(t.to(device) for t in batch) for batch in gpt2_batches()[:6]]
    schedule = build_schedule("paci", 4, 4, 4, num_minibatches=6, tied=True)
    enabled = device.type == "cuda" or autocast_on_cpu
    moves = [0]
    tally = _SyncTally()
    for runtime in reference.runtimes:  # per forward, as the precision plugin's train_step_context is entered
        runtime.program.context = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
        count_moves(runtime.prediction, moves)
        if audit is not None and device.type == "cuda":
            tally.watch(runtime, audit)
    start = end = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    host = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference.run(schedule, data)
    host = time.perf_counter() - host
    if end is not None:
        end.record()
    _sync(device)
    losses = reference.runtimes[-1].records.losses
    total = schedule.total_microbatches
    out: dict[str, Any] = {"losses": [float(losses[k]) for k in sorted(losses)],
                           "host_ms_per_microbatch": 1e3 * host / total, "compensated_forwards": moves[0],
                           "nondeterministic_ops": sorted({str(w.message)[:120] for w in caught
                                                           if "deterministic" in str(w.message)})}
    if start is not None:
        out["device_ms_per_microbatch"] = start.elapsed_time(end) / total
    if tally.watched:
        out.update(tally.figures(total, updates=sum(r.version for r in reference.runtimes)))
    return reference, out


class _SyncTally:
    """Device synchronisations per action kind and per site (the Python line that made it: the package's own, or
    the model's, or torch's), from ``set_sync_debug_mode("warn")``; under ``"error"`` a synchronisation outside
    the updates raises, naming its action and site."""

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_site: collections.Counter[str] = collections.Counter()
        self.watched = False

    def watch(self, runtime: Any, mode: str) -> None:
        execute, self.watched = runtime.execute, True

        def audited(action: Any) -> None:
            kind = action.kind.name
            torch.cuda.set_sync_debug_mode("warn" if mode == "warn" or kind == "OPT" else "error")
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    execute(action)
            except RuntimeError as error:
                if "synchroniz" not in str(error):
                    raise
                raise AssertionError(f"a device synchronisation in {action}: {sync_site(error)}") from error
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for w in seen:
                if "synchroniz" in str(w.message):
                    self.by_kind[kind] += 1
                    self.by_site[_site(w.filename, w.lineno)] += 1
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

        runtime.execute = audited

    def figures(self, microbatches: int, updates: int) -> dict[str, Any]:
        outside = sum(n for kind, n in self.by_kind.items() if kind != "OPT")
        return {"syncs_per_microbatch": outside / microbatches, "syncs_in_updates": self.by_kind["OPT"],
                "syncs_per_update": self.by_kind["OPT"] / max(1, updates), "syncs_by_action": dict(self.by_kind),
                "sync_sites": dict(self.by_site.most_common(20))}


def _site(filename: str, lineno: int) -> str:
    """``lightning_paci/...py:N`` for the package's lines, else the file's last two path parts."""
    path = Path(filename)
    with contextlib.suppress(ValueError):
        return f"{path.resolve().relative_to(ROOT).as_posix()}:{lineno}"
    return f"{'/'.join(path.parts[-2:])}:{lineno}"


def check_reference_bf16(device: torch.device) -> dict[str, Any]:
    _, first = _reference(device, deterministic=True)
    _, second = _reference(device, deterministic=True)
    _, loose = _reference(device, deterministic=False)
    if first["losses"] != second["losses"]:
        raise AssertionError(f"deterministic runs differ: {first['losses'][:4]} vs {second['losses'][:4]}; torch "
                             f"named as nondeterministic: {first['nondeterministic_ops']}")
    if len(set(first["losses"])) < len(first["losses"]) // 2:  # updates reach the forwards (no stale bf16 copy)
        raise AssertionError(f"the losses barely change across updates: {first['losses']}")
    return {"losses_first_last": [first["losses"][0], first["losses"][-1]],
            "deterministic_equal": True, "nondeterministic_ops": first["nondeterministic_ops"],
            "max_abs_diff_nondeterministic": max(abs(x - y) for x, y in zip(first["losses"], loose["losses"])),
            "host_ms_per_microbatch": loose["host_ms_per_microbatch"],
            "device_ms_per_microbatch": loose.get("device_ms_per_microbatch")}


def check_syncs(device: torch.device) -> dict[str, Any]:
    _, warm = _reference(device, deterministic=False, compensation="predict")  # allocator, kernels, lazy state
    if not warm["compensated_forwards"]:
        raise AssertionError("no forward ran with the weights moved ahead: the audit would not cover the prediction")
    figures: dict[str, Any] = {"compensated_forwards": warm["compensated_forwards"],
                               "compensated_forward_backward": _compensated_forward_backward(device)}
    if device.type != "cuda":
        return {**figures, "sync_debug": "skipped: needs CUDA (the actions ran; the CPU has no device to wait for)"}
    _, counted = _reference(device, deterministic=False, compensation="predict", audit="warn")
    figures["counted"] = {k: v for k, v in counted.items() if k.startswith("sync") or k == "host_ms_per_microbatch"}
    try:  # the first synchronisation outside the updates raises, with its traceback
        _reference(device, deterministic=False, compensation="predict", audit="error")
    except AssertionError as error:
        raise AssertionError(f"{error}\ncounted under 'warn': {figures['counted']}") from error
    return {**figures, "error_mode": "no synchronisation outside the updates"}


def _compensated_forward_backward(device: torch.device) -> dict[str, Any]:
    """One GPT-2-small block with AdamW state and half a window of gradient: a forward inside
    ``WeightPrediction.moved(1, 0.5)`` and its backward after it, all under ``set_sync_debug_mode("error")``."""
    from lightning_paci.optim.stage_optimizer import StageOptimizer
    from lightning_paci.optim.weight_prediction import WeightPrediction

    stage, forward, width = gpt2_stage(device, blocks=1)
    params = list(stage.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    stage_optimizer = StageOptimizer(optimizer, params)
    prediction = WeightPrediction(optimizer, stage_optimizer.pairs)
    x = torch.randn(2, 128, width, device=device, requires_grad=True)

    def step(moved: bool) -> None:
        with prediction.moved(1 if moved else 0, 0.5), torch.autocast(device.type, dtype=torch.bfloat16):
            out = forward(x)
        out.float().square().mean().backward()

    step(False)
    stage_optimizer.step()
    step(False)  # half a window
    step(True)  # warm-up: the first prediction after an update reads the step counts (on the host)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        step(True)
    except RuntimeError as error:
        if "synchroniz" not in str(error):
            raise
        raise AssertionError(f"a device synchronisation in a compensated forward+backward: {sync_site(error)}"
                             ) from error
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return {"syncs": 0 if device.type == "cuda" else None, "tensors": len(params)}


def check_split_wire(device: torch.device) -> dict[str, Any]:
    from lightning_paci.engine.transport.split_wire import frame_split, read_split_header, unpack_split

    hidden = torch.randn(4, 33, 64, device=device, dtype=torch.bfloat16)
    message = {"hidden": hidden, "mask": torch.ones(4, 33, dtype=torch.bool, device=device), "step": 7,
               "host": torch.arange(3)}
    frame_split(message, device, what="warm-up")  # allocator and kernels
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        frame = frame_split(message, device, what="the smoke message")
        first = frame.header[0]
        rest = iter(frame.header[1:])
        header = read_split_header(first, lambda count: next(rest))
        received = unpack_split(header, frame.payload)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(received["hidden"], hidden) and received["step"] == 7
    assert received["host"].device.type == "cpu" and received["hidden"].device == hidden.device
    return {"equal": True, "header_buffer_bytes": sum(p.numel() for p in frame.header),
            "payload_bytes": 0 if frame.payload is None else frame.payload.numel()}


# -- checks through processes ---------------------------------------------------------------------------------
def check_gloo_four_processes(device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_workers("paci", Path(tmp), world=4, rehearse=device.type == "cpu")
        stages = [json.loads((Path(tmp) / f"stage{s}.json").read_text()) for s in range(4)]
        piped = torch.load(Path(tmp) / "paci.pt")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # a CPU kernel's sums depend on its threads: the workers' number
        torch.set_num_threads(worker_threads(4))
    try:
        reference, figures = _reference(device, deterministic=True, lr=1e-3, autocast_on_cpu=True,
                                        compensation="predict")  # as the Trainer run (gpu_processes.py)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    expected = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    worst = max(float((piped[k].float() - v.float()).abs().max()) for k, v in expected.items())
    losses = stages[-1]["losses"]
    loss_diff = max(abs(x - y) for x, y in zip(losses, figures["losses"], strict=True))
    # the same lists and kernels in both: bit for bit on the CPU; on the GPU four processes' kernel choices may
    # differ from one process's in the last bits, so a tolerance there (what it was is in the figures)
    exact = device.type == "cpu"
    for key, value in expected.items():
        torch.testing.assert_close(piped[key], value, rtol=0 if exact else 1e-3, atol=0 if exact else 1e-4,
                                   msg=lambda m: f"{key}: {m}")
    drift: dict[str, Any] = {}
    for record in stages:
        stage = record["stage"]
        maxima = [w[f"paci/drift_max/stage_{stage}"] for w in record["drift_windows"]
                  if f"paci/drift_max/stage_{stage}" in w]
        bounds = {w[f"paci/drift_bound/stage_{stage}"] for w in record["drift_windows"]
                  if f"paci/drift_bound/stage_{stage}" in w}
        if not maxima or max(maxima) > min(bounds):
            raise AssertionError(f"stage {stage}: drift {maxima} against its bound {bounds}")
        if max(bounds) > 0 and not record["compensated_forwards"]:
            raise AssertionError(f"stage {stage} has drift {maxima} and no compensated forward")
        drift[f"stage_{stage}"] = {"drift_max": max(maxima), "bound": min(bounds),
                                   "compensated_forwards": record["compensated_forwards"]}
    return {"equal_to_reference_max_abs_diff": worst, "bit_identical": worst == 0.0, "losses_max_abs_diff": loss_diff,
            "losses_first_last": [losses[0], losses[-1]], "drift": drift,
            "fit_seconds": max(r["fit_seconds"] for r in stages)}


def check_gloo_two_processes(device: torch.device) -> dict[str, Any]:
    import lightning as L

    from models import SequentialMLP, regression_loader

    with tempfile.TemporaryDirectory() as tmp:
        run_workers("compare", Path(tmp), world=2, rehearse=device.type == "cpu")
        pipeline = torch.load(Path(tmp) / "pipeline.pt")
    torch.manual_seed(0)
    expected = SequentialMLP(depth=6)
    L.Trainer(accelerator="cpu" if device.type == "cpu" else "gpu", devices=1, max_epochs=1, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        expected, regression_loader(num_batches=4))
    worst = 0.0
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(pipeline[key], value.cpu(), rtol=1e-5, atol=1e-6)
        worst = max(worst, float((pipeline[key] - value.cpu()).abs().max()))
    return {"equal_to_one_device": True, "max_abs_diff": worst}


def check_fused_adamw_resume(device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run_workers("resume", Path(tmp), world=2, rehearse=device.type == "cpu")
        states = torch.load(Path(tmp) / "resume.pt")
    for key, value in states["whole"].items():
        torch.testing.assert_close(states["resumed"][key], value, rtol=0, atol=0)
    return {"resume_exact": True}


def check_nccl_world_size_1(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "nccl.json"
        try:
            run_workers("nccl", Path(tmp), world=1, rehearse=False)
        except (TimeUp, RuntimeError) as error:  # what the worker measured before it stopped
            if written.exists():
                error.args = (f"{error.args[0] if error.args else ''}\nmeasured: {written.read_text()}",)
            raise
        figures = json.loads(written.read_text())
    figures["p2p_communicators_per_rank"] = 4  # PipelineProcesses.p2p_connected for N >= 2 (tests/test_communicators)
    loop = figures["self_loop"]
    if loop.get("possible") and not (loop["completed"] and loop["received_equal"]):
        raise AssertionError(f"a send to itself did not arrive intact: {loop}")
    return figures


# name -> (check, allowance in seconds), in the order they run: what matters most first
CHECKS: dict[str, tuple[Callable[[torch.device], dict[str, Any]], float]] = {
    "reference_bf16": (check_reference_bf16, 60.0),
    "syncs": (check_syncs, 45.0),
    "split_wire": (check_split_wire, 15.0),
    "prediction_cost": (check_prediction_cost, 90.0),
    "nccl_world_size_1": (check_nccl_world_size_1, 60.0),
    "memory_per_microbatch": (check_memory_per_microbatch, 45.0),
    "gloo_four_processes": (check_gloo_four_processes, 120.0),
    "gloo_two_processes": (check_gloo_two_processes, 60.0),
    "fused_adamw_resume": (check_fused_adamw_resume, 90.0),
}


# -- the run: budget, figures written as it goes ----------------------------------------------------------------
def _after_check(device: torch.device) -> None:
    torch.use_deterministic_algorithms(False)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _commit() -> str | None:
    """The checkout's commit, read from .git without git (None where it is not a git checkout)."""
    try:
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        loose = ROOT / ".git" / ref
        if loose.exists():
            return loose.read_text().strip()
        for line in (ROOT / ".git" / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def _header(device: torch.device, budget: float) -> dict[str, Any]:
    header: dict[str, Any] = {
        "device": "cpu (rehearsal)" if device.type == "cpu" else torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit(), "budget_s": budget}
    for name in ("lightning", "transformers", "lightning_paci"):
        try:
            module = __import__(name)
            header[name] = getattr(module, "__version__", "?")
        except Exception as error:  # every check that needs it fails and says why; the others still run
            header[name] = f"not importable: {type(error).__name__}: {error}"
        else:
            if name == "lightning_paci":
                header["lightning_paci_path"] = str(Path(module.__file__).resolve().parent)
    return header


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_smoke.json"),
                        help="the JSON file, rewritten after every check (default: ./gpu_smoke.json)")
    parser.add_argument("--rehearse", action="store_true", help="run the checks on the CPU (no CUDA needed)")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the checks (default {BUDGET_S:.0f}); the run stops {GRACE_S:.0f} s after")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.rehearse)
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        print(json.dumps(NO_DEVICE))
        return 0
    device = _device(args.rehearse)
    if args.rehearse and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny models: one thread loses nothing, and a busy machine's cores stall several
    started = time.monotonic()
    names = args.only or list(CHECKS)
    run = Results(args.out.resolve(), {**_header(device, args.budget), "status": "running", "checks": names})
    print(f"gpu_smoke: figures go to {run.path}", file=sys.stderr, flush=True)
    stopper = threading.Timer(max(0.0, args.budget) + GRACE_S, run.hard_stop,
                              args=(f"stopped {GRACE_S:.0f} s past the {args.budget:.0f} s budget",))
    stopper.daemon = True
    stopper.start()
    terminate = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    failed = 0
    try:
        for name in names:
            check, allowance = CHECKS[name]
            allowance *= CPU_ALLOWANCE if device.type == "cpu" else 1.0
            left = args.budget - (time.monotonic() - started)
            if left < allowance / 2:
                run.update(**{name: {"ok": None, "skipped": f"{max(0.0, left):.0f} s left of the {args.budget:.0f} s "
                                                            f"budget; it may take {allowance:.0f} s"}})
                continue
            run.update(running=name)
            began = time.perf_counter()
            try:
                with time_limit(min(allowance, left)):
                    figures = check(device)
                result = {"ok": None if "skipped" in figures else True, **figures}
            except TimeUp as error:
                result = {"ok": False, "error": str(error)}
            except Exception:  # every check reports; one failure does not hide the others
                result = {"ok": False, "error": traceback.format_exc()[-4000:]}
            finally:
                _after_check(device)
            result["seconds"] = round(time.perf_counter() - began, 1)
            failed += result["ok"] is False
            run.update(running=None, **{name: result})
            state = {True: "ok", False: "FAILED", None: "skipped"}[result["ok"]]
            print(f"gpu_smoke: {name} {state} in {result['seconds']} s", file=sys.stderr, flush=True)
        run.update(status="done", seconds=round(time.monotonic() - started, 1))
    finally:
        stopper.cancel()
        signal.signal(signal.SIGTERM, terminate)
        if run.results["status"] == "running":  # interrupted (SIGTERM, Ctrl-C): what was measured stays
            kill_all()
            run.update(status="interrupted")
    print(json.dumps(run.results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
