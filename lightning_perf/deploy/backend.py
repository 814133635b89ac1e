"""What every export backend shares: the option set, its validation, and the backend and runner base classes.

A backend (:mod:`lightning_perf.deploy.onnx`, :mod:`lightning_perf.deploy.tensorrt`) subclasses
:class:`ExportBackend`: ``check`` raises :class:`BackendUnavailable` with the reason when it cannot run here,
``build`` exports, ``save`` writes the artifact files into a staging directory, ``load`` returns a :class:`Runner`
of the saved file. :func:`validate_options` checks every option of an export before anything runs, so the callback
and the CLI fail at construction rather than after training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import as_device
from lightning_perf._imports import is_available
from lightning_perf._validation import (
    check_bool,
    check_choice,
    check_int,
    check_int_sequence,
    check_mapping,
    check_str_sequence,
    is_int,
)
from lightning_perf.deploy.inputs import DimRange, Inputs, InputSpec
from lightning_perf.deploy.validate import DEFAULT_TOLERANCES, Tolerance
from lightning_perf.functional.inputs import export_shapes

__all__ = [
    "BACKENDS",
    "PRECISIONS",
    "BackendUnavailable",
    "ExportBackend",
    "ExportOptions",
    "Runner",
    "dynamic_shapes",
    "known_onnx_providers",
    "validate_options",
]

BACKENDS = ("tensorrt", "onnx")
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# onnxruntime 1.31's `get_all_providers()` (less `ExecutionProvider`): the names checked when it is not installed.
_ONNX_PROVIDERS = (
    "Tensorrt CUDA MIGraphX OpenVINO Dnnl VitisAI QNN Nnapi VSINPU Js CoreML Dml Rknpu WebNN WebGpu Xnnpack CANN Azure "
    "ROCM ACL ArmNN CPU"
)


def known_onnx_providers() -> tuple[str, ...]:
    """Every execution provider name onnxruntime knows: the installed onnxruntime's own list, else a static one."""
    if is_available("onnxruntime"):
        import onnxruntime

        return tuple(onnxruntime.get_all_providers())
    return tuple(f"{name}ExecutionProvider" for name in _ONNX_PROVIDERS.split())


class BackendUnavailable(Exception):
    """The backend cannot run here (not installed, no CUDA): a fallback, not an error of the export."""


class Runner:
    """Runs a saved artifact: ``run`` for timing (results stay where the runtime put them), ``__call__`` for values.
    ``threads``: the runtime's CPU threads where it sets its own (onnxruntime's intra-op threads), else ``None``."""

    output_names: list[str]
    runtime: str
    threads: int | None = None

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        raise NotImplementedError

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        raise NotImplementedError


class ExportBackend:
    name: str
    suffix: str

    def check(self, options: ExportOptions) -> None:
        """Raise :class:`BackendUnavailable` with the reason if the backend cannot run here."""

    def build(self, model: nn.Module, example: Inputs, specs: list[InputSpec], options: ExportOptions) -> Any:
        raise NotImplementedError

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: ExportOptions) -> list[Path]:
        """Write the artifact at ``path`` (plus side files); return every file written, the main file last."""
        raise NotImplementedError

    def load(self, path: Path, options: ExportOptions) -> Runner:
        raise NotImplementedError


def dynamic_shapes(specs: Sequence[InputSpec], model: nn.Module | None = None) -> tuple[Any, ...]:
    """``torch.export`` dynamic shapes of the inputs, positionally: one ``Dim`` shared by every batch dimension (as
    ``model`` takes them, see :func:`~lightning_perf.functional.inputs.export_shapes`)."""
    from torch.export import Dim

    batch = specs[0].dynamic_dims.get(0)
    shared_batch = None if batch is None else Dim("batch", min=batch.min, max=batch.max)
    shapes = []
    for spec in specs:
        dims = {
            d: shared_batch if d == 0 else Dim(f"{spec.name}_dim{d}", min=rng.min, max=rng.max)
            for d, rng in spec.dynamic_dims.items()
        }
        shapes.append(dims or None)
    return tuple(shapes) if model is None else export_shapes(model, shapes)  # type: ignore[no-any-return]


@dataclass
class ExportOptions:
    backends: tuple[str, ...]
    precision: str
    dtype: torch.dtype
    batch_range: DimRange
    dynamic_dims: list[dict[int, DimRange]]
    validation_batch_sizes: list[int] | None
    tolerance: Tolerance
    latency_iterations: int
    latency_warmup: int
    device: torch.device
    onnx_providers: tuple[str, ...] | None
    opset: int | None
    strict: bool
    output_names: list[str] = field(default_factory=list)


