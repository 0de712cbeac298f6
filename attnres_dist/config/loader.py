"""Loading a run configuration: YAML file plus dotted command-line overrides.

A run is described by a YAML file plus dotted command-line overrides
(``model.num_layers=12``). ``load_config`` merges them, checks every field's type and every
cross-field rule (``rules.py``), and raises ``ConfigError`` with one line naming the field, the
value and what is allowed. Nothing is built before the whole config is valid.
"""

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from attnres_dist.config.rules import validate
from attnres_dist.config.schema import Config
from attnres_dist.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """YAML file (optional) + ``a.b=value`` overrides -> a validated Config."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"file {str(path)!r} not found")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", -1) + 1
            raise ConfigError(str(path), f"invalid YAML near line {line}") from None
        if not isinstance(raw, dict):
            raise ConfigError(str(path), "top level must be a mapping of sections")
    for item in overrides:
        _apply_override(raw, item)
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def config_from_dict(raw: dict) -> Config:
    """A validated Config from a plain dict (e.g. one stored in a checkpoint)."""
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(repr(item), "overrides look like section.field=value")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[:-1]), "is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str):
    where = prefix.rstrip(".") or "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(where, f"got {raw!r}; expected a section (mapping)")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix}{close[0]!r}?" if close else f"known: {', '.join(names)}"
            raise ConfigError(f"{prefix}{key}", f"unknown field; {hint}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(tp, value, where: str):
    if tp is Any:  # checked by the field's own rule (rules.py)
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where + ".")
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(where, f"got {value!r}; expected {_type_name(tp)}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )
