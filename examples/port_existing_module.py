"""Porting an existing LightningModule: the same module, first on one device, then pipelined with PACI.

    python examples/port_existing_module.py

``TinyLM`` below is written the way one writes a model for a single GPU: an embedding, a list of blocks looped over
in ``forward``, a head, the loss in ``training_step``. Nothing in it knows about pipelines. The only difference
between the two runs is the ``Trainer`` line.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_paci  # noqa: F401  (registers strategy="paci")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int = 64, dim: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # the usual recipe: a linear warm-up over the first 4 steps, then a linear decay to zero at step 16
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min((step + 1) / 4, (16 - step) / 12))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (512, 1), generator=g)
    tokens = (start + torch.arange(17)) % 64  # counting sequences: learnable
    return DataLoader(TensorDataset(tokens), batch_size=32, shuffle=False)


if __name__ == "__main__":
    common = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False)

    torch.manual_seed(0)
    single = TinyLM()
    L.Trainer(devices=1, **common).fit(single, data())

    torch.manual_seed(0)
    piped = TinyLM()
    trainer = L.Trainer(strategy="paci", devices=2, **common)   # <- the only change
    trainer.fit(piped, data())

    if trainer.is_global_zero:
        print(f"one device: train_loss={float(single.trainer.callback_metrics['train_loss']):.3e}")
        print(f"paci, 2 stages: train_loss={float(trainer.callback_metrics['train_loss']):.3e}")
