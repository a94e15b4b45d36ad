"""Stage-level figures for tests/gpu_smoke.py: what the weight prediction costs against a forward+backward, and
what a stage holds per micro-batch in flight.

Each stage is built from a transformers config (never downloaded) and run as a middle stage: hidden states in,
hidden states out, the output's gradient back. Weights are float32 with bf16 autocast entered around each forward,
as ``precision="bf16-mixed"`` runs them (the weight prediction needs float32 weights). On the CPU (``--rehearse``)
the same code runs on smaller shapes, named in the figures; allocator figures need CUDA.

Only the public surface of the weight prediction is used: ``StageOptimizer(optimizer, params).pairs``,
``WeightPrediction(optimizer, pairs)`` and its ``moved(k, rest)`` context.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["check_memory_per_microbatch", "check_prediction_cost", "gpt2_stage", "sync_site"]

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_paci"

Forward = Callable[[torch.Tensor], torch.Tensor]


# -- the stages -----------------------------------------------------------------------------------------------
def _hidden(out: Any) -> torch.Tensor:
    """A block's hidden states (transformers 5.x blocks return a tensor, earlier ones a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def gpt2_stage(device: torch.device, *, blocks: int) -> tuple[nn.Module, Forward, int]:
    """``blocks`` GPT-2-small blocks (n_embd 768, 12 heads) of a ``GPT2LMHeadModel``; returns (stage, forward,
    width)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=1024, n_embd=768, n_head=12, n_layer=blocks, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        stage = GPT2LMHeadModel(config).transformer.h
    stage.to(device)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in stage:
            x = _hidden(block(x))
        return x

    return stage, forward, 768


def llama_stage(device: torch.device, *, hidden: int, intermediate: int, heads: int,
                seq: int) -> tuple[nn.Module, Forward, int]:
    """One Llama decoder layer (7B: hidden 4096, intermediate 11008, 32 heads) of a ``LlamaForCausalLM`` with one
    layer, with its rotary embedding; returns (stage, forward, width)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=1,
                         max_position_embeddings=max(2048, seq))
    with torch.device(device):
        model = LlamaForCausalLM(config)
    layer, rotary = model.model.layers[0].to(device), model.model.rotary_emb.to(device)
    del model
    positions = torch.arange(seq, device=device)[None]

    def forward(x: torch.Tensor) -> torch.Tensor:
        where = positions.expand(x.shape[0], -1)
        return _hidden(layer(x, position_embeddings=rotary(x, where), position_ids=where))

    return nn.ModuleList([layer]), forward, hidden


def sync_site(error: BaseException) -> str:
    """Where a synchronisation raised under ``set_sync_debug_mode("error")`` was made: the innermost frame, the
    package's innermost frame when that is another, and the message's first line."""
    frames = traceback.extract_tb(error.__traceback__)
    message = (str(error).splitlines() or [type(error).__name__])[0]
    if not frames:
        return message
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(PACKAGE)]
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})"
    if ours and ours[-1] is not frames[-1]:
        where += f", from {ours[-1].filename}:{ours[-1].lineno} ({ours[-1].line})"
    return f"{where}: {message}"


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, float]:
    """(host ms, device ms) per call after two warm-up calls: the host's time to enqueue the calls, and the device's
    from CUDA events around them (on the CPU both are the wall time)."""
    fn()
    fn()
    _sync(device)
    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = 1e3 * (time.perf_counter() - began) / repeats
        return wall, wall
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = 1e3 * (time.perf_counter() - began) / repeats
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / repeats


