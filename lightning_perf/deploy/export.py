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
latency of the artifact against eager PyTorch at the same batch sizes is measured with
:func:`lightning_perf.profiling.latency.measure_latency`.

Files are written as artifact sets (:mod:`lightning_perf.deploy.artifacts`): the validated artifact and the JSON
report are committed together as the set ``<dirpath>/<filename>/``; artifacts that failed validation (and the report
of an export where none passed) as the set ``<dirpath>/<filename>.failed/``, so a failed export never replaces a good
one. Heavy dependencies (onnx, onnxscript, onnxruntime, torch-tensorrt) are imported only inside the backend that
needs them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._warnings import FallbackWarning
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.backend import (
    BACKENDS,
    PRECISIONS,
    BackendUnavailable,
    ExportBackend,
    ExportOptions,
    Runner,
    failure_reason,
    validate_options,
)
from lightning_perf.deploy.inputs import (
    InputSpec,
    as_input_tuple,
    build_input_specs,
    cast_inputs,
    collect_inputs,
    take_batch,
)
from lightning_perf.deploy.onnx import OnnxBackend
from lightning_perf.deploy.tensorrt import TensorRTBackend
from lightning_perf.deploy.validate import Tolerance, ValidationResult, flat_outputs, full_fp32, validate_runner
from lightning_perf.functional.qat_device import disable_cache
from lightning_perf.profiling.latency import LatencyRow, measure_latency

__all__ = [
    "BACKENDS",
    "EXPORT_BACKENDS",
    "PRECISIONS",
    "BackendAttempt",
    "ExportError",
    "ExportReport",
    "export",
    "export_model",
    "validate_options",
]

#: The backends by name, in the order of :data:`BACKENDS`.
EXPORT_BACKENDS: dict[str, ExportBackend] = {b.name: b for b in (TensorRTBackend(), OnnxBackend())}


class ExportError(RuntimeError):
    """An export failed and ``strict=True`` asked for an error instead of a fallback."""


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

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["validation"] = [asdict(v) for v in self.validation]
        data["latency"] = [row.to_dict() for row in self.latency]
        return data


