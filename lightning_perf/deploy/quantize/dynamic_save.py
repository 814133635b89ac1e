"""The end of a dynamic int8 quantization: validate against fp32, time, save as one artifact set with its report.

:func:`export_dynamic` takes the float module and what :func:`~lightning_perf.deploy.quantize.dynamic.quantize_dynamic`
chose, and saves the int8 model and ``<filename>.json`` as :func:`~lightning_perf.deploy.quantize.save.export_quantized`
does (:class:`~lightning_perf.deploy.quantize.save.ArtifactRun`); it is timed eager against fp32, paired.
"""

from __future__ import annotations

import functools
import io
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_perf._validation import check_file_stem
from lightning_perf.deploy.artifacts import StagedSet
from lightning_perf.deploy.quantize.dynamic import (
    DynamicQuantization,
    OnnxRuntimeModule,
    eager_latency,
    figure_line,
    int8_size_bytes,
)
from lightning_perf.deploy.quantize.save import ArtifactRun, write_program
from lightning_perf.deploy.validate import ValidationSummary
from lightning_perf.functional.inputs import as_input_tuple
from lightning_perf.functional.qat_device import cache_off
from lightning_perf.profiling.latency import LatencyRow

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
    """What :func:`export_dynamic` did (``backend`` built the int8 model); the fields as in
    :class:`~lightning_perf.deploy.quantize.save.QuantizationReport`, with the sizes and the fp32 reference."""

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
        if self.choice.get("measured"):
            cached = ", cached" if self.choice.get("cached") else ""
            lines.append(f"  chosen by: {self.choice.get('rule')} ({self.choice.get('threads')} threads{cached})")
            lines += [f"    {figure_line(f)}" for f in self.choice["measured"]]
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
    check_file_stem("export_dynamic", "filename", filename)
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "export_dynamic(example_inputs)"))
    report = DynamicReport(ok=False, backend=choice.backend, choice=choice.to_dict(), metadata=dict(metadata or {}))
    report.float_bytes = float_size_bytes(float_module)
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    quantized, backend = choice.module, choice.backend
    with cache_off(float_module), StagedSet(dirpath) as staged:
        run = ArtifactRun(report, staged, filename)
        if quantized is None or backend is None:
            report.problems.append("no back-end built a correct int8 model faster than fp32 (see `choice`)")
        else:
            report.int8_bytes = int8_size_bytes(quantized)
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
