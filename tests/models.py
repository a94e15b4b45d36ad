"""A tiny model zoo for the tests: LightningModules written as for one device, never changed for the pipeline."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SequentialMLP(LightningModule):
    """An ``nn.Sequential`` regression MLP."""

    def __init__(self, width: int = 16, depth: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width), nn.Tanh()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 4))
        self.net = nn.Sequential(*layers)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def regression_loader(num_batches: int = 6, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_batches * batch_size, 8, generator=g)
    w = torch.randn(8, 4, generator=g)
    y = torch.tanh(x @ w)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class MisledLinear(LightningModule):
    """Two bias-free linear blocks whose loss is the output's mean, so every gradient follows its input's sign, and
    AdamW without momentum (``betas=(0, 0.99)``): with :func:`misled_loader`, where each batch's first half has
    positive inputs and its second half inputs three times larger and negative, the part of a window the weight
    prediction knows (its first micro-batch) points away from the window's whole gradient. ``betas=(0.9, 0.99)``:
    the momentum carries the windows' consistent direction and the prediction holds."""

    def __init__(self, betas: tuple[float, float] = (0.0, 0.99)) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        self.betas = betas

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, betas=self.betas, weight_decay=0.0)


def misled_loader(num_batches: int, batch_size: int = 4) -> DataLoader:
    """Batches whose first half is positive and whose second half is -3 times as large (see ``MisledLinear``)."""
    x = torch.rand(num_batches, batch_size, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    x[:, batch_size // 2:] *= -3.0
    return DataLoader(TensorDataset(x.reshape(-1, 4)), batch_size=batch_size, shuffle=False)


class _Block(nn.Module):
    """Pre-norm transformer block with causal self-attention; takes a keyword ``mask``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class LoopTransformer(LightningModule):
    """A hand-written causal LM whose ``forward`` loops over an ``nn.ModuleList``."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 4, seq: int = 8,
                 lr: float = 3e-3, *, build_now: bool = True) -> None:
        super().__init__()
        self.shape = dict(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq)
        self.lr = lr
        if build_now:
            self.build()

    def build(self) -> None:
        vocab, dim, heads, layers, seq = (self.shape[k] for k in ("vocab", "dim", "heads", "layers", "seq"))
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([_Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape  # batch, sequence length
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(self.ln_f(x))  # (B, T, vocab)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LaterLoopTransformer(LoopTransformer):
    """The same model built in ``configure_model`` (Lightning's hook for big models), idempotent as Lightning asks."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs, build_now=False)

    def configure_model(self) -> None:
        if getattr(self, "blocks", None) is not None:
            return
        self.build()


def token_loader(num_batches: int = 8, batch_size: int = 8, seq: int = 9, vocab: int = 32, seed: int = 0) -> DataLoader:
    # a learnable sequence: each token is the previous one plus a per-sequence stride, modulo the vocabulary
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (num_batches * batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (num_batches * batch_size, 1), generator=g)
    idx = (start + stride * torch.arange(seq)) % vocab
    return DataLoader(TensorDataset(idx), batch_size=batch_size, shuffle=False)


def no_block_container() -> LightningModule:
    class Flat(SequentialMLP):
        def __init__(self) -> None:
            super().__init__()
            self.net = None  # type: ignore[assignment]
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    return Flat()


def reference_accumulation(module: LightningModule, batches, num_microbatches: int, num_steps: int) -> LightningModule:
    """Single-device gradient accumulation over the same micro-batches: the exactness baseline."""
    optimizer = module.configure_optimizers()
    for batch in batches[:num_steps]:
        tensors = [torch.tensor_split(t, num_microbatches) for t in batch]
        for parts in zip(*tensors):
            loss = _loss(module, list(parts))
            (loss / num_microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module


def _loss(module: LightningModule, batch) -> torch.Tensor:
    logged = module.log
    module.log = lambda *a, **k: None  # no trainer here
    try:
        return module.training_step(batch, 0)
    finally:
        module.log = logged
        del module.log


assert math  # keep import for readers computing expected values


class HFCausalLM(LightningModule):
    """A transformers causal LM wrapped the ordinary way; ``training_step`` returns ``self.model(...).loss``."""

    def __init__(self, kind: str = "gpt2", *, layers: int = 4, tied: bool = False, lr: float = 3e-3,
                 vocab: int = 64, use_cache: bool | None = None) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if kind == "gpt2":
            config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=layers, n_head=2, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
            self.model = GPT2LMHeadModel(config)
        else:  # llama with grouped-query attention (4 query heads, 2 key/value heads) and rotary embeddings
            config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=tied)
            self.model = LlamaForCausalLM(config)
        if use_cache is not None:  # None: the config's default (True), as a user's model has it
            self.model.config.use_cache = use_cache
        self.lr = lr

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss)

    def predict_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids).logits

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def hf_reference_accumulation(module: LightningModule, batches, num_microbatches: int) -> LightningModule:
    """Single-device gradient accumulation for ``HFCausalLM`` (mean of micro-batch losses per step)."""
    optimizer = module.configure_optimizers()
    for (ids,) in batches:
        for part in torch.tensor_split(ids, num_microbatches):
            (module.model(input_ids=part, labels=part).loss / num_microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module


class PretrainedGPT2(LightningModule):
    """A transformers GPT-2 fine-tuned from a directory: ``from_pretrained`` in ``__init__`` (``load_now``), or built
    from the directory's config in ``configure_model`` for ``PACIStrategy(weights=directory)``."""

    def __init__(self, directory, *, load_now: bool, lr: float = 0.05) -> None:
        super().__init__()
        from transformers import GPT2LMHeadModel

        self.directory, self.lr = str(directory), lr
        self.model = GPT2LMHeadModel.from_pretrained(self.directory) if load_now else None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        self.model = GPT2LMHeadModel(GPT2Config.from_pretrained(self.directory))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class WideMLP(LightningModule):
    """``depth`` square ``Linear`` blocks of ``width``, built in ``configure_model`` (``later``) or ``__init__``:
    width 2048 and depth 16 make a 268 MB model, width 64 the tiny one of the same code."""

    def __init__(self, width: int, depth: int = 16, *, later: bool = True) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.net = None
        if not later:
            self.configure_model()

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(*[nn.Linear(self.width, self.width) for _ in range(self.depth)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return F.mse_loss(self.net(x[:, :self.width]), x[:, :self.width])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def wide_loader(width: int, num_batches: int = 3, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(num_batches * batch_size, width, generator=g)), batch_size=batch_size)


class LongSkip(SequentialMLP):
    """`head(blocks(h) + h)`: the embedding's output is used after the block container."""

    def __init__(self) -> None:
        super().__init__()
        del self.net  # registered in forward order: embedding, blocks, head
        self.embed = nn.Linear(8, 16)
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.net(h) + h)


class ReusedEmbedding(LongSkip):
    """`head(blocks(embed(x)) + embed(x))`: one module called before the container and again after it, on the
    batch's own input. The second call's value is read on the last stage, the module's parameters are on stage 0:
    stage 0 makes it after its egress and relays it (a late relay, as T5's shared embedding of the decoder's ids)."""

    def forward(self, x):
        return self.head(self.net(self.embed(x)) + self.embed(x))


class ReusedOnBlocks(LongSkip):
    """`head(embed2(blocks(embed(x))))` where ``embed2`` shares ``embed``: the second call reads the blocks' output,
    which its owner (stage 0) never has -- refused at setup, naming the module."""

    def forward(self, x):
        h = self.net(self.embed(x))
        return self.head(self.embed(h[..., :8]))


class InPlaceSkip(LongSkip):
    """A long skip whose value is changed in place after the embedding made it: every stage would apply the change
    to the value it holds, so the relayed one would be changed twice -- refused at the first forward."""

    def forward(self, x):
        h = self.embed(x)
        skip = h
        h.mul_(0.5)
        return self.head(self.net(h) + skip)


class HFModel(LightningModule):
    """Any transformers model wrapped as its model card shows: ``self.model(**batch).loss``, SGD."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tiny_clip(*, layers: int = 3, batch_size: int = 4) -> tuple[HFModel, dict[str, Any]]:
    """transformers' CLIP (two towers of ``layers`` layers, a learned temperature) in float64, and one batch of
    ``batch_size`` text-image pairs asking for its contrastive loss (in-batch negatives)."""
    import transformers as tr

    torch.manual_seed(61)
    config = tr.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=layers, num_attention_heads=4),
        projection_dim=16)
    batch = {"input_ids": torch.randint(3, 64, (batch_size, 6)),
             "pixel_values": torch.randn(batch_size, 3, 16, 16, dtype=torch.float64), "return_loss": True}
    return HFModel(tr.CLIPModel(config)).double(), batch


def dict_loader(batches: list[dict[str, torch.Tensor]]) -> DataLoader:
    """The given batches, as they are (no collation)."""
    return DataLoader(batches, batch_size=None, shuffle=False)


def hf_model_reference(module: HFModel, batches, num_microbatches: int) -> HFModel:
    """One device: the mean of the micro-batch losses per step, SGD."""
    optimizer = module.configure_optimizers()
    for batch in batches:
        parts = {k: torch.tensor_split(v, num_microbatches) for k, v in batch.items()}
        for i in range(num_microbatches):
            (module.model(**{k: v[i] for k, v in parts.items()}).loss / num_microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module


class _FormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.forms: list[list[tuple[str, tuple[int, ...], bool]]] | None = None  # set: record the inputs here

    def forward(self, h, *, bias, mask, positions):
        if self.forms is not None:  # inside the block: after a stage's ingress replaced its inputs
            self.forms.append([(str(t.dtype), tuple(t.shape), t.requires_grad) for t in (h, bias, mask, positions)])
        return torch.tanh(self.linear(h) + bias) * mask.unsqueeze(-1) + positions.unsqueeze(-1) * 0


class CrossingForms(LightningModule):
    """Block inputs of every kind a stage boundary carries: hidden states, a bias made from the dtype of the
    embedding's output (as BLOOM's ALiBi), a bool mask and int positions (no gradient). ``forms`` records what the
    blocks at ``watch`` receive, (dtype, shape, requires_grad) per input: on stage 1 of a split at 2, block 2's
    inputs are received, block 3's made on the stage from what a placeholder returned."""

    def __init__(self, watch: tuple[int, ...] = (2, 3)) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_FormBlock() for _ in range(4))
        self.head = nn.Linear(16, 4)
        self.forms: list[list[tuple[str, tuple[int, ...], bool]]] = []
        for index in watch:
            self.blocks[index].forms = self.forms

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)  # (B, T, 16)
        bias = torch.full(h.shape[-1:], 0.1, dtype=h.dtype, device=h.device)
        mask = x[..., 0] > -10
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        for block in self.blocks:
            h = block(h, bias=bias, mask=mask, positions=positions)
        return F.mse_loss(self.head(h).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sequence_loader(num_batches: int = 2, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_batches * batch_size, 5, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randn(num_batches * batch_size, 5, 4, generator=g)),
                      batch_size=batch_size)


