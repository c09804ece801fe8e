"""Build a JobConfig from defaults, a TOML file and command-line overrides (CLI > TOML > defaults).

    python -m torchtrain.train --job.config_file job.toml --training.steps 50 --optimizer.lr=3e-4

Every value is checked against its field's type and range as it is read, and an unknown section or
key is rejected with the closest valid name, so a typo fails at once with a message that names the key
instead of being ignored or failing deep inside PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import typing
from typing import Any, Callable

from torchtrain.config import torchtitan
from torchtrain.config.fields import (
    ConfigError,
    coerce,
    default_of,
    did_you_mean,
    field_docs,
    field_types,
    is_bool,
    type_name,
)
from torchtrain.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_INTERNAL = "internal"


def _sections() -> dict[str, type]:
    """Section name -> dataclass, in declaration order."""
    return dict(typing.get_type_hints(JobConfig))


def _public_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get(_INTERNAL)}


def _is_table(tp: Any) -> bool:
    """A field typed as a dataclass is a nested table: `[section.field]` in TOML (e.g. [quantize.linear.float8])."""
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def tables(name: str, cls: type) -> list[tuple[str, type]]:
    """(dotted name, dataclass) of a section and of its nested tables, depth first; a section whose
    fields are all tables (e.g. [quantize]) lists only the tables."""
    types_ = field_types(cls)
    own = [f for f in _public_fields(cls) if not _is_table(types_[f])]
    out = [(name, cls)] if own or not any(_is_table(t) for t in types_.values()) else []
    for f in _public_fields(cls):
        if _is_table(types_[f]):
            out += tables(f"{name}.{f}", types_[f])
    return out


def _leaf_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The public fields of a table that are values, not nested tables."""
    types_ = field_types(cls)
    return {k: f for k, f in _public_fields(cls).items() if not _is_table(types_[k])}


def _field_type(cls: type | None, dotted: str) -> Any:
    """The type of `a.b.c` inside section `cls` (following nested tables), or None when unknown."""
    for part in dotted.split("."):
        types_ = field_types(cls) if cls is not None and dataclasses.is_dataclass(cls) else {}
        if part not in types_:
            return None
        cls = types_[part]
    return cls


def job_value(config: JobConfig, dotted: str) -> Any:
    """The resolved value of `SECTION.KEY` (`SECTION.TABLE.KEY` in a nested table) of a job; a ConfigError naming
    the key, and the closest one the job has, when there is no such key (nor a table instead of a value)."""
    section, _, rest = dotted.partition(".")
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"{dotted}: not a job key; expected SECTION.KEY as `python -m torchtrain.train --help` "
                          f"lists them{did_you_mean(section, list(sections))}")
    value, cls, path = vars(config)[section], sections[section], section
    for part in rest.split(".") if rest else []:
        fields = _public_fields(cls) if _is_table(cls) else {}
        if part not in fields:
            raise ConfigError(f"{dotted}: {path} has no key {part!r}{did_you_mean(part, list(fields))}")
        value, cls, path = vars(value)[part], field_types(cls)[part], f"{path}.{part}"
    if _is_table(cls):
        keys = list(_public_fields(cls))
        raise ConfigError(f"{dotted}: a table, not a value; name one of its keys "
                          f"({', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''})")
    return value


