"""Does ``compensation="auto"`` ever end worse than ``"none"``? Six kinds of transformers model, each on its task.

Each model is built from a tiny transformers config (width 32, 4 layers, no dropout; nothing downloaded) and trained
on a fixed synthetic task it can learn in a few dozen updates: a causal LM (Llama) on arithmetic progressions, a
sequence classifier read at the last token (GPT-2) on a count of small tokens and the last token, a token
classifier (BERT) on whether each token rises over the one before it, extractive question answering (BERT) on the
span between two marker tokens, an image classifier (ViT) on which quadrant holds a bright square, and an audio
classifier (Wav2Vec2) on the frequency of a noisy sine. AdamW at a constant learning rate, global batch 32,
``m = a = N`` micro-batches, for every model, learning rate, stage count and seed: one device (the micro-batches'
gradients accumulated, one step per batch), and PACI with ``compensation="none"``, ``"predict"`` and ``"auto"``
in the one-process reference executor (the processes compute the same bits, tested; no timing involved).

Reported per row (model, stages, learning rate): the final loss -- the mean training loss of the last ``--last``
updates' micro-batches -- as the mean over the seeds and their sample standard deviation, what ``"auto"`` decided per
stage (its measured quality, [Note: the prediction's quality]) and whether the row passes: ``mean(auto) - mean(none)
<= max(sd(auto), sd(none))``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from benchmarks.harness import Benchmark, print_table
from lightning_paci import ReferencePipeline, build_schedule, plan_partition
from lightning_paci.integration.stage.logs import recording_logs
from lightning_paci.partition.plan import call_order

__all__ = ["KINDS", "TaskModel", "compensation", "one_device", "pipelined"]

VOCAB, LENGTH, WIDTH = 32, 12, 32
Batches = Callable[[], dict[str, torch.Tensor]]


class TaskModel(L.LightningModule):
    """A transformers model as its model card trains it (``self.model(**batch).loss``), AdamW at a constant lr."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _bert(layers: int) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": layers, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}


def _labelled(config: Any, labels: int) -> Any:
    """``config`` with ``labels`` output classes (``num_labels`` is a property of every transformers config)."""
    config.num_labels = labels
    return config


