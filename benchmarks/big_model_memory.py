"""Peak host memory per rank with a 268 MB model (16 square Linear blocks of width 2048) on 4 stages.

    cd benchmarks && python big_model_memory.py [--json results/big_model_memory.json]

``VmHWM`` of every stage process, over the tiny model of the same code (width 64) as the baseline: built in
``configure_model`` (each stage replays only its own share) or in ``__init__`` (every rank holds the whole model,
the control); at fit start, during training, and for what follows training -- a sharded or consolidated
``save_checkpoint`` and teardown, the peak reset when training ends. Global rank 0 is the last stage and writes the
consolidated file. Figures in RESULTS.md ("Big models").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from memory_peaks import MB, run_peaks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = {later: run_peaks(root / f"tiny-{later}", 64, later=later) for later in (True, False)}
        for name, later, layout in (("configure_model, sharded save", True, "sharded"),
                                    ("configure_model, consolidated save", True, "consolidated"),
                                    ("__init__ (control), sharded save", False, "sharded")):
            peaks = run_peaks(root / name.replace(" ", "_").replace(",", ""), 2048, later=later, layout=layout)
            for rank in range(4):
                base = tiny[later]
                rows.append({
                    "run": name, "rank": rank, "own_MB": round(peaks.read("start", rank)["own"] / MB),
                    "fit_start_MB": round((peaks.read("start", rank)["peak"] - base.read("start", rank)["peak"]) / MB),
                    "training_MB": round((peaks.read("train", rank)["peak"] - base.read("train", rank)["peak"]) / MB),
                    "save_teardown_MB": round((peaks.read("end", rank)["peak"] - peaks.read("reset", rank)["peak"])
                                              / MB)})
    print(f"{'run':38} rank  own  fit start  training  save+teardown   (MB over the tiny model; the last: added)")
    for row in rows:
        print(f"{row['run']:38} {row['rank']:4} {row['own_MB']:4} {row['fit_start_MB']:10} {row['training_MB']:9} "
              f"{row['save_teardown_MB']:14}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
