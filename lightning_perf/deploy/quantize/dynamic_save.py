"""The end of a dynamic int8 quantization: validate against fp32, time, save as one artifact set with its report.

:func:`export_dynamic` takes the float module and what :func:`~lightning_perf.deploy.quantize.dynamic.quantize_dynamic`
chose, compares the int8 module with the float one on real batches (cosine, top-1 agreement, and the accuracy gap when
the batches carry labels: :func:`~lightning_perf.deploy.validate.compare_models`), times both eager at each batch size
(paired, interleaved: :func:`~lightning_perf.profiling.latency.paired_blocks`; each speed-up with its 95% interval and
verdict), and writes the int8 model and ``<filename>.json`` as one artifact set
(:mod:`lightning_perf.deploy.artifacts`): ``<dirpath>/<filename>/`` when it passed, ``<dirpath>/<filename>.failed/``
otherwise.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_perf._warnings import FallbackWarning
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.backend import failure_reason
from lightning_perf.deploy.inputs import as_input_tuple
from lightning_perf.deploy.quantize.dynamic import DynamicQuantization, OnnxRuntimeModule, int8_size_bytes
from lightning_perf.deploy.quantize.save import write_program
from lightning_perf.deploy.validate import ValidationSummary, compare_models
from lightning_perf.functional.qat import QuantizationError, with_batch
from lightning_perf.functional.qat_device import cache_off
from lightning_perf.profiling.latency import LatencyRow, paired_blocks

__all__ = ["DynamicReport", "export_dynamic", "float_size_bytes"]

LOAD_WITH = {
    "eager": "torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, "
    "nn.GRUCell, nn.RNNCell}, dtype=torch.qint8).load_state_dict(torch.load(path, weights_only=True))",
    "onnxruntime": "onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])",
    "torchao": "torch.export.load(path).module()",
}
SUFFIXES = {"eager": ".pt", "onnxruntime": ".onnx", "torchao": ".pt2"}


def float_size_bytes(module: nn.Module) -> int:
    """Bytes of the float module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@dataclass
class DynamicReport:
    """What :func:`export_dynamic` did: the artifact, its size, its parity with fp32 and its latency against fp32.

    Attributes:
        ok: whether the int8 model passed validation and was saved.
        backend: the back-end that built it.
        artifact: the saved int8 model in the committed set, or ``None``.
        validation: the int8 model against the float one on the validation batches.
        latency: fp32 eager vs int8 per batch size (empty when not timed or when timing failed).
        problems: what failed, in order.
    """

    ok: bool
    backend: str | None
    artifact: Path | None = None
    float_bytes: int | None = None
    int8_bytes: int | None = None
    validation: ValidationSummary | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    choice: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    report_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "mode": "dynamic",
            "backend": self.backend,
            "artifact": None if self.artifact is None else str(self.artifact),
            "float_bytes": self.float_bytes,
            "int8_bytes": self.int8_bytes,
            "size_ratio": self.float_bytes / self.int8_bytes if self.float_bytes and self.int8_bytes else None,
            "validation": None if self.validation is None else self.validation.to_dict(),
            "latency": [row.to_dict() for row in self.latency],
            "choice": dict(self.choice),
            "problems": list(self.problems),
            "metadata": dict(self.metadata),
            "load_with": LOAD_WITH.get(self.backend or ""),
        }

    def summary(self, owner: str) -> str:
        """What happened, in a few lines for a log (``owner`` names the caller)."""
        if not self.ok:
            return f"{owner}: no dynamic int8 model saved ({'; '.join(self.problems)}). Report: {self.report_path}"
        lines = [f"{owner}: saved {self.artifact} (dynamic int8, {self.backend})"]
        if self.float_bytes and self.int8_bytes:
            lines.append(f"  size {self.int8_bytes / 1e6:.2f} MB int8 vs {self.float_bytes / 1e6:.2f} MB fp32")
        if self.validation is not None:
            lines.append("  against fp32: " + self.validation.describe().replace("(fake-quantized)", "(fp32)"))
        for row in self.latency:
            lines.append(
                f"  batch {row.batch_size}: {1e3 * row.candidate_median_s:.3f} ms int8 vs "
                f"{1e3 * row.baseline_median_s:.3f} ms fp32, eager: {row.format_speedup()} (95% interval)"
            )
        lines.append(f"  report: {self.report_path}")
        return "\n".join(lines)


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
    if not isinstance(filename, str) or not filename or os.sep in filename or filename.startswith("."):
        raise ValueError(f"`export_dynamic(filename={filename!r})` is not valid. Expected a plain file stem.")
    dirpath = Path(dirpath)
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "export_dynamic(example_inputs)"))
    reference = float_module
    report = DynamicReport(ok=False, backend=choice.backend, choice=choice.to_dict(), metadata=dict(metadata or {}))
    report.float_bytes = float_size_bytes(reference)
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    quantized = choice.module
    with cache_off(float_module), StagedSet(dirpath) as staged:
        passed = False
        if quantized is None or choice.backend is None:
            report.problems.append("no back-end built a correct int8 model faster than fp32 (see `choice`)")
        else:
            report.int8_bytes = int8_size_bytes(quantized)
            try:
                report.validation = compare_models(reference, quantized, batches or [example], min_cosine=min_cosine)
                agreement = report.validation.top1_agreement
                passed = report.validation.passed and (agreement is None or agreement >= min_agreement)
                if not report.validation.passed:
                    report.problems.append(f"validation: {report.validation.problem}")
                elif not passed:
                    report.problems.append(f"validation: top-1 agreement {agreement:.3f} below {min_agreement}")
            except Exception as exc:
                report.problems.append(f"validation: {failure_reason(exc)}")
        set_name = filename if passed else f"{filename}.failed"
        if quantized is not None and choice.backend is not None:
            name = f"{set_name}{SUFFIXES[choice.backend]}"
            try:
                _write_model(choice.backend, quantized, example, staged.file(name))
                report.artifact = dirpath / set_name / name
            except Exception as exc:
                report.problems.append(f"saving: {failure_reason(exc)}")
        report.ok = passed and report.artifact is not None and not report.problems
        if report.ok and benchmark and batch_sizes and quantized is not None:
            int8 = quantized
            modes = [(m, m.training) for m in (reference, int8)]
            reference.eval()
            int8.eval()
            try:
                for size in batch_sizes:
                    batch = with_batch(example, size)
                    base, cand = paired_blocks(
                        functools.partial(reference, *batch),
                        functools.partial(int8, *batch),
                        iterations=latency_iterations,
                        warmup=latency_warmup,
                    )
                    report.latency.append(LatencyRow.from_blocks(size, base, cand, names=("float", "int8")))
            except Exception as exc:
                report.problems.append(f"timing: {failure_reason(exc)}")
                warnings.warn(f"Timing the int8 model failed: {failure_reason(exc)}", FallbackWarning, stacklevel=2)
            finally:
                for module, mode in modes:
                    module.train(mode)
        report.report_path = dirpath / set_name / f"{filename}.json"
        staged.write_json(report.report_path.name, report.to_dict())
        staged.commit(set_name)
    if not report.ok:
        message = f"The dynamic int8 model was not exported: {'; '.join(report.problems)}. Report: {report.report_path}"
        if strict:
            raise QuantizationError(message)
        warnings.warn(message, FallbackWarning, stacklevel=2)
    return report
