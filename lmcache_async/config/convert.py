"""Conversion of raw configuration values: an environment string or a YAML scalar becomes the
type of its key (booleans, numbers, lists, JSON objects, quoted strings read as LMCache reads
them) before the model validates it, and the messages that name a bad key or value.
"""

from __future__ import annotations

import ast
import difflib
import json
import types
import typing
import warnings
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from lmcache_async.config.model import LMCacheEngineConfig
from lmcache_async.errors import ConfigError

__all__ = ["convert_value", "did_you_mean", "format_error"]

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}
_NONE = {"", "none", "null", "~"}


def _field_kind(key: str) -> tuple[str, bool]:
    """('bool'|'int'|'float'|'str'|'list_int'|'list_str'|'dict'|'literal', optional)."""
    ann = LMCacheEngineConfig.model_fields[key].annotation
    optional = False
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = True
        ann = args[0]
        origin = typing.get_origin(ann)
    if origin is Literal:
        return "literal", optional
    if origin is list:
        (item,) = typing.get_args(ann)
        return ("list_int" if item is int else "list_str"), optional
    if origin is dict:
        return "dict", optional
    kinds: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "str"}
    return kinds.get(ann, "str"), optional


def _unquote(v: str) -> str:
    """A raw text value read the way LMCache reads environment values.

    Surrounding whitespace goes. A value wrapped in matching quotes is read as a Python string
    literal, so its escapes are honoured (``"{\\"a\\": 1}"`` is the JSON text ``{"a": 1}``);
    when it is not a valid literal only the outer quotes go, and when it is some other literal
    (``'a', 'b'``) it stays as it is. The content of a quoted value keeps its inner whitespace.
    """
    v = v.strip()
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        try:
            with warnings.catch_warnings():  # "C:\dir" keeps its backslash, whatever the warning filters
                warnings.simplefilter("ignore")
                parsed = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return v[1:-1]
        return parsed if isinstance(parsed, str) else v
    return v


def _clean_str(v: str) -> str:
    return _unquote(v).strip()


def convert_value(key: str, value: Any, source: str) -> Any:
    """Convert a raw value (env string, YAML scalar) to ``key``'s type; pydantic validates after.

    Raises :class:`ConfigError` naming key, value and source when the text cannot be converted.
    """
    if key not in LMCacheEngineConfig.model_fields:
        raise ConfigError(_unknown_key_message(key, source))
    kind, optional = _field_kind(key)
    if not isinstance(value, str):
        if kind == "list_int" and isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if kind == "list_str" and isinstance(value, str):
            return [value]
        return value
    text = _unquote(value)
    if kind != "str":  # a string keeps what its quotes enclosed; other kinds ignore the spaces
        text = text.strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(f"invalid value for {key}: {value!r} (from {source}): {why}")

    if optional and text.strip().lower() in _NONE:
        return None
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad("expected a boolean (true/false/1/0)")
    if kind == "int":
        try:
            return int(text, 0) if text.lower().startswith(("0x", "0o", "0b")) else int(text)
        except ValueError:
            raise bad("expected an integer") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise bad("expected a number") from None
    if kind in ("list_int", "list_str"):
        if text.startswith("["):
            try:
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError:
                    parsed = yaml.safe_load(text)
            except (yaml.YAMLError, RecursionError, ValueError):  # unparsable or absurdly nested
                raise bad("expected a list") from None
            if not isinstance(parsed, list):
                raise bad("expected a list")
            items = parsed
        else:
            items = [_clean_str(p) for p in text.split(",") if p.strip()]
        if kind == "list_int":
            try:
                return [int(i) for i in items]
            except (TypeError, ValueError):
                raise bad("expected a comma-separated list of integers") from None
        return [str(i) for i in items]
    if kind == "dict":
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):  # malformed, absurdly nested, or a > 4300-digit int
            raise bad("expected a JSON object") from None
        if not isinstance(parsed, dict):
            raise bad("expected a JSON object")
        return parsed
    return text


def did_you_mean(key: str, prefix: str = "") -> str:
    """``"; did you mean 'chunk_size'?"`` for a key close to one of ours (spelled with ``prefix``
    and upper case for a variable), else ``""``."""
    close = difflib.get_close_matches(key, LMCacheEngineConfig.model_fields, n=1)
    if not close:
        return ""
    name = f"{prefix}{close[0].upper()}" if prefix else close[0]
    return f"; did you mean {name!r}?"


def _unknown_key_message(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, LMCacheEngineConfig.model_fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown configuration key {key!r} (from {source}){hint}"


def format_error(key: str, value: Any, source: str, exc: ValidationError) -> str:
    """The one-line message of an invalid value: key, value, source and pydantic's reasons."""
    msgs = "; ".join(e["msg"] for e in exc.errors())
    return f"invalid value for {key}: {value!r} (from {source}): {msgs}"
