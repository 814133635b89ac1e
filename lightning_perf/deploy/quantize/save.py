"""The end of a quantization: convert, validate, save as an artifact set with its report, and time it.

:func:`export_quantized` converts a copy of a trained (QAT) or calibrated (PTQ) model, validates it against the
fake-quantized (or calibrated) model on real batches (:func:`~lightning_perf.deploy.validate.compare_models`), saves it
with ``torch.export.save`` (and optionally ONNX), times it against the float model (both compiled, batch 1 and 32 by
default, with :func:`lightning_perf.profiling.latency.paired_blocks`; each speed-up with its 95% interval and
verdict) and writes a JSON report. The files are one artifact set (:mod:`lightning_perf.deploy.artifacts`):
``<dirpath>/<filename>/`` for a model that passed,
``<dirpath>/<filename>.failed/`` otherwise, so a failed run never replaces a good set.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import module_device
from lightning_perf._warnings import FallbackWarning
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.backend import failure_reason
from lightning_perf.deploy.inputs import as_input_tuple, split_inputs
from lightning_perf.deploy.onnx import save_program_onnx
from lightning_perf.deploy.quantize.convert import convert, float_copy
from lightning_perf.deploy.validate import ValidationSummary, compare_models
from lightning_perf.functional.qat import (
    QuantizationError,
    QuantizationRecipe,
    capture_module,
    export_dynamic_batch,
    quiet_deepcopy,
    recipe_of,
    with_batch,
)
from lightning_perf.functional.qat_device import cache_off
from lightning_perf.profiling.latency import LatencyRow, paired_blocks

__all__ = ["QuantizationReport", "compiled_latency", "export_quantized", "save_quantized", "write_program"]


def _lowered(model: nn.Module, example: tuple[Tensor, ...], device: torch.device) -> nn.Module:
    """A captured (``torch.export``) inference copy of ``model`` on ``device``: a graph module of its own, so
    compiling it never runs into the recompilation limit of a ``forward`` already compiled for another instance."""
    copied = quiet_deepcopy(model).to(device).eval()
    if isinstance(copied, torch.fx.GraphModule):
        return copied
    return capture_module(copied, tuple(t.to(device) for t in example), training=False)


@torch.no_grad()
def compiled_latency(
    float_model: nn.Module,
    quantized: nn.Module,
    inputs: Sequence[Tensor] | Tensor,
    batch_sizes: Sequence[int] = (1, 32),
    *,
    iterations: int = 20,
    warmup: int = 3,
) -> list[LatencyRow]:
    """Time the float and the quantized model, both lowered by inductor with weight freezing, at each batch size.

    Each model is captured and ``torch.compile``-d (``dynamic=False``) inside ``torch._inductor.config.patch(
    freezing=True)`` on the device of the quantized model, so the global inductor config is left as it was. The
    first call of each (compilation included) is reported apart as ``float_compile_s`` / ``quantized_compile_s``;
    the steady state is timed paired and interleaved by :func:`~lightning_perf.profiling.latency.paired_blocks`;
    each row's ``speedup`` (float time over quantized time) has its 95% interval and verdict.
    Samples are reused cyclically to fill a batch.
    """
    example = as_input_tuple(inputs, "compiled_latency(inputs)")
    device = module_device(quantized)
    rows = []
    with torch._inductor.config.patch(freezing=True):
        models = {"float": _lowered(float_model, example, device), "quantized": _lowered(quantized, example, device)}
        compiled = {name: torch.compile(m, dynamic=False) for name, m in models.items()}
        for b in batch_sizes:
            batch = tuple(t.to(device) for t in with_batch(example, b))
            compile_s = {}
            for name, fn in compiled.items():
                started = time.perf_counter()
                fn(*batch)
                compile_s[name] = time.perf_counter() - started
            float_blocks, quantized_blocks = paired_blocks(
                functools.partial(compiled["float"], *batch),
                functools.partial(compiled["quantized"], *batch),
                iterations=iterations,
                warmup=warmup,
                device=device,
            )
            rows.append(
                LatencyRow.from_blocks(
                    b,
                    float_blocks,
                    quantized_blocks,
                    names=("float", "quantized"),
                    warmup_s=(compile_s["float"], compile_s["quantized"]),
                )
            )
    return rows


def capture_program(module: nn.Module, example: tuple[Tensor, ...]) -> torch.export.ExportedProgram:
    """``torch.export`` of a quantized model with a dynamic batch dimension.

    Raises:
        QuantizationError: if the model cannot be captured.
    """
    try:
        return export_dynamic_batch(module, example)
    except Exception as exc:
        raise QuantizationError(f"torch.export could not capture the quantized model: {failure_reason(exc)}") from exc


def write_program(quantized: nn.Module, example_inputs: Any, path: Path) -> Path:
    """Capture the quantized model (dynamic batch) and write it with ``torch.export.save`` at ``path`` (a file of a
    staged artifact set)."""
    example = as_input_tuple(example_inputs, "save_quantized(example_inputs)")
    device = module_device(quantized)
    source = quiet_deepcopy(quantized) if isinstance(quantized, torch.fx.GraphModule) else quantized
    program = capture_program(source, tuple(t.to(device) for t in example))
    # torch's native zip writer must never write to the disk itself: when a write fails (a full disk), it raises,
    # and its destructor then throws again while finishing the archive, which aborts the process (`terminate called
    # after throwing an instance of 'c10::Error'`). It writes to memory; Python writes the bytes and raises OSError.
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with open(path, "wb") as handle:
        handle.write(buffer.getbuffer())
    return path


def save_quantized(quantized: nn.Module, example_inputs: Any, path: str | os.PathLike[str]) -> Path:
    """Save the quantized model as the artifact set ``<parent>/<stem>/`` holding ``<name>`` (``torch.export.save``,
    dynamic batch); returns the file's path through the set. Load with ``torch.export.load(path).module()`` and lower
    it with ``torch.compile`` under ``torch._inductor.config.patch(freezing=True)`` for int8 speed on CPUs.

    Raises:
        QuantizationError: if the model cannot be captured.
        ArtifactWriteError: if the disk is full or the target read-only (a previous set stays).
    """
    target = Path(path)
    with StagedSet(target.parent) as staged:
        write_program(quantized, example_inputs, staged.file(target.name))
        return staged.commit(target.stem) / target.name


@dataclass
class QuantizationReport:
    """What :func:`export_quantized` did: the artifact, its validation against the reference and its latency.

    Attributes:
        ok: whether the quantized model was converted, passed validation and was saved.
        artifact: the ``torch.export`` program (``.pt2``) in the committed set, or ``None``.
        onnx: the ONNX file, when asked for and successful.
        validation: the comparison with the fake-quantized (QAT) or calibrated (PTQ) model.
        latency: float vs quantized, both compiled, per batch size (empty when not timed or timing failed).
        problems: what failed, in order (conversion, validation, saving, ONNX, timing).
        report_path: the JSON report, in the same set as the artifact.
    """

    ok: bool
    recipe: QuantizationRecipe
    artifact: Path | None = None
    onnx: Path | None = None
    convert_s: float | None = None
    validation: ValidationSummary | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    report_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "recipe": self.recipe.to_dict(),
            "artifact": None if self.artifact is None else str(self.artifact),
            "onnx": None if self.onnx is None else str(self.onnx),
            "convert_s": self.convert_s,
            "validation": None if self.validation is None else self.validation.to_dict(),
            "latency": [row.to_dict() for row in self.latency],
            "problems": list(self.problems),
            "metadata": dict(self.metadata),
            "load_with": "torch.export.load(path).module(), then torch.compile under "
            "torch._inductor.config.patch(freezing=True)",
        }

    def summary(self, owner: str) -> str:
        """What happened, in a few lines for a log (``owner`` names the caller)."""
        if not self.ok:
            return f"{owner}: no quantized model ({'; '.join(self.problems)}). Report: {self.report_path}"
        lines = [f"{owner}: saved {self.artifact} ({self.recipe.backend}, {self.recipe.mode})"]
        if self.validation is not None:
            reference = "fake-quantized" if self.recipe.mode == "qat" else "float"
            lines.append(f"  against the {reference} model: " + self.validation.describe())
        for row in self.latency:
            lines.append(
                f"  batch {row.batch_size}: {1e3 * row.candidate_median_s:.2f} ms quantized vs "
                f"{1e3 * row.baseline_median_s:.2f} ms float, both compiled: {row.format_speedup()} "
                f"(95% interval, {row.speedup_method})"
            )
        lines.append(f"  report: {self.report_path}")
        return "\n".join(lines)


def export_quantized(
    prepared: nn.Module,
    *,
    float_model: nn.Module | None = None,
    validation_data: Iterable[Any] | None = None,
    example_inputs: Any = None,
    input_key: str | None = None,
    validation_batches: int | None = 4,
    min_cosine: float = 0.99,
    dirpath: str | os.PathLike[str] = ".",
    filename: str = "model_int8",
    benchmark: bool = True,
    batch_sizes: Sequence[int] = (1, 32),
    latency_iterations: int = 20,
    latency_warmup: int = 3,
    onnx: bool = False,
    strict: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> QuantizationReport:
    """Convert a copy of a trained (QAT) or calibrated (PTQ) model, validate it, save it, time it, report.

    ``prepared`` is left as it is. The converted model is compared with ``prepared`` itself in eval mode (the
    fake-quantized model for QAT, the float model with observers for PTQ) on up to ``validation_batches`` batches
    of ``validation_data`` (else on the example inputs): cosine similarity (at least ``min_cosine`` to pass), max abs
    difference, top-1 agreement and, for ``(inputs, labels)`` batches, both accuracies. A model that passes is saved
    as ``<dirpath>/<filename>/<filename>.pt2``; one that fails as ``<dirpath>/<filename>.failed/<filename>.failed.pt2``.
    With ``benchmark``, it is then timed against ``float_model`` (or the ``torchao`` model's float copy), both
    compiled with freezing, at each of ``batch_sizes``. The report ``<filename>.json`` is committed in the same
    artifact set, in one atomic step.

    A failure (conversion, validation, saving) warns with a :class:`~lightning_perf.FallbackWarning` and is recorded
    in the report; ``strict=True`` raises :class:`QuantizationError` instead. A failure of the optional steps (ONNX,
    timing) only warns.

    Raises:
        ValueError: for an invalid option or a module that was not prepared.
        QuantizationError: with ``strict=True``, when conversion, validation or saving fails.
    """
    recipe = recipe_of(prepared)
    if recipe is None:
        raise ValueError("export_quantized() needs a module returned by prepare().")
    if not isinstance(filename, str) or not filename or os.sep in filename or filename.startswith("."):
        raise ValueError(f"`export_quantized(filename={filename!r})` is not valid. Expected a plain file stem.")
    dirpath = Path(dirpath)
    report = QuantizationReport(ok=False, recipe=recipe, metadata=dict(metadata or {}))
    example = as_input_tuple(example_inputs) if example_inputs is not None else None
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    if example is None:
        example = split_inputs(batches[0], input_key) if batches else recipe.example_inputs()
    failure: BaseException | None = None

    def fail(step: str, exc: BaseException) -> None:
        nonlocal failure
        failure = exc
        report.problems.append(f"{step}: {failure_reason(exc) if not isinstance(exc, QuantizationError) else exc}")

    # A Hugging Face model validates, exports and is timed without its key/value cache (the copies inherit that).
    with cache_off(prepared, float_model), StagedSet(dirpath) as staged:
        quantized: nn.Module | None = None
        started = time.perf_counter()
        try:
            quantized = convert(prepared, recipe)
            report.convert_s = time.perf_counter() - started
        except Exception as exc:
            fail("conversion", exc)
        passed = False
        if quantized is not None:
            try:
                # The trained model itself in eval mode: no state moves (observers pause, batch norm uses its stats).
                report.validation = compare_models(
                    prepared,
                    quantized,
                    batches or [example],
                    input_key=input_key if batches else None,
                    min_cosine=min_cosine,
                )
            except Exception as exc:
                fail("validation", exc)
            passed = report.validation is not None and report.validation.passed
            if report.validation is not None and not passed:
                report.problems.append(f"validation: {report.validation.problem}")
        set_name = filename if passed else f"{filename}.failed"
        if quantized is not None:
            name = f"{set_name}.pt2"
            try:
                write_program(quantized, example, staged.file(name))
                report.artifact = dirpath / set_name / name
            except Exception as exc:
                fail("saving", exc)
                staged.file(name).unlink(missing_ok=True)  # a partial file; the set is a failed one
                set_name = f"{filename}.failed"
            report.ok = passed and report.artifact is not None and not report.problems
        if report.ok and onnx:
            try:
                program = capture_program(quiet_deepcopy(quantized), example)
                onnx_files = save_program_onnx(program, staged.file(f"{filename}.onnx"), "export_quantized")
                report.onnx = dirpath / set_name / onnx_files[-1].name
            except Exception as exc:
                for leftover in staged.path.glob(f"{filename}.onnx*"):
                    leftover.unlink()
                report.problems.append(f"onnx: {failure_reason(exc)}")
                warnings.warn(
                    f"The ONNX export of the quantized model failed: {failure_reason(exc)}",
                    FallbackWarning,
                    stacklevel=2,
                )
        if report.ok and benchmark and batch_sizes:
            try:
                reference_float = float_model if float_model is not None else float_copy(prepared)
                report.latency = compiled_latency(
                    reference_float,
                    quantized,  # type: ignore[arg-type]
                    example,
                    batch_sizes,
                    iterations=latency_iterations,
                    warmup=latency_warmup,
                )
            except Exception as exc:
                report.problems.append(f"timing: {failure_reason(exc)}")
                warnings.warn(
                    f"Timing the quantized model failed: {failure_reason(exc)}", FallbackWarning, stacklevel=2
                )
        report.report_path = dirpath / set_name / f"{filename}.json"
        staged.write_json(report.report_path.name, report.to_dict())
        staged.commit(set_name)
    if not report.ok:
        message = (
            f"The quantized model was not exported: {'; '.join(report.problems)}. The trained model is unchanged. "
            f"Report: {report.report_path}"
        )
        if strict:
            raise QuantizationError(message) from failure
        warnings.warn(message, FallbackWarning, stacklevel=2)
    return report
