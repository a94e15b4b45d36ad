"""In-process mailboxes: the transport of the one-process reference executor, and of the stages one device runs.

The same interface as :class:`~lightning_paci.engine.transport.point_to_point.DistComm` (``send``, ``recv``,
``ready``, ``post``, ``flush``), so that a stage's runtime runs the same code whether its neighbour is another
process or a sibling chunk in this one ([Note: virtual stages]).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from lightning_paci.engine.transport.messages import StageMismatchError, flatten, metas_of, unflatten
from lightning_paci.engine.transport.pickle_guard import guarded_dumps

__all__ = ["LocalComm"]


class LocalComm:
    """In-process mailboxes for the one-process reference executor: ``LocalComm.network(n)`` gives each stage its
    endpoint. A message is copied on send, as a real transport would."""

    def __init__(self, stage: int, boxes: dict[tuple[int, int, int], deque[Any]]) -> None:
        self._stage = stage
        self._boxes = boxes

    @staticmethod
    def network(num_stages: int) -> list[LocalComm]:
        boxes: dict[tuple[int, int, int], deque[Any]] = {
            (s, d, c): deque() for s in range(num_stages) for d in range(num_stages) for c in (0, 1)
        }
        return [LocalComm(s, boxes) for s in range(num_stages)]

    def send(self, payload: Any, stage: int, channel: int = 0) -> None:
        skeleton, tensors = flatten(payload)
        guarded_dumps(skeleton, what=f"stage {self._stage}: the message to stage {stage}")  # as DistComm refuses
        self._boxes[(self._stage, stage, channel)].append((skeleton, [t.detach().clone() for t in tensors]))

    def recv(self, stage: int, channel: int = 0) -> Any:
        box = self._boxes[(stage, self._stage, channel)]
        if not box:
            raise StageMismatchError(f"stage {self._stage}: nothing to receive from stage {stage} "
                                     f"(reference executor order bug)")
        skeleton, tensors = box.popleft()
        for meta, tensor in zip(metas_of(skeleton), tensors):
            if meta.requires_grad:
                tensor.requires_grad_(True)
        return unflatten(skeleton, tensors)

    def ready(self, stage: int, channel: int = 0) -> bool:
        return bool(self._boxes[(stage, self._stage, channel)])

    def post(self, stage: int) -> None:
        pass  # the mailboxes hold every message already

    def flush(self) -> None:
        pass
