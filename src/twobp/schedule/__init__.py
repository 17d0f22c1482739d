"""Schedules as data: actions, whole schedules, generators and passes (no torch)."""

from twobp.schedule.action import Action, Kind
from twobp.schedule.schedule import Schedule

__all__ = ["Action", "Kind", "Schedule"]
