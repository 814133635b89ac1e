"""Lazy availability checks for the optional dependencies.

Nothing here imports an optional package: availability is read from the installed distribution's metadata and
``importlib.util.find_spec``, so ``import lightning_perf`` stays cheap and a local folder that happens to share a
package's name cannot pass for the real thing (the check accelerate's ``is_<pkg>_available`` makes).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from functools import cache
from types import ModuleType


@dataclass(frozen=True)
class OptionalDependency:
    """An optional package: its import name, its distribution name and the extra that installs it."""

    module: str
    distribution: str
    extra: str


OPTIONAL_DEPENDENCIES: dict[str, OptionalDependency] = {
    dep.module: dep
    for dep in (
        OptionalDependency("torchao", "torchao", "qat"),
        OptionalDependency("onnx", "onnx", "onnx"),
        OptionalDependency("onnxscript", "onnxscript", "onnx"),
        OptionalDependency("onnxruntime", "onnxruntime", "onnx"),
        OptionalDependency("tensorrt", "tensorrt", "tensorrt"),
        OptionalDependency("torch_tensorrt", "torch-tensorrt", "tensorrt"),
        OptionalDependency("flash_attn", "flash-attn", "flash"),
        OptionalDependency("matplotlib", "matplotlib", "plot"),
        OptionalDependency("monai", "monai", "monai"),
    )
}

# onnxruntime ships under several distribution names (GPU builds among them).
_ALTERNATIVE_DISTRIBUTIONS = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training")}


@cache
def is_available(module: str) -> bool:
    """Whether the optional package ``module`` is installed, without importing it.

    Raises:
        KeyError: if ``module`` is not one of :data:`OPTIONAL_DEPENDENCIES`.
    """
    dep = OPTIONAL_DEPENDENCIES[module]
    if importlib.util.find_spec(dep.module) is None:
        return False
    for dist in _ALTERNATIVE_DISTRIBUTIONS.get(dep.module, (dep.distribution,)):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def install_hint(module: str) -> str:
    """The sentence that tells a user how to install ``module``."""
    dep = OPTIONAL_DEPENDENCIES[module]
    return (
        f"`{dep.distribution}` is not installed. It is part of the `{dep.extra}` extra: "
        f"`pip install 'lightning-perf[{dep.extra}]'` (or `pip install {dep.distribution}`)."
    )


def require(module: str, purpose: str | None = None) -> ModuleType:
    """Import and return the optional package ``module``, or raise a ``ModuleNotFoundError`` naming its extra.

    Args:
        module: import name, one of :data:`OPTIONAL_DEPENDENCIES`.
        purpose: what needs it, prefixed to the message (e.g. ``"QATCallback(backend='torchao')"``).

    Raises:
        ModuleNotFoundError: if the package is not installed.
    """
    if not is_available(module):
        prefix = f"{purpose} needs `{module}`. " if purpose else ""
        raise ModuleNotFoundError(prefix + install_hint(module), name=module)
    return importlib.import_module(module)


def is_onnx_available() -> bool:
    return is_available("onnx") and is_available("onnxscript")


def is_onnxruntime_available() -> bool:
    return is_available("onnxruntime")


def is_flash_attn_available() -> bool:
    return is_available("flash_attn")


def is_matplotlib_available() -> bool:
    return is_available("matplotlib")
