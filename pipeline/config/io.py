"""Config files: TOML and `section.key=value` overrides in, a validated RunConfig out, and TOML back.

The schema itself (the frozen dataclasses and their checks) is pipeline.config.schema; this module
only reads, merges, coerces and writes it.

Invariants:
- Loading refuses unknown keys and wrong types (a `ConfigError` naming the dotted key), so a
  typo never silently falls back to a default.
- Every bad input (a broken or unreadable file, a wrong type, a value out of range, an unknown
  key, a bad `--set`) raises `ConfigError` and nothing else; its one-line message names the
  dotted key (or the file) and what is allowed. The only file it reads is the config file itself:
  whether the paths, packages and devices the values name exist is pipeline.loop.preflight's.
- `dump_toml(load_config(x))` loads back to an equal config: the resolved config written to
  the run directory repeats the run exactly.
- `reference_markdown()` takes each key's meaning from the comment beside its field in the
  schema's source, so the reference (docs/configuration.md, `python -m pipeline.config`) cannot drift from it.
- Like pipeline.config.schema, importing it imports no torch (run.py's fast path for config errors).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

# _check and _show: the schema's own message helpers, so a refusal reads the same from either module
from pipeline.config.schema import RunConfig, _check, _show
from pipeline.errors import ConfigError


# TOML integers are 64-bit; larger ones would overflow torch, numpy and vLLM far from the config.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        plural = {int: "integers", float: "finite numbers", bool: "booleans", str: "strings"}
        return f"a list of {plural.get(elem) or _type_name(elem)}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:  # try the union's next type; the last refusal below names them all
                pass
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            elem = typing.get_args(tp)[0]
            return tuple(_coerce(elem, v, f"{key}[{i}]") for i, v in enumerate(value))
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            _check(_INT_MIN <= value <= _INT_MAX, key, "a 64-bit integer (TOML's range)", value)
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer beyond float range: refused below like inf
                number = math.inf
            if math.isfinite(number):
                return number
    elif tp is str:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate could be neither logged nor written back
                raise ConfigError(f"{key} must be UTF-8 text, got {_show(value)}") from None
            return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {_show(value)}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in hints:
            raise ConfigError(f"unknown key {_show(key)}; allowed here: {', '.join(names)}")
        kwargs[k] = _coerce(hints[k], v, key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a constructor refusing arguments is a config error, said plainly
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from nested dicts (as TOML parses)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a table of sections, got {type(data).__name__}")
    return _build(RunConfig, data)


def _parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"{where} nests arrays or tables too deeply to be a config") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `section.key=VALUE` (VALUE in TOML syntax; a bare word is a string)."""
    if "=" not in text:
        raise ConfigError(f"override {_show(text)} must look like section.key=value")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"override {_show(text)}: {_show(key)} is not a dotted key like trainer.lr")
    if "\n" in raw or "\r" in raw:
        raise ConfigError(f"override {key}: the value must be on one line, got {_show(raw)}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:  # not a TOML value: a bare word, taken as the string it reads
        value = raw
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"override {key}: the value nests too deeply, got {_show(raw)}") from None
    return key.split("."), value


def _merge(old: Any, new: Any) -> Any:
    """A table given to an override updates the table it replaces, key by key."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merge(old.get(k), v) for k, v in new.items()}}
    return new


def _apply_override(data: dict[str, Any], parts: list[str], value: Any) -> None:
    """Set data[parts[0]][parts[1]]... = value, refusing a path the schema does not have."""
    cls: Any = RunConfig
    node = data
    dotted = ".".join(str(p) for p in parts)
    if not parts:
        raise ConfigError("override with an empty key; use section.key=value")
    for i, part in enumerate(parts):
        here = ".".join(str(p) for p in parts[: i + 1])
        hints = typing.get_type_hints(cls)
        if part not in hints:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"override {dotted}: unknown key {_show(here)}; allowed here: {names}")
        if i == len(parts) - 1:
            node[part] = _merge(node.get(part), value)
            return
        cls = hints[part]
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"override {dotted}: {here} is a value ({_type_name(cls)}), not a section")
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{here} must be a table, got {_show(nxt)}")
        node = nxt


def _read_config_file(path: str | Path) -> dict[str, Any]:
    name = _show(str(path))
    # os.path's tests never raise: an unreadable or malformed path is simply "not there"
    if os.path.isdir(path):
        raise ConfigError(f"config file {name} is a directory, not a TOML file")
    if not os.path.exists(path):
        raise ConfigError(f"config file {name} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {name} is not a regular file")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {name} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")  # TOML is UTF-8; tolerate the BOM some editors write
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name} is not UTF-8 text (bad byte at offset {e.start})") from None
    return _parse_toml(text, f"config file {name}")


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> RunConfig:
    """Read a TOML file (or nothing: all defaults), apply `section.key=value` overrides, validate."""
    data = _read_config_file(path) if path is not None else {}
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    for key, value in items:
        _apply_override(data, key.split(".") if isinstance(key, str) else list(key), value)
    return config_from_dict(data)


# --------------------------------------------------------------------------- writing


# TOML basic strings allow no raw control character but tab; the rest are written as \uXXXX
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c)
                             for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_toml(cfg: Any) -> str:
    """Write a config dataclass as TOML (scalars first, then one table per nested dataclass)."""
    lines: list[str] = []

    def emit(obj: Any, prefix: str) -> None:
        scalars, tables = [], []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            (tables if dataclasses.is_dataclass(v) else scalars).append((f.name, v))
        if prefix and scalars:
            lines.append(f"\n[{prefix}]")
        for name, v in scalars:
            if v is not None:
                lines.append(f"{name} = {_toml_value(v)}")
        for name, v in tables:
            emit(v, f"{prefix}.{name}" if prefix else name)

    emit(cfg, "")
    return "\n".join(lines).lstrip("\n") + "\n"


def reference_markdown() -> str:
    """The config reference (docs/configuration.md): every section and key with its default and comment."""
    import inspect  # only here: the reference is printed once, loading a config never needs it

    lines: list[str] = []

    def section(cls: type, prefix: str) -> None:
        src = inspect.getsource(cls)
        comments = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+): [^=]+=.*?#\s*(.*)$", src, re.M)}
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, whole
        rows = []
        nested = []
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if dataclasses.is_dataclass(default):
                nested.append((f.name, type(default)))
                continue
            rows.append(f"| `{f.name}` | `{_toml_value(default)}` | {comments.get(f.name, '')} |")
        if rows:
            lines.append(f"\n**[{prefix}]** {doc}\n" if prefix else f"\n**top level** {doc}\n")
            lines.append("| key | default | meaning |\n| --- | --- | --- |")
            lines.extend(rows)
        for name, sub in nested:
            section(sub, f"{prefix}.{name}" if prefix else name)

    section(RunConfig, "")
    return "\n".join(lines).lstrip("\n") + "\n"

