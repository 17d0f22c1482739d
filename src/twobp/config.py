"""Typed configuration: dataclasses whose field docs are also the CLI help.

Each field of a config dataclass carries its help text in
``field(metadata={"help": ...})``; :func:`add_arguments` turns the fields into
``argparse`` options (``--field-name``) and :func:`from_namespace` builds the
dataclass back from the parsed arguments, so the two never drift apart.
:func:`read_toml` reads the same options from a TOML file, checked against the
field types and choices, and :func:`to_toml` writes them back.
:func:`check_writable` checks an output path option before any work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def doc(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field with help text (and optional ``choices``/``short``, or ``parse``
    and ``metavar``: the command line's own parser of the option, and its name in the help)."""
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


def _int_or_word(text: str) -> int | str:
    """An ``int | str`` option's value: an integer where it reads as one (``4``, not ``auto``)."""
    try:
        return int(text)
    except ValueError:
        return text


def add_arguments(
    parser: argparse.ArgumentParser, cls: type[Any], *, only_given: bool = False
) -> None:
    """Add one ``--option`` per field of the dataclass ``cls``.

    Booleans become ``--flag/--no-flag``; ``Optional[X]`` fields accept a value
    of ``X``; ``list[int]`` fields accept comma-separated values. ``choices``
    apply to every element of a list.

    Args:
        parser: the parser to add the options to.
        cls: the dataclass.
        only_given: leave the options that are not on the command line out of
            the parsed namespace (the help still shows the defaults), so that
            they can be told apart from values of a configuration file.
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
        if default is not None and (tp is not bool or only_given):
            shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
            help_text += f" (default: {shown})"
        if only_given:
            default = argparse.SUPPRESS
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
        choices = f.metadata.get("choices")
        if "parse" in f.metadata:
            # The command line's own form of the option (``--seq-len 64:256``).
            kwargs["type"] = f.metadata["parse"]
            kwargs["metavar"] = f.metadata.get("metavar")
        elif typing.get_origin(tp) in (list, tuple):
            kwargs["type"] = _comma_list(typing.get_args(tp)[0], choices)
            kwargs["metavar"] = "A,B,..."
        elif tp == int | str:
            kwargs["type"] = _int_or_word
        else:
            kwargs["type"] = tp if tp in (int, float, str) else str
            if choices is not None:
                kwargs["choices"] = choices
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


def read_toml(cls: type[Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """The options of a TOML file, checked against the fields of the dataclass ``cls``.

    Every key is a field's name, as written in Python (``seq_len``) or on the
    command line (``seq-len``); values have the field's type (an integer is
    also a float) and, where a field has ``choices``, one of them. An
    ``Optional`` field left out keeps its default (TOML has no null).

    Args:
        cls: the dataclass whose fields are the options.
        path: the TOML file.

    Returns:
        ``{field name: value}`` for the keys of the file.

    Raises:
        ValueError: one line naming the file, the key and what is wrong.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; keys are {', '.join(fields)}"
            raise ValueError(f"{path}: unknown key {key!r}{hint}")
        problem = _type_problem(hints[name], value, fields[name].metadata.get("choices"))
        if problem:
            raise ValueError(f"{path}: key {key!r} = {_toml_value(value)}: {problem}")
        values[name] = float(value) if _base_type(hints[name])[0] is float else value
    return values


def _type_problem(tp: Any, value: Any, choices: Collection[Any] | None) -> str | None:
    """What is wrong with ``value`` for a field of type ``tp`` (None if nothing)."""
    tp, _ = _base_type(tp)
    items = value if typing.get_origin(tp) in (list, tuple) else None
    if items is not None:
        if not isinstance(items, list):
            return "expected a list"
        inner = typing.get_args(tp)[0]
        problems = [_type_problem(inner, item, choices) for item in items]
        return next((p for p in problems if p), None)
    expected: dict[Any, str] = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        int | list[int]: "an integer or a list of integers",
    }
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp == int | str:
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
    elif tp == int | list[int]:
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in _listed(value))
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        return f"expected {expected.get(tp, 'a string')}"
    if choices is not None and value not in choices:
        return f"choose from {', '.join(map(str, choices))}"
    return None


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def to_toml(values: dict[str, Any], header: str = "") -> str:
    """``values`` as a flat TOML table that :func:`read_toml` reads back; None values left out.

    Args:
        values: ``{key: value}`` of booleans, numbers, strings or lists of them.
        header: a comment for the top of the file (lines without ``#``).
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string is a TOML basic string: the same quotes and escapes.
    return json.dumps(str(value), ensure_ascii=False)


def _comma_list(inner: Callable[[str], Any], choices: Collection[Any] | None) -> Any:
    """An argparse ``type`` for comma-separated values, each checked against ``choices``."""

    def parse(text: str) -> list[Any]:
        values = [inner(x) for x in text.split(",") if x]
        for value in values:
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {value!r} (choose from {', '.join(map(str, choices))})"
                )
        return values

    # argparse names the type in "invalid <name> value: ..."
    parse.__name__ = f"comma-separated {getattr(inner, '__name__', 'value')}"
    return parse


def check_writable(option: str, path: str | os.PathLike[str], *, folder: bool) -> None:
    """Check that an output path can be written, before any work starts.

    The folder that would hold it is probed with a temporary file (removed at
    once): permission bits do not tell about read-only mounts or special
    file systems, nor anything for root.

    Args:
        option: the option that gave the path, for the message (``"--out"``).
        path: a folder (created with its parents if missing) or a file (whose
            folder must exist).
        folder: True if ``path`` is a folder, False if it is a file.

    Raises:
        ValueError: naming the option, the path and what to do.
    """
    target = Path(path)
    if target.exists() and folder != target.is_dir():
        what = "a file, not a folder" if folder else "a folder, not a file"
        raise ValueError(f"{option} {path}: is {what}; give another path")
    if target.is_file() and not os.access(target, os.W_OK):
        raise ValueError(f"{option} {path}: is read-only; give another path")
    home = target if folder else target.absolute().parent
    if not folder and not home.is_dir():
        raise ValueError(
            f"{option} {path}: the folder {home} does not exist; create it or give another path"
        )
    while not home.exists():
        home = home.parent
    try:
        with tempfile.TemporaryFile(dir=home):
            pass
    except OSError as exc:
        raise ValueError(
            f"{option} {path}: cannot write in {home} ({exc.strerror or exc}); give another path"
        ) from None


def parse_overrides(text: str, option: str = "--overrides") -> dict[str, Any]:
    """Parse ``'a=1,b=2.5,c=x'`` into ``{"a": 1, "b": 2.5, "c": "x"}`` (config fields to change).

    Raises:
        ValueError: on a part without ``=``, naming ``option``.
    """
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{option}: expected name=value, got {part!r}")
        out[key.strip()] = _number(value.strip())
    return out


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
