"""2 stages under the default launcher, global rank 0 killed (SIGKILL, as an out-of-memory kill would) right after
it started rank 1, before it opened the rendezvous store (in the model's ``configure_callbacks``): rank 1, still
importing, would otherwise wait for that store until the process-group timeout. Every rank writes its pid to
``OUT/pid<local rank>``.

    python tests/scripts/early_failure_script.py OUT
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L

from lightning_paci import PACIStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import SequentialMLP, regression_loader  # noqa: E402

OUT = Path(sys.argv[1])


class KillsRank0BeforeSetup(SequentialMLP):
    def configure_callbacks(self):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return []


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    OUT.joinpath(f"pid{os.environ.get('LOCAL_RANK', '0')}").write_text(str(os.getpid()))
    strategy = PACIStrategy(partition="parameters", failure_timeout=3.0, timeout=timedelta(seconds=120))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(KillsRank0BeforeSetup(), regression_loader())
