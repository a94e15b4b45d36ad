"""The processes and time limits of tests/gpu_smoke.py, and what its worker processes run.

Every worker is this checkout's ``tests/gpu_smoke.py --worker KIND OUT`` (so it puts the checkout on ``sys.path``
itself, as the script does), a single-process node of a gloo world on this machine, in a process group of its own:
at its check's deadline, or as soon as one of its peers fails, the whole group is killed. ``time_limit`` stops a check
running in the script's own process; ``Results`` writes the figures after every change (a temporary file, then
``os.replace``) and, past the run's time limit, saves them and ends the process even inside a hung call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = ["Results", "TimeUp", "count_moves", "gpt2_batches", "gpt2_model", "kill_all", "run_processes",
           "run_workers", "save", "time_limit", "worker", "worker_threads"]

SCRIPT = Path(__file__).resolve().with_name("gpu_smoke.py")


class TimeUp(BaseException):
    """A check ran past its time limit (a ``BaseException``: no ``except Exception`` on the way swallows it)."""


_live: set[subprocess.Popen[bytes]] = set()  # worker processes running now
_deadline = float("inf")  # the running check's, on ``time.monotonic()``


def kill_all() -> None:
    """Kill every worker process still running (a hard stop, an interrupted run)."""
    for proc in list(_live):
        _kill(proc)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """``TimeUp`` in the main thread after ``seconds`` (between Python instructions: a call into C finishes first;
    the check's worker processes are killed at the same deadline)."""
    global _deadline
    _deadline = time.monotonic() + seconds

    def alarm(signum: int, frame: Any) -> None:
        raise TimeUp(f"stopped at its time limit ({seconds:.0f} s)")

    began = time.monotonic()
    previous = signal.signal(signal.SIGALRM, alarm)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:  # a timer of the caller's (e.g. pytest-timeout's) goes on with what it had left
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - began)), interval)
        _deadline = float("inf")


