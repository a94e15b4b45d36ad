"""What a stage's runtime needs from the model's side, and what one forward hands back to it.

The runtime (runtime.py) runs actions and knows nothing about Lightning; a :class:`StageProgram` runs one
micro-batch's forward through the stage's part of the model (for an unchanged LightningModule,
:class:`lightning_paci.integration.stage.lightning_program.LightningStageProgram`) and returns a
:class:`ForwardOutput`; :class:`BackwardHooks` are called around the stage's own backwards. A :class:`LogRecord`
is one ``self.log`` call of the user's step, carried upstream with the gradients (recorded and replayed by
integration/stage/logs.py). Two details of a forward's result live here too: a padding micro-batch's forward
(``padding_forward``), and how a loss is read without stopping the host ([Note: no host sync per micro-batch]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from lightning_paci.errors import StageFailure

__all__ = ["LOSS_KEY", "BackwardHooks", "ForwardOutput", "LogRecord", "StageProgram", "check_losses", "loss_value",
           "own_values", "padding_forward"]

LOSS_KEY = "__paci_loss__"  # the log record carrying the step's returned loss upstream


class LogRecord(NamedTuple):
    """One ``self.log`` call made by the user's step on the last stage, travelling upstream with the gradients."""

    name: str
    value: float | torch.Tensor  # a 0-dim device tensor on an accelerator ([Note: no host sync per micro-batch])
    batch_size: int
    options: tuple[tuple[str, Any], ...]  # prog_bar, logger, on_step, on_epoch, ...


@dataclass
class ForwardOutput:
    """What a stage's forward produced: ``outgoing`` (the next stage's block inputs, graph attached) on a non-last
    stage, or ``loss`` and the ``logs`` on the last stage."""

    outgoing: Any = None
    loss: torch.Tensor | None = None
    logs: list[LogRecord] = field(default_factory=list)
    result: Any = None  # an evaluation step's return value (last stage)
    skipped: bool = False  # dropped for a non-finite loss


class BackwardHooks(Protocol):
    """Called by the stage around its own local backwards (Lightning's ``on_before_backward`` / ``on_after_backward``
    for an unchanged LightningModule)."""

    def before_backward(self, loss: torch.Tensor) -> None: ...

    def after_backward(self) -> None: ...

    # ``self.log`` records made by hooks (this stage's and upstream stages'), travelling downstream with the
    # activations to the last stage, which is global rank 0 (see [Note: the logging rank] in integration/stage/logs.py)
    logs: list[LogRecord]


class StageProgram(Protocol):
    """Runs one micro-batch's forward through this stage's part of the model."""

    @property
    def module(self) -> nn.Module:  # the stage's module: its parameters are named in errors and are not activations
        ...

    def forward(self, data: Any, *step_args: Any, received: Any | None) -> ForwardOutput: ...


@contextlib.contextmanager
def padding_forward(module: torch.nn.Module) -> Iterator[None]:
    """A padding micro-batch's forward: no gradient, and every submodule in eval mode (BatchNorm statistics do not
    see the duplicated sample); the modes are restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def loss_value(loss: torch.Tensor, key: int, unchecked: list[tuple[int, torch.Tensor]], *, keep: bool | None,
               skip: bool) -> float | torch.Tensor:
    """[Note: no host sync per micro-batch]
    Reading a CUDA loss on the host (``float(loss)``) waits for the device to finish the forward, so the host could
    never run ahead of the last stage's device. On an accelerator the loss (and what the step logs) stays a 0-dim
    device tensor: it travels upstream inside the gradient message (a device-to-device copy), is combined with the
    other micro-batches' when the batch's logs are replayed (one host read per batch), and its finiteness is checked
    with the window's other losses right before the update that would use them (``check_losses``: one host read
    per update, which the gradient check makes anyway) -- still before any update, naming the micro-batch. A CPU
    loss is read at once (no device to wait for), as is every loss with ``nonfinite="skip"`` (``skip``), which must
    decide before the backward. ``keep`` forces the device form (True: tests run it on the CPU) or the host form;
    None decides by the loss's device. A kept loss is appended to ``unchecked`` with its micro-batch ``key``."""
    if (keep if keep is not None else loss.device.type != "cpu") and not skip:
        unchecked.append((key, loss))
        return loss
    return float(loss)


def own_values(records: list[LogRecord]) -> list[LogRecord]:
    """Received log records whose tensor values are views into the message's receive buffer, given their own
    storage: they wait for the batch's log replay, and would keep the whole buffer alive until then."""
    return [r._replace(value=r.value.clone()) if isinstance(r.value, torch.Tensor) else r for r in records]


def check_losses(unchecked: list[tuple[int, torch.Tensor]], stage: int, where: str) -> None:
    """Refuse an update after a non-finite loss kept on the device (``loss_value``); empties ``unchecked``."""
    if not unchecked:
        return
    pending = list(unchecked)
    unchecked.clear()
    finite = torch.isfinite(torch.stack([loss for _, loss in pending]))  # (losses,): one host read below
    if not bool(finite.all()):
        key, loss = pending[int((~finite).nonzero()[0, 0])]
        raise StageFailure(
            f"stage {stage}: the loss of micro-batch {key} is {float(loss)} at {where}. Pass "
            f"`PACIStrategy(nonfinite='skip')` to drop such micro-batches instead of stopping."
        )
