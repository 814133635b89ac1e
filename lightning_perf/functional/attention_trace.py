"""Which modules call PyTorch's fused attention entry, and how often: :class:`SDPACalls`.

Part of :mod:`lightning_perf.functional.attention` (import the public names from there). It serves two jobs: telling
that a module already computes its attention with :func:`torch.nn.functional.scaled_dot_product_attention` (timm's
``Attention`` with ``fused_attn=True``, MONAI's ``SABlock(use_flash_attention=True)``, Hugging Face's ``"sdpa"``
implementation), so that it is reported as already fused instead of swapped, and checking that a swapped module really
runs the fused kernel during training (the tests count calls per module over training steps).

The calls are seen through a :class:`~torch.overrides.TorchFunctionMode`, so they are counted whatever name the
caller imported the function under (``F.scaled_dot_product_attention``, ``torch.nn.functional...``, a ``from``
import). Calls to ``flash_attn.flash_attn_func`` (the CUDA-only flash-attn kernel) are not Python-dispatched and not
counted: count on CPU, or on CUDA in fp32, where every swapped call goes through SDPA.
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
