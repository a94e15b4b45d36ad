"""Every error lightning_paci raises for a user to read, in one place, each exported from ``lightning_paci``.

Bad options and Trainer settings are plain ``ValueError``/``TypeError`` at construction or setup, naming the
argument, the value, the rule and the fix; the classes below are the conditions a user may want to catch or look
up. Each derives from the builtin it refines (``ValueError`` for what the model or input cannot do, ``RuntimeError``
for what went wrong while running), so ``except ValueError`` keeps working. This module imports nothing, so the
engine and the pure tools can raise them without loading torch or Lightning.
"""

from __future__ import annotations

__all__ = [
    "BuildMismatchError",
    "CrossingError",
    "DataMismatchError",
    "LightningAPIError",
    "MetaLoadError",
    "NCCL_RULES",
    "NcclRuleError",
    "ReplicaMismatchError",
    "ScheduleError",
    "StageFailure",
    "StageMismatchError",
    "TensorPickleError",
    "WeightsError",
    "is_setup_error",
    "mark_setup_error",
]


# -- the model and its partition (at setup) ---------------------------------------------------------------------------
class CrossingError(ValueError):
    """A value computed by a module this stage does not run reaches code it does run, and cannot be relayed
    (partition/relay.py); the message names the module and the fix."""


class WeightsError(ValueError):
    """``weights=`` cannot fill the model: the file's keys and the module's names do not match."""


class MetaLoadError(ValueError):
    """``load_state_dict`` into meta parameters inside ``configure_model``: torch makes it a no-op with a warning;
    here it is an error pointing to ``weights=`` and ``ckpt_path=``."""


class BuildMismatchError(RuntimeError):
    """The replayed ``configure_model`` registered different parameters than the recorded one (it must build the
    same model each time it runs)."""


class ScheduleError(ValueError):
    """An action list that cannot run (bad order, unmatched message, deadlock). The message holds the grid."""


class LightningAPIError(RuntimeError):
    """A private Lightning symbol that lightning_paci relies on is missing or has changed."""


# -- while running --------------------------------------------------------------------------------------------------
class StageFailure(RuntimeError):
    """A pipeline stage cannot go on; the message names the stage and the reason (every other stage raises it too,
    naming the stage that failed first)."""


class StageMismatchError(RuntimeError):
    """A message between stages does not have the form the receiver can use."""


class ReplicaMismatchError(RuntimeError):
    """The data-parallel replicas of a stage disagree on which parameters received a gradient."""


class DataMismatchError(RuntimeError):
    """A stage trained on other batches than stage 0 (the data order differs between ranks)."""


class TensorPickleError(TypeError):
    """A tensor or storage was about to be pickled into a message header or an object collective."""


NCCL_RULES = {
    1: "group creation on a device-bound world",
    2: "a pair's first point-to-point operation meets the peer's",
    3: "collectives in one order on every member",
    4: "NCCL operations take device tensors only",
}


class NcclRuleError(RuntimeError):
    """A rule of NCCL's broken under the emulation (``LIGHTNING_PACI_EMULATE_NCCL=1``); ``rule`` is its number in
    :data:`NCCL_RULES` and [Note: NCCL emulation] (engine/transport/nccl_emulation.py)."""

    def __init__(self, rule: int, message: str) -> None:
        super().__init__(f"NCCL emulation, rule {rule} ({NCCL_RULES[rule]}): {message}")
        self.rule = rule


# -- the same error on every rank ------------------------------------------------------------------------------------
_SETUP_MARK = "_lightning_paci_setup_error"


def mark_setup_error(error: BaseException) -> BaseException:
    """Mark an error raised by the checks at setup: every rank runs the same checks and raises the same error, so
    rank 0 prints it in full and the others in one line, and no rank takes another's for the first failure."""
    setattr(error, _SETUP_MARK, True)
    return error


def is_setup_error(error: BaseException) -> bool:
    """Whether ``error`` was marked by :func:`mark_setup_error`."""
    return bool(getattr(error, _SETUP_MARK, False))
