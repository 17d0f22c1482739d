"""Schedules as data: actions, whole schedules, generators and passes (no torch).

A schedule is a :class:`Schedule`: for each rank, its ordered list of
:class:`Action` (text form ``1F0``, ``0I3``, ``2W0-3``). What each kind of
action is (its :class:`Role`), needs, makes, costs and holds in memory
(:class:`MemoryChange`) is one table (:data:`KINDS`; a kind beyond it carries
its own entry, :func:`declare_kind`); :func:`walk` runs a schedule in time by
that table.
Generators build the named schedules (:func:`generate`, :data:`SCHEDULES`);
:func:`prepare` (:func:`source_schedule`, then :func:`finish_schedule`) is
the one pass every user of a runnable schedule takes it from; smaller
passes turn one schedule into another (:func:`apply_two_bp`,
:func:`fuse_first_stage_backward`, :func:`add_communication`,
:func:`merge_backward`); :func:`validate` checks one
and :func:`save_csv` / :func:`load_csv` store one in
``torch.distributed.pipelining``'s CSV layout.
"""

from twobp.schedule.action import Action, Kind
from twobp.schedule.csv_io import from_rows, load_csv, save_csv, to_rows
from twobp.schedule.errors import DeadlockError
from twobp.schedule.kinds import (
    KINDS,
    ActionKind,
    DeclaredKind,
    KindSpec,
    MemoryChange,
    Moment,
    Need,
    Role,
    declare_kind,
    register_kind,
)
from twobp.schedule.lowering import (
    add_communication,
    compute_only,
    forward_only,
    fuse_first_stage_backward,
    is_split,
    merge_backward,
    split_stages,
)
from twobp.schedule.prepare import (
    DEFAULT_MICROBATCHES,
    ScheduleConfigError,
    finish_schedule,
    prepare,
    source_schedule,
)
from twobp.schedule.rebuild import mark_rebuilds, rebuilt_microbatches
from twobp.schedule.registry import SCHEDULES, ScheduleInfo, generate
from twobp.schedule.schedule import Schedule
from twobp.schedule.two_bp import TWO_BP_POLICIES, apply_two_bp
from twobp.schedule.validate import ScheduleError, dry_run, format_grid, validate
from twobp.schedule.walk import Run, Walk, walk

__all__ = [
    "DEFAULT_MICROBATCHES",
    "KINDS",
    "SCHEDULES",
    "TWO_BP_POLICIES",
    "Action",
    "ActionKind",
    "DeadlockError",
    "DeclaredKind",
    "Kind",
    "KindSpec",
    "MemoryChange",
    "Moment",
    "Need",
    "Role",
    "Run",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleError",
    "ScheduleInfo",
    "Walk",
    "add_communication",
    "apply_two_bp",
    "compute_only",
    "declare_kind",
    "dry_run",
    "finish_schedule",
    "format_grid",
    "forward_only",
    "from_rows",
    "fuse_first_stage_backward",
    "generate",
    "is_split",
    "load_csv",
    "mark_rebuilds",
    "merge_backward",
    "prepare",
    "rebuilt_microbatches",
    "register_kind",
    "save_csv",
    "source_schedule",
    "split_stages",
    "to_rows",
    "validate",
    "walk",
]
