"""The end of a quantization: convert, validate, save as an artifact set with its report, and time it.

:func:`export_quantized` does it for a trained (QAT) or calibrated (PTQ) model, :func:`export_dynamic` for a dynamic
int8 one; :class:`ArtifactRun` holds what they share: the steps' failures, the model file and the report
(:class:`ArtifactReport`), committed as one artifact set (:mod:`lightning_perf.deploy.artifacts`):
``<dirpath>/<filename>/`` for a model that passed, ``<dirpath>/<filename>.failed/`` otherwise, so a failed run never
replaces a good set.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from lightning_perf._device import module_device
from lightning_perf._io import failure_reason
from lightning_perf._validation import check_file_stem
from lightning_perf._warnings import FallbackWarning
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.onnx import save_program_onnx
from lightning_perf.deploy.quantize.convert import convert, float_copy
from lightning_perf.deploy.quantize.dynamic import (
    DynamicQuantization,
    OnnxRuntimeModule,
    eager_latency,
    figure_line,
    size_bytes,
)
from lightning_perf.deploy.validate import ValidationSummary, compare_models
from lightning_perf.functional.inputs import as_input_tuple, split_inputs
from lightning_perf.functional.quantization.device import cache_off
from lightning_perf.functional.quantization.qat import (
    QuantizationError,
    QuantizationRecipe,
    capture_module,
    export_dynamic_batch,
    quiet_deepcopy,
    recipe_of,
    with_batch,
)
from lightning_perf.profiling.latency import LatencyRow, measure_latency
from lightning_perf.profiling.report import to_jsonable

__all__ = [
    "ArtifactReport",
    "ArtifactRun",
    "DynamicReport",
    "QuantizationReport",
    "compiled_latency",
    "export_dynamic",
    "export_quantized",
    "save_quantized",
    "write_program",
]

_T = TypeVar("_T")


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
    freezing=True)`` on the quantized model's device (the global config is left as it was). The first call of each
    (compilation included) is reported apart (``float_compile_s``, ``quantized_compile_s``); the steady state is timed
    paired and interleaved (:func:`~lightning_perf.profiling.latency.paired_blocks`). Samples are reused cyclically.
    """
    example = as_input_tuple(inputs, "compiled_latency(inputs)")
    device = module_device(quantized)
    rows = []
    with torch._inductor.config.patch(freezing=True):
        models = {"float": _lowered(float_model, example, device), "quantized": _lowered(quantized, example, device)}
        compiled = {name: torch.compile(m, dynamic=False) for name, m in models.items()}
        for b in batch_sizes:
            batch = tuple(t.to(device) for t in with_batch(example, b))
            calls = [functools.partial(compiled[name], *batch) for name in ("float", "quantized")]
            compile_s = []
            for call in calls:
                started = time.perf_counter()
                call()
                compile_s.append(time.perf_counter() - started)
            kw: dict[str, Any] = {"iterations": iterations, "warmup": warmup, "device": device, "batch_size": b}
            kw["warmup_s"] = (compile_s[0], compile_s[1])
            rows.append(measure_latency(*calls, names=("float", "quantized"), **kw))
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


@dataclass(kw_only=True)
class ArtifactReport:
    """What an export into an artifact set did; the fields both quantized-model reports share.

    Attributes:
        ok: whether the quantized model was built, passed validation and was saved.
        artifact: the model file in the committed set, or ``None``.
        validation: the comparison with the reference model.
        latency: reference vs quantized, per batch size (empty when not timed or timing failed).
        problems: what failed, in order (conversion, validation, saving, ONNX, timing).
        report_path: the JSON report, in the same set as the artifact.
    """

    ok: bool = False
    artifact: Path | None = None
    validation: ValidationSummary | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    report_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "report_path"}
        return to_jsonable({**data, **self._more()})  # type: ignore[no-any-return]

    def _more(self) -> dict[str, Any]:
        """Entries of the JSON report beyond the fields."""
        return {}

    def _facts(self) -> tuple[str, str, str, list[str]]:
        """What was saved, the reference's name, how it was timed, and lines of its own for :meth:`summary`."""
        raise NotImplementedError

    def summary(self, owner: str) -> str:
        """What happened, in a few lines for a log (``owner`` names the caller)."""
        kind, reference, timing, lines = self._facts()
        if not self.ok:
            return f"{owner}: no quantized model saved ({kind}): {'; '.join(self.problems)}. Report: {self.report_path}"
        lines = [f"{owner}: saved {self.artifact} ({kind})", *lines]
        if self.validation is not None:
            lines.append(f"  against the {reference} model: " + self.validation.describe(reference))
        for row in self.latency:
            lines.append(
                f"  batch {row.batch_size}: {1e3 * row.candidate_median_s:.3g} ms quantized vs "
                f"{1e3 * row.baseline_median_s:.3g} ms float, {timing}: {row.format_speedup()} "
                f"(95% interval, {row.speedup_method})"
            )
        return "\n".join([*lines, f"  report: {self.report_path}"])


