"""The error of :func:`twobp.split`."""

from __future__ import annotations


class SplitError(ValueError):
    """A model that :func:`twobp.split` cannot cut as asked; the message says where and why."""
