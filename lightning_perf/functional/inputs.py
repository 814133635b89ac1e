"""The model inputs of a batch, as positional tensors: shared by training-time transforms and the deploy layer.

:func:`split_inputs` finds the model input in a data-loader batch (a tensor, an ``(inputs, targets)`` tuple, a dict);
:func:`as_input_tuple` checks example inputs (a tensor or a sequence of tensors, each with a batch dimension).
:class:`CapturedCall` is one call as ``forward`` received it (:class:`CallRecorder` keeps the first one of a run,
:func:`call_of` the one a function makes), so that exporters, int8 back-ends and parity checks call a model with
several or keyword inputs exactly as training did. Plain PyTorch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

__all__ = [
    "INPUT_KEYS",
    "CallRecorder",
    "CapturedCall",
    "PositionalCall",
    "as_input_tuple",
    "call_of",
    "export_shapes",
    "split_inputs",
]

# Batch keys taken as the model input when a data loader yields dicts; anything else needs `input_key`.
INPUT_KEYS = ("input", "inputs", "x", "image", "images", "pixel_values", "input_ids")


def split_inputs(batch: Any, input_key: str | None = None) -> tuple[Tensor, ...]:
    """The model inputs of a data-loader batch, as a tuple of positional tensors.

    A tensor is the input itself; of a tuple or list (``(x, y)``, ``(x, y, weights)``...) the first element is the
    input (a tensor, or a tuple of tensors for a multi-input model); of a dict, the value under ``input_key`` or under
    one of the usual keys (``input``, ``inputs``, ``x``, ``image``, ``images``, ``pixel_values``, ``input_ids``).

    Raises:
        ValueError: if no input can be found, or the input is a dict (a model whose ``forward`` takes a dict is not
            supported: export a wrapper module that takes tensors).
    """
    if isinstance(batch, Mapping):
        keys = [input_key] if input_key is not None else [k for k in INPUT_KEYS if k in batch]
        if not keys or keys[0] not in batch:
            wanted = repr(input_key) if input_key is not None else f"one of {', '.join(INPUT_KEYS)}"
            raise ValueError(
                f"The batch is a dict with keys {sorted(map(str, batch))} and none is {wanted}. Pass `input_key=` "
                "naming the model input."
            )
        return split_inputs(batch[keys[0]])
    if isinstance(batch, Tensor):
        return (batch,)
    if isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, Tensor):
            return (first,)
        if isinstance(first, (tuple, list)) and first and all(isinstance(t, Tensor) for t in first):
            return tuple(first)
        if isinstance(first, Mapping):
            raise ValueError(
                "The model input is a dict: a model whose `forward` takes a dict cannot be exported here. Export a "
                "wrapper module whose `forward` takes the tensors as positional arguments."
            )
    raise ValueError(
        f"Cannot find the model input in a batch of type {type(batch).__name__}. Expected a tensor, an (inputs, "
        "targets) tuple or a dict; or give example inputs or input shapes explicitly."
    )


def as_input_tuple(example: Any, what: str = "example_inputs") -> tuple[Tensor, ...]:
    """``example`` (a tensor or a sequence of tensors) as a tuple of tensors with a batch dimension.

    Raises:
        ValueError: for a dict (a model whose forward takes a dict is not supported), an empty sequence, a non-tensor,
            or a tensor without a batch dimension.
    """
    if isinstance(example, CapturedCall):
        if example.positional:
            return example.tensors
        raise ValueError(
            f"{what} is a call with keyword or non-tensor arguments ({', '.join(example.kwargs) or 'non-tensors'}): "
            "this path takes positional tensor inputs only."
        )
    if isinstance(example, Mapping):
        raise ValueError(
            f"{what} is a dict: a model whose `forward` takes a dict (keyword inputs) cannot be exported here. Export "
            "a wrapper module whose `forward` takes the tensors as positional arguments."
        )
    inputs = (example,) if isinstance(example, Tensor) else tuple(example) if isinstance(example, (tuple, list)) else ()
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise ValueError(f"{what} must be a tensor or a tuple of tensors, got {type(example).__name__}.")
    for i, t in enumerate(inputs):
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)}: expected a batch dimension of size >= 1 first.")
    return inputs


# ------------------------------------------------------------------------------------------------ the captured call


def _cpu(value: Any) -> Any:
    return pytree.tree_map_only(Tensor, lambda t: t.detach().cpu(), value)


@dataclass(frozen=True)
class CapturedCall:
    """One ``forward`` call as the model received it: positional and keyword arguments with their structure (tuples,
    dicts, ``None``, Python scalars), tensors detached on the CPU.

    Its *inputs* (:attr:`tensors`) are the tensors whose first dimension is the batch (the first tensor's leading
    size): what an export makes dynamic and an int8 back-end is fed, positionally (:meth:`adapter`). Every other value
    (``None``, scalars, a tensor without the batch dimension) stays as captured.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    source: str = "the call training made"

    def _batched(self) -> tuple[list[Any], Any, list[int]]:
        leaves, spec = pytree.tree_flatten((self.args, self.kwargs))
        sizes = [t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim()]
        return (
            leaves,
            spec,
            [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() and t.shape[0] == sizes[0]],
        )

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The inputs: the batched tensors, in the order of the call's arguments."""
        leaves, _, index = self._batched()
        return tuple(leaves[i] for i in index)

    @property
    def positional(self) -> bool:
        """Whether the call is its inputs, positionally (a model that needs no :meth:`adapter`)."""
        return not self.kwargs and len(self.tensors) == len(self.args) and all(isinstance(a, Tensor) for a in self.args)

    def names(self, module: nn.Module) -> list[str]:
        """A name per input: its parameter's name in ``module.forward`` (or keyword), with the path inside it."""
        try:
            kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            params = [p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in kinds]
        except (TypeError, ValueError):
            params = []
        paths, _ = pytree.tree_flatten_with_path((self.args, self.kwargs))

        def name(path: Any) -> str:
            where, first, *rest = (getattr(k, "idx", getattr(k, "key", k)) for k in path)
            head = first if where else params[first] if first < len(params) else f"input_{first}"
            return "_".join(map(str, [head, *rest]))

        return [name(paths[i][0]) for i in self._batched()[2]]

    def bind(self, tensors: tuple[Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with ``tensors`` in place of its inputs."""
        leaves, spec, index = self._batched()
        for i, tensor in zip(index, tensors):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)  # type: ignore[no-any-return]

    def inputs_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, ...]:
        """The inputs of another call of this one's structure (a validation or predict call)."""
        leaves = pytree.tree_leaves((args, kwargs))
        return tuple(leaves[i] for i in self._batched()[2])

    def adapter(self, module: nn.Module) -> nn.Module:
        """``module`` taking the inputs positionally (itself when the call is positional already)."""
        return module if self.positional else PositionalCall(module, self)


class PositionalCall(nn.Module):
    """``module`` taking a call's inputs as positional tensors and calling it as the call did; with ``reverse``, a
    positional-input model (an int8 ONNX session) standing in for ``module`` where it is called as the call was."""

    def __init__(self, module: nn.Module, call: CapturedCall, reverse: bool = False) -> None:
        super().__init__()
        self.module, self.call, self.reverse = module, call, reverse

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.reverse:
            return self.module(*self.call.inputs_of(args, kwargs))
        args, kwargs = self.call.bind(args)
        return self.module(*args, **kwargs)


def export_shapes(model: nn.Module, shapes: Any) -> Any:
    """Dynamic shapes, one per input, as ``torch.export`` wants them for ``model``: a :class:`PositionalCall` takes its
    inputs as ``*inputs``, which is one argument."""
    return (tuple(shapes),) if isinstance(model, PositionalCall) else tuple(shapes)


class CallRecorder:
    """Keeps the first call ``module``'s ``forward`` receives (:attr:`call`): a forward pre-hook with keyword
    arguments that removes itself after that call (:meth:`remove` takes it off if the call never came)."""

    def __init__(self, module: nn.Module, source: str = "the first training call") -> None:
        self.call: CapturedCall | None = None
        self.source = source
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.call = CapturedCall(_cpu(args), _cpu(kwargs), self.source)
        self.remove()

    def remove(self) -> None:
        self._handle.remove()


class _Stop(Exception):
    """Raised by :func:`call_of`'s hook: the call is known, the rest of the work is not needed."""


def call_of(module: nn.Module, run: Callable[[], Any], source: str, *, cpu: bool = True) -> CapturedCall | None:
    """The first call ``run()`` makes to ``module``'s ``forward``, which is not run (nor anything after it); ``None``
    when ``run`` finishes without calling it (or its class has no ``forward``). Tensors go to the CPU unless ``cpu``
    is false."""
    found: list[CapturedCall] = []

    def stop(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found.append(CapturedCall(_cpu(args), _cpu(kwargs), source) if cpu else CapturedCall(args, kwargs, source))
        raise _Stop

    handle = module.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            run()
    except (_Stop, NotImplementedError):
        pass
    finally:
        handle.remove()
    return found[0] if found else None
