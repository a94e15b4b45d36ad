"""``python -m lightning_paci.checkpoint DIR model.ckpt``: consolidate a sharded PACI checkpoint into one file.

Only an entry point, kept so the documented command keeps working: the checkpoint format and this command's
code are in :mod:`lightning_paci.integration.checkpoint`.
"""

from __future__ import annotations

import sys

from lightning_paci.integration.checkpoint import consolidate_checkpoint, main

__all__ = ["consolidate_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
