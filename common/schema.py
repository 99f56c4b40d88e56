"""Strict, typed loading of nested dataclasses from YAML-shaped dicts.

Every problem is reported with its dotted path (`model.model_config.num_layer: unknown
key; did you mean num_layers?`) and all problems are collected before failing, so a user
fixes a recipe in one pass. MindFormers silently ignores unknown keys; this does not.
"""

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal, Union

# Every integer key is bounded at load: MindSpore counts steps in int32 (the optimizer's global_step) and sizes and
# ids fit int32 too, so a larger value would fail only in the worker ("Cannot construct Tensor because of unsupported
# data type"). A key that MindSpore takes wider declares its own largest value: field(metadata=int_max(N)).
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
INT_MAX = "int_max"


def int_max(largest: int) -> dict:
    """Field metadata: the largest value an integer key takes, when it is not INT32_MAX."""
    return {INT_MAX: largest}


def _describe(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if dataclasses.is_dataclass(annotation):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _convert(annotation, value, path: str, problems: list, largest: int = INT32_MAX):
    """Return `value` converted to `annotation`, or None after recording a problem; `largest` bounds integers."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices and type(value) in {type(c) for c in choices}:
            return value
        problems.append(f"{path}: {value!r} is not {_describe(annotation)}")
        return None
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        tagged = [o for o in options if dataclasses.is_dataclass(o) and "type" in _hints(o)]
        if tagged and isinstance(value, dict):
            for option in tagged:
                if value.get("type") in typing.get_args(_hints(option)["type"]):
                    return load_dataclass(option, value, path, problems)
            known = [t for o in tagged for t in typing.get_args(_hints(o)["type"])]
            problems.append(f"{path}.type: {value.get('type')!r} is not one of {', '.join(map(repr, known))}")
            return None
        real = [o for o in options if o is not type(None)]  # None was handled above
        if len(real) == 1:  # Optional[X]: X's own, precise problems
            return _convert(real[0], value, path, problems, largest)
        for option in real:
            trial: list = []
            converted = _convert(option, value, path, trial, largest)
            if not trial:
                return converted
        problems.append(f"{path}: expected {_describe(annotation)}, got {value!r}")
        return None
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{path}: expected {_describe(annotation)}, got {value!r}")
            return None
        item_type = typing.get_args(annotation)[0]
        return [_convert(item_type, item, f"{path}[{i}]", problems, largest) for i, item in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return load_dataclass(annotation, value, path, problems)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if INT32_MIN <= value <= largest:
                return value
            why = " (MindSpore holds steps and sizes as 32-bit integers)" if largest == INT32_MAX else ""
            problems.append(f"{path}: {value} is out of range: must be from {INT32_MIN} to {largest}{why}")
            return None
    elif annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2**1024 else math.inf  # float() raises past the largest double
        elif isinstance(value, str):
            # PyYAML reads `1e-3` (no dot) as a string; accept what is unambiguously a number.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if math.isfinite(number):
                return number
            problems.append(f"{path}: must be a finite number, got {value!r}")
            return None
    elif annotation is str:
        if isinstance(value, str):
            return value
    elif annotation is dict:
        if isinstance(value, dict):
            return value
    else:
        raise TypeError(f"schema annotation {annotation!r} at {path} is not supported")  # a bug in a schema
    problems.append(f"{path}: expected {_describe(annotation)}, got {value!r}")
    return None


@functools.lru_cache(maxsize=None)  # resolving annotations is most of the loading time
def _hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=False)


def load_dataclass(cls, data: dict, path: str, problems: list):
    """Build `cls` from `data`, appending every problem (with its dotted path) to `problems`."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            suggestion = f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(fields)}"
            problems.append(f"{prefix}{key}: unknown key{suggestion}")
            continue
        largest = fields[key].metadata.get(INT_MAX, INT32_MAX)
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}", problems, largest)
    for name, field in fields.items():
        no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if name not in data and no_default:
            problems.append(f"{prefix}{name}: missing required key ({_describe(hints[name])})")
            kwargs[name] = None
    return cls(**kwargs)


def to_plain(obj):
    """Dataclasses -> plain dicts/lists, in field order, dropping keys whose value is None."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    return obj
