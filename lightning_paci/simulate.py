"""``python -m lightning_paci.simulate``: print a schedule's predicted per-stage drift, in-flight depth and bubble.

    python -m lightning_paci.simulate --schedule paci --stages 8 --microbatches 8 --accumulation 8 \\
        [--minibatches K] [--forward-cost F] [--backward-cost B] [--comm-cost C] [--json] [--timeline out.png]

Only an entry point, kept so the documented command keeps working: the table, the argument parser and the
engine are in :mod:`lightning_paci.simulation`.
"""

from __future__ import annotations

import sys

from lightning_paci.simulation import format_table, main

__all__ = ["format_table", "main"]

if __name__ == "__main__":
    sys.exit(main())
