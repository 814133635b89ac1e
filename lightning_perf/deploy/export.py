"""Deployment export of a trained model: TensorRT or ONNX, checked against the model, with its measured speed.

Entry point: :func:`export_model` (its :class:`ExportReport`, one :class:`BackendAttempt` per back-end tried;
:class:`ExportError`). What an artifact must pass, the fallbacks and how files are written: docs/architecture.md, Module
notes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._io import failure_reason
from lightning_perf._validation import check_file_stem, check_instance
from lightning_perf._warnings import FallbackWarning
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.backend import (
    BackendUnavailable,
    ExportBackend,
    ExportOptions,
    Runner,
    validate_options,
)
from lightning_perf.deploy.inputs import (
    InputSpec,
    build_input_specs,
    cast_inputs,
    collect_inputs,
)
from lightning_perf.deploy.onnx import OnnxBackend
from lightning_perf.deploy.tensorrt import TensorRTBackend
from lightning_perf.deploy.validate import Tolerance, ValidationResult, flat_outputs, validate_runner
from lightning_perf.functional.backend_flags import BackendFlags, backend_flags
from lightning_perf.functional.inputs import CapturedCall, as_input_tuple
from lightning_perf.functional.quantization.device import disable_cache
from lightning_perf.functional.quantization.qat import with_batch
from lightning_perf.profiling.latency import LatencyRow, measure_latency
from lightning_perf.profiling.machine import installed_version
from lightning_perf.profiling.report import to_jsonable

__all__ = ["EXPORT_BACKENDS", "BackendAttempt", "ExportError", "ExportReport", "export_model"]

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
    threads: int | None = None
    validation: list[ValidationResult] = field(default_factory=list)
    latency: list[LatencyRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class ExportReport:
    """The result of :func:`export_model`: which backend produced the artifact, and all the evidence.

    Paths are the committed sets' (``<dirpath>/<filename>/...``).

    Attributes:
        attempts: one entry per backend tried, in order, with its status, reason, validation and latency; an
            onnxruntime session runs with ``threads`` intra-op threads, as many as ``torch_threads`` (the eager side
            of the latency table), one inter-op thread and no spin-waiting, so the table compares equal threads.
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
    torch_threads: int = field(default_factory=torch.get_num_threads)

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
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "report_path"}
        return to_jsonable({"ok": self.ok, "backend": self.backend, "artifact": self.artifact, **data})  # type: ignore[no-any-return]


def _versions() -> dict[str, str | None]:
    # torch, lightning and the machine are in the report's `environment` (profiling.environment_info).
    dists = ("onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tensorrt", "torch-tensorrt")
    return {dist: installed_version(dist) for dist in dists}


_STATUS_TEXT = dict(
    unavailable="is unavailable", error="failed", failed_validation="produced an export that failed validation"
)


