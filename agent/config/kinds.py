"""How each configuration value type is read and shown: from TOML, from environment or
command-line text, and back to its TOML form.

A field's type annotation picks its :class:`Kind` (``int``, ``bool``, ``str``, ``Path``,
``Path | None``, ``tuple[int, ...]``, ``tuple[Path, ...]``); a new type is one more entry in
:data:`KINDS`. Converters raise ``ValueError``, ``TypeError`` or ``LookupError`` on a value of the
wrong form; the loader turns that into a :class:`~agent.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import ConfigError, InternalError


@dataclass(frozen=True)
class Kind:
    expected: str  # as a TOML value
    expected_text: str  # as environment or command-line text
    accepts: Callable[[Any], bool]  # is this already a valid field value?
    from_toml: Callable[[Any], Any]  # raises ValueError
    from_text: Callable[[str], Any]  # raises ValueError
    plain: Callable[[Any], Any]  # the TOML form, for to_dict
    rebase: Callable[[Any, Path], Any] = lambda value, base: value  # relative paths in the file


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(check: Callable[[Any], bool]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if not check(value):
            raise ValueError
        return value

    return convert


_BOOL_TEXT = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool_from_text(text: str) -> bool:
    return _BOOL_TEXT[text.strip().lower()]  # KeyError is a LookupError, caught as bad text


_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _int_from_text(text: str) -> int:
    # Plain decimal digits only: Python's int() also takes "8_0" (80) and non-ASCII digits.
    text = text.strip()
    if not _INT_TEXT.fullmatch(text):
        raise ValueError
    return int(text, 10)


def _is_number(value: Any) -> bool:
    """An int or float that is finite (a bool is not a number here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _float_from_toml(value: Any) -> float:
    if not _is_number(value):
        raise ValueError
    return float(value)


def _float_from_text(text: str) -> float:
    text = text.strip()
    if not _FLOAT_TEXT.fullmatch(text):  # as for ints; also refuses "nan" and "inf"
        raise ValueError
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def _path_from_any(value: Any) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise ValueError
    return Path(value)


def _optional_path_from_any(value: Any) -> Path | None:
    return None if value is None or value == "" else _path_from_any(value)


def _rebase_path(value: Path | None, base: Path) -> Path | None:
    return value if value is None else base / value  # an absolute value stays as it is


def _text_items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",")] if text.strip() else []


def _int_tuple(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(item) for item in value):
        raise ValueError
    return tuple(value)


def _path_tuple(value: Any) -> tuple[Path, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError
    return tuple(_path_from_any(item) for item in value)


KINDS: dict[Any, Kind] = {
    int: Kind(
        expected="an integer",
        expected_text="an integer",
        accepts=_is_int,
        from_toml=_require(_is_int),
        from_text=_int_from_text,
        plain=lambda value: value,
    ),
    float: Kind(
        expected="a number",
        expected_text="a number",
        accepts=lambda value: isinstance(value, float) and math.isfinite(value),
        from_toml=_float_from_toml,
        from_text=_float_from_text,
        plain=lambda value: value,
    ),
    bool: Kind(
        expected="true or false",
        expected_text="one of true, false, 1, 0, yes, no",
        accepts=lambda value: isinstance(value, bool),
        from_toml=_require(lambda value: isinstance(value, bool)),
        from_text=_bool_from_text,
        plain=lambda value: value,
    ),
    str: Kind(
        expected="a string",
        expected_text="a string",
        accepts=lambda value: isinstance(value, str),
        from_toml=_require(lambda value: isinstance(value, str)),
        from_text=lambda text: text,
        plain=lambda value: value,
    ),
    Path: Kind(
        expected="a path (a non-empty string)",
        expected_text="a path",
        accepts=lambda value: isinstance(value, Path),
        from_toml=_path_from_any,
        from_text=_path_from_any,
        plain=str,
        rebase=_rebase_path,
    ),
    Path | None: Kind(
        expected='a path, or "" for none',
        expected_text="a path, or empty for none",
        accepts=lambda value: value is None or isinstance(value, Path),
        from_toml=_optional_path_from_any,
        from_text=_optional_path_from_any,
        plain=lambda value: "" if value is None else str(value),
        rebase=_rebase_path,
    ),
    tuple[int, ...]: Kind(
        expected="a list of integers",
        expected_text="comma-separated integers",
        accepts=lambda value: isinstance(value, tuple) and all(_is_int(item) for item in value),
        from_toml=_int_tuple,
        from_text=lambda text: tuple(_int_from_text(item) for item in _text_items(text)),
        plain=list,
    ),
    tuple[Path, ...]: Kind(
        expected="a list of paths",
        expected_text="comma-separated paths",
        accepts=lambda value: isinstance(value, tuple)
        and all(isinstance(item, Path) for item in value),
        from_toml=_path_tuple,
        from_text=lambda text: _path_tuple(_text_items(text)),
        plain=lambda value: [str(item) for item in value],
        rebase=lambda value, base: tuple(base / item for item in value),
    ),
}


def kind_of(hint: Any) -> Kind:
    """The kind of a field's (evaluated) type annotation."""
    try:
        return KINDS[hint]
    except (KeyError, TypeError):
        raise InternalError(f"configuration field type {hint!r} has no parser") from None


# --------------------------------------------------------------------------------------------------
# Values in errors


def show(value: object) -> str:
    """A value in one short line, TOML-like (strings quoted, booleans lower case)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (str, Path)):
        text = json.dumps(str(value))
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(show(item) for item in value) + "]"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
               dict: "table"}


def show_toml(value: object) -> str:
    """A value read from TOML, with its TOML type (``8 (integer)``)."""
    type_name = _TOML_TYPES.get(type(value), type(value).__name__)
    return f"{show(value)} ({type_name})"


def invalid(key: str, expected: str, found: object) -> ConfigError:
    return ConfigError(f"invalid value for '{key}'", key=key, expected=expected, found=show(found))
