"""Packages that export their public names on first use, so that importing one module costs only what it imports."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str], packages: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` that load each name of ``exports`` (name -> module) on first use,
    and any other name from the first of ``packages`` whose ``__all__`` holds it.

    ``namespace`` is the package's ``globals()``: a loaded name is cached there, so the module is looked up once.
    """
    module_name = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        source = exports.get(name) or next(
            (p for p in packages if name in getattr(importlib.import_module(p), "__all__", ())), None
        )
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