@dataclass
class ExportReport:
    """The result of :func:`export_model`: which backend produced the artifact, and all the evidence.

    Paths are the committed sets' (``<dirpath>/<filename>/...``).

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
            "attempts": [a.to_dict() for a in self.attempts],
            "versions": dict(self.versions),
            "metadata": dict(self.metadata),
        }


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

    Artifacts, as artifact sets in ``dirpath`` (:mod:`lightning_perf.deploy.artifacts`): ``<filename>/`` holds
    ``<filename>.trt.pt2`` (TensorRT, an ExportedProgram: load with ``torch_tensorrt.load(path).module()``) or
    ``<filename>.onnx`` with its weights in ``<filename>.onnx.data``, and ``<filename>.export.json``, the report;
    ``<filename>.failed/`` holds artifacts that failed validation (``<filename>.failed.<ext>``) and, when no backend
    passed, the report.

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
    pool = collect_inputs(validation_data, max(sizes), input_key) if validation_data is not None else None
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
    batches = {b: take_batch(tuple(t.to(dev) for t in pool), b) for b in sizes}

    reference = copy.deepcopy(model).eval().to(device=dev, dtype=torch.float32)
    disable_cache(reference)  # a Hugging Face model exports and validates without its key/value cache
    with full_fp32(dev):
        ref_outputs = {b: flat_outputs(reference(*cast_inputs(batches[b], torch.float32, dev))) for b in sizes}
    output_names = ref_outputs[sizes[0]][1]
    opts.output_names = output_names
    exportable = reference.to(opts.dtype)  # in place: the reference outputs are all the fp32 copy was needed for
    # Trace at the optimized batch size: an example batch of 1 would make torch.export specialize the batch dim.
    trace_batch = opts.batch_range.opt if opts.batch_range.opt > 1 else min(2, opts.batch_range.max)
    trace_example = cast_inputs(take_batch(tuple(t.to(dev) for t in example), trace_batch), opts.dtype, dev)

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
    sets = _Sets(dirpath, filename)
    try:
        failure = _attempts(report, exportable, trace_example, specs, batches, ref_outputs, opts, sets)
        report.report_path = sets.commit(report)
    finally:
        sets.discard()
    if opts.strict and not report.ok:
        last = report.attempts[-1]
        raise ExportError(
            f"Export backend {last.backend!r} {_STATUS_TEXT[last.status]}: {last.reason}. Report: {report.report_path}"
        ) from failure
    return report


export = export_model
"""Alias: ``lightning_perf.deploy.export.export(...)``."""


class _Sets:
    """The two artifact sets of one export: the validated artifact (``<filename>``) and the failed ones
    (``<filename>.failed``), each staged until the report is written into it and committed."""

    def __init__(self, dirpath: Path, filename: str) -> None:
        self.dirpath, self.filename = dirpath, filename
        self.good: StagedSet | None = None
        self.failed: StagedSet | None = None

    @property
    def failed_name(self) -> str:
        return f"{self.filename}.failed"

    def failed_set(self) -> StagedSet:
        if self.failed is None:
            self.failed = StagedSet(self.dirpath)
        return self.failed

    def final_paths(self, files: Sequence[Path], set_name: str) -> list[str]:
        return [str(self.dirpath / set_name / f.name) for f in files]

    def commit(self, report: ExportReport) -> Path:
        json_name = f"{self.filename}.export.json"
        data = report.to_dict()
        path = None
        if self.failed is not None or self.good is None:
            failed = self.failed_set()
            failed.write_json(json_name, data)
            path = failed.commit(self.failed_name) / json_name
        if self.good is not None:
            self.good.write_json(json_name, data)
            path = self.good.commit(self.filename) / json_name
        assert path is not None
        return path

    def discard(self) -> None:
        for staged in (self.good, self.failed):
            if staged is not None and staged.committed is None:
                staged.discard()


def _attempts(
    report: ExportReport,
    exportable: nn.Module,
    trace_example: tuple[Tensor, ...],
    specs: list[InputSpec],
    batches: Mapping[int, tuple[Tensor, ...]],
    ref_outputs: Mapping[int, tuple[list[Tensor], list[str]]],
    opts: ExportOptions,
    sets: _Sets,
) -> BaseException | None:
    """Try each backend in turn until one passes (or, ``strict``, one fails); returns the last failure."""
    failure: BaseException | None = None
    for name in opts.backends:
        backend = EXPORT_BACKENDS[name]
        attempt = BackendAttempt(name)
        report.attempts.append(attempt)
        try:
            backend.check(opts)
            started = time.perf_counter()
            built = backend.build(exportable, trace_example, specs, opts)
            attempt.export_s = time.perf_counter() - started
            staged = StagedSet(sets.dirpath)
            try:
                files = backend.save(built, staged.file(sets.filename + backend.suffix), specs, opts)
                runner = backend.load(files[-1], opts)  # the saved file, not the object in memory
                attempt.runtime = runner.runtime
                attempt.validation = validate_runner(
                    runner, batches, ref_outputs, opts.dtype, opts.device, opts.tolerance
                )
            except BaseException:
                staged.discard()
                raise
            if all(v.passed for v in attempt.validation):
                sets.good = staged
                attempt.files = sets.final_paths(files, sets.filename)
                attempt.status = "ok"
                if opts.latency_iterations:
                    attempt.latency = _measure(exportable, runner, batches, opts)
            else:
                staged.discard()
                failed_name = f"{sets.filename}.failed{backend.suffix}"
                kept = backend.save(built, sets.failed_set().file(failed_name), specs, opts)
                attempt.files = sets.final_paths(kept, sets.failed_name)
                bad = next(v for v in attempt.validation if not v.passed)
                attempt.status = "failed_validation"
                attempt.reason = f"at batch size {bad.batch_size}: {bad.problem}"
        except BackendUnavailable as exc:
            attempt.status, attempt.reason = "unavailable", str(exc)
            failure = exc
        except Exception as exc:  # an export failure must never take the user's training down (strict aside)
            attempt.status, attempt.reason = "error", failure_reason(exc)
            failure = exc
        if attempt.ok or opts.strict:
            break
        rest = opts.backends[opts.backends.index(name) + 1 :]
        then = f"falling back to {rest[0]!r}" if rest else "no backend left, nothing was exported"
        warnings.warn(
            f"Export backend {name!r} {_STATUS_TEXT[attempt.status]}: {attempt.reason} ({then}).",
            FallbackWarning,
            stacklevel=4,
        )
    return failure


def _measure(
    eager_model: nn.Module, runner: Runner, batches: Mapping[int, tuple[Tensor, ...]], opts: ExportOptions
) -> list[LatencyRow]:
    rows = []
    for b, inputs in batches.items():
        cast = cast_inputs(inputs, opts.dtype, opts.device)
        rows.append(
            measure_latency(
                functools.partial(eager_model, *cast),
                functools.partial(runner.run, cast),
                batch_size=b,
                iterations=opts.latency_iterations,
                warmup=opts.latency_warmup,
                device=opts.device,
                names=("eager", "export"),
            )
        )
    return rows
