"""Example inputs of the deployment layer: example tensors made from shapes (:func:`example_inputs_from_shapes`),
each input's min/opt/max shapes (:func:`build_input_specs`), and the batch path (:func:`through_batch_hooks`: a batch
through the datamodule's and the module's own transfer hooks, found by duck typing, without importing Lightning).
The model inputs of a batch come from :mod:`lightning_perf.functional.inputs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_perf._device import as_device
from lightning_perf._validation import is_int
from lightning_perf.functional.inputs import CapturedCall, as_input_tuple, call_of, split_inputs

__all__ = [
    "BATCH_HOOKS",
    "DimRange",
    "InputSpec",
    "Inputs",
    "build_input_specs",
    "cast_inputs",
    "collect_inputs",
    "example_inputs_from_shapes",
    "input_names",
    "model_inputs",
    "submodule_inputs",
    "through_batch_hooks",
]

Inputs = tuple[Tensor, ...]  # a model's positional input tensors


@dataclass(frozen=True)
class DimRange:
    """The range of a dynamic dimension: smallest, optimized-for and largest size (TensorRT's min/opt/max)."""

    min: int
    opt: int
    max: int

    @classmethod
    def parse(cls, value: Any, owner: str, name: str) -> DimRange:
        """A ``DimRange`` from a ``DimRange`` or a ``(min, opt, max)`` sequence; ``owner(name=...)`` in errors.

        Raises:
            ValueError: unless ``1 <= min <= opt <= max`` are integers.
        """
        parts = (value.min, value.opt, value.max) if isinstance(value, DimRange) else value
        listed = isinstance(parts, Sequence) and not isinstance(parts, str)
        if not listed or len(parts) != 3 or not all(is_int(p, 1) for p in parts):
            raise ValueError(
                f"`{owner}({name}={value!r})` is not valid. Expected (min, opt, max): three positive integers."
            )
        low, opt, high = parts
        if not low <= opt <= high:
            raise ValueError(
                f"`{owner}({name}={value!r})` is not a consistent range. Expected min <= opt <= max, got min={low}, "
                f"opt={opt}, max={high}."
            )
        return cls(low, opt, high)

    def sizes(self) -> list[int]:
        """The distinct sizes min, opt and max, ascending."""
        return sorted({self.min, self.opt, self.max})


@dataclass(frozen=True)
class InputSpec:
    """One positional input of the exported model: name, dtype and its min/opt/max shapes."""

    name: str
    dtype: torch.dtype
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]

    @property
    def dynamic_dims(self) -> dict[int, DimRange]:
        """Dimension index -> range, for the dimensions whose min and max differ."""
        return {
            d: DimRange(lo, opt, hi)
            for d, (lo, opt, hi) in enumerate(zip(self.min_shape, self.opt_shape, self.max_shape))
            if lo != hi
        }

    def accepts(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` lies within this input's range."""
        return len(shape) == len(self.min_shape) and all(
            lo <= s <= hi for s, lo, hi in zip(shape, self.min_shape, self.max_shape)
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}  # shapes: lists in JSON


def example_inputs_from_shapes(
    shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32, batch_size: int = 1, seed: int = 0
) -> tuple[Tensor, ...]:
    """Random standard-normal inputs of the given sample shapes (without the batch dimension), ``batch_size`` each.

    Give the largest batch size to validate at: the samples then differ, which validates more than copies of one.

    Raises:
        ValueError: if a shape is empty or has a size < 1.
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        dims = tuple(shape)
        if not dims or not all(is_int(s, 1) for s in dims):
            raise ValueError(f"Input shape {tuple(shape)!r} is not valid. Expected positive integer sizes.")
        out.append(torch.randn((batch_size, *dims), generator=generator, dtype=torch.float32).to(dtype))
    if not out:
        raise ValueError("input shapes are empty. Expected one shape per model input, e.g. [(3, 224, 224)].")
    return tuple(out)


def input_names(count: int) -> list[str]:
    return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]


def build_input_specs(
    example: tuple[Tensor, ...],
    batch_range: DimRange,
    dynamic_dims: Sequence[Mapping[int, DimRange]],
    names: Sequence[str] | None = None,
) -> list[InputSpec]:
    """Each input's min/opt/max shapes: the batch dimension over ``batch_range``, the dims in ``dynamic_dims``
    over theirs, every other dimension fixed at the example's size; ``names`` default ``input``, ``input_0``...

    Raises:
        ValueError: if a dynamic dimension does not exist, is the batch dimension, or the example's size lies outside
            its range.
    """
    specs = []
    for i, (name, tensor) in enumerate(zip(names or input_names(len(example)), example)):
        ranges: dict[int, DimRange] = {0: batch_range}
        for dim, rng in (dynamic_dims[i] if i < len(dynamic_dims) else {}).items():
            if dim == 0 or not 0 < dim < tensor.dim():
                raise ValueError(
                    f"dynamic_dims for {name}: dimension {dim} is not valid for an input of shape "
                    f"{tuple(tensor.shape)}. Expected 1..{tensor.dim() - 1} (the batch range is set by batch_range)."
                )
            if not rng.min <= tensor.shape[dim] <= rng.max:
                raise ValueError(
                    f"dynamic_dims for {name}: the example's size {tensor.shape[dim]} in dimension {dim} is outside "
                    f"its range {rng.min}..{rng.max}."
                )
            ranges[dim] = rng
        shape, ends = tuple(tensor.shape), ("min", "opt", "max")
        sizes = [tuple(getattr(ranges[d], end) if d in ranges else s for d, s in enumerate(shape)) for end in ends]
        specs.append(InputSpec(name, tensor.dtype, *sizes))  # its min, opt and max shapes
    return specs


def collect_inputs(batches: Iterable[Any], needed: int, input_key: str | None) -> tuple[Tensor, ...] | None:
    """Concatenate the inputs of ``batches`` (or of :class:`CapturedCall` items) until ``needed`` samples are gathered
    (fewer if the data ends)."""
    parts: list[tuple[Tensor, ...]] = []
    count = 0
    for batch in batches:
        inputs = batch.tensors if isinstance(batch, CapturedCall) else split_inputs(batch, input_key)
        if parts and len(inputs) != len(parts[0]):
            raise ValueError(
                f"Validation batches disagree on the number of model inputs: {len(parts[0])} vs {len(inputs)}."
            )
        parts.append(inputs)
        count += int(inputs[0].shape[0])
        if count >= needed:
            break
    if not parts:
        return None
    return tuple(torch.cat([p[i].detach() for p in parts])[:needed] for i in range(len(parts[0])))


def cast_inputs(inputs: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    # Only floating inputs follow the precision: token ids and masks keep their integer type.
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs)


# ------------------------------------------------------------------------------------------------- the batch path

#: The hooks a training batch goes through, in Lightning's order (its `_apply_batch_transfer_handler`).
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def _overrides(obj: Any, hook: str) -> bool:
    """Whether ``obj``'s class defines ``hook`` itself rather than inheriting Lightning's default (``DataHooks``)."""
    fn = getattr(type(obj), hook, None)
    return fn is not None and getattr(fn, "__qualname__", "").split(".")[0] != "DataHooks"


def through_batch_hooks(
    module: Any,
    batch: Any,
    *,
    datamodule: Any = None,
    device: torch.device | str | None = None,
    dataloader_idx: int = 0,
) -> Any:
    """``batch`` as ``forward`` sees it in a loop: after ``on_before_batch_transfer``, ``transfer_batch_to_device``
    and ``on_after_batch_transfer``.

    As Lightning does, each hook is the datamodule's when the datamodule overrides it, else the module's; an object
    without the hook (a plain ``nn.Module``) skips it. Nothing is imported from Lightning: the hooks are looked up
    by name. ``device`` is where ``transfer_batch_to_device`` moves the batch (default the CPU: exporters move
    inputs to their own device).
    """
    target = torch.device("cpu") if device is None else as_device(device)
    for hook in BATCH_HOOKS:
        owner = datamodule if datamodule is not None and _overrides(datamodule, hook) else module
        fn = getattr(owner, hook, None)
        if not callable(fn):
            continue
        batch = fn(batch, target, dataloader_idx) if hook == "transfer_batch_to_device" else fn(batch, dataloader_idx)
    return batch


def model_inputs(
    module: Any,
    batches: Iterable[Any],
    *,
    datamodule: Any = None,
    device: torch.device | str | None = None,
) -> Iterator[Any]:
    """Each batch of ``batches`` through :func:`through_batch_hooks`, lazily."""
    for batch in batches:
        yield through_batch_hooks(module, batch, datamodule=datamodule, device=device)


def submodule_inputs(
    model: nn.Module,
    submodule: nn.Module,
    inputs: Any,
    source: str,
    *,
    device: torch.device | str | None = None,
    owner: str = "submodule_inputs",
) -> tuple[Tensor, ...] | CapturedCall:
    """What ``submodule`` receives when ``model``'s ``forward`` runs on ``inputs`` (a tensor, tensors, a dict of
    keyword inputs or a :class:`CapturedCall`), on the CPU: its positional tensors, or the call itself when it has
    keyword or non-tensor arguments.

    The forward stops at the submodule (:func:`call_of`), so whatever the model does to its input first (reshaping,
    normalizing) is seen. Without a ``forward`` (a LightningModule that calls its submodule directly in its step
    methods), ``inputs`` are the submodule's inputs. ``inputs`` go to ``device`` first (default: left where they are);
    ``source`` and ``owner`` name them in errors.
    """
    if device is not None:
        inputs = pytree.tree_map_only(Tensor, lambda t: t.to(device), inputs)
    if isinstance(inputs, CapturedCall):
        args, kwargs = inputs.args, inputs.kwargs
    else:
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (as_input_tuple(inputs, f"{owner}: {source}"), {})
    call = call_of(submodule, lambda: model(*args, **kwargs), f"the inputs of the submodule for {source}")
    if call is None:
        cpu_args, cpu_kwargs = pytree.tree_map_only(Tensor, lambda t: t.detach().cpu(), (args, kwargs))
        call = CapturedCall(cpu_args, cpu_kwargs, source)
    return call.tensors if call.positional else call
