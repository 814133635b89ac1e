"""Channels-last memory format for convolution weights and inputs, as plain functions on modules and tensors.

Entry points: :func:`apply_channels_last` (a :class:`ChannelsLastReport`), :func:`find_conv_layers`,
:func:`tensor_to_channels_last`, :func:`batch_to_channels_last`. Values never change, only strides. Why it pays and why
sharded (FSDP2) weights keep their layout: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_perf._validation import check_choice
from lightning_perf.functional.sharding import is_sharded_parameter

Dims = Literal["auto", 2, 3]

#: The memory format for tensors of each spatial rank: 2 -> 4D tensors (N, C, H, W), 3 -> 5D (N, C, D, H, W).
MEMORY_FORMATS: dict[int, torch.memory_format] = {2: torch.channels_last, 3: torch.channels_last_3d}


def validate_dims(dims: Any, owner: str = "apply_channels_last") -> Dims:
    """Return ``dims`` if it is ``"auto"``, 2 or 3; raise otherwise.

    Raises:
        ValueError: naming ``owner``, the value given and the valid ones.
    """
    return check_choice(owner, "dims", dims, ("auto", 2, 3))  # type: ignore[no-any-return]


def conv_spatial_dims(module: nn.Module) -> int | None:
    """The number of spatial dimensions of a convolution module's weight (2 or 3), or ``None`` if it is not one.

    Any ``_ConvNd`` counts (``Conv2d``, ``ConvTranspose3d``, quantization-aware and user subclasses); what decides is
    the rank of its initialized weight, so 1D convolutions and lazy modules that have not seen data yet are skipped.
    """
    if not isinstance(module, nn.modules.conv._ConvNd):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or isinstance(weight, nn.parameter.UninitializedParameter):
        return None
    return {4: 2, 5: 3}.get(weight.dim())


def find_conv_layers(model: nn.Module) -> dict[int, list[str]]:
    """Qualified names of the 2D and 3D convolution layers of ``model``: ``{2: [...], 3: [...]}``."""
    found: dict[int, list[str]] = {2: [], 3: []}
    for name, module in model.named_modules():
        spatial = conv_spatial_dims(module)
        if spatial is not None:
            found[spatial].append(name)
    return found


def resolve_dims(found: dict[int, list[str]], dims: Dims) -> tuple[frozenset[int], str | None]:
    """Which spatial ranks to convert for a model whose conv layers are ``found``, and why not, when none.

    Returns:
        The ranks to convert (a subset of ``{2, 3}``) and, when that set is empty, the reason in a sentence.
    """
    present = frozenset(d for d, names in found.items() if names)
    if not present:
        return frozenset(), "the model has no 2D or 3D convolution layers"
    if dims == "auto":
        return present, None
    if dims not in present:
        other = ", ".join(f"{d}D" for d in sorted(present))
        return frozenset(), f"dims={dims} was asked for but the model has only {other} convolution layers"
    return frozenset({dims}), None


@dataclass
class ChannelsLastReport:
    """What :func:`apply_channels_last` did.

    Attributes:
        dims: the spatial ranks that apply to this model (batches of these ranks should be converted too).
        layers: qualified names of the convolution layers now in channels-last format, by rank.
        changed: how many of their weights changed layout (1x1 kernels and weights converted before already match).
        sharded: layers whose weights are DTensor shards (FSDP2), left in their layout (see the module notes);
            their inputs are still converted.
        skipped_reason: why nothing applies, when ``dims`` is empty.
    """

    dims: frozenset[int] = frozenset()
    layers: dict[int, list[str]] = field(default_factory=lambda: {2: [], 3: []})
    changed: int = 0
    sharded: list[str] = field(default_factory=list)
    skipped_reason: str | None = None

    def summary(self) -> str:
        """One sentence for a log: the layers of each rank and their inputs' format."""
        text = "; ".join(
            f"{len(self.layers[d])} {d}D conv layer(s) and {d + 2}D inputs in {_format_name(MEMORY_FORMATS[d])}"
            for d in sorted(self.dims)
        )
        if self.sharded:
            text += (
                f" ({len(self.sharded)} of these layers have FSDP2-sharded weights: FSDP2 gathers them contiguous for "
                "each forward, so they stay as they are and the convolution kernels reorder them for the channels-last "
                "inputs)"
            )
        return text


def _format_name(memory_format: torch.memory_format) -> str:
    return str(memory_format).removeprefix("torch.")


def _to_format(tensor: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Convert a parameter's data (and gradient) in place, keeping the Parameter object; True if it changed."""
    changed = False
    if not tensor.is_contiguous(memory_format=memory_format):
        # Assigning `.data`, as `nn.Module._apply` does, keeps the Parameter object that optimizers and hooks hold.
        tensor.data = tensor.data.contiguous(memory_format=memory_format)
        changed = True
    if tensor.grad is not None and not tensor.grad.is_contiguous(memory_format=memory_format):
        tensor.grad = tensor.grad.contiguous(memory_format=memory_format)
    return changed


def apply_channels_last(model: nn.Module, dims: Dims = "auto") -> ChannelsLastReport:
    """Convert the weights of ``model``'s 2D/3D convolution layers to the channels-last formats, in place.

    Call it before the optimizer is built (the optimizer's state is created with the parameter's layout). Inputs need
    the same format: pass each batch through :func:`batch_to_channels_last` with ``report.dims``.

    Args:
        model: any module; only ``_ConvNd`` weights of rank 4 and 5 change.
        dims: ``"auto"`` converts every 2D and 3D convolution found; ``2`` or ``3`` only those of that rank.

    Returns:
        What was converted, and why nothing was when nothing applies.

    Raises:
        ValueError: for a ``dims`` other than ``"auto"``, 2 or 3.

    Example::

        report = apply_channels_last(model)
        for x, y in loader:
            x = batch_to_channels_last(x, report.dims)
    """
    dims = validate_dims(dims)
    found = find_conv_layers(model)
    target, reason = resolve_dims(found, dims)
    report = ChannelsLastReport(dims=target, skipped_reason=reason)
    modules = dict(model.named_modules())
    for spatial in sorted(target):
        for name in found[spatial]:
            weight = modules[name].weight
            if is_sharded_parameter(weight):
                report.sharded.append(name)
            else:
                report.changed += _to_format(weight, MEMORY_FORMATS[spatial])
            report.layers[spatial].append(name)
    return report


def tensor_to_channels_last(tensor: torch.Tensor, dims: Collection[int] = (2, 3)) -> torch.Tensor:
    """``tensor`` in the channels-last format of its rank if it is a floating-point 4D/5D tensor of ``dims``."""
    spatial = tensor.dim() - 2
    if spatial not in dims or spatial not in MEMORY_FORMATS or not tensor.is_floating_point():
        return tensor
    return tensor.contiguous(memory_format=MEMORY_FORMATS[spatial])


def batch_to_channels_last(batch: Any, dims: Iterable[int] = (2, 3)) -> Any:
    """Every floating-point 4D (``2 in dims``) and 5D (``3 in dims``) tensor of ``batch`` in channels-last format.

    ``batch`` may nest tensors in tuples, lists, dicts, named tuples and dataclasses; integer tensors (labels, masks)
    and tensors of other ranks are returned as they are.
    """
    wanted = frozenset(dims)
    if not wanted:
        return batch
    return apply_to_collection(batch, torch.Tensor, tensor_to_channels_last, dims=wanted)