class _ResBlock(nn.Module):
    """A diffusion UNet's residual block: two convolutions, the time embedding added in between; ``down``/``up``
    resamples after (down path) or before (up path)."""

    def __init__(self, channels_in: int, channels_out: int, time_dim: int, resample: str = "") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.time = nn.Linear(time_dim, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        self.skip = nn.Conv2d(channels_in, channels_out, 1)
        self.resample = resample

    def forward(self, h, temb):
        if self.resample == "up":
            h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
        out = torch.tanh(self.conv1(h)) + self.time(temb)[:, :, None, None]
        out = self.conv2(torch.tanh(out)) + self.skip(h)
        return nn.functional.avg_pool2d(out, 2) if self.resample == "down" else out


class DiffusionUNet(LightningModule):
    """A diffusion-style U-shaped network on 8x8 images: a time-embedding MLP, down blocks whose outputs the up
    blocks read as skips (``torch.cat([h, skips.pop()])``), a middle block, and a noise-prediction loss. Its down
    and up blocks are two containers; the skips cross stages as relayed values."""

    def __init__(self, channels: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        c = channels
        self.time_mlp = nn.Sequential(nn.Linear(1, 2 * c), nn.Tanh(), nn.Linear(2 * c, 2 * c))
        self.conv_in = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList([_ResBlock(c, c, 2 * c), _ResBlock(c, 2 * c, 2 * c, "down"),
                                   _ResBlock(2 * c, 2 * c, 2 * c, "down")])
        self.mid = _ResBlock(2 * c, 2 * c, 2 * c)
        self.up = nn.ModuleList([_ResBlock(4 * c, 2 * c, 2 * c, "up"), _ResBlock(4 * c, c, 2 * c, "up"),
                                 _ResBlock(2 * c, c, 2 * c)])
        self.conv_out = nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, noisy, t):  # noisy: (batch, 3, 8, 8); t: (batch, 1)
        temb = self.time_mlp(t)
        h = self.conv_in(noisy)
        skips = []
        for block in self.down:
            h = block(h, temb)
            skips.append(h)
        h = self.mid(h, temb)
        for block in self.up:
            h = block(torch.cat([h, skips.pop()], dim=1), temb)
        return self.conv_out(h)

    def training_step(self, batch, batch_idx):
        noisy, t, noise = batch
        loss = nn.functional.mse_loss(self(noisy, t), noise)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def planned_mlp() -> tuple[LightningModule, DataLoader]:
    """A module and its data for ``python -m lightning_paci.plan tests.models:planned_mlp``-style runs."""
    torch.manual_seed(0)
    return SequentialMLP(width=32, depth=8), regression_loader(num_batches=2, batch_size=16)


class TwoTower(LightningModule):
    """Two towers of ``depth`` blocks each (a query and a document encoder), a learned temperature held by the
    module itself, and a loss that is a mean over samples: each sample's own pair, no in-batch negatives, so one
    device's plain step on the whole batch is the reference. The towers run one after the other (one row of
    ``2 * depth`` blocks); the query's embedding is read by the loss on the last stage (relayed)."""

    def __init__(self, depth: int = 3, width: int = 8) -> None:
        super().__init__()
        self.query_in, self.doc_in = nn.Linear(6, width), nn.Linear(5, width)
        self.query = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.doc = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.query_out, self.doc_out = nn.Linear(width, 4), nn.Linear(width, 4)
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def training_step(self, batch, batch_idx):
        queries, docs, targets = batch
        q = self.query_in(queries)
        for block in self.query:
            q = block(q)
        d = self.doc_in(docs)
        for block in self.doc:
            d = block(d)
        score = (self.query_out(q) * self.doc_out(d)).sum(-1) * self.temperature.exp()  # (B,)
        loss = ((score - targets) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def two_tower_batch(size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One float64 batch for :class:`TwoTower`: queries (B, 6), documents (B, 5), target scores (B,)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(size, 6, generator=generator, dtype=torch.float64),
            torch.randn(size, 5, generator=generator, dtype=torch.float64),
            torch.randn(size, generator=generator, dtype=torch.float64))


class _FeedForward(nn.Module):
    """A Llama-style feed-forward block: ``w2(silu(w1(x)) * w3(x))`` with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, 2 * width, bias=False)
        self.w3 = nn.Linear(width, 2 * width, bias=False)
        self.w2 = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


class TensorParallelFeedForward(LightningModule):
    """Written for Lightning's ``ModelParallelStrategy``: the layers built in ``__init__``, the tensor-parallel plan
    applied to every block in ``configure_model`` over ``self.device_mesh["tensor_parallel"]`` (Lightning's
    documented form, docs/source-pytorch/advanced/model_parallel/tp.rst); without a mesh (one device) it does
    nothing."""

    def __init__(self, width: int = 8, depth: int = 4, lr: float = 0.1, optimizer: str = "sgd") -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.Sequential(*[_FeedForward(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
        self.lr, self.optimizer = lr, optimizer

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.device_mesh is None:
            return
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            for block in self.blocks:
                parallelize_module(block, tp, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                               "w2": RowwiseParallel()})
        if dp.size() > 1:  # FSDP2 over the replicas, as Lightning's tp_fsdp guide does
            for block in self.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.embed, mesh=dp)
            fully_shard(self.head, mesh=dp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def feed_forward_loader(num_batches: int = 3, batch_size: int = 8, seed: int = 0,
                        dtype: torch.dtype = torch.float64) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_batches * batch_size, 4, generator=generator, dtype=dtype)
    y = torch.randn(num_batches * batch_size, 1, generator=generator, dtype=dtype)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)
