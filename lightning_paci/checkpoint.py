"""``python -m lightning_paci.checkpoint DIR model.ckpt``: consolidate a sharded PACI checkpoint into one file.

The command only: the checkpoint format is :mod:`lightning_paci.integration.checkpoints.checkpoint`.
"""

from __future__ import annotations

import argparse
import sys

from lightning_paci.integration.checkpoints.checkpoint import consolidate_checkpoint

__all__ = ["consolidate_checkpoint", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_paci.checkpoint",
                                     description="Consolidate a sharded lightning_paci checkpoint into one file.")
    parser.add_argument("directory", help="the sharded checkpoint directory (meta.pt + stage_NNN.pt)")
    parser.add_argument("output", help="the consolidated .ckpt file to write")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.directory, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
