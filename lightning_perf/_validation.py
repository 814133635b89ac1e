"""Argument checks shared by the constructors: the error names the owner, the argument, the value and what is valid."""

from __future__ import annotations

import math
from typing import Any


def check_int(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> Any:
    """Return ``value`` if it is an integer >= ``minimum`` (or None when allowed), else raise ``ValueError``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected {expected}.")
    return value


def check_number(
    owner: str, name: str, value: Any, minimum: float = 0.0, maximum: float | None = None, *, exclusive: bool = False
) -> float:
    """Return ``value`` as a float if it is a finite number >= ``minimum`` (> with ``exclusive``) and <= ``maximum``,
    else raise ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > minimum if exclusive else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        bound = f"> {minimum:g}" if exclusive else f">= {minimum:g}"
        if maximum is not None:
            bound += f" and <= {maximum:g}"
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected a finite number {bound}.")
    return float(value)


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})` is not valid. Expected True or False.")
    return value


def check_optional_bool(owner: str, name: str, value: Any) -> bool | None:
    """Return ``value`` if it is a bool or None, else raise ``TypeError``."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"`{owner}({name}={value!r})` is not valid. Expected True, False or None.")
    return value


def check_choice(owner: str, name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """Return ``value`` if it is one of ``choices``, of the same type (``2.0`` is not ``2``, ``True`` is not ``1``),
    else raise ``ValueError``."""
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected one of {', '.join(map(repr, choices))}.")
    return value


def check_instance(owner: str, name: str, value: Any, types: type | tuple[type, ...], expected: str) -> Any:
    """Return ``value`` if it is an instance of ``types``, else raise ``TypeError`` saying ``expected``."""
    if not isinstance(value, types):
        raise TypeError(f"`{owner}({name}={_short_repr(value)})` is not valid. Expected {expected}.")
    return value


def _short_repr(value: Any) -> str:
    """``repr(value)``, or the class name for an object whose repr spans lines (a module, an optimizer)."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= 200 else f"<{type(value).__name__}>"
