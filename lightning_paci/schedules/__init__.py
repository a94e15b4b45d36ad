"""Pipeline schedules as data: one ordered action list per stage.

Every part of lightning_paci (the runtime, the one-process reference executor, the simulator, the monitors and the
timeline pictures) reads the lists built here, so there is exactly one definition of what a stage does and when.
The package keeps one concept per module and re-exports all of them here, so importers write
``from lightning_paci.schedules import build_schedule, F, validate_schedule`` without knowing the layout:

* :mod:`~lightning_paci.schedules.actions`: action kinds, ``Action``, its text form, ``Schedule``, message keys,
  ``Interval`` (an action placed in time),
* :mod:`~lightning_paci.schedules.build`: the builder (compute order, lowering, tied-weight exchange),
* :mod:`~lightning_paci.schedules.analysis`: facts read off the lists (drift, in-flight depth, call rounds),
* :mod:`~lightning_paci.schedules.validate`: the validator and its step x stage grid,
* :mod:`~lightning_paci.schedules.communicators`: which communicator carries each message, the setup's groups,
* :mod:`~lightning_paci.schedules.deadlock`: the strict model of NCCL messaging, lists checked against it,
* :mod:`~lightning_paci.schedules.virtual`: virtual stages, their placement on devices and the devices' orders.

Importing this package imports neither torch nor lightning: the simulator and the command line stay light.
"""

from __future__ import annotations

from lightning_paci.schedules.actions import (
    COMPUTE_KINDS,
    OPT,
    RECV_B,
    RECV_F,
    RECV_KINDS,
    RECV_T,
    SEND_B,
    SEND_F,
    SEND_KINDS,
    SEND_T,
    Action,
    ActionKind,
    B,
    F,
    Interval,
    MessageKey,
    Schedule,
    ScheduleError,
    format_grid,
    message_key,
    parse_actions,
)
from lightning_paci.schedules.analysis import (
    activation_peaks,
    assign_rounds,
    chunk_drift_bounds,
    derived_drift_bound,
    drift_bound,
    inflight_profile,
    static_drift,
    static_tied_lags,
)
from lightning_paci.schedules.build import SCHEDULE_NAMES, VIRTUAL_SCHEDULE_NAMES, ScheduleName, build_schedule
from lightning_paci.schedules.communicators import (
    LAYOUTS,
    Communicator,
    communicator,
    layout_communicators,
    setup_groups,
)
from lightning_paci.schedules.deadlock import check_deadlock_free, check_group_creation
from lightning_paci.schedules.validate import stage_lists_from_text, validate_schedule
from lightning_paci.schedules.virtual import PLACEMENTS, stage_devices

__all__ = [
    "COMPUTE_KINDS",
    "LAYOUTS",
    "OPT",
    "RECV_B",
    "RECV_F",
    "RECV_KINDS",
    "RECV_T",
    "SCHEDULE_NAMES",
    "SEND_B",
    "SEND_F",
    "SEND_KINDS",
    "SEND_T",
    "Action",
    "ActionKind",
    "B",
    "Communicator",
    "F",
    "Interval",
    "MessageKey",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "VIRTUAL_SCHEDULE_NAMES",
    "PLACEMENTS",
    "activation_peaks",
    "assign_rounds",
    "build_schedule",
    "chunk_drift_bounds",
    "check_group_creation",
    "check_deadlock_free",
    "communicator",
    "derived_drift_bound",
    "drift_bound",
    "format_grid",
    "inflight_profile",
    "layout_communicators",
    "message_key",
    "parse_actions",
    "setup_groups",
    "stage_lists_from_text",
    "static_drift",
    "static_tied_lags",
    "stage_devices",
    "validate_schedule",
]
