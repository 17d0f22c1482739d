"""Typed configuration: dataclasses whose field docs are also the CLI help.

Each field of a config dataclass carries its help text in
``field(metadata={"help": ...})``; :func:`add_arguments` turns the fields into
``argparse`` options (``--field-name``) and :func:`from_namespace` builds the
dataclass back from the parsed arguments, so the two never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def doc(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field with help text (and optional ``choices``/``short``)."""
    metadata = {"help": text, **kwargs}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """Strip ``Optional``; return (inner type, is_optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Add one ``--option`` per field of the dataclass ``cls``.

    Booleans become ``--flag/--no-flag``; ``Optional[X]`` fields accept a value
    of ``X``; ``list[int]`` fields accept comma-separated values.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, _ = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([f.metadata["short"]] if "short" in f.metadata else [])
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()  # type: ignore[misc]
            if f.default_factory is not dataclasses.MISSING
            else None
        )
        help_text = f.metadata.get("help", "")
        if default is not None and tp is not bool:
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            help_text += f" (default: {shown})"
        if tp is bool:
            parser.add_argument(
                *names,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if typing.get_origin(tp) in (list, tuple):
            inner = typing.get_args(tp)[0]
            kwargs["type"] = lambda s, inner=inner: [inner(x) for x in s.split(",") if x]
            kwargs["metavar"] = "A,B,..."
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            kwargs["type"] = str
        parser.add_argument(*names, **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from parsed arguments (fields absent from ``ns`` keep defaults)."""
    values = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and hasattr(ns, f.name)
    }
    values.update(overrides)
    return cls(**values)