@dataclass(kw_only=True)
class QuantizationReport(ArtifactReport):
    """What :func:`export_quantized` did (``onnx``: the ONNX file, when asked for and successful)."""

    recipe: QuantizationRecipe
    onnx: Path | None = None
    convert_s: float | None = None

    def _more(self) -> dict[str, Any]:
        return {
            "load_with": "torch.export.load(path).module(), then torch.compile under "
            "torch._inductor.config.patch(freezing=True)"
        }

    def _facts(self) -> tuple[str, str, str, list[str]]:
        reference = "fake-quantized" if self.recipe.mode == "qat" else "float"
        return f"{self.recipe.backend}, {self.recipe.mode}", reference, "both compiled", []


LOAD_WITH = {
    "eager": "torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, "
    "nn.GRUCell, nn.RNNCell}, dtype=torch.qint8).load_state_dict(torch.load(path, weights_only=True))",
    "onnxruntime": "onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])",
    "torchao": "torch.export.load(path).module()",
}
SUFFIXES = {"eager": ".pt", "onnxruntime": ".onnx", "torchao": ".pt2"}


@dataclass(kw_only=True)
class DynamicReport(ArtifactReport):
    """What :func:`export_dynamic` did (``backend`` built the int8 model), with the sizes and the measured choice."""

    backend: str | None
    float_bytes: int | None = None
    int8_bytes: int | None = None
    choice: dict[str, Any] = field(default_factory=dict)

    def _more(self) -> dict[str, Any]:
        sizes = (self.float_bytes, self.int8_bytes)
        return {
            "mode": "dynamic",
            "size_ratio": sizes[0] / sizes[1] if all(sizes) else None,  # type: ignore[operator]
            "load_with": LOAD_WITH.get(self.backend or ""),
        }

    def _facts(self) -> tuple[str, str, str, list[str]]:
        lines = []
        if self.choice.get("measured"):
            cached = ", cached" if self.choice.get("cached") else ""
            lines.append(f"  chosen by: {self.choice.get('rule')} ({self.choice.get('threads')} threads{cached})")
            lines += [f"    {figure_line(f)}" for f in self.choice["measured"]]
        if self.float_bytes and self.int8_bytes:
            lines.append(f"  size {self.int8_bytes / 1e6:.2f} MB int8 vs {self.float_bytes / 1e6:.2f} MB fp32")
        return f"dynamic int8, {self.backend}", "fp32", "eager", lines


