"""Deployment export of a trained model: TensorRT or ONNX, checked against the model, with its measured speed.

:func:`export_model` takes a plain ``nn.Module`` and example inputs, tries each backend in the order given
(``"tensorrt"``: torch-tensorrt's dynamo path, saved as an ExportedProgram; ``"onnx"``: ``torch.onnx.export(...,
dynamo=True)`` run with onnxruntime), and keeps the first artifact that

1. exports with a dynamic batch dimension (and any other dimension the caller marks dynamic),
2. is saved, loaded back from the saved file, and
3. computes what the model computes on real inputs at several batch sizes of the dynamic range: same output names
   and shapes, no NaN/Inf, differences within the tolerance of its precision.

A backend that is missing, fails, or produces an artifact that disagrees with the model is reported with its reason
and the next one is tried, with a :class:`~lightning_perf.FallbackWarning` (``strict=True`` raises instead). The
latency of the artifact against eager PyTorch at the same batch sizes and a JSON report are written next to it.
Nothing is written under a final name before it is complete, and an artifact that failed validation is kept under a
``.failed`` name so it can be inspected but not mistaken for a good one.

Heavy dependencies (onnx, onnxscript, onnxruntime, torch-tensorrt) are imported only inside the backend that needs
them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.metadata
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_perf._device import as_device, synchronize
from lightning_perf._imports import require
from lightning_perf._io import atomic_path
from lightning_perf._validation import check_int
from lightning_perf._warnings import FallbackWarning
from lightning_perf.profiling import PhaseTimer, Stats, write_json

__all__ = [
    "BACKENDS",
    "DEFAULT_TOLERANCES",
    "PRECISIONS",
    "BackendAttempt",
    "DimRange",
    "ExportError",
    "ExportReport",
    "InputSpec",
    "LatencyRow",
    "OutputCheck",
    "Tolerance",
    "ValidationResult",
    "example_inputs_from_shapes",
    "export",
    "export_model",
    "split_inputs",
]

BACKENDS = ("tensorrt", "onnx")
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Batch keys taken as the model input when a data loader yields dicts; anything else needs `input_key`.
_INPUT_KEYS = ("input", "inputs", "x", "image", "images", "pixel_values", "input_ids")


class ExportError(RuntimeError):
    """An export failed and ``strict=True`` asked for an error instead of a fallback."""


@dataclass(frozen=True)
class Tolerance:
    """How close an export's outputs must be to the model's.

    An element passes when ``|export - model| <= atol + rtol * |model|`` (``torch.allclose``'s rule); every output
    must also have a cosine similarity to the model's of at least ``min_cosine``.
    """

    atol: float
    rtol: float
    min_cosine: float

    def __post_init__(self) -> None:
        for name in ("atol", "rtol", "min_cosine"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`Tolerance({name}={value!r})` is not valid. Expected a finite number >= 0.")
        if self.min_cosine > 1:
            raise ValueError(f"`Tolerance(min_cosine={self.min_cosine!r})` is not valid. Expected at most 1.")


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, min_cosine=0.9999),
    "fp16": Tolerance(atol=1e-2, rtol=1e-2, min_cosine=0.99),
    # bf16 keeps 8 bits of mantissa against fp16's 11: about 8x coarser.
    "bf16": Tolerance(atol=5e-2, rtol=5e-2, min_cosine=0.99),
}


@dataclass(frozen=True)
class DimRange:
    """The range of a dynamic dimension: smallest, optimized-for and largest size (TensorRT's min/opt/max)."""

    min: int
    opt: int
    max: int

    @classmethod
    def parse(cls, value: Any, what: str) -> DimRange:
        """A ``DimRange`` from a ``DimRange`` or a ``(min, opt, max)`` sequence; ``what`` names it in errors.

        Raises:
            ValueError: unless ``1 <= min <= opt <= max`` are integers.
        """
        if isinstance(value, DimRange):
            parts: Sequence[Any] = (value.min, value.opt, value.max)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            parts = value
        else:
            parts = ()
        if len(parts) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in parts):
            raise ValueError(f"{what}={value!r} is not valid. Expected (min, opt, max): three positive integers.")
        low, opt, high = parts
        if not low <= opt <= high:
            raise ValueError(
                f"{what}={value!r} is not a consistent range. Expected min <= opt <= max, got min={low}, opt={opt}, "
                f"max={high}."
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
        return {
            "name": self.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "min_shape": list(self.min_shape),
            "opt_shape": list(self.opt_shape),
            "max_shape": list(self.max_shape),
        }


@dataclass
class OutputCheck:
    """How one output of the export compares with the model's at one batch size."""

    name: str
    expected_shape: list[int]
    shape: list[int] | None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cosine: float | None = None
    non_finite: int = 0
    passed: bool = False
    problem: str | None = None


@dataclass
class ValidationResult:
    """The comparison of the export with the model on one batch of real inputs."""

    batch_size: int
    passed: bool
    outputs: list[OutputCheck] = field(default_factory=list)
    problem: str | None = None


@dataclass
class LatencyRow:
    """Latency of eager PyTorch and of the export at one batch size (seconds; throughput in samples/s)."""

    batch_size: int
    eager_median_s: float
    eager_p90_s: float
    export_median_s: float
    export_p90_s: float
    speedup: float
    eager_throughput: float
    export_throughput: float
    iterations: int


@dataclass
class BackendAttempt:
    """What happened to one backend: ``ok``, ``failed_validation``, ``error`` or ``unavailable``, and why."""

    backend: str
    status: str = "error"
    reason: str | None = None
    files: list[str] = field(default_factory=list)
    export_s: float | None = None
    runtime: str | None = None
    validation: list[ValidationResult] = field(default_factory=list)
    latency: list[LatencyRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class ExportReport:
    """The result of :func:`export_model`: which backend produced the artifact, and all the evidence.

    Attributes:
        attempts: one entry per backend tried, in order, with its status, reason, validation and latency.
        validation_source: ``"validation_data"`` or ``"example_inputs"``: what the export was checked on.
        metadata: the caller's facts (e.g. the checkpoint the weights came from).
        report_path: where the JSON report was written.
    """

    precision: str
    device: str
    inputs: list[InputSpec]
    output_names: list[str]
    validation_source: str
    tolerance: Tolerance
    versions: dict[str, str | None]
    attempts: list[BackendAttempt] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    report_path: Path | None = None

    @property
    def attempt(self) -> BackendAttempt | None:
        """The attempt that produced a validated artifact, if any."""
        return next((a for a in self.attempts if a.ok), None)

    @property
    def ok(self) -> bool:
        """Whether some backend produced an artifact that passed validation."""
        return self.attempt is not None

    @property
    def backend(self) -> str | None:
        """The backend of the validated artifact, or ``None``."""
        return None if self.attempt is None else self.attempt.backend

    @property
    def artifact(self) -> Path | None:
        """The validated artifact's main file (ONNX keeps its weights in ``<artifact>.data``), or ``None``."""
        return None if self.attempt is None else Path(self.attempt.files[-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "artifact": None if self.artifact is None else str(self.artifact),
            "precision": self.precision,
            "device": self.device,
            "inputs": [spec.to_dict() for spec in self.inputs],
            "output_names": list(self.output_names),
            "validation_source": self.validation_source,
            "tolerance": asdict(self.tolerance),
            "attempts": [asdict(a) for a in self.attempts],
            "versions": dict(self.versions),
            "metadata": dict(self.metadata),
        }


# ------------------------------------------------------------------------------------------------------- inputs


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
        keys = [input_key] if input_key is not None else [k for k in _INPUT_KEYS if k in batch]
        if not keys or keys[0] not in batch:
            wanted = repr(input_key) if input_key is not None else f"one of {', '.join(_INPUT_KEYS)}"
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
        if not dims or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in dims):
            raise ValueError(f"Input shape {tuple(shape)!r} is not valid. Expected positive integer sizes.")
        out.append(torch.randn((batch_size, *dims), generator=generator, dtype=torch.float32).to(dtype))
    if not out:
        raise ValueError("input shapes are empty. Expected one shape per model input, e.g. [(3, 224, 224)].")
    return tuple(out)


def _input_names(count: int) -> list[str]:
    return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]


def build_input_specs(
    example: tuple[Tensor, ...],
    batch_range: DimRange,
    dynamic_dims: Sequence[Mapping[int, DimRange]],
) -> list[InputSpec]:
    """Each input's min/opt/max shapes: the batch dimension over ``batch_range``, the dims in ``dynamic_dims``
    over theirs, every other dimension fixed at the example's size.

    Raises:
        ValueError: if a dynamic dimension does not exist, is the batch dimension, or the example's size lies outside
            its range.
    """
    specs = []
    for i, (name, tensor) in enumerate(zip(_input_names(len(example)), example)):
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
        shape = tuple(tensor.shape)
        specs.append(
            InputSpec(
                name=name,
                dtype=tensor.dtype,
                min_shape=tuple(ranges[d].min if d in ranges else s for d, s in enumerate(shape)),
                opt_shape=tuple(ranges[d].opt if d in ranges else s for d, s in enumerate(shape)),
                max_shape=tuple(ranges[d].max if d in ranges else s for d, s in enumerate(shape)),
            )
        )
    return specs


def _take(inputs: tuple[Tensor, ...], batch_size: int) -> tuple[Tensor, ...]:
    # Cycle through the samples available, so a small pool still fills a large batch with real samples.
    index = torch.arange(batch_size) % inputs[0].shape[0]
    return tuple(t[index.to(t.device)] for t in inputs)


def _collect(batches: Iterable[Any], needed: int, input_key: str | None) -> tuple[Tensor, ...] | None:
    """Concatenate the inputs of ``batches`` until ``needed`` samples are gathered (fewer if the data ends)."""
    parts: list[tuple[Tensor, ...]] = []
    count = 0
    for batch in batches:
        inputs = split_inputs(batch, input_key)
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


def _cast_inputs(inputs: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    # Only floating inputs follow the precision: token ids and masks keep their integer type.
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs)


# ------------------------------------------------------------------------------------------------------ outputs


def _flat_outputs(output: Any) -> tuple[list[Tensor], list[str]]:
    """The tensors of a model output and their names (``output``; ``output_0``...; or the dict keys)."""
    if isinstance(output, Tensor):
        return [output], ["output"]
    leaves, _ = pytree.tree_flatten(output)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        raise ValueError(f"The model output {type(output).__name__} is not a tensor or a container of tensors.")
    if isinstance(output, Mapping) and len(leaves) == len(output):
        return leaves, [str(k) for k in output]
    return leaves, [f"output_{i}" for i in range(len(leaves))]


def _compare(
    outputs: Sequence[Tensor],
    names: Sequence[str],
    reference: Sequence[Tensor],
    ref_names: Sequence[str],
    tol: Tolerance,
) -> list[OutputCheck]:
    checks = []
    if list(names) != list(ref_names):
        problem = f"output names {list(names)} differ from the model's {list(ref_names)}"
        return [OutputCheck(n, list(r.shape), None, problem=problem) for n, r in zip(ref_names, reference)]
    for name, out, ref in zip(names, outputs, reference):
        check = OutputCheck(name, list(ref.shape), list(out.shape))
        checks.append(check)
        if tuple(out.shape) != tuple(ref.shape):
            check.problem = f"shape {tuple(out.shape)} differs from the model's {tuple(ref.shape)}"
            continue
        got, want = out.detach().double().cpu(), ref.detach().double().cpu()
        check.non_finite = int((~torch.isfinite(got)).sum())
        if not bool(torch.isfinite(want).all()):
            check.problem = "the model itself produced NaN/Inf on this batch"
            continue
        if check.non_finite:
            check.problem = f"{check.non_finite} NaN/Inf value(s)"
            continue
        diff = (got - want).abs()
        check.max_abs_diff = float(diff.max()) if diff.numel() else 0.0
        significant = want.abs() > tol.atol
        check.max_rel_diff = float((diff[significant] / want.abs()[significant]).max()) if significant.any() else 0.0
        g, w = got.flatten(), want.flatten()
        norms = float(g.norm() * w.norm())
        check.cosine = float(g @ w) / norms if norms > 0 else (1.0 if float(g.norm() + w.norm()) == 0 else 0.0)
        within = bool((diff <= tol.atol + tol.rtol * want.abs()).all())
        if not within:
            check.problem = (
                f"max abs diff {check.max_abs_diff:.3g} exceeds atol={tol.atol:g} + rtol={tol.rtol:g}*|model|"
            )
        elif check.cosine < tol.min_cosine:
            check.problem = f"cosine similarity {check.cosine:.6f} is below {tol.min_cosine}"
        check.passed = check.problem is None
    return checks


@contextlib.contextmanager
def _full_fp32(device: torch.device) -> Iterator[None]:
    """Compute the fp32 reference without TF32 (a TF32 callback may still be active at fit end), then restore."""
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# ----------------------------------------------------------------------------------------------------- backends


class _Unavailable(Exception):
    """The backend cannot run here (not installed, no CUDA): a fallback, not an error of the export."""


class _Runner:
    """Runs a saved artifact: ``run`` for timing (results stay where the runtime put them), ``__call__`` for values."""

    output_names: list[str]
    runtime: str

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        raise NotImplementedError

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        raise NotImplementedError


class _Backend:
    name: str
    suffix: str

    def check(self, options: _Options) -> None:
        """Raise :class:`_Unavailable` with the reason if the backend cannot run here."""

    def build(
        self,
        model: nn.Module,
        example: tuple[Tensor, ...],
        specs: list[InputSpec],
        options: _Options,
    ) -> Any:
        raise NotImplementedError

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: _Options) -> list[Path]:
        """Write the artifact at ``path`` (plus side files); return every file written, the main file last."""
        raise NotImplementedError

    def load(self, path: Path, options: _Options) -> _Runner:
        raise NotImplementedError


def _dynamic_shapes(specs: Sequence[InputSpec]) -> tuple[dict[int, Any] | None, ...]:
    """``torch.export`` dynamic shapes of the inputs, positionally: one ``Dim`` shared by every batch dimension."""
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
    return tuple(shapes)


# -- ONNX

_ORT_TYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


def _onnx_providers(ort: Any, device: torch.device, requested: Sequence[str] | None) -> list[str]:
    """The execution providers asked for, or by default CUDA's (on a CUDA device, when installed) then the CPU's."""
    if requested is not None:
        return list(requested)
    wanted = ["CUDAExecutionProvider"] if device.type == "cuda" else []
    return [p for p in wanted if p in ort.get_available_providers()] + ["CPUExecutionProvider"]


class _OnnxRunner(_Runner):
    def __init__(self, path: Path, device: torch.device, providers: Sequence[str] | None) -> None:
        ort = require("onnxruntime", "export(backends=['onnx'])")
        providers = _onnx_providers(ort, device, providers)
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: the session's warnings about fallback nodes are not actionable
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        self.providers = list(self.session.get_providers())
        self.runtime = f"onnxruntime {ort.__version__} ({', '.join(self.providers)})"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_dtypes = [_ORT_TYPES.get(i.type) for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.on_cuda = device.type == "cuda" and self.providers[0] in (
            "CUDAExecutionProvider",
            "TensorrtExecutionProvider",
        )
        self.device = device

    def _prepare(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"The ONNX model takes {len(self.input_names)} inputs, got {len(inputs)}.")
        target = self.device if self.on_cuda else torch.device("cpu")
        return [t.to(device=target, dtype=dtype or t.dtype).contiguous() for t, dtype in zip(inputs, self.input_dtypes)]

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        tensors = self._prepare(inputs)
        if not self.on_cuda:
            return self.session.run(None, {n: t.numpy() for n, t in zip(self.input_names, tensors)})
        # Inputs already on the GPU are bound in place, outputs stay there: no host copy in the timed call.
        binding = self.session.io_binding()
        index = self.device.index or 0
        for name, t in zip(self.input_names, tensors):
            binding.bind_input(name, "cuda", index, _numpy_dtype(t.dtype), tuple(t.shape), t.data_ptr())
        for name in self.output_names:
            binding.bind_output(name, "cuda", index)
        self.session.run_with_iobinding(binding)
        return binding

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        result = self.run(inputs)
        arrays = result.copy_outputs_to_cpu() if self.on_cuda else result
        return [torch.from_numpy(a) for a in arrays]


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


class _OnnxBackend(_Backend):
    name = "onnx"
    suffix = ".onnx"

    def check(self, options: _Options) -> None:
        try:
            for module in ("onnx", "onnxscript", "onnxruntime"):
                require(module, "export(backends=['onnx'])")
        except ModuleNotFoundError as exc:
            raise _Unavailable(str(exc)) from exc
        if options.precision == "bf16":
            raise _Unavailable(
                "bf16 ONNX is not supported: numpy has no bfloat16, so onnxruntime's Python API cannot feed or return "
                "it. Use fp16, or the tensorrt backend for bf16."
            )
        ort = require("onnxruntime")
        providers = _onnx_providers(ort, options.device, options.onnx_providers)
        if options.precision == "fp16" and providers[0] == "CPUExecutionProvider":
            # Refused rather than tried: onnxruntime 1.31's CPU provider lacks fp16 kernels for many operators, and
            # loading an fp16 transformer (the `vit` workload) crashes the whole process, which no fallback catches.
            raise _Unavailable(
                "fp16 ONNX needs a GPU execution provider (onnxruntime-gpu on a CUDA device): onnxruntime's CPU "
                "provider lacks half-precision kernels for many operators."
            )

    def build(
        self,
        model: nn.Module,
        example: tuple[Tensor, ...],
        specs: list[InputSpec],
        options: _Options,
    ) -> Any:
        with warnings.catch_warnings():
            # torch.export's own deprecation chatter (pytree LeafSpec...) says nothing about the user's model.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.onnx.export(
                model,
                example,
                None,
                dynamo=True,
                dynamic_shapes=_dynamic_shapes(specs),
                input_names=[s.name for s in specs],
                output_names=options.output_names,
                opset_version=options.opset,
                verbose=False,
            )

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: _Options) -> list[Path]:
        # The weights go to `<name>.data` beside the graph, referenced by that name: both move together.
        built.save(str(path), external_data=True)
        data = path.with_name(path.name + ".data")
        return [data, path] if data.exists() else [path]

    def load(self, path: Path, options: _Options) -> _Runner:
        return _OnnxRunner(path, options.device, options.onnx_providers)