@torch.no_grad()
def export_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    dirpath: str | os.PathLike[str] = ".",
    filename: str = "model",
    validation_data: Iterable[Any] | None = None,
    input_key: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    **options: Any,
) -> ExportReport:
    """Export ``model`` for deployment, prove that the export computes what the model computes, and time it.

    The model is not modified: a deep copy in eval mode on ``device`` is the fp32 reference (without TF32), cast to
    ``precision`` for export. The set ``<dirpath>/<filename>/`` holds ``<filename>.trt.pt2`` (TensorRT: load with
    ``torch_tensorrt.load(path).module()``) or ``<filename>.onnx`` (+ ``.onnx.data``) and the report
    ``<filename>.export.json``; ``<filename>.failed/`` the artifacts that failed and, if none passed, the report.

    Args:
        model: the module to export.
        example_inputs: tensor(s) with a batch dimension, or a :class:`~lightning_perf.functional.inputs.CapturedCall`
            (several, nested or keyword inputs: each batched tensor becomes a named input of the export, the other
            arguments stay as captured): every input's dtype and other sizes; traces the export.
        options: the export options, checked by :func:`~lightning_perf.deploy.backend.validate_options` (its
            keywords, defaults and errors):
        backends: tried in this order until one passes; ``"tensorrt"`` and/or ``"onnx"`` (one name alone: that one).
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``. ONNX in fp16 needs a GPU execution provider; ONNX has no
            bf16 here (numpy has no bfloat16 to feed onnxruntime).
        batch_range, dynamic_dims: ``(min, opt, max)`` of the dynamic batch dimension; other dynamic dimensions as
            ``{dim: (min, opt, max)}`` for the first input, or a list of such dicts, one per input.
        dirpath, filename: where artifacts and the report go; the stem of their names.
        validation_data: batches of held-out data (e.g. a validation ``DataLoader``; the model input of a dict batch
            under ``input_key``). ``None`` validates on ``example_inputs`` (said so in the report).
        validation_batch_sizes: batch sizes to validate and time at; default the batch range's min, opt and max.
        tolerance: override of :data:`DEFAULT_TOLERANCES` for ``precision`` (a :class:`Tolerance` or a dict of fields).
        latency_iterations, latency_warmup: timed calls per batch size, eager and export interleaved at equal
            threads, after untimed ones: ``2 x (latency_warmup + latency_iterations)`` calls per batch size, which
            can take as long as the export; ``latency_iterations=0`` skips the timing.
        device: where the export runs and is timed; default CUDA when available, else CPU.
        onnx_providers, opset: onnxruntime providers by preference (default CUDA on a CUDA device, then CPU); opset.
        strict: raise :class:`ExportError` at the first backend that fails instead of falling back.
        metadata: extra facts stored in the report (e.g. the checkpoint the weights came from).

    Raises:
        ValueError: for an invalid option, example or validation data (before anything is exported).
        ExportError: with ``strict=True``, when a backend fails or its artifact fails validation.

    Example::

        report = export_model(model, torch.randn(1, 3, 224, 224), backends=["onnx"], validation_data=val_loader)
        print(report.ok, report.backend, report.artifact, report.attempt.latency)
    """
    known = inspect.signature(validate_options).parameters
    if unknown := sorted(set(options) - set(known)):
        raise TypeError(f"`export_model` got unknown option(s) {unknown}. Expected some of: {', '.join(known)}.")
    opts = validate_options(**options)
    _check_target(model, filename)
    model, example_inputs, names = _positional(model, example_inputs)
    example, specs = _input_specs(example_inputs, opts, names)
    source, batches = _real_batches(validation_data, input_key, example, specs, opts)
    exportable, ref_outputs = _reference(model, batches, opts)
    facts = (opts.precision, str(opts.device), specs, opts.output_names, source, opts.tolerance, _versions())
    report = ExportReport(*facts, metadata=dict(metadata or {}))
    sets = _Sets(Path(dirpath), filename)
    try:
        failure = _attempts(report, exportable, _trace_example(example, opts), specs, batches, ref_outputs, opts, sets)
        report.report_path = sets.commit(report)
    finally:
        sets.discard()
    if opts.strict and not report.ok:
        last = report.attempts[-1]
        raise ExportError(f"Export backend {last.backend!r} {_STATUS_TEXT[last.status]}: {last.reason}. "
                          f"Report: {report.report_path}") from failure  # fmt: skip
    return report


def _positional(model: nn.Module, example_inputs: Any) -> tuple[nn.Module, Any, list[str] | None]:
    """A captured call (several or keyword inputs) is exported positionally, one named input per batched tensor."""
    if not isinstance(example_inputs, CapturedCall):
        return model, example_inputs, None
    names = example_inputs.names(model) if len(example_inputs.tensors) > 1 else None  # one: `input`
    return example_inputs.adapter(model), example_inputs.tensors, names


def _input_specs(example_inputs: Any, opts: Any, names: list[str] | None) -> tuple[tuple[Tensor, ...], list[Any]]:
    """The example as a tuple of tensors, and each input's spec (name, dtype, static sizes, dynamic ranges)."""
    example = as_input_tuple(example_inputs)
    if len(opts.dynamic_dims) > len(example):
        raise ValueError(f"dynamic_dims names {len(opts.dynamic_dims)} inputs but the example has {len(example)}.")
    return example, build_input_specs(example, opts.batch_range, opts.dynamic_dims, names)


