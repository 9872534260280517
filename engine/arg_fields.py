"""Settings written once, as dataclass fields, and everything generated from them.

A settings dataclass (`EngineArgs`, `ServerArgs`, `RequestLimits`) declares each setting
as a field: its name, type hint, default, and `setting(help)` metadata. From those fields
come the command-line flags (`add_cli_args`), the values read from an argparse namespace
(`from_namespace`), the typed values of string keys such as Ray Serve's
`serve run app key=value` (`from_values`: "false" is False, "8" is 8, a dict setting's
string is a JSON object, an unknown key is an error naming its near misses), and the
Markdown reference of the docs (`markdown_table`). A field whose default is another
settings dataclass (`nested()`) puts that class's settings beside its own, under their own
names. `SettingsMixin` gives a settings dataclass these as its own class methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import MISSING, Field, dataclass
from typing import Any, Self

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null"})


def setting(help: str, *, cli: bool = True, key: bool = True, choices: tuple[str, ...] | None = None,
            note: str = "") -> dict[str, Any]:
    """A field's metadata. `cli=False`: no flag; `key=False`: not a key of string-keyed
    settings (Serve's app arguments), with `note` saying where it is set instead."""
    return {"help": help, "cli": cli, "key": key, "choices": choices, "note": note}


def nested() -> dict[str, Any]:
    """The metadata of a field holding another settings dataclass, whose settings are
    spelled beside this class's own (`--max-stop-strings`, not `--limits-max-stop-strings`)."""
    return {"nested": True}


@dataclass(frozen=True)
class Setting:
    """One setting as the generators see it."""

    name: str
    hint: Any  # the type, `| None` taken off
    optional: bool  # None is allowed
    default: Any
    help: str
    cli: bool
    key: bool
    choices: tuple[str, ...] | None
    note: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.hint) is list

    @property
    def is_dict(self) -> bool:
        return self.hint is dict or typing.get_origin(self.hint) is dict

    @property
    def type_name(self) -> str:
        if self.is_dict:
            name = "JSON object"
        elif self.is_list:
            name = f"list[{typing.get_args(self.hint)[0].__name__}]"
        else:
            name = getattr(self.hint, "__name__", str(self.hint))
        return name + (" | None" if self.optional else "")


def settings_of(cls: type) -> list[Setting]:
    """The settings of a dataclass in field order, nested ones in place of their field."""
    hints = typing.get_type_hints(cls)
    found: list[Setting] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("nested"):
            found += settings_of(hints[f.name])
            continue
        hint, optional = _strip_none(hints[f.name])
        found.append(Setting(f.name, hint, optional, _default(f), f.metadata.get("help", ""),
                             f.metadata.get("cli", True), f.metadata.get("key", True), f.metadata.get("choices"),
                             f.metadata.get("note", "")))
    return found


def _strip_none(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


# ----------------------------------------------------------------- flags
def add_cli_args(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = ()) -> Any:
    """One flag per setting (`--max-model-len`), with its help and default. The help shows
    the default as vLLM's does, "(default: 256)"; a None default is described by the help
    text itself ("default: the model's"), so that no help reads "default: None"."""
    for s in settings_of(cls):
        if s.name in skip or not s.cli:
            continue
        help_text = s.help.replace("%", "%%")
        if s.default is not None:
            help_text += " (default: %(default)s)"
        elif "default" not in help_text.lower():
            help_text += " (default: none)"
        if s.hint is bool:
            parser.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=s.default, help=help_text)
        elif s.is_dict:
            parser.add_argument(s.flag, type=_json_object_arg, default=s.default, metavar="JSON", help=help_text)
        elif s.is_list:
            parser.add_argument(s.flag, nargs="+", type=typing.get_args(s.hint)[0], default=s.default,
                                help=help_text)
        else:
            parser.add_argument(s.flag, type=s.hint, default=s.default, choices=s.choices, help=help_text)
    return parser


