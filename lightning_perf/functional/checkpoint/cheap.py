"""Recompute the outputs of a block's norms and activations in backward instead of keeping them, and nothing else.

Entry points: :class:`RecomputeCheapForward`, :func:`cheap_modules`, :func:`is_cheap` (:data:`CHEAP_MODULES`). Why these
outputs, and how a saved tensor becomes a recipe: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_perf.functional.checkpoint.apply import CheckpointedForward
from lightning_perf.functional.surgery import find_forward_patch

CHEAP_MODULES: tuple[type[nn.Module], ...] = tuple(
    cls
    for cls in (
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.GELU,
        nn.ReLU,
        nn.ReLU6,
        nn.SiLU,
        nn.Mish,
        nn.Tanh,
        nn.Sigmoid,
        nn.LeakyReLU,
        nn.ELU,
        nn.Hardswish,
        nn.Hardtanh,
        nn.Softplus,
    )
    if cls is not None
)
"""Module classes whose output may be recomputed from their input: deterministic, no running statistics."""


def is_cheap(module: nn.Module) -> bool:
    """Whether ``module``'s output may be recomputed from its input (a :data:`CHEAP_MODULES` type, not in place)."""
    return type(module) in CHEAP_MODULES and not getattr(module, "inplace", False)


def cheap_modules(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules inside ``block`` (qualified names) whose output could be recomputed, in ``named_modules`` order."""
    return [(f"{name}.{child}", m) for child, m in block.named_modules() if child and is_cheap(m)]


class _Recipe:
    """What a dropped output is made again from: the module, its input, and the saved view's place in the output."""

    __slots__ = ("input", "layout", "module", "version", "view")

    def __init__(self, module: nn.Module, input: torch.Tensor, layout: tuple[Any, ...], view: torch.Tensor) -> None:
        self.module = module
        self.input = input
        self.version = input._version
        self.layout = layout  # the output's (size, stride, storage offset)
        self.view = (view.size(), view.stride(), view.storage_offset() - layout[2])


def _recompute(recipe: Any) -> Any:
    if not isinstance(recipe, _Recipe):
        return recipe
    if recipe.input._version != recipe.version:
        raise RuntimeError(
            f"The input of {type(recipe.module).__name__}, whose output activation checkpointing recomputes in "
            "backward, was modified in place after the forward: its output cannot be made again."
        )
    with torch.no_grad(), torch.autograd.graph.disable_saved_tensors_hooks("recomputing a norm or activation"):
        out = recipe.module.forward(recipe.input)
    size, stride, _ = recipe.layout
    if out.size() != size or out.stride() != stride:
        raise RuntimeError(f"{type(recipe.module).__name__} recomputed an output of another layout.")
    view_size, view_stride, offset = recipe.view
    return out.as_strided(view_size, view_stride, out.storage_offset() + offset)


def _pop_hooks(*_: Any) -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


class RecomputeCheapForward(CheckpointedForward):
    """A block's forward that keeps the given modules' outputs out of autograd's saved tensors (see the module notes).

    A :class:`~lightning_perf.functional.checkpoint.apply.CheckpointedForward` kind, so
    :func:`~lightning_perf.functional.checkpoint.apply.remove_activation_checkpointing` removes it too. Parts of the
    block checkpointed on their own keep their own (innermost) saved-tensor hooks.

    Args:
        module: the block.
        modules: the modules inside it whose outputs are recomputed (each :func:`is_cheap`).
    """

    def __init__(self, module: nn.Module, modules: Sequence[nn.Module] = ()) -> None:
        super().__init__(module)
        self.modules = [m for m in modules if is_cheap(m)]
        self._outputs: dict[int, tuple[Any, nn.Module, torch.Tensor, tuple[Any, ...]]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self._outputs is not None or not self.modules:
            return self.call_original(*args, **kwargs)
        if torch.compiler.is_compiling():  # saved-tensor hooks are the compiler's to plan: run the block as it is
            return self.call_original(*args, **kwargs)
        self._outputs = {}
        handles = [m.register_forward_hook(self._note, with_kwargs=True) for m in self.modules]
        # torch's checkpoint does not recompute the same tensors under outer saved-tensor hooks: a checkpointed part
        # of the block runs without them (they are popped right before it and pushed back right after).
        for m in self.module.modules():
            if m is not self.module and find_forward_patch(m, CheckpointedForward) is not None:
                handles.append(m.register_forward_pre_hook(_pop_hooks))
                handles.append(m.register_forward_hook(self._push_hooks, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _recompute):
                return self.call_original(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
            self._outputs = None

    def _push_hooks(self, *_: Any) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, _recompute)

    def _note(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._outputs is None or len(args) != 1 or kwargs or not isinstance(output, torch.Tensor):
            return  # recomputed as `module.forward(input)`: one positional tensor, nothing else
        (input,) = args
        if not isinstance(input, torch.Tensor) or torch.is_autocast_enabled(output.device.type):
            return  # under autocast the module may run in another dtype than it would in backward
        storage = output.untyped_storage()
        if storage.nbytes():
            layout = (output.size(), output.stride(), output.storage_offset())
            self._outputs[storage.data_ptr()] = (StorageWeakRef(storage), module, input, layout)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._outputs is None:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return t
        entry = self._outputs.get(storage.data_ptr()) if storage.nbytes() else None
        if entry is None or entry[0].expired():  # two live storages never share an address: this is the output
            return t
        return _Recipe(entry[1], entry[2], entry[3], t)


__all__: list[str] = ["CHEAP_MODULES", "RecomputeCheapForward", "cheap_modules", "is_cheap"]