def _check_target(model: Any, filename: Any) -> None:
    check_file_stem("export_model", "filename", filename)
    check_instance("export_model", "model", model, nn.Module, "an nn.Module")


def _real_batches(
    validation_data: Iterable[Any] | None,
    input_key: str | None,
    example: tuple[Tensor, ...],
    specs: list[InputSpec],
    opts: ExportOptions,
) -> tuple[str, dict[int, tuple[Tensor, ...]]]:
    """Real inputs for validation and timing, per batch size, and where they come from: gathered before anything is
    exported, so that bad data fails early."""
    sizes = opts.validation_batch_sizes or opts.batch_range.sizes()
    pool = collect_inputs(validation_data, max(sizes), input_key) if validation_data is not None else None
    source = "validation_data" if pool is not None else "example_inputs"
    pool = pool if pool is not None else example
    if len(pool) != len(specs):
        raise ValueError(f"The validation data has {len(pool)} model input(s); the example has {len(specs)}.")
    for spec, tensor in zip(specs, pool):
        if tensor.dtype != spec.dtype or not spec.accepts((1, *tensor.shape[1:])):
            raise ValueError(
                f"Validation input {spec.name!r} has samples of shape {tuple(tensor.shape[1:])} and dtype "
                f"{str(tensor.dtype).removeprefix('torch.')}, which do not fit the export's input (shapes "
                f"{list(spec.min_shape)} to {list(spec.max_shape)}, dtype {str(spec.dtype).removeprefix('torch.')}). "
                "Mark differing dimensions in dynamic_dims or give a matching example."
            )
    return source, {b: with_batch(tuple(t.to(opts.device) for t in pool), b) for b in sizes}


def _reference(
    model: nn.Module, batches: Mapping[int, tuple[Tensor, ...]], opts: ExportOptions
) -> tuple[nn.Module, dict[int, tuple[list[Tensor], list[str]]]]:
    """The copy to export (in the export's dtype) and the fp32 outputs it must reproduce; sets ``opts.output_names``."""
    reference = copy.deepcopy(model).eval().to(device=opts.device, dtype=torch.float32)
    disable_cache(reference)  # a Hugging Face model exports and validates without its key/value cache
    with backend_flags(BackendFlags(matmul_tf32=False, cudnn_tf32=False)):  # a TF32 callback may still be on
        outputs = {b: flat_outputs(reference(*cast_inputs(x, torch.float32, opts.device))) for b, x in batches.items()}
    opts.output_names = next(iter(outputs.values()))[1]
    return reference.to(opts.dtype), outputs  # in place: the fp32 outputs are all the fp32 copy was needed for


def _trace_example(example: tuple[Tensor, ...], opts: ExportOptions) -> tuple[Tensor, ...]:
    # Trace at the optimized batch size: an example batch of 1 would make torch.export specialize the batch dim.
    trace_batch = opts.batch_range.opt if opts.batch_range.opt > 1 else min(2, opts.batch_range.max)
    return cast_inputs(with_batch(tuple(t.to(opts.device) for t in example), trace_batch), opts.dtype, opts.device)


class _Sets:
    """The two artifact sets of one export: the validated artifact (``<filename>``) and the failed ones
    (``<filename>.failed``), each staged until the report is written into it and committed."""

    def __init__(self, dirpath: Path, filename: str) -> None:
        self.dirpath, self.filename, self.failed_name = dirpath, filename, f"{filename}.failed"
        self.good: StagedSet | None = None
        self.failed: StagedSet | None = None

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
                attempt.runtime, attempt.threads = runner.runtime, runner.threads
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
    timing: dict[str, Any] = {"iterations": opts.latency_iterations, "warmup": opts.latency_warmup}
    rows = []
    for b, inputs in batches.items():
        cast = cast_inputs(inputs, opts.dtype, opts.device)
        calls = (functools.partial(eager_model, *cast), functools.partial(runner.run, cast))
        rows.append(measure_latency(*calls, batch_size=b, device=opts.device, names=("eager", "export"), **timing))
    return rows
