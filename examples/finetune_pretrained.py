"""Fine-tune a pretrained transformers model with PACI, each stage reading only its own weights from the directory.

    python examples/finetune_pretrained.py                          # 4 stages on CPU, offline: see below
    python examples/finetune_pretrained.py --pretrained DIR --devices 8 --accelerator gpu

``--pretrained`` is a transformers directory (``config.json`` and safetensors shards with their index, as
``save_pretrained`` writes it or a hub download holds it). Without one, the script first writes a small byte-level
GPT-2 there (a stand-in for a downloaded checkpoint, in several shards) so that it runs offline.

The LightningModule builds its model from the directory's config in ``configure_model``; with
``PACIStrategy(weights=DIR)`` no stage ever builds, initializes or loads the whole model: each stage's parameters
are created on the meta device, materialized on its own device and filled from the shards that hold them (the
keys it read are logged). At the end, ``SavePretrained`` writes the fine-tuned model back as a transformers
directory, each stage its own shard, and the script reloads it with ``from_pretrained`` to check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from lightning_paci import PACIStrategy, SavePretrained

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import ByteBlocks, stdlib_corpus  # noqa: E402  (the main example's embedded corpus)


class FineTune(L.LightningModule):
    """An ordinary causal-LM fine-tuning module; the model comes from ``directory``'s config."""

    def __init__(self, directory: str, lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hparams.directory))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def write_stand_in(directory: Path, context: int) -> None:
    """A small byte-level GPT-2 in several safetensors shards with their index, as `save_pretrained` writes."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=context, n_embd=128, n_layer=8, n_head=4, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(directory, max_shard_size="1MB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pretrained", type=Path, help="a transformers directory (default: write a stand-in)")
    parser.add_argument("--devices", type=int, default=4, help="pipeline stages, one process each")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--corpus-bytes", type=int, default=400_000)
    parser.add_argument("--root", type=Path, default=Path("runs/finetune_pretrained"))
    parser.add_argument("--start-method", default="popen", help="popen (as ddp), or fork (notebooks, tests)")
    args = parser.parse_args(argv)

    pretrained = args.pretrained or args.root / "pretrained"
    if args.pretrained is None and not (pretrained / "config.json").exists():
        write_stand_in(pretrained, args.context)
    data = stdlib_corpus(args.corpus_bytes)
    split = int(len(data) * 0.95)
    train = DataLoader(ByteBlocks(data[:split], args.context - 1), batch_size=args.batch_size, shuffle=True,
                       drop_last=True)
    val = DataLoader(ByteBlocks(data[split:], args.context - 1), batch_size=args.batch_size, drop_last=True)
    export = args.root / "finetuned"
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=PACIStrategy(weights=pretrained, start_method=args.start_method),
        accelerator=args.accelerator, devices=args.devices, max_steps=args.max_steps, limit_val_batches=4,
        val_check_interval=max(1, args.max_steps // 2), check_val_every_n_epoch=None, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, callbacks=[SavePretrained(export)],
    )
    trainer.fit(FineTune(str(pretrained)), train, val)
    if trainer.is_global_zero:
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        size = sum(p.numel() for p in reloaded.parameters())
        print(f"validation loss: {float(trainer.callback_metrics['val_loss']):.3f}")
        print(f"fine-tuned model: {export} ({size:,} parameters; reload with from_pretrained)")


if __name__ == "__main__":
    main()