# -- TensorRT


class _TensorRTRunner(_Runner):
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, output_names: list[str]) -> None:
        torch_tensorrt = require("torch_tensorrt", "export(backends=['tensorrt'])")
        self.module = torch_tensorrt.load(str(path)).module()
        self.device, self.dtype = device, dtype
        self.runtime = f"torch-tensorrt {getattr(torch_tensorrt, '__version__', '?')}"
        self.output_names = output_names

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        return self.module(*_cast_inputs(inputs, self.dtype, self.device))

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        outputs, names = _flat_outputs(self.run(inputs))
        self.output_names = names
        return outputs


@dataclass
class _TensorRTBuild:
    """A compiled TensorRT module with what saving it needs: the traced example and its dynamic shapes."""

    module: Any
    example: tuple[Tensor, ...]
    dynamic_shapes: tuple[dict[int, Any] | None, ...]


class _TensorRTBackend(_Backend):
    name = "tensorrt"
    suffix = ".trt.pt2"  # torch.export.save wants the .pt2 extension

    def check(self, options: _Options) -> None:
        try:
            require("tensorrt", "export(backends=['tensorrt'])")
            require("torch_tensorrt", "export(backends=['tensorrt'])")
        except ModuleNotFoundError as exc:
            raise _Unavailable(str(exc)) from exc
        if options.device.type != "cuda" or not torch.cuda.is_available():
            raise _Unavailable(f"TensorRT needs a CUDA device; the export device is {options.device}.")

    def _inputs(self, specs: list[InputSpec], dtype: torch.dtype) -> list[Any]:
        import torch_tensorrt

        return [
            torch_tensorrt.Input(
                min_shape=spec.min_shape,
                opt_shape=spec.opt_shape,
                max_shape=spec.max_shape,
                dtype=dtype if spec.dtype.is_floating_point else spec.dtype,
            )
            for spec in specs
        ]

    def build(
        self,
        model: nn.Module,
        example: tuple[Tensor, ...],
        specs: list[InputSpec],
        options: _Options,
    ) -> Any:
        import torch_tensorrt

        # Traced here with one Dim shared by every input's batch dimension: torch-tensorrt's own tracer makes one per
        # input, which torch.export rejects as soon as the model combines two inputs along the batch.
        dynamic_shapes = _dynamic_shapes(specs)
        program = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
        # torch-tensorrt >= 2.13 takes the precision from the dtypes (TensorRT 11 is strongly typed, and
        # `enabled_precisions` is gone from the dynamo path): the model copy and the inputs are cast already.
        compiled = torch_tensorrt.compile(
            program,
            ir="dynamo",
            arg_inputs=self._inputs(specs, options.dtype),
            device=options.device,
            # fp32 means fp32: without this TensorRT uses TF32 on Ampere and newer, 1e-3 away from the model.
            disable_tf32=options.precision == "fp32",
            min_block_size=1,
        )
        return _TensorRTBuild(compiled, example, dynamic_shapes)

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: _Options) -> list[Path]:
        import torch_tensorrt

        torch_tensorrt.save(
            built.module,
            str(path),
            output_format="exported_program",
            arg_inputs=list(built.example),
            dynamic_shapes=built.dynamic_shapes,
        )
        return [path]

    def load(self, path: Path, options: _Options) -> _Runner:
        return _TensorRTRunner(path, options.device, options.dtype, options.output_names)


