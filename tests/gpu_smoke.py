"""On one lent GPU, check what a CPU machine cannot: one script, at most 6 minutes, one JSON object on stdout.

    python tests/gpu_smoke.py [--out gpu_smoke.json]     # on a machine with CUDA
    python tests/gpu_smoke.py --rehearse                  # the same checks on the CPU, where they can run

Checks, each independent (one failing does not stop the others; the exit status is 1 if any failed), each given
what is left of the 6-minute budget (a check that would start past it is reported as skipped):

* ``reference_bf16``: the one-process reference executor on the device, a tied transformers GPT-2 (4 stages, paci),
  with bf16 autocast entered around each forward as the strategy's precision plugin does (one autocast around the
  whole run would cache each weight's first bf16 copy, so later updates would never reach the forwards), run twice
  with deterministic algorithms on (losses must be equal bit for bit, and must change from update to update) and
  once off (the difference is printed); host vs device time per micro-batch (CUDA events around the whole run);
* ``syncs``: ``torch.cuda.set_sync_debug_mode("error")`` over every action of the steady state but the updates: a
  device synchronisation inside a forward, backward or message raises, naming its site (0 per micro-batch is the
  design); the updates' own reads (the pre-update check) are counted under ``"warn"``;
* ``split_wire``: the NCCL runs' message framing on the device ([Note: headers on a host side channel]): a payload
  framed on the GPU with a host header, parsed back, under ``"error"`` (no synchronisation), equal to what was sent;
* ``gloo_two_processes``: two processes sharing the GPU over gloo (messages staged through host memory), 2 stages
  under 1f1b against ``Trainer(devices=1)`` on the GPU (SGD, rel 1e-5), launched as two single-process nodes;
* ``fused_adamw_resume``: the same two processes with ``AdamW(fused=True)``: fit 2 epochs, and fit 1 + save + resume
  to 2, equal weights (the optimizer's ``step`` restored as float32 on the device, as ``load_state_dict`` places it);
* ``nccl_world_size_1``: NCCL initialised on one rank bound to the GPU, a gloo host group of every rank created after
  binding (what the strategy does under NCCL), GPU memory per communicator (free-memory deltas), and the number of
  point-to-point communicators a rank of an N-stage pipeline creates (4 for N >= 2).

What one GPU cannot show: two NCCL ranks (one GPU cannot host both ends of a communicator), so NCCL's point-to-point
and group-creation rules are checked on the CPU under ``LIGHTNING_PACI_EMULATE_NCCL=1`` (docs/launching.md) and by
the deadlock model; workers are killed when their time is up. Without CUDA (and without ``--rehearse``) it prints
that no device was found and exits 0 at once.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS possible

import torch  # noqa: E402

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def _device(rehearse: bool) -> torch.device:
    return torch.device("cpu") if rehearse else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the reference executor on the device ----------------------------------------------------------------------
def _reference_run(device: torch.device, *, deterministic: bool, count_syncs: bool = False) -> dict[str, Any]:
    import lightning as L

    from lightning_paci import ReferencePipeline, build_schedule, plan_partition

    from models import HFCausalLM, token_loader

    torch.use_deterministic_algorithms(deterministic)
    L.seed_everything(0, verbose=False)
    stages, m, a, batches = 4, 4, 4, 6
    model = HFCausalLM("gpt2", layers=8, tied=True).to(device)
    plan = plan_partition(model, num_stages=stages, partition="parameters")
    reference = ReferencePipeline(model, plan)
    data = [tuple(t.to(device) for t in batch) for batch in token_loader(num_batches=batches, batch_size=16,
                                                                            vocab=64, seq=33)]
    schedule = build_schedule("paci", stages, m, a, num_minibatches=batches, tied=True)
    for runtime in reference.runtimes:  # per forward, as the precision plugin's train_step_context is entered
        runtime.program.context = lambda: torch.autocast(device.type, dtype=torch.bfloat16,
                                                         enabled=device.type == "cuda")
        if count_syncs:
            _strict_outside_updates(runtime, device)
    start = end = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    host = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            reference.run(schedule, data)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    host = time.perf_counter() - host
    if end is not None:
        end.record()
    _sync(device)
    losses = reference.runtimes[-1].records.losses
    values = [float(losses[k]) for k in sorted(losses)]
    total = schedule.total_microbatches
    out: dict[str, Any] = {"losses": values, "host_ms_per_microbatch": 1e3 * host / total}
    if start is not None:
        out["device_ms_per_microbatch"] = start.elapsed_time(end) / total
    if count_syncs:
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        updates = sum(r.version for r in reference.runtimes)
        out.update(syncs_per_microbatch=0, syncs_in_updates=len(syncs), syncs_per_update=len(syncs) / max(1, updates),
                   sync_sites=sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:20])
    return out


def _strict_outside_updates(runtime: Any, device: torch.device) -> None:
    """Every action of ``runtime`` but its updates under ``set_sync_debug_mode("error")`` (a synchronisation raises
    there, naming its site); the updates under ``"warn"`` (counted)."""
    if device.type != "cuda":
        return
    execute = runtime.execute

    def strict(action: Any) -> None:
        torch.cuda.set_sync_debug_mode("warn" if action.kind.name == "OPT" else "error")
        try:
            execute(action)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runtime.execute = strict


def check_reference_bf16(device: torch.device) -> dict[str, Any]:
    first = _reference_run(device, deterministic=True)
    second = _reference_run(device, deterministic=True)
    loose = _reference_run(device, deterministic=False)
    torch.use_deterministic_algorithms(False)
    if first["losses"] != second["losses"]:
        raise AssertionError(f"deterministic runs differ: {first['losses'][:4]} vs {second['losses'][:4]}")
    if len(set(first["losses"])) < len(first["losses"]) // 2:  # updates reach the forwards (no stale bf16 copy)
        raise AssertionError(f"the losses barely change across updates: {first['losses']}")
    return {"losses_first_last": [first["losses"][0], first["losses"][-1]],
            "deterministic_equal": True,
            "max_abs_diff_nondeterministic": max(abs(x - y) for x, y in zip(first["losses"], loose["losses"])),
            "host_ms_per_microbatch": loose["host_ms_per_microbatch"],
            "device_ms_per_microbatch": loose.get("device_ms_per_microbatch")}


def check_syncs(device: torch.device) -> dict[str, Any]:
    _reference_run(device, deterministic=False)  # warm-up: allocator, kernels, lazy state
    figures = _reference_run(device, deterministic=False, count_syncs=True)
    del figures["losses"]
    return figures


def check_split_wire(device: torch.device) -> dict[str, Any]:
    from lightning_paci.engine.split_wire import frame_split, read_split_header, unpack_split

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


# -- two processes sharing the device over gloo ----------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(kind: str, out: Path, rehearse: bool) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "NODE_RANK": str(rank), "LOCAL_RANK": "0", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, str(HERE), "--worker", kind, str(out)] + (["--rehearse"] if rehearse else [])
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=max(10.0, _left()))[0] for p in procs]
    finally:
        for p in procs:  # past the budget (or on any error): no worker outlives the check
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError("a worker failed:\n" + "\n".join(o[-3000:] for o in outputs))


def _trainer(rehearse: bool, max_epochs: int, **kwargs: Any) -> Any:
    import lightning as L

    from lightning_paci import PACIStrategy

    strategy = PACIStrategy(process_group_backend="gloo", schedule="1f1b", microbatches=4)
    return L.Trainer(strategy=strategy, accelerator="cpu" if rehearse else "gpu", devices=1, num_nodes=2,
                     max_epochs=max_epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, use_distributed_sampler=False, **kwargs)


def _fused_model() -> Any:
    from models import SequentialMLP

    class FusedAdamW(SequentialMLP):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    return FusedAdamW(depth=6)


def worker(kind: str, out: Path, rehearse: bool) -> None:
    """One of the two processes (one stage each)."""
    import lightning as L

    from models import SequentialMLP, regression_loader

    torch.manual_seed(0)
    if kind == "compare":
        model = SequentialMLP(depth=6)
        _trainer(rehearse, 1).fit(model, regression_loader(num_batches=4))
        if int(os.environ["NODE_RANK"]) == 0:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out / "pipeline.pt")
        return
    loader = regression_loader(num_batches=4)  # an epoch of 4 steps; resumed at the epoch's end
    whole = _fused_model()
    _trainer(rehearse, 2).fit(whole, loader)
    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    first, ckpt = _fused_model(), out / "half.ckpt"
    half = _trainer(rehearse, 1)
    half.fit(first, loader)
    half.save_checkpoint(ckpt)
    resumed = _fused_model()
    _trainer(rehearse, 2).fit(resumed, loader, ckpt_path=str(ckpt))
    if int(os.environ["NODE_RANK"]) == 0:
        torch.save({"whole": {k: v.cpu() for k, v in whole.state_dict().items()},
                    "resumed": {k: v.cpu() for k, v in resumed.state_dict().items()}}, out / "resume.pt")


def check_gloo_two_processes(device: torch.device) -> dict[str, Any]:
    import lightning as L

    from models import SequentialMLP, regression_loader

    with tempfile.TemporaryDirectory() as tmp:
        _two_processes("compare", Path(tmp), device.type == "cpu")
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
        _two_processes("resume", Path(tmp), device.type == "cpu")
        states = torch.load(Path(tmp) / "resume.pt")
    for key, value in states["whole"].items():
        torch.testing.assert_close(states["resumed"][key], value, rtol=0, atol=0)
    return {"resume_exact": True}


# -- NCCL at world size 1 -----------------------------------------------------------------------------------------
def check_nccl_world_size_1(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "needs CUDA"}
    code = (
        "import os, json, torch, torch.distributed as dist\n"
        "torch.cuda.set_device(0)\n"
        "free = lambda: torch.cuda.mem_get_info(0)[0]\n"
        "base = free()\n"
        "dist.init_process_group('nccl', rank=0, world_size=1, device_id=torch.device('cuda', 0))\n"
        "t = torch.ones(1, device='cuda'); dist.all_reduce(t); torch.cuda.synchronize()\n"
        "world = base - free()\n"
        "host = dist.new_group([0], backend='gloo')\n"
        "dist.broadcast(torch.ones(1), src=0, group=host)\n"
        "groups = [dist.new_group([0]) for _ in range(4)]\n"
        "before = free()\n"
        "for g in groups: dist.all_reduce(t, group=g)\n"
        "torch.cuda.synchronize()\n"
        "print(json.dumps({'world_bytes': world, 'per_extra_communicator_bytes': (before - free()) / 4,"
        " 'nccl': '.'.join(map(str, torch.cuda.nccl.version()))}))\n"
        "dist.destroy_process_group()\n"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=max(10.0, min(120.0, _left())))
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["p2p_communicators_per_rank"] = 4  # PipelineProcesses.p2p_connected for N >= 2 (tests/test_communicators)
    return figures


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "reference_bf16": check_reference_bf16,
    "syncs": check_syncs,
    "split_wire": check_split_wire,
    "gloo_two_processes": check_gloo_two_processes,
    "fused_adamw_resume": check_fused_adamw_resume,
    "nccl_world_size_1": check_nccl_world_size_1,
}


BUDGET = 360.0  # seconds for the whole script
_START = time.monotonic()


def _left() -> float:
    return BUDGET - (time.monotonic() - _START)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the results as one JSON file")
    parser.add_argument("--rehearse", action="store_true", help="run the checks on the CPU (no CUDA needed)")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.rehearse)
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        print(json.dumps({"device": None, "note": "gpu_smoke: no CUDA device found; nothing to check (run with "
                                                  "--rehearse to exercise it on the CPU)"}))
        return 0
    device = _device(args.rehearse)
    results: dict[str, Any] = {
        "device": "cpu (rehearsal)" if args.rehearse else torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    failed = 0
    for name in args.only or list(CHECKS):
        if _left() < 20:
            results[name] = {"ok": None, "skipped": f"the {BUDGET:.0f} s budget is spent"}
            continue
        began = time.perf_counter()
        try:
            result = {"ok": True, **CHECKS[name](device)}
        except Exception:  # every check reports; one failure does not hide the others
            result = {"ok": False, "error": traceback.format_exc()[-4000:]}
            failed += 1
        result["seconds"] = round(time.perf_counter() - began, 1)
        results[name] = result
        print(f"gpu_smoke: {name} {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", file=sys.stderr,
              flush=True)
    print(json.dumps(results), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