def causal_lm(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """Llama on ``(start + step * t) mod V``: the step is read off the first tokens, then every next token follows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32, use_cache=False))

    def batch() -> dict[str, torch.Tensor]:
        start, step = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
        ids = (start + step * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids}
    return model, batch


def sequence_classification(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """GPT-2 read at the last token: whether most tokens are small (x2) plus whether the last one is (4 classes)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=WIDTH, n_layer=layers, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=VOCAB - 1,
                        eos_token_id=VOCAB - 1, use_cache=False)
    model = GPT2ForSequenceClassification(_labelled(config, 4))

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)  # 0 is the padding id: never in the data
        small = ids < VOCAB // 2
        return {"input_ids": ids, "labels": (small.sum(1) > LENGTH // 2).long() * 2 + small[:, -1].long()}
    return model, batch


def token_classification(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """BERT, per token: below, equal to or above the token before it (3 classes)."""
    from transformers import BertConfig, BertForTokenClassification

    model = BertForTokenClassification(_labelled(BertConfig(**_bert(layers)), 3))

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        before = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
        return {"input_ids": ids, "labels": torch.sign(ids - before).long() + 1}
    return model, batch


def question_answering(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """BERT span extraction: the answer starts at token 1 and ends at token 2, placed at random."""
    from transformers import BertConfig, BertForQuestionAnswering

    model = BertForQuestionAnswering(BertConfig(**_bert(layers)))

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
        start = torch.randint(0, LENGTH - 3, (n,), generator=g)
        end = start + torch.randint(1, 3, (n,), generator=g)
        rows = torch.arange(n)
        ids[rows, start], ids[rows, end] = 1, 2
        return {"input_ids": ids, "start_positions": start, "end_positions": end}
    return model, batch


def image_classification(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """ViT on 16x16 noise images (patches of 4): which quadrant holds a brighter square (4 classes)."""
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(_labelled(ViTConfig(
        image_size=16, patch_size=4, num_channels=1, hidden_size=WIDTH, num_hidden_layers=layers,
        num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 4))

    def batch() -> dict[str, torch.Tensor]:
        labels = torch.randint(0, 4, (n,), generator=g)
        images = torch.randn(n, 1, 16, 16, generator=g) * 0.5
        for i, quadrant in enumerate(labels.tolist()):
            row, column = divmod(quadrant, 2)
            images[i, 0, 8 * row:8 * row + 8, 8 * column:8 * column + 8] += 1.0
        return {"pixel_values": images, "labels": labels}
    return model, batch


def audio_classification(layers: int, g: torch.Generator, n: int) -> tuple[nn.Module, Batches]:
    """Wav2Vec2 on 400 samples of a sine in noise: which of 4 frequencies (3, 7, 11, 15 periods)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    model = Wav2Vec2ForSequenceClassification(_labelled(Wav2Vec2Config(
        hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=16,
        do_stable_layer_norm=True, feat_extract_norm="layer"), 4))

    def batch() -> dict[str, torch.Tensor]:
        labels = torch.randint(0, 4, (n,), generator=g)
        t = torch.arange(400) / 400
        phase = torch.rand(n, 1, generator=g) * 2 * math.pi
        waves = torch.sin(2 * math.pi * (3 + 4 * labels).unsqueeze(1).float() * t + phase)
        return {"input_values": waves + 0.3 * torch.randn(n, 400, generator=g), "labels": labels}
    return model, batch


KINDS: dict[str, Callable[[int, torch.Generator, int], tuple[nn.Module, Batches]]] = {
    "causal_lm": causal_lm, "sequence_classification": sequence_classification,
    "token_classification": token_classification, "question_answering": question_answering,
    "image_classification": image_classification, "audio_classification": audio_classification,
}
CONFIGS = ("one_device", "none", "predict", "auto")


def _task(kind: str, seed: int, lr: float, updates: int, batch_size: int) -> tuple[TaskModel, list[dict[str, Any]]]:
    """The model (weights from ``seed``) and its ``updates`` batches (from ``seed`` too)."""
    torch.manual_seed(seed)
    model, batch = KINDS[kind](4, torch.Generator().manual_seed(10_000 + seed), batch_size)
    return TaskModel(model, lr), [batch() for _ in range(updates)]


def _parts(batch: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    """``batch`` cut into ``m`` micro-batches as the pipeline cuts it (equal parts here)."""
    return [dict(zip(batch, pieces)) for pieces in zip(*(torch.tensor_split(v, m) for v in batch.values()))]


def one_device(module: TaskModel, batches: list[dict[str, Any]], m: int) -> list[float]:
    """One device: the mean of the ``m`` micro-batches' losses per step; every micro-batch's loss."""
    optimizer, losses = module.configure_optimizers(), []
    for batch in batches:
        for part in _parts(batch, m):
            loss = module.training_step(part, 0)
            losses.append(float(loss))
            (loss / m).backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def pipelined(module: TaskModel, batches: list[dict[str, Any]], stages: int,
              compensation: str) -> tuple[list[float], list[float | None]]:
    """PACI on ``stages`` stages (``m = a = stages``) in the reference executor: every micro-batch's loss, and each
    stage's measured prediction quality (``"auto"``; None where nothing was measured)."""
    with torch.no_grad(), recording_logs(module, [], 1, "training_step"):
        trace = call_order(module, lambda: module.training_step(_parts(batches[0], stages)[0], 0))
    pipeline = ReferencePipeline(module, plan_partition(module, stages, partition="parameters", trace=trace),
                                 compensation=compensation)
    pipeline.run(build_schedule("paci", stages, stages, stages, len(batches)), batches)
    losses = pipeline.runtimes[-1].records.losses
    return [float(losses[k]) for k in sorted(losses)], [r.records.prediction_quality for r in pipeline.runtimes]


def _row(kind: str, stages: int, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    finals: dict[str, list[float]] = {c: [] for c in CONFIGS}
    qualities = []
    for seed in args.seeds:
        for config in CONFIGS:
            module, batches = _task(kind, seed, lr, args.updates, args.batch_size)
            if config == "one_device":
                losses = one_device(module, batches, stages)
            else:
                losses, quality = pipelined(module, batches, stages, config)
                if config == "auto":
                    qualities.append(quality[:-1])  # the last stage's forwards cross no update
            tail = losses[-stages * args.last:]
            finals[config].append(sum(tail) / len(tail))
    mean = {c: statistics.mean(v) for c, v in finals.items()}
    spread = {c: statistics.stdev(v) if len(v) > 1 else 0.0 for c, v in finals.items()}
    return {"model": kind, "stages": stages, "lr": lr, "finals": finals, "mean": mean, "sd": spread,
            "auto_quality": qualities,
            "auto_off": [[q is not None and q < args.minimum for q in per_seed] for per_seed in qualities],
            "auto_minus_none": mean["auto"] - mean["none"], "allowed": max(spread["auto"], spread["none"]),
            "passes": mean["auto"] - mean["none"] <= max(spread["auto"], spread["none"])}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The report's table: mean final loss ± seed standard deviation per configuration, what auto decided."""
    lines = ["| model | N | lr | one device | none | predict | auto | auto - none (allowed) | auto: quality per stage, "
             "seeds (off) | passes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['mean'][c]:.4f} ± {r['sd'][c]:.4f}" for c in CONFIGS]
        quality = "; ".join(", ".join("-" if q is None else f"{q:.2f}" + ("*" if off else "") for q, off in zip(qs, o))
                            for qs, o in zip(r["auto_quality"], r["auto_off"]))
        lines.append(f"| {r['model']} | {r['stages']} | {r['lr']:g} | {' | '.join(cells)} | "
                     f"{r['auto_minus_none']:+.4f} ({r['allowed']:.4f}) | {quality} | "
                     f"{'yes' if r['passes'] else '**no**'} |")
    return "\n".join(lines)


def _arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--models", nargs="+", choices=sorted(KINDS), default=list(KINDS))
    add("--stages", type=int, nargs="+", default=[2, 4])
    add("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])
    add("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add("--updates", type=int, default=64)
    add("--batch-size", type=int, default=32)
    add("--last", type=int, default=5, help="the final loss: mean over the last this many updates' micro-batches")
    add("--markdown", type=Path, metavar="PATH", help="also write the table as markdown here")
    add("--quick", action="store_true", help="one model, one seed, 2 stages, 10 updates: proves the command works")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_paci.optim.prediction_quality import QUALITY_MIN

    torch.set_num_threads(1)
    if args.quick:
        args.models, args.stages, args.lrs, args.seeds, args.updates = ["causal_lm"], [2], [3e-3], [0], 10
    args.minimum = QUALITY_MIN
    rows, began = [], time.perf_counter()
    for kind in args.models:
        for stages in args.stages:
            for lr in args.lrs:
                rows.append(_row(kind, stages, lr, args))
                r = rows[-1]
                print(f"[{time.perf_counter() - began:6.0f} s] {kind}, {stages} stages, lr {lr:g}: "
                      + ", ".join(f"{c} {r['mean'][c]:.4f}±{r['sd'][c]:.4f}" for c in CONFIGS)
                      + f"; auto quality {r['auto_quality']}; {'passes' if r['passes'] else 'FAILS'}", flush=True)
    print_table(f"final loss (mean of the last {args.last} updates), mean over seeds {args.seeds}, "
                f"{args.updates} updates, AdamW constant lr", [
                    {"model": r["model"], "N": r["stages"], "lr": r["lr"],
                     **{c: r["mean"][c] for c in CONFIGS}, "auto-none": r["auto_minus_none"],
                     "allowed": r["allowed"], "passes": "yes" if r["passes"] else "NO"} for r in rows],
                [("model", "s"), ("N", "d"), ("lr", "g"), *[(c, ".4f") for c in CONFIGS], ("auto-none", "+.4f"),
                 ("allowed", ".4f"), ("passes", "s")])
    table = markdown(rows)
    if args.markdown is not None:
        args.markdown.write_text(table + "\n")
    print(f"\n{sum(r['passes'] for r in rows)} of {len(rows)} rows pass; {time.perf_counter() - began:.0f} s")
    return {"rows": rows, "minimum": QUALITY_MIN, "seconds": time.perf_counter() - began}


compensation = Benchmark(_arguments, _run, __doc__ or "")
