"""Which modules call PyTorch's fused attention entry, and how often: :class:`SDPACalls`.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there): it tells that a module is
already fused, and lets tests check that a swapped module runs the fused kernel. What it sees and what it does not:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SDPACalls"]


class SDPACalls(TorchFunctionMode):
    """Count calls to :func:`torch.nn.functional.scaled_dot_product_attention` while active, per calling module.

    Args:
        model: the calls are attributed to the innermost of its submodules (by qualified name) running at the time;
            ``None``: every call counts under ``""``.

    Attributes:
        counts: module name -> calls.

    Example::

        with SDPACalls(model) as calls:
            model(x).sum().backward()
        assert calls.counts["blocks.0.attn"] == 1
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._model = model
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> SDPACalls:
        if self._model is not None:
            for name, module in self._model.named_modules():
                self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._stack.append(n)))
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._stack.clear()

    def _pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.counts[self._stack[-1] if self._stack else ""] += 1
        return func(*args, **(kwargs or {}))
