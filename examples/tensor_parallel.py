"""A Llama-style model written for Lightning's ``ModelParallelStrategy``, trained on a pipeline of tensor-parallel
stages by changing the strategy only.

    python examples/tensor_parallel.py                       # 2 stages x 2 tensor-parallel ranks, 4 CPU processes
    python examples/tensor_parallel.py --model-parallel      # the same module under ModelParallelStrategy (TP 2)

The module is what Lightning's tensor-parallel guide has a user write: the layers built in ``__init__``, the plan
applied in ``configure_model`` over ``self.device_mesh["tensor_parallel"]`` (attention's query, key and value
projections and the feed-forward's gate and up projections split by columns, the output projections by rows, each
rank holding ``heads / T`` attention heads). Under ``PACIStrategy(tensor_parallel_size=2)`` each of the 2 pipeline
stages runs that plan on its own blocks over its own 2 ranks; the blocks of the other stage are placeholders there
and the plan passes over them ([Note: tensor parallelism in a stage]). The data is a fixed random token stream,
made here (no download).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_paci


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    """Causal self-attention; ``heads`` is this rank's number of heads (the plan divides it)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: (batch, seq, width); q, k, v: (batch, heads here, seq, head_dim)
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(width), Attention(width, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(width), FeedForward(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(L.LightningModule):
    """Written for ``ModelParallelStrategy``: nothing here knows about the pipeline."""

    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:  # one device
            return
        mesh = self.device_mesh["tensor_parallel"]
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel()}
        for block in self.layers:
            parallelize_module(block, mesh, plan)
            block.attention.heads //= mesh.size()  # each rank computes its share of the heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.output(self.norm(x))

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def token_stream(vocab: int, batches: int, batch_size: int, seq: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (batches * batch_size, seq + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


def main(argv: Sequence[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="processes: stages x tensor-parallel ranks")
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--model-parallel", action="store_true", help="ModelParallelStrategy instead")
    parser.add_argument("--start-method", default="popen", choices=["popen", "fork", "spawn"])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.model_parallel:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: L.pytorch.strategies.Strategy = ModelParallelStrategy(
            data_parallel_size=1, tensor_parallel_size=args.tensor_parallel)
        devices = args.tensor_parallel
    else:
        # the weight prediction does not move DTensor shards yet: a tensor-parallel stage trains uncompensated
        strategy = lightning_paci.PACIStrategy(tensor_parallel_size=args.tensor_parallel, microbatches=4,
                                               compensation="none", start_method=args.start_method)
        devices = args.devices
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=args.max_steps,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(Llama(), token_stream(256, args.max_steps, 8, 32))
    loss = float(trainer.callback_metrics["train_loss"])
    if trainer.is_global_zero:
        print(f"final training loss: {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
