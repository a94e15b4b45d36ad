"""Every stage checks that it trained on stage 0's batches: a running fingerprint, compared at each drain.

Every rank loads its own copy of each batch; stage 0 feeds its inputs to the first block and the last stage its
labels to the loss, so a batch that differs between ranks pairs one sample's inputs with another's labels -- a run
that finishes with a plausible curve and a wrong model. The known causes are removed at setup (the user's sampler is
kept, the RNG states of torch, ``random`` and NumPy are rank 0's, dataloader workers are seeded by the data-parallel
rank: fit_loop.py); what remains (loading that depends on the process, the clock, the file system's order) is
caught here, never silently.

Cost: per batch, a few small reductions over at most ``SAMPLE`` strided elements of each tensor, accumulated on the
batch's device (no host synchronisation); at each drain, one broadcast of two numbers from stage 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_paci.engine.transport.messages import flatten
from lightning_paci.errors import DataMismatchError

__all__ = ["SAMPLE", "BatchFingerprint", "DataMismatchError"]

SAMPLE = 4096  # elements of each tensor that enter the fingerprint (evenly strided over the whole tensor)


class BatchFingerprint:
    """Running fingerprint of the batches this stage was fed since the last check.

    ``digest`` holds two float64 sums: of every sampled value, and of every sampled value weighted by its position
    in the batch and the batch's position since the last check (so that a reordering is caught too).
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.batches = 0  # fed since the last check; every stage counts the same (drains are at the same batches)
        self.first_batch: int | None = None
        self.checked_first = False  # whether the first batch of this fit was compared (``check_first``)
        self.digest: torch.Tensor | None = None  # (2,) float64, on the batch's device
        self._weights: dict[torch.device, torch.Tensor] = {}  # (SAMPLE,) position weights, one per device

    def _positions(self, n: int, device: torch.device) -> torch.Tensor:
        if device not in self._weights:
            positions = torch.arange(1, SAMPLE + 1, dtype=torch.float64, device=device)
            self._weights[device] = positions.remainder_(97).add_(1)
        return self._weights[device][:n]

    def update(self, batch: Any, batch_idx: int) -> None:
        """Fold one Lightning batch (every tensor leaf) into the digest."""
        tensors = [t for t in flatten(batch)[1] if t.numel()]
        if not tensors:
            return
        if self.first_batch is None:
            self.first_batch = batch_idx
        self.batches += 1
        sums = []
        for t in tensors:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].to(torch.float64)  # (<= SAMPLE,)
            sample = torch.nan_to_num(sample, nan=0.25, posinf=0.5, neginf=-0.5)  # NaN != NaN: compare finitely
            weighted = (sample * self._positions(sample.numel(), sample.device)).sum() * self.batches
            sums.append(torch.stack([sample.sum(), weighted]).to(tensors[0].device))
        total = torch.stack(sums).sum(0)  # (2,)
        self.digest = total if self.digest is None else self.digest + total

    def check_first(self, broadcast: Callable[[Any, int], Any]) -> None:
        """At the first batch of a fit only: ``check`` it at once (every stage feeds it before any computes)."""
        if not self.checked_first:
            self.checked_first = True
            self.check(broadcast, first=True)

    def check(self, broadcast: Callable[[Any, int], Any], *, first: bool = False) -> None:
        """Compare with stage 0's digest (a collective: every stage calls it at the same drains, and at the first
        batch of a run -- ``first`` -- before any stage computes, where data made differently per rank shows).

        Raises:
            DataMismatchError: this stage's batches differ from stage 0's.
        """
        if self.batches == 0:
            return
        mine = None if self.digest is None else self.digest.cpu().tolist()
        theirs = broadcast(mine, 0)
        since, self.batches, self.first_batch, self.digest = self.first_batch, 0, None, None
        if mine != theirs:
            what = (f"stage {self.stage}'s first batch differs from stage 0's (fingerprints {mine} vs {theirs}), "
                    f"before any stage computed with it" if first else
                    f"stage {self.stage} trained on other batches than stage 0 (fingerprints of the batches since "
                    f"Lightning batch {since}: {mine} vs {theirs})")
            raise DataMismatchError(
                f"{what}: stage 0's inputs would be paired with other labels. Data made before `fit` (random tensors, "
                f"a shuffled list) must be the same on every rank: seed before building it "
                f"(`lightning.seed_everything(seed)` at the top of the script). Every "
                f"stage loads the batch itself, so loading must give the same samples on every rank: keep randomness "
                f"in the dataset, collate_fn or sampler on torch's, Python's `random` or NumPy's global generators "
                f"(shared at setup, dataloader workers seeded alike), and avoid process-dependent sources (PIDs, "
                f"the clock, unsorted directory listings)."
            )