# -- the weight prediction's cost -----------------------------------------------------------------------------
class AtenOps(TorchDispatchMode):
    """Counts the aten operations below autograd (on a GPU each one that is not a view launches a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0
        self.on_cpu = 0  # operations whose tensors are all on the CPU (no kernel launch on a GPU)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "is_view", False):
            self.views += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            self.on_cpu += all(t.device.type == "cpu" for t in tensors)
        return func(*args, **(kwargs or {}))


def _ulps(error: torch.Tensor, magnitude: torch.Tensor) -> float:
    """The largest ``error`` in units in the last place of ``magnitude`` (elementwise)."""
    spacing = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    return float((error / spacing).max())


def _prediction_figures(stage: nn.Module, forward: Forward, shape: tuple[int, ...], device: torch.device,
                        repeats: int, *, fused: bool = False) -> dict[str, Any]:
    from lightning_paci.optim.stage_optimizer import StageOptimizer
    from lightning_paci.optim.weight_prediction import WeightPrediction

    params = list(stage.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    stage_optimizer = StageOptimizer(optimizer, params)
    prediction = WeightPrediction(optimizer, stage_optimizer.pairs, fused=fused)
    x = torch.randn(shape, device=device, requires_grad=True)  # a middle stage: the input's gradient is sent back
    grad = torch.randn(shape, device=device)

    def forward_backward() -> None:
        with _autocast(device):
            out = forward(x)
        out.backward(grad.to(out.dtype))

    forward_backward()
    if not stage_optimizer.step().done:  # AdamW's state exists from here
        raise AssertionError("the first update found a non-finite gradient")
    forward_backward()  # half a window of gradient (`rest=0.5`)

    def predict() -> None:
        with prediction.moved(1, 0.5):
            pass

    predict()  # the first prediction after an update reads the step counts once ([Note: step counts on the host])
    counter = AtenOps()
    if not fused:  # (the compiled pass's kernels are counted on the CPU: tests/test_fused_prediction.py)
        with counter:
            predict()
    before = [p.detach().clone() for p in params]
    with prediction.moved(1, 0.5):
        inside = [p.detach().clone() for p in params]
    moved = sum(int((a != b).sum()) for a, b in zip(inside, before))
    if not moved:
        raise AssertionError("moved(k=1, rest=0.5) left every weight where it was")
    restore_ulps = max(_ulps((p.detach() - b).abs(), torch.maximum(b.abs(), i.abs()))
                       for p, b, i in zip(params, before, inside))
    if restore_ulps > 1:  # [Note: weight prediction]: back within one unit in the last place
        raise AssertionError(f"the way back left a weight {restore_ulps:.2f} units in the last place away")
    del before, inside
    peak_extra = None
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        predict()
        _sync(device)
        peak_extra = torch.cuda.max_memory_allocated(device) - base
    predict_host, predict_device = _timed(predict, device, repeats)
    fb_host, fb_device = _timed(forward_backward, device, repeats)
    ops = sum(counter.ops.values())
    if fused:  # every bin on the compiled pass (a failed compile falls back, said once)
        bins = prediction.apply(1, 0.5)
        prediction.revert(bins)
        if any(one.fused is None for one in bins):
            raise AssertionError("the fused prediction fell back to the multi-tensor passes")
    return {
        "path": "fused" if fused else "multi-tensor",
        "tensors": len(params), "parameters": sum(p.numel() for p in params),
        "weight_dtype": str(params[0].dtype).replace("torch.", ""), "tokens": f"{shape[0]} x {shape[1]}",
        "forward_backward_ms": round(fb_device, 3), "forward_backward_host_ms": round(fb_host, 3),
        "prediction_ms": round(predict_device, 3), "prediction_host_ms": round(predict_host, 3),
        "ratio_prediction_to_forward_backward": round(predict_device / fb_device, 4),
        "ratio_prediction_host_to_forward_backward": round(predict_host / fb_device, 4),
        "aten_ops_per_apply_revert": ops, "aten_ops_on_cpu_tensors": counter.on_cpu,
        "aten_views_per_apply_revert": counter.views,
        "aten_ops_per_tensor": round(ops / len(params), 2),
        "top_ops": dict(counter.ops.most_common(6)),
        "weights_moved_fraction": round(moved / sum(p.numel() for p in params), 4),
        "restore_max_ulps": restore_ulps,
        "prediction_peak_extra_bytes": peak_extra,
    }


def check_prediction_cost(device: torch.device) -> dict[str, Any]:
    """``WeightPrediction.moved(k=1, rest=0.5)`` enter+exit against one forward+backward of the same stage, with
    AdamW state and half a window of gradient: a GPT-2-small stage (2 blocks, 8 x 1024 tokens) and a stage of one
    Llama-7B-shaped decoder layer (2 x 1024 tokens); smaller shapes on the CPU."""
    rehearse = device.type != "cuda"
    out: dict[str, Any] = {}
    blocks, batch, seq = (1, 2, 64) if rehearse else (2, 8, 1024)
    stage, forward, width = gpt2_stage(device, blocks=blocks)
    out["gpt2_small"] = {"blocks": blocks, **_prediction_figures(stage, forward, (batch, seq, width), device,
                                                                 3 if rehearse else 20)}
    if not rehearse:  # the default on CUDA ([Note: the fused prediction pass]); the CPU keeps the multi-tensor passes
        out["gpt2_small_fused"] = {"blocks": blocks, **_prediction_figures(stage, forward, (batch, seq, width), device,
                                                                           20, fused=True)}
    del stage, forward
    _free(device)
    shape = dict(hidden=1024, intermediate=2752, heads=8) if rehearse else dict(hidden=4096, intermediate=11008,
                                                                                  heads=32)
    batch, seq = (1, 32) if rehearse else (2, 1024)
    stage, forward, width = llama_stage(device, seq=seq, **shape)
    out["llama_7b_layer" if not rehearse else "llama_layer_quarter_width"] = {
        **shape, **_prediction_figures(stage, forward, (batch, seq, width), device, 3 if rehearse else 10)}
    if not rehearse:
        out["llama_7b_layer_fused"] = {**shape, **_prediction_figures(stage, forward, (batch, seq, width), device, 10,
                                                                      fused=True)}
    del stage, forward
    _free(device)
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- memory per micro-batch in flight ---------------------------------------------------------------------------
class _SavedBytes:
    """The bytes of the distinct storages autograd saves for backward, the stage's own weights left out."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.own = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.own:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            yield

    def total(self) -> int:
        return sum(self.storages.values())