def validate_options(
    *,
    backends: Sequence[str] | str = BACKENDS,
    precision: str = "fp32",
    batch_range: Any = (1, 8, 32),
    dynamic_dims: Any = None,
    validation_batch_sizes: Sequence[int] | None = None,
    tolerance: Tolerance | Mapping[str, float] | None = None,
    latency_iterations: int = 20,
    latency_warmup: int = 3,
    device: torch.device | str | None = None,
    onnx_providers: Sequence[str] | None = None,
    opset: int | None = None,
    strict: bool = False,
    owner: str = "export_model",
) -> ExportOptions:
    """Check every export option, raising ``ValueError``/``TypeError`` that names the argument and what is valid.

    The callback and the CLI call this at construction, so a bad option fails before any training time is spent.
    """
    names = check_str_sequence(owner, "backends", backends, BACKENDS)
    check_choice(owner, "precision", precision, tuple(PRECISIONS))
    rng = DimRange.parse(batch_range, owner, "batch_range")
    dims = _dynamic_dims(owner, dynamic_dims)
    sizes = None if validation_batch_sizes is None else _batch_sizes(owner, validation_batch_sizes, rng)
    tol = _tolerance(owner, tolerance, precision)
    check_bool(owner, "strict", strict)
    check_int(owner, "latency_iterations", latency_iterations, 0)
    check_int(owner, "latency_warmup", latency_warmup, 0)
    dev = _device(owner, device)
    check_int(owner, "opset", opset, 18, allow_none=True)  # None: the exporter's default
    if onnx_providers is not None:
        check_str_sequence(owner, "onnx_providers", onnx_providers, known_onnx_providers(), single=False)
    _check_precision(owner, precision, names, dev, onnx_providers)
    return ExportOptions(
        backends=tuple(names),
        precision=precision,
        dtype=PRECISIONS[precision],
        batch_range=rng,
        dynamic_dims=dims,
        validation_batch_sizes=sizes,
        tolerance=tol,
        latency_iterations=latency_iterations,
        latency_warmup=latency_warmup,
        device=dev,
        onnx_providers=None if onnx_providers is None else tuple(onnx_providers),
        opset=opset,
        strict=bool(strict),
    )


def _dynamic_dims(owner: str, dynamic_dims: Any) -> list[dict[int, DimRange]]:
    """One ``{dim: DimRange}`` per input, from ``{dim: (min, opt, max)}`` for the first input or a list of them."""
    if dynamic_dims is None:
        return []
    expected = (
        "{dim: (min, opt, max)} for the first input (dim >= 1, integers 1 <= min <= opt <= max), or a list of such "
        "dicts, one per input"
    )
    single = isinstance(dynamic_dims, Mapping)
    per_input = [dynamic_dims] if single else dynamic_dims
    if not isinstance(per_input, Sequence) or isinstance(per_input, str):
        check_mapping(owner, "dynamic_dims", dynamic_dims, lambda k, v: None, expected)  # raises: not a mapping
    for i, dims in enumerate(per_input):
        check_mapping(owner, "dynamic_dims" if single else f"dynamic_dims[{i}]", dims, _dim_problem, expected)
    return [{dim: DimRange.parse(value, owner, "dynamic_dims") for dim, value in dims.items()} for dims in per_input]


def _dim_problem(dim: Any, value: Any) -> str | None:
    if dim == 0 and not isinstance(dim, bool):
        return "dimension 0 is the batch, already dynamic: its range is batch_range"
    if not is_int(dim, 1):
        return f"dimension {dim!r} is not an int >= 1"
    try:
        DimRange.parse(value, "", "")
    except ValueError:
        return f"dimension {dim} has {value!r}, not (min, opt, max): integers with 1 <= min <= opt <= max"
    return None


def _batch_sizes(owner: str, validation_batch_sizes: Any, rng: DimRange) -> list[int]:
    sizes = sorted(set(check_int_sequence(owner, "validation_batch_sizes", validation_batch_sizes)))
    if any(not rng.min <= s <= rng.max for s in sizes):
        raise ValueError(
            f"`{owner}(validation_batch_sizes={validation_batch_sizes!r})` is not valid. Expected batch sizes "
            f"within the batch range {rng.min}..{rng.max}."
        )
    return sizes


def _device(owner: str, device: torch.device | str | None) -> torch.device:
    try:
        dev = as_device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"`{owner}(device={device!r})` is not valid: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"`{owner}(device={device!r})` is not valid. Expected 'cpu', 'cuda' or 'cuda:N'.")
    return dev


def _tolerance(owner: str, tolerance: Any, precision: str) -> Tolerance:
    if tolerance is None or isinstance(tolerance, Tolerance):
        return tolerance or DEFAULT_TOLERANCES[precision]
    keys = tuple(f.name for f in fields(Tolerance))
    expected = f"a Tolerance or a dict with some of the keys {', '.join(map(repr, keys))} (finite numbers >= 0)"
    check_mapping(owner, "tolerance", tolerance, lambda k, v: None if k in keys else f"no key {k!r}", expected)
    try:
        return Tolerance(**{**asdict(DEFAULT_TOLERANCES[precision]), **tolerance})
    except ValueError as exc:
        raise ValueError(f"`{owner}(tolerance={tolerance!r})` is not valid: {exc}") from None


# Which backend computes which precision where; checked at construction, so that a precision nothing here can export
# fails before training rather than as a fallback warning after it.
_PRECISION_SUPPORT = (
    "fp32 exports with either backend anywhere; fp16 needs a CUDA device (TensorRT, or ONNX with onnxruntime-gpu's "
    "CUDA provider: onnxruntime's CPU provider lacks half-precision kernels for many operators); bf16 needs TensorRT "
    "on a CUDA device (onnxruntime's Python API cannot feed or return bfloat16: numpy has no such type)"
)


def _check_precision(
    owner: str, precision: str, backends: Sequence[str], device: torch.device, providers: Sequence[str] | None
) -> None:
    if precision == "fp32":
        return
    on_cuda = device.type == "cuda"
    able = "tensorrt" in backends and on_cuda
    if "onnx" in backends and precision == "fp16" and on_cuda:
        able = able or providers is None or providers[0] != "CPUExecutionProvider"
    if not able:
        raise ValueError(
            f"`{owner}(precision={precision!r})` cannot be exported with backends={list(backends)!r} on {device}: "
            f"{_PRECISION_SUPPORT}. Expected precision='fp32' here, or a CUDA device with a backend that computes "
            f"{precision}."
        )
