"""Moved public names: the old import path keeps working and warns, naming the new one.

Each old module keeps a table ``{old name: "new.module"}`` (or ``"new.module:new_name"`` when the name changed too) and
sets ``__getattr__ = moved_names(__name__, table)``. The new module is imported by name only when an old name is used,
so a shim never imports the layer it forwards to at load time.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(module_name: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each name of ``moved`` at its new place with a ``DeprecationWarning``."""

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        new_module, _, new_name = target.partition(":")
        new_name = new_name or name
        warnings.warn(
            f"{module_name}.{name} moved to {new_module}.{new_name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