def _holding(stage: nn.Module, forward: Forward, inputs: list[torch.Tensor], device: torch.device, *,
             per_forward: bool) -> dict[str, int | None]:
    """Forward ``inputs`` one after another and keep every graph, as a stage with that many micro-batches in
    flight does; bf16 autocast entered around each forward (the precision plugin's way) or once around all."""
    saved = _SavedBytes(list(stage.parameters()))
    _sync(device)
    base = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    outputs = []
    around_all = contextlib.nullcontext() if per_forward else _autocast(device)
    with saved.watching(), around_all:
        for x in inputs:
            with _autocast(device) if per_forward else contextlib.nullcontext():
                outputs.append(forward(x))
    _sync(device)
    row: dict[str, int | None] = {"saved_bytes": saved.total(), "held_bytes": None, "peak_bytes": None}
    if base is not None:
        row["held_bytes"] = torch.cuda.memory_allocated(device) - base
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    del outputs
    return row


def check_memory_per_microbatch(device: torch.device) -> dict[str, Any]:
    """What a GPT-2-small stage (2 blocks, 8 x 1024 tokens per micro-batch) holds with 1, 2 and 4 micro-batches'
    graphs alive: allocator deltas (``memory_allocated`` held, ``max_memory_allocated`` peak; CUDA only) and the
    bytes autograd saved. Autocast around each forward against one around all: the difference per micro-batch is
    the bf16 weight copy each forward's autocast makes and its graph keeps."""
    rehearse = device.type != "cuda"
    blocks, batch, seq = (1, 2, 128) if rehearse else (2, 8, 1024)
    stage, forward, width = gpt2_stage(device, blocks=blocks)
    inputs = [torch.randn(batch, seq, width, device=device, requires_grad=True) for _ in range(4)]
    out: dict[str, Any] = {"blocks": blocks, "tokens": f"{batch} x {seq}",
                           "bf16_weight_bytes": sum(p.numel() for p in stage.parameters()) * 2}
    if rehearse:
        out["allocator"] = "skipped: needs CUDA"
    slopes = {}
    for mode in ("autocast_per_forward", "one_autocast"):
        rows = {n: _holding(stage, forward, inputs[:n], device, per_forward=mode == "autocast_per_forward")
                for n in (1, 2, 4)}
        if not rows[1]["saved_bytes"] < rows[2]["saved_bytes"] < rows[4]["saved_bytes"]:
            raise AssertionError(f"{mode}: the saved bytes do not grow with the micro-batches in flight: {rows}")
        figures: dict[str, Any] = {f"in_flight_{n}": row for n, row in rows.items()}
        for key in ("saved_bytes", "held_bytes"):
            if rows[1][key] is not None:
                figures[f"{key}_per_microbatch"] = (rows[4][key] - rows[1][key]) // 3  # type: ignore[operator]
        slopes[mode] = figures
        out[mode] = figures
    out["weight_copy_bytes_per_microbatch"] = (slopes["autocast_per_forward"]["saved_bytes_per_microbatch"]
                                               - slopes["one_autocast"]["saved_bytes_per_microbatch"])
    del stage, forward, inputs
    _free(device)
    return out
