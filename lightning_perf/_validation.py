"""Argument checks shared by the constructors: the error names the owner, the argument, the value and what is valid.

One helper per kind of argument, so that the same mistake gets the same message everywhere: a number
(:func:`check_int`, :func:`check_number`), a flag, a choice, a list of ints (:func:`check_int_sequence`: a bare int
is refused), a list of names (:func:`check_str_sequence`: unknown names get a did-you-mean), a mapping
(:func:`check_mapping`: the first bad entry is named), a file stem (:func:`check_file_stem`), a device
(:func:`check_device`).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def is_int(value: Any, minimum: int | None = None) -> bool:
    """Whether ``value`` is an integer (not a bool) and, with ``minimum``, at least that."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(owner: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> Any:
    """Return ``value`` if it is an integer >= ``minimum`` (or None when allowed), else raise ``ValueError``."""
    if value is None and allow_none:
        return None
    if not is_int(value, minimum):
        expected = f"an integer >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected {expected}.")
    return value


def check_number(
    owner: str, name: str, value: Any, minimum: float = 0.0, maximum: float | None = None, *, exclusive: bool = False
) -> float:
    """Return ``value`` as a float if it is a finite number >= ``minimum`` (> with ``exclusive``) and <= ``maximum``,
    else raise ``ValueError``."""
    ok = is_number(value)
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


FILTER_FN = "None or a function `filter_fn(module, name) -> bool`"
"""What a ``filter_fn`` argument takes, for :func:`check_instance`."""


def check_instance(owner: str, name: str, value: Any, types: type | tuple[Any, ...], expected: str) -> Any:
    """Return ``value`` if it is an instance of ``types``, else raise ``TypeError`` saying ``expected``."""
    if not isinstance(value, types):
        raise TypeError(f"`{owner}({name}={_short_repr(value)})` is not valid. Expected {expected}.")
    return value


def check_device(owner: str, name: str, value: Any, allow_none: bool = False) -> Any:
    """Return ``value`` as a ``torch.device`` (or None when allowed), else raise ``TypeError`` for another type or
    ``ValueError`` for a string torch does not read as a device."""
    import torch  # not at the top: importing lightning_perf does not import torch

    if (value is None and allow_none) or isinstance(value, torch.device):
        return value
    expected = ("None, " if allow_none else "") + "a torch.device or a device string such as 'cpu' or 'cuda:0'"
    if not isinstance(value, str):
        raise TypeError(f"`{owner}({name}={_short_repr(value)})` is not valid. Expected {expected}.")
    try:
        return torch.device(value)
    except RuntimeError as err:
        raise ValueError(f"`{owner}({name}={value!r})` is not valid: {err}. Expected {expected}.") from None


def _short_repr(value: Any) -> str:
    """``repr(value)``, or the class name for an object whose repr spans lines (a module, an optimizer)."""
    text = repr(value)
    return text if "\n" not in text and len(text) <= 200 else f"<{type(value).__name__}>"


def check_int_sequence(owner: str, name: str, value: Any, minimum: int = 1) -> tuple[int, ...]:
    """Return ``value`` as a tuple if it is a non-empty list or tuple of integers >= ``minimum``, else raise
    ``ValueError``; a bare integer is refused with the list it probably meant (``[8]`` for ``8``)."""
    is_list = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    if is_list and value and all(is_int(v, minimum) for v in value):
        return tuple(value)
    hint = f" Did you mean {name}=[{value!r}]?" if is_int(value, minimum) else ""
    expected = f"a non-empty list of integers >= {minimum}"
    raise ValueError(f"`{owner}({name}={_short_repr(value)})` is not valid. Expected {expected}.{hint}")


def check_str_sequence(
    owner: str, name: str, value: Any, choices: Sequence[str], *, single: bool = True
) -> tuple[str, ...]:
    """Return ``value`` as a tuple of distinct names from ``choices``, else raise ``ValueError`` (an unknown name with
    the nearest valid one). With ``single``, one string stands for the list of that one name (``"onnx"`` is
    ``["onnx"]``); without, a string is refused."""
    items = [value] if single and isinstance(value, str) else value
    expected = f"a non-empty list of distinct names from {', '.join(map(repr, choices))}"
    expected += " (one name alone stands for a list of that name)" if single else ""
    shown = f"`{owner}({name}={_short_repr(value)})` is not valid"
    is_list = isinstance(items, Sequence) and not isinstance(items, (str, bytes))
    if not is_list or not items or not all(isinstance(v, str) for v in items):
        raise ValueError(f"{shown}. Expected {expected}.")
    for item in items:
        if item not in choices:
            close = difflib.get_close_matches(item, list(choices), 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{shown}: {item!r} is not one of them{hint}. Expected {expected}.")
    if len(set(items)) != len(items):
        raise ValueError(f"{shown}: a name repeats. Expected {expected}.")
    return tuple(items)


def check_mapping(
    owner: str, name: str, value: Any, entry: Callable[[Any, Any], str | None], expected: str
) -> Mapping[Any, Any]:
    """Return ``value`` if it is a mapping in which ``entry(key, item)`` finds no problem (``None``) with any entry,
    else raise ``TypeError`` (not a mapping) or ``ValueError`` saying the first problem and ``expected``."""
    if not isinstance(value, Mapping):
        raise TypeError(f"`{owner}({name}={_short_repr(value)})` is not valid. Expected {expected}.")
    for key, item in value.items():
        problem = entry(key, item)
        if problem:
            raise ValueError(f"`{owner}({name}={_short_repr(value)})` is not valid: {problem}. Expected {expected}.")
    return value


def check_file_stem(owner: str, name: str, value: Any) -> str:
    """Return ``value`` if it is a plain, non-hidden file name (no directory separator, no leading dot), else raise
    ``ValueError``."""
    separators = {"/", os.sep, os.altsep or "/"}
    if not isinstance(value, str) or not value or value.startswith(".") or any(c in value for c in separators):
        raise ValueError(
            f"`{owner}({name}={_short_repr(value)})` is not valid. Expected a plain, non-hidden file stem (no '/')."
        )
    return value
