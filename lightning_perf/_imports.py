"""Lazy availability checks for the optional dependencies.

Nothing here imports an optional package: availability is read from the installed distribution's metadata and
``importlib.util.find_spec``, so ``import lightning_perf`` stays cheap and a local folder that happens to share a
package's name cannot pass for the real thing (the check accelerate's ``is_<pkg>_available`` makes).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from functools import cache
from types import ModuleType

OPTIONAL_DEPENDENCIES: dict[str, tuple[str, str]] = {
    # import name: (distribution name, the extra that installs it)
    "torchao": ("torchao", "qat"),
    "onnx": ("onnx", "onnx"),
    "onnxscript": ("onnxscript", "onnx"),
    "onnxruntime": ("onnxruntime", "onnx"),
    "tensorrt": ("tensorrt", "tensorrt"),
    "torch_tensorrt": ("torch-tensorrt", "tensorrt"),
    "flash_attn": ("flash-attn", "flash"),
    "matplotlib": ("matplotlib", "plot"),
    "monai": ("monai", "monai"),
}

# onnxruntime ships under several distribution names (GPU builds among them).
_ALTERNATIVE_DISTRIBUTIONS = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-training")}


@cache
def is_available(module: str) -> bool:
    """Whether the optional package ``module`` is installed, without importing it.

    Raises:
        KeyError: if ``module`` is not one of :data:`OPTIONAL_DEPENDENCIES`.
    """
    distribution, _ = OPTIONAL_DEPENDENCIES[module]
    if importlib.util.find_spec(module) is None:
        return False
    for dist in _ALTERNATIVE_DISTRIBUTIONS.get(module, (distribution,)):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def install_hint(module: str) -> str:
    """The sentence that tells a user how to install ``module``."""
    distribution, extra = OPTIONAL_DEPENDENCIES[module]
    return (
        f"`{distribution}` is not installed. It is part of the `{extra}` extra: "
        f"`pip install 'lightning-perf[{extra}]'` (or `pip install {distribution}`)."
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