class ArtifactRun:
    """One model's artifact set being staged: each step records its failure in ``report.problems``; the set is
    ``<filename>`` once a model that passed is saved, else ``<filename>.failed``."""

    def __init__(self, report: Any, staged: StagedSet, filename: str) -> None:
        self.report, self.staged, self.filename = report, staged, filename
        self.set_name = f"{filename}.failed"
        self.failure: BaseException | None = None

    def final(self, name: str) -> Path:
        """Where the staged file ``name`` will be once the set is committed."""
        return self.staged.dirpath / self.set_name / name

    def fail(self, step: str, exc: BaseException) -> None:
        self.failure = exc
        self.report.problems.append(f"{step}: {exc if isinstance(exc, QuantizationError) else failure_reason(exc)}")

    def validate(
        self, reference: nn.Module, quantized: nn.Module, batches: list[Any], min_cosine: float, **kw: Any
    ) -> bool:
        """Whether ``quantized`` matches ``reference`` on ``batches`` (``input_key``, ``min_agreement`` in ``kw``)."""
        try:
            self.report.validation = compare_models(
                reference, quantized, batches, input_key=kw.get("input_key"), min_cosine=min_cosine
            )
        except Exception as exc:
            self.fail("validation", exc)
            return False
        problem = self.report.validation.failure(kw.get("min_agreement"))
        if problem is not None:
            self.report.problems.append(f"validation: {problem}")
        return problem is None

    def save_model(self, passed: bool, suffix: str, write: Callable[[Path], object]) -> None:
        """Write the model with ``write(path)``; the report is ``ok`` when it passed, was saved and nothing failed."""
        name = f"{self.filename if passed else self.set_name}{suffix}"
        try:
            write(self.staged.file(name))
        except Exception as exc:
            self.fail("saving", exc)
            self.staged.file(name).unlink(missing_ok=True)  # a partial file; the set is a failed one
            return
        self.set_name = self.filename if passed else self.set_name
        self.report.artifact = self.final(name)
        self.report.ok = passed and not self.report.problems

    def optional(self, step: str, what: str, action: Callable[[], _T]) -> _T | None:
        """Run an optional step (ONNX, timing): a failure is recorded and warned about; the saved model stands."""
        try:
            return action()
        except Exception as exc:
            self.report.problems.append(f"{step}: {failure_reason(exc)}")
            warnings.warn(f"{what} failed: {failure_reason(exc)}", FallbackWarning, stacklevel=3)
            return None

    def commit(self) -> None:
        """The JSON report into the set, then the set committed: everything in it becomes visible at once."""
        self.report.report_path = self.final(f"{self.filename}.json")
        self.staged.write_json(self.report.report_path.name, self.report.to_dict())
        self.staged.commit(self.set_name)

    def finish(self, strict: bool, what: str, note: str = "") -> None:
        """Without a model: warn with a :class:`~lightning_perf.FallbackWarning`, or with ``strict`` raise."""
        if self.report.ok:
            return
        problems = "; ".join(self.report.problems)
        message = f"The {what} was not exported: {problems}.{note} Report: {self.report.report_path}"
        if strict:
            raise QuantizationError(message) from self.failure
        warnings.warn(message, FallbackWarning, stacklevel=3)


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
    difference, top-1 agreement and, for ``(inputs, labels)`` batches, both accuracies. It is saved as
    ``<filename>.pt2`` (``<filename>.failed.pt2`` in the failed set) and, with ``benchmark``, timed against
    ``float_model`` (or the ``torchao`` model's float copy), both compiled with freezing, at each of ``batch_sizes``;
    the report ``<filename>.json`` is committed in the same set. A failure (conversion, validation, saving) warns with
    a :class:`~lightning_perf.FallbackWarning` (``strict=True`` raises); one of ONNX or timing only warns.

    Raises:
        ValueError: for an invalid option or a module that was not prepared.
        QuantizationError: with ``strict=True``, when conversion, validation or saving fails.
    """
    recipe = recipe_of(prepared)
    if recipe is None:
        raise ValueError("export_quantized() needs a module returned by prepare().")
    check_file_stem("export_quantized", "filename", filename)
    report = QuantizationReport(recipe=recipe, metadata=dict(metadata or {}))
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    example = as_input_tuple(example_inputs) if example_inputs is not None else None
    if example is None:
        example = split_inputs(batches[0], input_key) if batches else recipe.example_inputs()
    # A Hugging Face model validates, exports and is timed without its key/value cache (the copies inherit that).
    with cache_off(prepared, float_model), StagedSet(dirpath) as staged:
        run = ArtifactRun(report, staged, filename)
        quantized = _convert(prepared, recipe, run)
        if quantized is not None:
            # The trained model itself in eval mode: no state moves (observers pause, batch norm uses its stats).
            key = input_key if batches else None
            passed = run.validate(prepared, quantized, batches or [example], min_cosine, input_key=key)
            run.save_model(passed, ".pt2", functools.partial(write_program, quantized, example))
            if report.ok and onnx:
                onnx_export = functools.partial(_save_onnx, run, quantized, example)
                report.onnx = run.optional("onnx", "The ONNX export of the quantized model", onnx_export)
            if report.ok and benchmark and batch_sizes:
                kw = {"iterations": latency_iterations, "warmup": latency_warmup}
                timing = functools.partial(_timed, prepared, float_model, quantized, example, batch_sizes, **kw)
                report.latency = run.optional("timing", "Timing the quantized model", timing) or []
        run.commit()
    run.finish(strict, "quantized model", " The trained model is unchanged.")
    return report


def _convert(prepared: nn.Module, recipe: QuantizationRecipe, run: ArtifactRun) -> nn.Module | None:
    """The converted copy of ``prepared``, timed; ``None`` (recorded) when conversion fails."""
    started = time.perf_counter()
    try:
        quantized = convert(prepared, recipe)
    except Exception as exc:
        run.fail("conversion", exc)
        return None
    run.report.convert_s = time.perf_counter() - started
    return quantized


def _timed(prepared: nn.Module, float_model: nn.Module | None, quantized: nn.Module, *args: Any, **kw: Any) -> Any:
    """:func:`compiled_latency` against ``float_model``, else against the float copy of ``prepared``."""
    return compiled_latency(float_model if float_model is not None else float_copy(prepared), quantized, *args, **kw)


def _save_onnx(run: ArtifactRun, quantized: Any, example: tuple[Tensor, ...]) -> Path:
    """The quantized model's ONNX export in the set (its partial files removed when it fails)."""
    try:
        program = capture_program(quiet_deepcopy(quantized), example)
        files = save_program_onnx(program, run.staged.file(f"{run.filename}.onnx"), "export_quantized")
    except Exception:
        for leftover in run.staged.path.glob(f"{run.filename}.onnx*"):
            leftover.unlink()
        raise
    return run.final(files[-1].name)


def _write_model(backend: str, module: nn.Module, example: tuple[torch.Tensor, ...], path: Path) -> None:
    if isinstance(module, OnnxRuntimeModule):
        path.write_bytes(module.onnx_bytes)
    elif backend == "eager":
        buffer = io.BytesIO()
        torch.save(getattr(module, "module", module).state_dict(), buffer)
        path.write_bytes(buffer.getvalue())
    else:
        write_program(module, example, path)


@torch.no_grad()
def export_dynamic(
    float_module: nn.Module,
    choice: DynamicQuantization,
    *,
    example_inputs: Any,
    validation_data: Iterable[Any] | None = None,
    validation_batches: int | None = 4,
    min_cosine: float = 0.99,
    min_agreement: float = 0.95,
    dirpath: str | os.PathLike[str] = ".",
    filename: str = "model_int8",
    benchmark: bool = True,
    batch_sizes: Sequence[int] = (1, 32),
    latency_iterations: int = 20,
    latency_warmup: int = 3,
    strict: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> DynamicReport:
    """Validate, time and save the int8 module ``choice.module`` against ``float_module``; one artifact set.

    Validation runs both on up to ``validation_batches`` of ``validation_data`` (``(inputs, labels)`` batches give
    the accuracy gap; else on ``example_inputs``): it passes with cosine at least ``min_cosine`` and top-1 agreement
    at least ``min_agreement``. A failure warns with a :class:`~lightning_perf.FallbackWarning` (``strict=True``
    raises :class:`QuantizationError`); a timing failure only warns.

    Raises:
        ValueError: for an invalid file name.
        QuantizationError: with ``strict=True``, when there is no int8 model, or validation or saving fails.
    """
    check_file_stem("export_dynamic", "filename", filename)
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "export_dynamic(example_inputs)"))
    report = DynamicReport(backend=choice.backend, choice=choice.to_dict(), metadata=dict(metadata or {}))
    report.float_bytes = size_bytes(float_module)
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    quantized, backend = choice.module, choice.backend
    with cache_off(float_module), StagedSet(dirpath) as staged:
        run = ArtifactRun(report, staged, filename)
        if quantized is None or backend is None:
            report.problems.append("no back-end built a correct int8 model faster than fp32 (see `choice`)")
        else:
            report.int8_bytes = size_bytes(quantized)
            passed = run.validate(
                float_module, quantized, batches or [(example,)], min_cosine, min_agreement=min_agreement
            )
            run.save_model(passed, SUFFIXES[backend], functools.partial(_write_model, backend, quantized, example))
        if report.ok and benchmark and batch_sizes and quantized is not None:
            steps = functools.partial(eager_latency, iterations=latency_iterations, warmup=latency_warmup)
            timing = functools.partial(steps, float_module, quantized, example, batch_sizes)
            report.latency = run.optional("timing", "Timing the int8 model", timing) or []
        run.commit()
    run.finish(strict, "dynamic int8 model")
    return report
