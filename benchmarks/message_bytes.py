"""Bytes per message of the main example (examples/train_gpt.py's GPT-2, its defaults), per stage and direction.

    cd benchmarks && python message_bytes.py [--steps 2] [--devices 4]

Runs a few training steps through the Trainer (forked ranks, gloo) and counts, on every rank, the activation and
gradient messages it sent and their framed size: header (the pickled structure with the tensors taken out) plus
the tensors' bytes, as the transport frames them. A transformers model leaves ``use_cache=True`` on, so before its
cache was kept off the wire ([Note: no cache across stages]) each activation message also carried the keys and
values of every upstream layer.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_gpt import GPT, ByteBlocks, stdlib_corpus  # noqa: E402

from lightning_paci import PACIStrategy  # noqa: E402
from lightning_paci.engine.comm import DistComm  # noqa: E402
from lightning_paci.engine.messages import flatten  # noqa: E402


def _framed(payload: Any) -> int:
    skeleton, tensors = flatten(payload)
    return 16 + len(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)) + sum(
        t.numel() * t.element_size() for t in tensors)


class _Count(L.Callback):
    """Wraps this rank's training transport to add up each direction's messages and framed bytes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sent: dict[str, list[int]] = {"activation": [0, 0], "gradient": [0, 0]}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        comm: DistComm = trainer.strategy.runtime.comm
        stage, send = trainer.strategy.stage_index, comm.send

        def counted(payload: Any, to: int, channel: int = 0) -> None:
            if channel == 0:
                entry = self.sent["activation" if to > stage else "gradient"]
                entry[0], entry[1] = entry[0] + 1, entry[1] + _framed(payload)
            send(payload, to, channel)

        comm.send = counted  # type: ignore[method-assign]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        record = {"stage": trainer.strategy.stage_index, **self.sent}
        (self.directory / f"sent{dist.get_rank()}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = stdlib_corpus(400_000)
    loader = torch.utils.data.DataLoader(ByteBlocks(data, 128), batch_size=16, drop_last=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(strategy=PACIStrategy(start_method="fork", microbatches=4), accelerator="cpu",
                            devices=args.devices, max_steps=args.steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[_Count(Path(tmp))])
        trainer.fit(GPT(), loader)
        records = sorted((json.loads(p.read_text()) for p in Path(tmp).glob("sent*.json")), key=lambda r: r["stage"])
    print("stage  activation messages  bytes each  gradient messages  bytes each")
    for r in records:
        (fm, fb), (bm, bb) = r["activation"], r["gradient"]
        print(f"{r['stage']:>5}  {fm:>19}  {fb // max(1, fm):>10}  {bm:>17}  {bb // max(1, bm):>10}")


if __name__ == "__main__":
    main()
