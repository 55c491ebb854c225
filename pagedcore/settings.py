"""Engine settings from outside Python, all derived from `EngineConfig`'s fields.

One source: every CLI engine flag (`--max-num-seqs`), every `PAGEDCORE_<FIELD>` variable (the
BentoML door) and every key of the Triton door's model.json is an EngineConfig field, parsed by
the field's type, with the field's comment in config.py as its help text. A new field shows up in
all three without further code.

Stays light (no torch): `pagedcore --help` imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Mapping

from pagedcore.config import EngineConfig

ENV_PREFIX = "PAGEDCORE_"
_FIELD_LINE = re.compile(r"^\s*(\w+)\s*:[^=#]*(?:=[^#]*)?(?:#\s*(.*))?$")


@functools.cache
def field_help() -> dict[str, str]:
    """Field name -> its comment in config.py (the comment lines above it, then the one after it)."""
    helps: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(EngineConfig).splitlines()[1:]:
        text = line.strip()
        if text.startswith("def "):
            break
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        m = _FIELD_LINE.match(line)
        if m:
            helps[m.group(1)] = " ".join(above + ([m.group(2).strip()] if m.group(2) else []))
        above = []
    return helps


def _kinds(hint) -> tuple[type, bool]:
    """(the field's value type, whether it accepts None)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        return next(a for a in args if a is not type(None)), type(None) in args
    return hint, False


def parse_setting(name: str, raw: str, source: str | None = None) -> object:
    """A field's value from text, by the field's type ("none"/"null" for an optional field)."""
    hints = typing.get_type_hints(EngineConfig)
    if name not in hints:
        raise ValueError(f"unknown engine setting {name!r} (EngineConfig fields: {', '.join(sorted(hints))})")
    kind, optional = _kinds(hints[name])
    where = source or name
    if optional and raw.lower() in ("none", "null"):
        return None
    try:
        if kind is dict:  # e.g. speculative_config: a JSON object
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
        if kind is bool:
            if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError:  # json.JSONDecodeError included
        what = "JSON object" if kind is dict else kind.__name__
        raise ValueError(f"{where}={raw!r} is not a valid {what}") from None


def settings_from_env(environ: Mapping[str, str]) -> dict:
    """EngineConfig keyword arguments from PAGEDCORE_<FIELD> variables (unset or empty: default)."""
    settings = {}
    for f in dataclasses.fields(EngineConfig):
        var = ENV_PREFIX + f.name.upper()
        if environ.get(var, "") != "":
            settings[f.name] = parse_setting(f.name, environ[var], source=var)
    return settings


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--field-name` flag per EngineConfig field (booleans: --x / --no-x). Flags not given stay
    None and are left out of `settings_from_args`: the dataclass default (or the environment) decides."""
    g = parser.add_argument_group("engine (EngineConfig; default in brackets)")
    hints = typing.get_type_hints(EngineConfig)
    helps = field_help()
    for f in dataclasses.fields(EngineConfig):
        kind, _ = _kinds(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        text = f"{helps.get(f.name, '')} [{f.default}]".replace("%", "%%").strip()
        if kind is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, dest=f.name, default=None, metavar="JSON" if kind is dict else kind.__name__.upper(),
                           help=text,
                           type=functools.partial(_parse_arg, f.name))


def _parse_arg(name: str, raw: str) -> object:
    try:
        return parse_setting(name, raw, source="--" + name.replace("_", "-"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def settings_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the engine flags given on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
            if getattr(args, f.name, None) is not None}