def _json_object_arg(text: str) -> dict[str, Any]:
    """argparse's type for a dict setting: a JSON object (`--speculative-config '{...}'`)."""
    try:
        return json_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def json_object(text: str) -> dict[str, Any]:
    """`text` parsed as a JSON object; a ValueError says why it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"a JSON object was expected, got {text!r} ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object was expected, got {text!r}")
    return value


def from_namespace(cls: type, namespace: argparse.Namespace) -> Any:
    """The settings dataclass from parsed flags; settings without a flag keep their default."""
    values = vars(namespace)
    return _build(cls, lambda s: values[s.name] if s.cli and s.name in values else s.default)


def _build(cls: type, value_of: Any) -> Any:
    """`cls(...)` with `value_of(setting)` for each setting, nested dataclasses built alike."""
    hints = typing.get_type_hints(cls)
    own = {s.name: s for s in settings_of(cls)}
    return cls(**{f.name: _build(hints[f.name], value_of) if f.metadata.get("nested") else value_of(own[f.name])
                  for f in dataclasses.fields(cls)})


# ------------------------------------------------------------ string keys
def known_keys(cls: type) -> list[str]:
    return [s.name for s in settings_of(cls) if s.key]


def unknown_keys_message(unknown: list[str], known: list[str], what: str) -> str:
    """"Unknown X 'maxx_tokens' (did you mean 'max_tokens'?)" for each unknown key."""
    hints = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=2)
        hints.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    return f"Unknown {what}: {', '.join(hints)}."


def from_values(cls: type, values: dict[str, Any], what: str = "setting") -> Any:
    """The settings dataclass from a dict of keys, typed: strings (what `serve run
    key=value` passes) are parsed by the field's type, other values checked against it. A
    key that is no setting, or that is set elsewhere (`key=False`), is a ValueError naming it."""
    settings = {s.name: s for s in settings_of(cls)}
    keys = [name for name, s in settings.items() if s.key]
    unknown = [name for name in values if name not in settings]
    if unknown:
        raise ValueError(unknown_keys_message(unknown, keys, what) + f" Allowed: {', '.join(keys)}.")
    for name in values:
        if not settings[name].key:
            raise ValueError(f"{name!r} is not a {what}: {settings[name].note}")
    return _build(cls, lambda s: parse_value(s, values[s.name]) if s.name in values else s.default)


def parse_value(s: Setting, value: Any) -> Any:
    """`value` as setting `s` holds it; a ValueError names the setting, the value and what
    is allowed."""
    if value is None or (isinstance(value, str) and s.optional and value.strip().lower() in _NONE):
        if s.optional:
            return None
        raise ValueError(f"{s.name} may not be None; it takes a {s.type_name}.")
    if s.is_dict:
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            try:
                return json_object(value)
            except ValueError as error:
                raise ValueError(f"{s.name}: {error}.") from None
        raise ValueError(f"{s.name} takes a dict (or a JSON object string), got {value!r}.")
    if s.is_list:
        item = typing.get_args(s.hint)[0]
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"{s.name} takes a list of {item.__name__} (or one string of comma-separated "
                             f"items), got {value!r}.")
        return [_parse_scalar(s, item, v.strip() if isinstance(v, str) else v) for v in items]
    parsed = _parse_scalar(s, s.hint, value)
    if s.choices is not None and parsed not in s.choices:
        raise ValueError(f"{s.name} must be one of {', '.join(s.choices)}, got {value!r}.")
    return parsed


def _parse_scalar(s: Setting, kind: Any, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{s.name} must be true or false, got {value!r}.")
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{s.name} must be {'an integer' if kind is int else 'a number'}, got {value!r}.")
        if isinstance(value, float) and kind is int and not value.is_integer():
            raise ValueError(f"{s.name} must be an integer, got {value!r}.")
        try:
            return kind(value) if not isinstance(value, float) or kind is float else int(value)
        except ValueError:
            raise ValueError(f"{s.name} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}.") from None
    if kind is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"{s.name} must be a string, got {value!r}.")
        return value
    return value  # a type the generators do not know: taken as given


# ---------------------------------------------------------------- the mixin
class SettingsMixin:
    """The class methods every top-level settings dataclass offers (`EngineArgs`,
    `ServerArgs`, `DeploymentArgs`), each the generator above applied to the class.
    `setting_kind` names its settings in errors ("Unknown engine argument: ...")."""

    setting_kind = "setting"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """One flag per setting (`--max-model-len`) but those in `skip`, with its help and
        default (see `add_cli_args`)."""
        return add_cli_args(parser, cls, skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Self:
        return from_namespace(cls, args)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> Self:
        """From string-keyed values (Ray Serve's `key=value` app arguments): strings parsed
        by each field's type; an unknown or misplaced key a ValueError naming it and its
        near misses."""
        return from_values(cls, values, cls.setting_kind)

    @classmethod
    def keys(cls) -> list[str]:
        """The string keys (Serve app keys) that are settings of this class."""
        return known_keys(cls)


# ------------------------------------------------------------------- docs
def markdown_table(cls: type, *, key_column: str | None = None, positional: tuple[str, ...] = ()) -> str:
    """A Markdown table of the settings: flag (`positional` ones shown as the command's
    argument), key (`key_column` names that column: "Serve app key", ...), type, default,
    help."""
    header = ["Flag"] + ([key_column] if key_column else []) + ["Type", "Default", "Description"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in settings_of(cls):
        flag = f"`{s.name.upper()}` (argument)" if s.name in positional else f"`{s.flag}`" if s.cli else "-"
        cells = [flag]
        if key_column:
            cells.append(f"`{s.name}`" if s.key else f"- ({s.note})" if s.note else "-")
        default = "-" if s.default is None else f"`{s.default!r}`" if isinstance(s.default, str) else f"`{s.default}`"
        description = s.help + (f" Choices: {', '.join(s.choices)}." if s.choices else "")
        cells += [f"`{s.type_name}`", default, description]
        # A pipe, even in a code span, would end the cell.
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"
