"""Typed run configuration: dataclasses <- YAML file <- ``key.sub=value`` command-line overrides.

Every option is documented exactly once, in its field's ``help`` where its section is defined (``sections.py``,
``data.py``, ``algo.py``, ``dapo.py``; ``megatron-dppo train --help-config`` prints them all). The root ``Config``
and the rules that span sections are ``root.py``; this module loads it. Loading goes:

1. ``Config()`` defaults;
2. the YAML file's sections overwrite them (``load_config(path)``);
3. command-line overrides ``algo.r_q=0.5 train.steps=20 eval.files=[a.jsonl,b.jsonl]`` overwrite those. Values
   are parsed as YAML scalars/lists and coerced to the field's declared type (``1e-5`` -> float, ``true`` ->
   bool, ``null`` -> None for optional fields);
4. ``Config.validate()`` checks ranges and choices; every error is a ``ValueError`` that names the key, the bad
   value and what would be valid.

An unknown key (in the file or on the command line) is an error naming it and listing the closest known keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from megatron_dppo.config.root import Config


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _options(cls: Any) -> list[dataclasses.Field]:
    """The fields of a section (class or instance) that are options: a field the run sets itself
    (``metadata["set_by"]``, e.g. the loss's temperature, from rollout.temperature) is neither read nor listed."""
    return [f for f in dataclasses.fields(cls) if "set_by" not in f.metadata]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional_section(tp: Any) -> type | None:
    """The section class of an optional section (``env: Optional[EnvConfig] = None``, ``model.lora``: absent, i.e.
    off, unless configured), else None."""
    if _is_optional(tp) and _is_dataclass_type(_strip_optional(tp)):
        return _strip_optional(tp)
    return None


def _build_section(cls: type, current: Any, data: Any, prefix: str) -> Any:
    """An optional section from a mapping, over ``current`` (None: the section's defaults); ``data`` None (or
    null) removes the section. The section validates itself when built (its errors name the key)."""
    if data is None or (isinstance(data, str) and data.lower() in ("null", "none", "~")):
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.')} must be a mapping (or null to leave it out), got {data!r}")
    values = dataclasses.asdict(current) if current is not None else {}
    hints = _hints(cls)
    names = {f.name for f in _options(cls)}
    for k, v in data.items():
        if k not in names:
            raise _unknown_key_error(prefix + str(k))
        values[k] = coerce(prefix + str(k), v, hints[k])
    return cls(**values)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted option name, e.g. ``algo.r_q``."""
    out: list[str] = []
    for f in _options(cls):
        tp = _hints(cls)[f.name]
        section = tp if _is_dataclass_type(tp) else _optional_section(tp)
        if section is not None:
            out.extend(all_keys(section, prefix + f.name + "."))
        else:
            out.append(prefix + f.name)
    return out


def _unknown_key_error(key: str) -> ValueError:
    close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.5)
    if not close:  # also try the last component against the leaf names (e.g. 'rq' -> algo.r_q)
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=3, cutoff=0.6)]
    hint = f"; did you mean {', '.join(close)}?" if close else "; run `megatron-dppo train --help-config` for all keys"
    return ValueError(f"unknown config key {key!r}{hint}")


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if _is_optional(tp):
        return _type_name(_strip_optional(tp)) + " or null"
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else typing.Union[tuple(args)]


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (a YAML-parsed scalar/list/dict or a raw string) to the declared type ``tp``."""
    bad = ValueError(f"{key}={value!r} is invalid: expected {_type_name(tp)}")
    if _is_optional(tp):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        tp = _strip_optional(tp)
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. a number or "preset": the first type that takes the value
        for arg in get_args(tp):
            try:
                return coerce(key, value, arg)
            except ValueError:
                continue
        raise bad
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{key}={value!r} is invalid: expected {_type_name(tp)}{hint}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, str)) and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise bad from None
            if f.is_integer():
                return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if tp is list or origin is list:
        if isinstance(value, str):  # a single path given without brackets
            value = [value] if value else []
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise bad
        (item_tp,) = get_args(tp) or (Any,)
        return [coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    raise TypeError(f"config field {key} has unsupported type {tp!r}")


def _apply(section: Any, data: dict, prefix: str) -> None:
    """Overwrite dataclass ``section`` in place from a (possibly nested) dict."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = _hints(type(section))
    names = {f.name for f in _options(section)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in names:
            raise _unknown_key_error(key)
        tp = hints[k]
        if _is_dataclass_type(tp):
            _apply(getattr(section, k), v if v is not None else {}, key + ".")
        elif (optional := _optional_section(tp)) is not None:
            setattr(section, k, _build_section(optional, getattr(section, k), v, key + "."))
        else:
            setattr(section, k, coerce(key, v, tp))


def set_option(cfg: Config, key: str, value: Any) -> None:
    """Set one dotted option (``algo.r_q``); ``model.hf_config.hidden_size`` sets one entry of a dict option."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        if dataclasses.is_dataclass(obj):
            names = {f.name for f in _options(obj)}
            if part not in names:
                raise _unknown_key_error(key)
            tp = _hints(type(obj))[part]
            if (optional := _optional_section(tp)) is not None:  # rebuilt whole: it validates itself
                rest = parts[i + 1:]
                if (rest and getattr(obj, part) is None and rest[0] != "name"
                        and "name" in optional.__dataclass_fields__):
                    raise ValueError(f"{key}: the {part} section is not configured; set {part}.name first (e.g. "
                                     f"{part}.name=... {key}=...)")
                data = value
                if rest:
                    data = dataclasses.asdict(getattr(obj, part)) if getattr(obj, part) is not None else {}
                    if rest[0] not in optional.__dataclass_fields__:
                        raise _unknown_key_error(key)
                    node = data
                    for sub in rest[:-1]:  # env.kwargs.timeout_s: one entry of a dict option
                        node = node.setdefault(sub, {})
                        if not isinstance(node, dict):
                            raise ValueError(f"{'.'.join(parts[:i + 2])} is not a mapping option, it has no "
                                             f"sub-key {'.'.join(rest[1:])!r}")
                    node[rest[-1]] = value
                setattr(obj, part, _build_section(optional, None, data, ".".join(parts[:i + 1]) + "."))
                return
            if i == len(parts) - 1:
                if _is_dataclass_type(tp):
                    _apply(getattr(obj, part), value, key + ".")
                else:
                    setattr(obj, part, coerce(key, value, tp))
                return
            if not _is_dataclass_type(tp) and not (
                    tp is dict or get_origin(tp) is dict):
                raise ValueError(f"{'.'.join(parts[:i + 1])} is a {_type_name(tp)} option, it has no sub-key "
                                 f"{'.'.join(parts[i + 1:])!r}")
            obj = getattr(obj, part)
        elif isinstance(obj, dict):
            if i == len(parts) - 1:
                obj[part] = value
                return
            obj = obj.setdefault(part, {})
    raise _unknown_key_error(key)


def parse_override(text: str) -> tuple[str, Any]:
    """``'algo.r_q=0.5'`` -> ``('algo.r_q', 0.5)``; the value is parsed as YAML (lists: ``[a,b]``)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ValueError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                validate: bool = True) -> Config:
    """Defaults <- YAML file <- overrides, then validation (see module docstring)."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config file {str(p)!r} does not exist")
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} is a directory, not a YAML file")
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise ValueError(f"config file {str(p)!r}: line {line} is not valid UTF-8 (byte 0x{raw[err.start]:02x} "
                             f"at offset {err.start}); save the file as UTF-8") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {err}") from err
        _apply(cfg, data, "")
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        set_option(cfg, key, value)
        overridden.add(key)
    return cfg.validate(overridden) if validate else cfg


