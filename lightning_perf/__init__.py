"""Performance optimizations for PyTorch Lightning: callbacks and strategies you stack on any Trainer.

``import lightning_perf`` is cheap: callbacks and strategies load on first use, no optional dependency (torchao,
onnx, onnxruntime, tensorrt, flash-attn, matplotlib, monai) is imported until a feature needs it, and Lightning itself
is not imported either, so :mod:`lightning_perf.functional`, :mod:`lightning_perf.profiling` and
:mod:`lightning_perf.deploy` serve plain PyTorch training loops. ``from lightning_perf import
SlidingWindowInferenceCallback`` (or any other callback or strategy) imports only what it needs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lightning_perf._warnings import (
    FallbackWarning,
    LightningPerfWarning,
    MeasurementWarning,
    NoEffectWarning,
    PartialEffectWarning,
)

__version__ = "0.1.0"

__all__ = [
    "FallbackWarning",
    "LightningPerfWarning",
    "MeasurementWarning",
    "NoEffectWarning",
    "PartialEffectWarning",
    "__version__",
]

_LAZY_SUBPACKAGES = ("callbacks", "strategies", "tuning")

# Names for `Trainer(strategy="...")`. They go into Lightning's StrategyRegistry without importing Lightning here:
# at once when `lightning.pytorch.strategies` is loaded already, else the moment it finishes loading (an import hook,
# as wrapt's post-import hooks do). The entry builds the class on first use.
_STRATEGY_NAMES = {"ddp_powersgd": "PowerSGDDDPStrategy"}
_REGISTRY_MODULE = "lightning.pytorch.strategies"


def _build_strategy(class_name: str, **kwargs: Any) -> Any:
    return getattr(importlib.import_module("lightning_perf.strategies"), class_name)(**kwargs)


def _register_strategy_names(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    for name, class_name in _STRATEGY_NAMES.items():
        if name not in registry:
            registry.register(
                name, functools.partial(_build_strategy, class_name), description=f"lightning_perf {class_name}"
            )


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``lightning.pytorch.strategies``, then registers the names and steps aside."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            # The module keeps its real loader (importlib.resources, inspect and pickling read it).
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        _register_strategy_names(module)
        _STRATEGY_HOOK.uninstall()


class _StrategyNamesHook(importlib.abc.MetaPathFinder):
    """A meta path finder that only watches for ``lightning.pytorch.strategies``; every other name passes by."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False  # finding the real spec goes through sys.meta_path again: do not recurse

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _REGISTRY_MODULE or self._busy:
            return None
        with self._lock:
            self._busy = True
            try:
                spec = next(
                    (
                        found
                        for finder in list(sys.meta_path)
                        if finder is not self and hasattr(finder, "find_spec")
                        for found in [finder.find_spec(fullname, path, target)]
                        if found is not None
                    ),
                    None,
                )
            finally:
                self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


_STRATEGY_HOOK = _StrategyNamesHook()


def _register_now_or_on_import() -> None:
    loaded = sys.modules.get(_REGISTRY_MODULE)
    if loaded is not None and hasattr(loaded, "StrategyRegistry"):
        _register_strategy_names(loaded)
    else:
        _STRATEGY_HOOK.install()


_register_now_or_on_import()


def __getattr__(name: str) -> Any:
    # `from lightning_perf import ChannelsLastCallback` works without importing every callback up front.
    for sub in _LAZY_SUBPACKAGES:
        module = importlib.import_module(f"lightning_perf.{sub}")
        if name in getattr(module, "__all__", ()):
            return getattr(module, name)
    raise AttributeError(f"module 'lightning_perf' has no attribute {name!r}")
