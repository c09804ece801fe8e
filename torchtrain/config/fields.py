"""Typed config fields: constraints, docstrings, and value coercion.

Each config section is a plain dataclass whose fields carry a type annotation, a default and an
attribute docstring (the string literal right after the field).  This module is the small amount of
machinery that turns those declarations into a validating parser:

* ``Annotated[int, Ge(1)]`` attaches a range constraint, checked on every value and shown by ``--help``;
* ``Literal["a", "b"]`` restricts a field to named choices;
* ``field_docs(cls)`` reads the attribute docstrings from the class source, so the documentation a
  reader sees in the code is the documentation ``--help`` prints;
* ``coerce(value, annotation, key)`` converts a TOML value or a command-line string to the field type,
  raising :class:`ConfigError` that names the key and the accepted values.
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import operator
import textwrap
import types
import typing
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

INT_LIMIT = 2**63


class ConfigError(ValueError):
    """A bad job configuration. The message names the offending key and how to fix it."""


class TextForm(abc.ABC):
    """Base of a table (a config dataclass) that may also be written as one string on the command line
    (`training.datasets`' `PATH:WEIGHT`)."""

    @classmethod
    @abc.abstractmethod
    def parse(cls, text: str, key: str) -> dict[str, Any]:
        """The table's dict from its command-line string; ConfigError naming `key` when the string is not one."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """Constraint: value <op> bound, for the operator its subclass names (`Ge`, `Gt`, `Le`)."""

    bound: float
    symbol: ClassVar[str]
    compare: ClassVar[Callable[[Any, Any], bool]]

    def check(self, value: Any) -> bool:
        return type(self).compare(value, self.bound)

    def __str__(self) -> str:
        return f"{self.symbol} {self.bound:g}"


class Ge(Bound):
    """Constraint: value >= bound."""

    symbol, compare = ">=", operator.ge


class Gt(Bound):
    """Constraint: value > bound."""

    symbol, compare = ">", operator.gt


class Le(Bound):
    """Constraint: value <= bound."""

    symbol, compare = "<=", operator.le


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", ""}


def did_you_mean(name: str, options: list[str]) -> str:
    """'; did you mean 'x'?' for the closest option (case-insensitive), or ''."""
    lowered = {o.lower(): o for o in options}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def _split_annotated(tp: Any) -> tuple[Any, tuple]:
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _optional_inner(tp: Any) -> Any | None:
    """Return T for ``T | None`` / ``Optional[T]``, else None."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    """Human-readable type, e.g. ``int (>= 1)``, ``float | None``, ``one of: linear, cosine``."""
    base, meta = _split_annotated(tp)
    inner = _optional_inner(base)
    if inner is not None:
        return f"{type_name(inner)} | None"
    origin = typing.get_origin(base)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in typing.get_args(base))
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(base) or (Any,)
        name = f"list[{type_name(arg)}]"
    elif dataclasses.is_dataclass(base):
        name = "{" + ", ".join(f"{k}: {type_name(t)}" for k, t in field_types(base).items()) + "}"
    else:
        name = getattr(base, "__name__", str(base))
    if meta:
        name += " (" + ", ".join(str(m) for m in meta) + ")"
    return name


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"[{key}] expects {expected}, got {value!r} ({type(value).__name__})")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (a TOML value or a CLI string) to type ``tp``; raise ConfigError if impossible."""
    base, meta = _split_annotated(tp)
    out = _coerce_base(value, base, key)
    if isinstance(out, float) and not math.isfinite(out):  # nan, inf, 1e999: never a setting
        raise ConfigError(f"[{key}] must be a finite number{''.join(f' {c}' for c in meta)}, got {out!r}")
    for constraint in meta:
        if out is not None and not constraint.check(out):
            raise ConfigError(f"[{key}] must be {constraint}, got {out!r}")
    return out


def _coerce_base(value: Any, tp: Any, key: str) -> Any:
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return coerce(value, inner, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ConfigError(
            f"[{key}] must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    if origin in (list, tuple):
        (arg, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            nested = typing.get_origin(_split_annotated(arg)[0]) in (list, tuple)
            sep = ";" if nested else ","  # a list of lists on the command line: "a,b;c,d"
            items = [v.strip() for v in value.split(sep) if v.strip()] if value.strip() else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise _fail(key, value, f"a list ({type_name(tp)})")
        return [coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(items)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _fail(key, value, "a boolean (true/false)")
    if tp is int:
        number = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str):
            try:
                number = int(value.strip().replace("_", ""))
            except ValueError:
                pass
        if number is None:
            raise _fail(key, value, "an integer")
        if not -INT_LIMIT <= number < INT_LIMIT:  # torch and numpy take 64-bit integers
            raise ConfigError(f"[{key}] {number} is out of range: integers must lie within +-2**63")
        return number
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise _fail(key, value, "a number")
        return number
    if tp is str:
        if isinstance(value, str):
            if "\x00" in value:  # no path, name or option holds one; the OS refuses it in paths
                raise ConfigError(f"[{key}] contains a NUL character (\\x00): {value!r}")
            return value
        raise _fail(key, value, "a string")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _coerce_table(value, tp, key)
    raise ConfigError(f"[{key}] has an unsupported type {tp!r} (a bug in the config declaration)")


def _coerce_table(value: Any, tp: type, key: str) -> Any:
    """A TOML table (dict) into the dataclass `tp`, each field coerced; a string goes through
    `tp.parse(text)` when the class has a command-line form (`TextForm`)."""
    if isinstance(value, tp):
        return value
    if isinstance(value, str) and issubclass(tp, TextForm):
        value = tp.parse(value, key)
    if not isinstance(value, dict):
        raise _fail(key, value, f"a table {type_name(tp)}")
    types_ = field_types(tp)
    unknown = [k for k in value if k not in types_]
    if unknown:
        raise ConfigError(f"[{key}] unknown key {unknown[0]!r}{did_you_mean(unknown[0], list(types_))} "
                          f"Valid keys: {', '.join(types_)}")
    missing = [f.name for f in dataclasses.fields(tp) if f.name not in value and default_of(f) is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"[{key}] needs {', '.join(missing)} ({type_name(tp)})")
    return tp(**{k: coerce(v, types_[k], f"{key}.{k}") for k, v in value.items()})


def is_bool(tp: Any) -> bool:
    base, _ = _split_annotated(tp)
    return base is bool


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> attribute docstring, read from the class source (inherited ones included)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints (with Annotated metadata kept) of a dataclass's init fields."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING
