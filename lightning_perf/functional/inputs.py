"""The model inputs of a batch, as positional tensors: shared by training-time transforms and the deploy layer.

:func:`split_inputs` finds the model input in a data-loader batch (a tensor, an ``(inputs, targets)`` tuple, a dict);
:func:`as_input_tuple` checks example inputs (a tensor or a sequence of tensors, each with a batch dimension).
Plain PyTorch; :mod:`lightning_perf.deploy.inputs` re-exports both with the rest of the deployment input helpers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["INPUT_KEYS", "as_input_tuple", "split_inputs"]

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