def _deep_update(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Merge `new` into `into`; nested tables merge key by key (a command-line key overrides one key of
    a TOML table, not the whole table)."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value


def _split_key(flag: str) -> tuple[str, str]:
    section, dot, key = flag.partition(".")
    if not dot or not section or not key:
        raise ConfigError(f"bad argument --{flag}: expected --section.key (e.g. --training.steps 10)")
    return section, key


def parse_cli(argv: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.key value`, `--section.key=value` and bare boolean flags into a nested dict
    (`--quantize.linear.float8.emulate` sets the key of a nested table)."""
    out: dict[str, dict[str, str]] = {}
    sections = _sections()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        flag, eq, value = arg[2:].partition("=")
        section, key = _split_key(flag)
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            tp = _field_type(sections.get(section), key)
            bool_flag = tp is not None and is_bool(tp)
            if nxt is None or (nxt.startswith("--") and bool_flag):
                if not bool_flag:
                    raise ConfigError(f"--{flag} needs a value (--{flag} VALUE or --{flag}=VALUE)")
                value = "true"
            else:
                value, i = nxt, i + 1
        *path, leaf = key.split(".")
        table = out.setdefault(section, {})
        for part in path:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--{flag}: {section}.{part} is given a value and a nested key")
        table[leaf] = value
        i += 1
    return out


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    if not os.path.isfile(path):
        raise ConfigError(f"[job.config_file] file not found: {path!r}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"[job.config_file] {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 only
        line = 1 + e.object[:e.start].count(b"\n")
        raise ConfigError(f"[job.config_file] {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at line "
                          f"{line}); TOML files must be UTF-8: re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                          ) from None
    except OSError as e:
        raise ConfigError(f"[job.config_file] cannot read {path}: {e.strerror}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: top-level key {section!r} is not a [section] table; keys belong in a section"
            )
    return data


def _build_section(name: str, cls: type, raw: dict[str, Any], origin: dict[str, str]) -> Any:
    fields = _public_fields(cls)
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key in fields:
            kwargs[key] = coerce(value, types_[key], f"{name}.{key}")
        elif name == "model":  # a model argument (checked against the model's arguments in preflight)
            extra[key] = value
        else:
            raise ConfigError(
                f"unknown key {name}.{key} ({origin[key]}){did_you_mean(key, list(fields))} "
                f"Valid keys of [{name}]: {', '.join(fields)}"
            )
    section = cls(**kwargs)
    if name == "model":  # the model's own arguments: kept raw here, coerced by the model registry
        section.overrides.update(extra)
        section.override_sources.update({key: origin[key] for key in extra})
    return section


def _import_custom_modules(raw: Any) -> None:
    """Import job.custom_imports first: they may register the models/datasets the job names."""
    import importlib

    if raw is None:
        return
    for name in coerce(raw, list[str], "job.custom_imports"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"[job.custom_imports] cannot import {name!r}: {e}") from None


def _merge_sources(argv: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]],
                                             list[tuple[str, str]]]:
    """The raw values of the job file overlaid by the command line, per section, where each came from,
    and the notices of torchtitan keys adapted on the way (`torchtitan.py`); imports
    job.custom_imports (they may register the models/datasets the job names)."""
    cli = parse_cli(argv)
    config_file = cli.get("job", {}).get("config_file")
    from_file = load_toml(config_file) if config_file else {}
    sections = _sections()
    merged: dict[str, dict[str, Any]] = {}
    origin: dict[str, dict[str, str]] = {}
    for source, data in ((f"in {config_file}", from_file), ("on the command line", cli)):
        for section, table in data.items():
            if section not in sections and section not in torchtitan.SECTIONS:
                raise ConfigError(
                    f"unknown config section [{section}] ({source}){did_you_mean(section, list(sections))}"
                    f" Sections: {', '.join(sections)}"
                )
            _deep_update(merged.setdefault(section, {}), table)
            origin.setdefault(section, {}).update({k: source for k in table})
    notices = torchtitan.translate(merged, origin)
    _import_custom_modules(merged.get("job", {}).get("custom_imports"))
    return merged, origin, notices


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build and validate the JobConfig (no process group needed; raises ConfigError)."""
    merged, origin, notices = _merge_sources(list(sys.argv[1:] if argv is None else argv))
    sections = _sections()
    built = {
        name: _build_section(name, cls, merged.get(name, {}), origin.get(name, {}))
        for name, cls in sections.items()
    }
    config = JobConfig(**built)
    config.job.notices = notices
    config.validate()
    return config


# ----------------------------------------------------------------------------------------- output
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):  # an inline table; unset (None) keys are left out, as TOML has no null
        return "{" + ", ".join(f"{f.name} = {_toml_value(getattr(value, f.name))}"
                               for f in dataclasses.fields(value) if getattr(value, f.name) is not None) + "}"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """The resolved config as {section: {key: value}} (unset keys are None): what `to_toml` writes.
    Nested tables are entries of their own, keyed by their dotted name ("quantize.linear.float8")."""
    out: dict[str, dict[str, Any]] = {}
    for name, cls in _sections().items():
        for dotted, _ in tables(name, cls):
            table = config
            for part in dotted.split("."):
                table = getattr(table, part)
            items = [(key, getattr(table, key)) for key in _leaf_fields(type(table))]
            if dotted == "model":
                items += sorted(table.overrides.items())
            out[dotted] = {key: value for key, value in items if not (dotted == "job" and key == "config_file")}
    return out


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML that `--job.config_file` reads back to the same JobConfig."""
    lines: list[str] = []
    for name, items in to_dict(config).items():
        lines.append(f"[{name}]")
        for key, value in items.items():
            lines.append(f"# {key} unset" if value is None else f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _help_entry(prefix: str, name: str, tp: Any, default: Any, doc: str) -> list[str]:
    shown = "unset" if default is None else _toml_value(default) if default is not dataclasses.MISSING else "required"
    out = [f"  --{prefix}.{name}  {type_name(tp)}  (default: {shown})"]
    out += [f"      {line}" for line in (doc or "(undocumented)").splitlines()]
    return out


def format_help(argv: list[str] | None = None,
                model_arguments: Callable[[str], list[tuple[str, Any, Any, str]]] | None = None) -> str:
    """Every key: type, default and docstring, section by section.

    `argv` (the command line) selects the job's model (`--model.name`, CLI > TOML, default llama3;
    job.custom_imports are imported first); `model_arguments(name)` -> [(key, type, default, doc)]
    lists that model's arguments under [model] (the entry point passes the model registry's)."""
    merged, _, _ = _merge_sources([a for a in (argv or []) if a not in ("-h", "--help")])
    model_name = merged.get("model", {}).get("name") or "llama3"
    lines = [
        "usage: python -m torchtrain.train [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: command line > TOML file > defaults. Booleans accept true/false (a bare flag means",
        "true); lists are comma-separated; `none` unsets an optional key.",
        "",
    ]
    for name, cls in ((t, c) for section, klass in _sections().items() for t, c in tables(section, klass)):
        lines.append(f"[{name}]")
        docs, types_ = field_docs(cls), field_types(cls)
        for fname, f in _leaf_fields(cls).items():
            lines += _help_entry(name, fname, types_[fname], default_of(f), docs.get(fname, ""))
        if name == "model" and model_arguments is not None:
            lines.append(f"  model arguments of {model_name!r} (override the flavor's preset value):")
            for key, tp, default, doc in model_arguments(model_name):
                lines += _help_entry(name, key, tp, default, doc)
        lines.append("")
    return "\n".join(lines)