_BACKENDS: dict[str, _Backend] = {b.name: b for b in (_TensorRTBackend(), _OnnxBackend())}


# ------------------------------------------------------------------------------------------------------ options


@dataclass
class _Options:
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
) -> _Options:
    """Check every export option, raising ``ValueError``/``TypeError`` that names the argument and what is valid.

    The callback and the CLI call this at construction, so a bad option fails before any training time is spent.
    """
    names = [backends] if isinstance(backends, str) else list(backends)
    unknown = [b for b in names if b not in BACKENDS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(
            f"`{owner}(backends={backends!r})` is not valid. Expected a non-empty sequence of distinct names from "
            f"{', '.join(BACKENDS)} (tried in that order)."
        )
    if precision not in PRECISIONS:
        raise ValueError(f"`{owner}(precision={precision!r})` is not valid. Expected one of: {', '.join(PRECISIONS)}.")
    rng = DimRange.parse(batch_range, f"`{owner}(batch_range)`")
    if dynamic_dims is None:
        dims: list[dict[int, DimRange]] = []
    else:
        per_input = [dynamic_dims] if isinstance(dynamic_dims, Mapping) else dynamic_dims
        if not isinstance(per_input, Sequence) or not all(isinstance(m, Mapping) for m in per_input):
            raise ValueError(
                f"`{owner}(dynamic_dims={dynamic_dims!r})` is not valid. Expected {{dim: (min, opt, max)}} for the "
                "first input, or a list of such dicts, one per input."
            )
        dims = []
        for i, mapping in enumerate(per_input):
            parsed = {}
            for dim, value in mapping.items():
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                    raise ValueError(
                        f"`{owner}(dynamic_dims)`: dimension {dim!r} of input {i} is not valid. Expected an int >= 1 "
                        "(dimension 0 is the batch, set by batch_range)."
                    )
                parsed[dim] = DimRange.parse(value, f"`{owner}(dynamic_dims)[{i}][{dim}]`")
            dims.append(parsed)
    sizes = None
    if validation_batch_sizes is not None:
        sizes = sorted(set(validation_batch_sizes)) if isinstance(validation_batch_sizes, Sequence) else []
        if not sizes or any(
            isinstance(s, bool) or not isinstance(s, int) or not rng.min <= s <= rng.max for s in sizes
        ):
            raise ValueError(
                f"`{owner}(validation_batch_sizes={validation_batch_sizes!r})` is not valid. Expected batch sizes "
                f"within the batch range {rng.min}..{rng.max}."
            )
    if tolerance is None:
        tol = DEFAULT_TOLERANCES[precision]
    elif isinstance(tolerance, Tolerance):
        tol = tolerance
    elif isinstance(tolerance, Mapping):
        tol = Tolerance(**{**asdict(DEFAULT_TOLERANCES[precision]), **tolerance})
    else:
        raise TypeError(
            f"`{owner}(tolerance={tolerance!r})` is not valid. Expected a Tolerance or a dict of its fields."
        )
    check_int(owner, "latency_iterations", latency_iterations, 0)
    check_int(owner, "latency_warmup", latency_warmup, 0)
    try:
        dev = as_device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"`{owner}(device={device!r})` is not valid: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"`{owner}(device={device!r})` is not valid. Expected 'cpu', 'cuda' or 'cuda:N'.")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < 18):
        raise ValueError(f"`{owner}(opset={opset!r})` is not valid. Expected None (the exporter's default) or >= 18.")
    if onnx_providers is not None and (
        isinstance(onnx_providers, str) or not all(isinstance(p, str) for p in onnx_providers)
    ):
        raise ValueError(
            f"`{owner}(onnx_providers={onnx_providers!r})` is not valid. Expected a list of onnxruntime execution "
            "provider names, e.g. ['CUDAExecutionProvider', 'CPUExecutionProvider']."
        )
    return _Options(
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


# --------------------------------------------------------------------------------------------------- artifacts


@contextlib.contextmanager
def _staging_dir(dirpath: Path) -> Iterator[Path]:
    """A hidden scratch directory beside the final artifacts, removed whatever happens.

    The ONNX exporter names its weights file after the graph file and records that name inside it, so an artifact is
    first written whole under its final names here and then moved into place file by file (see :func:`_commit`).
    """
    dirpath.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-staging-", dir=dirpath))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit(files: Sequence[Path], dirpath: Path) -> list[Path]:
    """Move staged ``files`` into ``dirpath``, each with an atomic rename, side files first and the main file last.

    A reader who finds the main file under its final name therefore finds its side files complete as well.
    """
    placed = []
    for staged in files:
        with atomic_path(dirpath / staged.name) as tmp:
            os.replace(staged, tmp)
        placed.append(dirpath / staged.name)
    return placed


def _write(
    backend: _Backend, built: Any, dirpath: Path, name: str, specs: list[InputSpec], opts: _Options
) -> list[Path]:
    with _staging_dir(dirpath) as staging:
        return _commit(backend.save(built, staging / name, specs, opts), dirpath)


# ------------------------------------------------------------------------------------------------------ latency


def _latency(
    eager: Callable[[], Any], exported: Callable[[], Any], device: torch.device, warmup: int, iterations: int
) -> tuple[Stats, Stats]:
    """Median and spread of eager and exported calls, in blocks ordered eager, export, export, eager.

    Blocks rather than alternating calls: a runtime's worker threads keep spinning for a while after a call
    (onnxruntime's do by default) and would slow the other runtime's next call. The ABBA order makes a linear drift
    of the machine fall on both alike; each block starts with ``warmup`` untimed calls. Each call is timed on the
    host up to a device synchronize: end-to-end latency as a caller sees it, the only fair clock when the two run on
    different runtimes (onnxruntime's CUDA work is on its own stream).
    """
    timer = PhaseTimer(device="cpu")
    per_block = math.ceil(iterations / 2)
    for name in ("eager", "export", "export", "eager"):
        fn = eager if name == "eager" else exported
        for _ in range(warmup):
            fn()
        synchronize(device)
        for _ in range(per_block):
            timer.start(name)
            fn()
            synchronize(device)
            timer.stop(name)
            timer.end_step()
    summary = timer.summary()
    return summary["eager"], summary["export"]


# -------------------------------------------------------------------------------------------------- the export


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    # torch, lightning and the machine are in the report's `environment` (profiling.environment_info).
    for dist in ("onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tensorrt", "torch-tensorrt"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


_STATUS_TEXT = {
    "unavailable": "is unavailable",
    "error": "failed",
    "failed_validation": "produced an export that failed validation",
}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:500]}"


@torch.no_grad()
def export_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    backends: Sequence[str] | str = BACKENDS,
    precision: str = "fp32",
    batch_range: Any = (1, 8, 32),
    dynamic_dims: Any = None,
    dirpath: str | os.PathLike[str] = ".",
    filename: str = "model",
    validation_data: Iterable[Any] | None = None,
    validation_batch_sizes: Sequence[int] | None = None,
    input_key: str | None = None,
    tolerance: Tolerance | Mapping[str, float] | None = None,
    latency_iterations: int = 20,
    latency_warmup: int = 3,
    device: torch.device | str | None = None,
    onnx_providers: Sequence[str] | None = None,
    opset: int | None = None,
    strict: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> ExportReport:
    """Export ``model`` for deployment, prove that the export computes what the model computes, and time it.

    The model is not modified: a deep copy is put in eval mode, moved to ``device`` and, for ``fp16``/``bf16``, cast
    to that dtype before export (TensorRT 11 and torch-tensorrt >= 2.13 take the precision from the dtypes). The
    reference is the fp32 copy, without TF32.

    Artifacts in ``dirpath``: ``<filename>.trt.pt2`` (TensorRT, an ExportedProgram: load with
    ``torch_tensorrt.load(path).module()``) or ``<filename>.onnx`` with its weights in ``<filename>.onnx.data``;
    ``<filename>.failed.<ext>`` for an artifact that failed validation; ``<filename>.export.json``, the report.

    Args:
        model: the module to export; its ``forward`` takes positional tensors.
        example_inputs: a tensor or tuple of tensors with a batch dimension: sets every input's dtype and non-batch
            sizes and traces the export.
        backends: tried in this order until one passes; ``"tensorrt"`` and/or ``"onnx"``.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``. ONNX in fp16 needs a GPU execution provider (onnxruntime's
            CPU provider lacks half-precision kernels for many operators); ONNX has no bf16 here (numpy has no
            bfloat16 to feed onnxruntime): the backend is reported unavailable with that reason.
        batch_range: ``(min, opt, max)`` of the dynamic batch dimension.
        dynamic_dims: other dynamic dimensions: ``{dim: (min, opt, max)}`` for the first input, or a list of such dicts,
            one per input.
        dirpath: where artifacts and the report go.
        filename: stem of the artifact names.
        validation_data: batches of held-out data (e.g. a validation ``DataLoader``); the inputs of each batch are
            found with :func:`split_inputs`. ``None`` validates on ``example_inputs`` (said so in the report).
        validation_batch_sizes: batch sizes to validate and time at; default the batch range's min, opt and max.
            Samples are reused cyclically when the data has fewer than a batch size needs.
        input_key: the key of the model input when ``validation_data`` yields dicts.
        tolerance: override of :data:`DEFAULT_TOLERANCES` for ``precision`` (a :class:`Tolerance` or some of its
            fields as a dict).
        latency_iterations: timed calls per batch size, each for eager and export; 0 skips timing.
        latency_warmup: untimed calls before them.
        device: where the export runs and is timed; default CUDA when available, else CPU.
        onnx_providers: onnxruntime execution providers, in order of preference; default CUDA (on a CUDA device)
            then CPU. ``TensorrtExecutionProvider`` may be named here.
        opset: ONNX opset; default the exporter's.
        strict: raise :class:`ExportError` at the first backend that fails instead of falling back.
        metadata: extra facts stored in the report (e.g. the checkpoint the weights came from).

    Returns:
        The :class:`ExportReport`. ``report.ok`` is false when no backend produced a validated artifact.

    Raises:
        ValueError: for an invalid option, example or validation data (before anything is exported).
        ExportError: with ``strict=True``, when a backend fails or its artifact fails validation.

    Example::

        report = export_model(model, torch.randn(1, 3, 224, 224), backends=["onnx"], dirpath="deploy",
                              validation_data=val_loader)
        print(report.backend, report.artifact, report.attempt.latency)
    """
    opts = validate_options(
        backends=backends,
        precision=precision,
        batch_range=batch_range,
        dynamic_dims=dynamic_dims,
        validation_batch_sizes=validation_batch_sizes,
        tolerance=tolerance,
        latency_iterations=latency_iterations,
        latency_warmup=latency_warmup,
        device=device,
        onnx_providers=onnx_providers,
        opset=opset,
        strict=strict,
    )
    if not isinstance(filename, str) or not filename or os.sep in filename or filename.startswith("."):
        raise ValueError(f"`export_model(filename={filename!r})` is not valid. Expected a plain, non-hidden file stem.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`export_model(model=...)` expects an nn.Module, got {type(model).__name__}.")
    example = as_input_tuple(example_inputs)
    if len(opts.dynamic_dims) > len(example):
        raise ValueError(f"dynamic_dims names {len(opts.dynamic_dims)} inputs but the example has {len(example)}.")
    specs = build_input_specs(example, opts.batch_range, opts.dynamic_dims)
    sizes = opts.validation_batch_sizes or opts.batch_range.sizes()
    dirpath = Path(dirpath)
    dev = opts.device

    # Real inputs for validation and timing: gathered before anything is exported, so bad data fails early.
    pool = _collect(validation_data, max(sizes), input_key) if validation_data is not None else None
    source = "validation_data" if pool is not None else "example_inputs"
    pool = pool if pool is not None else example
    if len(pool) != len(specs):
        raise ValueError(f"The validation data has {len(pool)} model input(s); the example has {len(specs)}.")
    for spec, tensor in zip(specs, pool):
        probe = (1, *tensor.shape[1:])
        if tensor.dtype != spec.dtype or not spec.accepts(probe):
            raise ValueError(
                f"Validation input {spec.name!r} has samples of shape {tuple(tensor.shape[1:])} and dtype "
                f"{str(tensor.dtype).removeprefix('torch.')}, which do not fit the export's input (shapes "
                f"{list(spec.min_shape)} to {list(spec.max_shape)}, dtype {str(spec.dtype).removeprefix('torch.')}). "
                "Mark differing dimensions in dynamic_dims or give a matching example."
            )
    batches = {b: _take(tuple(t.to(dev) for t in pool), b) for b in sizes}

    reference = copy.deepcopy(model).eval().to(device=dev, dtype=torch.float32)
    with _full_fp32(dev):
        ref_outputs = {b: _flat_outputs(reference(*_cast_inputs(batches[b], torch.float32, dev))) for b in sizes}
    output_names = ref_outputs[sizes[0]][1]
    opts.output_names = output_names
    exportable = reference.to(opts.dtype)  # in place: the reference outputs are all the fp32 copy was needed for
    # Trace at the optimized batch size: an example batch of 1 would make torch.export specialize the batch dim.
    trace_batch = opts.batch_range.opt if opts.batch_range.opt > 1 else min(2, opts.batch_range.max)
    trace_example = _cast_inputs(_take(tuple(t.to(dev) for t in example), trace_batch), opts.dtype, dev)

    report = ExportReport(
        precision=opts.precision,
        device=str(dev),
        inputs=specs,
        output_names=output_names,
        validation_source=source,
        tolerance=opts.tolerance,
        versions=_versions(),
        metadata=dict(metadata or {}),
    )
    failure: BaseException | None = None
    for name in opts.backends:
        backend = _BACKENDS[name]
        attempt = BackendAttempt(name)
        report.attempts.append(attempt)
        artifact_name = filename + backend.suffix
        try:
            backend.check(opts)
            started = time.perf_counter()
            built = backend.build(exportable, trace_example, specs, opts)
            attempt.export_s = time.perf_counter() - started
            with _staging_dir(dirpath) as staging:
                staged = backend.save(built, staging / artifact_name, specs, opts)
                runner = backend.load(staged[-1], opts)  # the saved file, not the object in memory
                attempt.runtime = runner.runtime
                attempt.validation = _validate(runner, batches, ref_outputs, opts)
                passed = all(v.passed for v in attempt.validation)
                if passed:
                    attempt.files = [str(p) for p in _commit(staged, dirpath)]
            if not passed:
                failed_name = f"{filename}.failed{backend.suffix}"
                attempt.files = [str(p) for p in _write(backend, built, dirpath, failed_name, specs, opts)]
                bad = next(v for v in attempt.validation if not v.passed)
                attempt.status = "failed_validation"
                attempt.reason = f"at batch size {bad.batch_size}: {bad.problem}"
            else:
                attempt.status = "ok"
                if opts.latency_iterations:
                    attempt.latency = _measure(exportable, runner, batches, opts)
        except _Unavailable as exc:
            attempt.status, attempt.reason = "unavailable", str(exc)
            failure = exc
        except Exception as exc:  # an export failure must never take the user's training down (strict aside)
            attempt.status, attempt.reason = "error", _reason(exc)
            failure = exc
        if attempt.ok or opts.strict:
            break
        rest = opts.backends[opts.backends.index(name) + 1 :]
        then = f"falling back to {rest[0]!r}" if rest else "no backend left, nothing was exported"
        warnings.warn(
            f"Export backend {name!r} {_STATUS_TEXT[attempt.status]}: {attempt.reason} ({then}).",
            FallbackWarning,
            stacklevel=3,
        )

    report.report_path = write_json(report.to_dict(), dirpath / f"{filename}.export.json")
    if opts.strict and not report.ok:
        last = report.attempts[-1]
        raise ExportError(
            f"Export backend {last.backend!r} {_STATUS_TEXT[last.status]}: {last.reason}. Report: {report.report_path}"
        ) from failure
    return report


export = export_model
"""Alias: ``lightning_perf.functional.export.export(...)``."""


def _validate(
    runner: _Runner,
    batches: Mapping[int, tuple[Tensor, ...]],
    reference: Mapping[int, tuple[list[Tensor], list[str]]],
    opts: _Options,
) -> list[ValidationResult]:
    results = []
    for b, inputs in batches.items():
        outputs = runner(_cast_inputs(inputs, opts.dtype, opts.device))
        checks = _compare(outputs, runner.output_names, *reference[b], opts.tolerance)
        problem = next((c.problem for c in checks if c.problem), None)
        results.append(ValidationResult(b, problem is None, checks, problem))
    return results


def _measure(
    eager_model: nn.Module, runner: _Runner, batches: Mapping[int, tuple[Tensor, ...]], opts: _Options
) -> list[LatencyRow]:
    rows = []
    for b, inputs in batches.items():
        cast = _cast_inputs(inputs, opts.dtype, opts.device)
        eager, exported = _latency(
            functools.partial(eager_model, *cast),
            functools.partial(runner.run, cast),
            opts.device,
            opts.latency_warmup,
            opts.latency_iterations,
        )
        rows.append(
            LatencyRow(
                batch_size=b,
                eager_median_s=eager.median,
                eager_p90_s=eager.p90,
                export_median_s=exported.median,
                export_p90_s=exported.p90,
                speedup=eager.median / exported.median if exported.median > 0 else math.inf,
                eager_throughput=b / eager.median if eager.median > 0 else math.inf,
                export_throughput=b / exported.median if exported.median > 0 else math.inf,
                iterations=exported.count,
            )
        )
    return rows