def save(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` to ``path`` atomically: a temporary file beside it, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class Results:
    """The run's figures, saved to ``path`` after every change; ``hard_stop`` (past the run's time limit) kills the
    workers, marks the check that was running, saves and ends the process."""

    def __init__(self, path: Path, results: dict[str, Any]) -> None:
        self.path, self.results = path, results
        self.lock = threading.Lock()

    def update(self, **items: Any) -> None:
        with self.lock:
            self.results.update(items)
            save(self.path, self.results)

    def hard_stop(self, note: str) -> None:
        kill_all()
        if self.lock.acquire(timeout=5):
            running = self.results.get("running")
            if running:
                self.results[running] = {"ok": False, "error": "still running when the run passed its time limit"}
            self.results["status"] = note
            save(self.path, self.results)
        print(f"gpu_smoke: stopped past the time limit; figures in {self.path}", file=sys.stderr, flush=True)
        os._exit(2)


# -- worker processes -----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc`` (while it runs its id is its own) and whatever it started in its process group; reap it."""
    if proc.poll() is None:
        if hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    proc.wait()
    _live.discard(proc)


def run_processes(commands: list[list[str]], envs: list[dict[str, str]], logs: list[Path], *,
                  deadline: float) -> None:
    """Run the processes together (output to ``logs``) until every one has ended; kill them all as soon as one
    fails (the others would wait for it) or at ``deadline`` (``time.monotonic()``: ``TimeUp``). A failure raises a
    ``RuntimeError`` with the end of the failed processes' output."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with open(log, "wb") as sink:
                proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            procs.append(proc)
            _live.add(proc)
        while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
            if time.monotonic() > deadline:
                raise TimeUp(f"{sum(p.poll() is None for p in procs)} of {len(procs)} worker processes still "
                             f"running at the time limit: killed")
            time.sleep(0.1)
    finally:
        codes = [p.poll() for p in procs]
        for p in procs:
            _kill(p)
    failed = [i for i, code in enumerate(codes) if code]
    if failed:
        tails = [f"-- process {i} exited with {codes[i]}:\n{logs[i].read_text(errors='replace')[-3000:]}"
                 for i in failed]
        stopped = [i for i, code in enumerate(codes) if code is None]
        raise RuntimeError("\n".join(tails) + (f"\n-- processes {stopped} killed (a peer failed)" if stopped else ""))


def _python() -> list[str]:
    """This interpreter with the flags that change what it imports (a run under ``-S`` keeps its workers so)."""
    return [sys.executable] + (["-S"] if sys.flags.no_site else []) + (["-I"] if sys.flags.isolated else [])


def worker_threads(world: int) -> int:
    """The intra-op threads of each of ``world`` workers: ``OMP_NUM_THREADS`` if set, else the cores shared."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // world))


def run_workers(kind: str, out: Path, *, world: int, rehearse: bool) -> None:
    """``world`` processes of this script (``--worker kind``), single-process nodes of one gloo world; started again
    on another port when the rendezvous port was taken between choosing it and binding it (twice at most)."""
    threads = str(worker_threads(world))
    command = _python() + [str(SCRIPT), "--worker", kind, str(out)] + (["--rehearse"] if rehearse else [])
    for attempt in range(3):
        port = str(_free_port())
        envs = [{**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
                 "NODE_RANK": str(rank), "LOCAL_RANK": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads}
                for rank in range(world)]
        try:
            run_processes([command] * world, envs, [out / f"{kind}{rank}.log" for rank in range(world)],
                          deadline=_deadline - 2.0)
            return
        except RuntimeError as error:
            if "EADDRINUSE" not in str(error) or attempt == 2:
                raise


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


def _two_process_worker(kind: str, out: Path, rehearse: bool) -> None:
    """One of the two processes (one stage each) of ``gloo_two_processes`` / ``fused_adamw_resume``."""
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


class _NullWriter:
    """A TensorBoard writer's surface where ``tensorboard`` is not installed (the figures are kept anyway)."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _paci_worker(out: Path, rehearse: bool) -> None:
    """One of the four processes of ``gloo_four_processes``: writes its stage's figures to ``stage<s>.json``, and
    global rank 0 (the last stage) the model's weights after fit to ``paci.pt``."""
    import lightning as L

    from lightning_paci import DriftMonitor, PACIStrategy

    from models import token_loader

    windows: list[dict[str, float]] = []
    moves = [0]
    record: dict[str, Any] = {}

    class KeptDrift(DriftMonitor):  # keeps every window's figures for the JSON, counts the compensated forwards
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            super().on_train_start(trainer, pl_module)
            for runtime in trainer.strategy.runtimes.values():
                count_moves(runtime.prediction, moves)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            super().on_train_end(trainer, pl_module)
            strategy = trainer.strategy
            record["stage"] = strategy.stage_index
            if strategy.stage_index == strategy.num_stages - 1:  # the runtimes are gone after fit
                losses = strategy.runtime.records.losses
                record["losses"] = [float(losses[k]) for k in sorted(losses)]

        def _write(self, trainer: L.Trainer, figures: dict[str, float]) -> None:
            windows.append({tag: float(value) for tag, value in figures.items()})
            super()._write(trainer, figures)

    if importlib.util.find_spec("tensorboard") is None:
        import lightning_paci.callbacks.drift_monitor as drift_monitor

        drift_monitor.stage_writer = lambda *args, **kwargs: _NullWriter()  # type: ignore[assignment]
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = gpt2_model(1e-3)
    # compensation="predict" on both sides: "auto" may switch itself off from a timing on CUDA (the Trainer's
    # setup gives it its timer), which the reference executor it is compared with never does
    strategy = PACIStrategy(process_group_backend="gloo", schedule="paci", microbatches=4, partition="parameters",
                            compensation="predict", timeout=timedelta(seconds=120))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu" if rehearse else "gpu", devices=1, num_nodes=4,
                        precision="bf16-mixed", max_steps=6, callbacks=[KeptDrift(logging_interval=1)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=str(out))
    began = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitors' note that logger=False leaves them TensorBoard files only
        trainer.fit(model, token_loader(num_batches=7, batch_size=16, vocab=64, seq=33))
    record.update(fit_seconds=round(time.perf_counter() - began, 2), compensated_forwards=moves[0],
                  drift_windows=windows)
    (out / f"stage{record['stage']}.json").write_text(json.dumps(record))
    if trainer.is_global_zero:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / "paci.pt")


def _nccl_worker(out: Path) -> None:
    """NCCL on one rank bound to the GPU: communicator memory, a host group after binding, a send to itself."""
    import torch.distributed as dist

    torch.cuda.set_device(0)

    def free() -> int:
        return torch.cuda.mem_get_info(0)[0]

    base = free()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    version = torch.cuda.nccl.version()
    figures: dict[str, Any] = {"world_bytes": base - free(),
                               "nccl": version if isinstance(version, int) else ".".join(map(str, version))}
    host = dist.new_group([0], backend="gloo")  # after binding: on a bound world every new_group splits the world
    dist.broadcast(torch.ones(1), src=0, group=host)
    groups = [dist.new_group([0]) for _ in range(4)]
    before = free()
    for group in groups:
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    figures["per_extra_communicator_bytes"] = (before - free()) / 4
    (out / "nccl.json").write_text(json.dumps(figures))  # kept if the loop below never completes
    figures["self_loop"] = loop = _self_loop()
    (out / "nccl.json").write_text(json.dumps(figures))
    if loop.get("completed") is False:  # a communicator with work that never ends cannot be destroyed
        os._exit(0)
    dist.destroy_process_group()


def _self_loop() -> dict[str, Any]:
    """A send to this rank and its receive in one group call (``batch_isend_irecv``) behind a spinning kernel:
    whether the works are pending until ``wait()``, how long ``wait()`` holds the host, whether the allocator hands
    the freed send buffer's block out again before the loop completes (the process group keeps it alive until
    then) and after, and whether the received data is intact, read on the current stream after ``wait()``."""
    import torch.distributed as dist

    count, device = 1 << 22, torch.device("cuda", 0)
    figures: dict[str, Any] = {
        "ungrouped": "not tried: an ncclSend blocks the GPU until its ncclRecv runs, and a receive from itself "
                     "queued behind it never would; NCCL pairs them only within one group call",
        "avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS")}
    sent = torch.arange(count, device=device, dtype=torch.float32)
    expected = sent.clone()
    received = torch.full_like(sent, -1.0)
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of a spinning kernel ahead of the loop on the current stream
    try:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 0), dist.P2POp(dist.irecv, received, 0)])
    except Exception as error:  # a version that refuses it: say so
        torch.cuda.synchronize()
        return {**figures, "possible": False, "refused": f"{type(error).__name__}: {error}"[:500]}
    address = sent.data_ptr()
    del sent
    scratch = torch.empty(count, device=device, dtype=torch.float32)
    figures["send_buffer_reused_before_completion"] = scratch.data_ptr() == address
    scratch.fill_(7.0)
    figures["pending_before_wait"] = not all(work.is_completed() for work in works)
    began = time.perf_counter()
    for work in works:
        work.wait()  # the current stream waits for the loop; the host does not
    figures["wait_host_ms"] = round(1e3 * (time.perf_counter() - began), 3)
    limit = time.monotonic() + 10.0
    while not all(work.is_completed() for work in works) and time.monotonic() < limit:
        time.sleep(0.005)
    figures["completed"] = all(work.is_completed() for work in works)
    if not figures["completed"]:
        return {**figures, "possible": True, "note": "the loop did not complete within 10 s"}
    figures["received_equal"] = bool(torch.equal(received, expected))
    del works
    again = torch.empty(count, device=device, dtype=torch.float32)
    figures["send_buffer_reused_after_completion"] = again.data_ptr() == address
    torch.cuda.synchronize()
    return {**figures, "possible": True}


def worker(kind: str, out: Path, rehearse: bool) -> None:
    if kind == "paci":
        _paci_worker(out, rehearse)
    elif kind == "nccl":
        _nccl_worker(out)
    else:
        _two_process_worker(kind, out, rehearse)


# -- what the reference and the Trainer checks share ----------------------------------------------------------
def gpt2_model(lr: float) -> Any:
    """The tied transformers GPT-2 of the reference and Trainer checks, the same weights wherever it is built."""
    import lightning as L

    from models import HFCausalLM

    L.seed_everything(0, verbose=False)
    return HFCausalLM("gpt2", layers=8, tied=True, lr=lr)


def gpt2_batches() -> list[Any]:
    """Six mini-batches of 16 x 33 tokens (the first six of a seven-batch loader, which the Trainer runs on)."""
    from models import token_loader

    return list(token_loader(num_batches=7, batch_size=16, vocab=64, seq=33))


def count_moves(prediction: Any, moves: list[int]) -> None:
    """Count the forwards a stage's weight prediction runs ahead (``moved`` with ``k > 0``)."""
    if prediction is None:
        return
    moved = prediction.moved

    def counting(k: int, rest: float = 1.0) -> Any:
        moves[0] += k > 0
        return moved(k, rest)

    prediction.moved = counting