def describe(cls: type = Config, prefix: str = "") -> str:
    """Human-readable reference of every option: key, type, default, help (``--help-config``)."""
    lines: list[str] = []
    defaults = cls()
    for f in _options(cls):
        tp = _hints(cls)[f.name]
        section = tp if _is_dataclass_type(tp) else _optional_section(tp)
        if section is tp:
            lines.append(f"\n[{prefix}{f.name}]  {(tp.__doc__ or '').strip().splitlines()[0]}")
            lines.append(describe(tp, prefix + f.name + "."))
        elif section is not None:
            lines.append(f"\n[{prefix}{f.name}]  (default null: off) {f.metadata.get('help', '')}\n  "
                         f"{(section.__doc__ or '').strip().splitlines()[0]}")
            lines.append(_describe_fields(section, prefix + f.name + "."))
        else:
            default = getattr(defaults, f.name)
            lines.append(f"  {prefix}{f.name}: {_type_name(tp)} = {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _describe_fields(cls: type, prefix: str) -> str:
    """The fields of an optional section (its defaults read from the field declarations: the section itself may
    refuse to be built empty)."""
    lines = []
    for f in _options(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {prefix}{f.name}: {_type_name(_hints(cls)[f.name])} = {default!r}\n      "
                     f"{f.metadata.get('help', '')}")
    return "\n".join(lines)
