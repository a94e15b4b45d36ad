"""Placeholder: the old StreamCursor, replaced by the incremental one (merged from the `sched` branch)."""

from __future__ import annotations

from lightning_paci.schedules import Action, assign_rounds, build

__all__ = ["StreamCursor"]


class StreamCursor:
    def __init__(self, name: str, num_stages: int, num_microbatches: int, accumulation: int, stage: int,
                 *, backward_offset: int = 0, tied: bool = False) -> None:
        self.args = (name, num_stages, num_microbatches, accumulation)
        self.stage = stage
        self.backward_offset = backward_offset
        self.tied = tied
        self.position = 0
        self._horizon = 0
        self._actions: tuple[Action, ...] = ()
        self._rounds: tuple[int, ...] = ()

    def _ensure(self, horizon: int) -> None:
        if horizon <= self._horizon:
            return
        horizon = max(horizon, 2 * self._horizon, 8)
        schedule = build(*self.args, horizon, backward_offset=self.backward_offset, tied=self.tied)
        self._actions = schedule.actions[self.stage]
        self._rounds = assign_rounds(schedule)[self.stage]
        self._horizon = horizon

    def segment(self, call: int) -> list[Action]:
        self._ensure(call + 2)
        end = self.position
        while end < len(self._actions) and self._rounds[end] <= call:
            end += 1
        out = list(self._actions[self.position:end])
        self.position = end
        return out

    def drain(self, num_minibatches: int) -> list[Action]:
        if num_minibatches == 0:
            return []
        schedule = build(*self.args, num_minibatches, backward_offset=self.backward_offset, tied=self.tied)
        actions = schedule.actions[self.stage]
        if tuple(actions[:self.position]) != tuple(self._actions[:self.position]):
            raise AssertionError("drained list does not extend the executed prefix")
        out = list(actions[self.position:])
        self.position = len(actions)
        return out
