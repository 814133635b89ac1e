"""Parity of a deployed model with the model it came from: outputs compared on real inputs.

Two comparisons: :func:`compare_outputs` checks an export's outputs element-wise against the model's (names, shapes,
NaN/Inf, ``atol + rtol * |model|`` and cosine similarity, a :class:`Tolerance` per precision) and
:func:`validate_runner` does it for a saved artifact at each batch size; :func:`compare_models` runs a quantized
model beside its reference on batches and summarizes cosine similarity, max abs difference, top-1 agreement and, with
labelled batches, both accuracies (:class:`ValidationSummary`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_perf._device import module_device
from lightning_perf._validation import check_number
from lightning_perf.deploy.inputs import cast_inputs
from lightning_perf.functional.inputs import split_inputs

__all__ = [
    "DEFAULT_TOLERANCES",
    "OutputCheck",
    "Tolerance",
    "ValidationResult",
    "ValidationSummary",
    "compare_models",
    "compare_outputs",
    "eval_mode",
    "flat_outputs",
    "validate_runner",
]


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
            check_number("Tolerance", name, getattr(self, name), 0, 1 if name == "min_cosine" else None)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-4, min_cosine=0.9999),
    "fp16": Tolerance(atol=1e-2, rtol=1e-2, min_cosine=0.99),
    # bf16 keeps 8 bits of mantissa against fp16's 11: about 8x coarser.
    "bf16": Tolerance(atol=5e-2, rtol=5e-2, min_cosine=0.99),
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


def flat_outputs(output: Any) -> tuple[list[Tensor], list[str]]:
    """The tensors of a model output and their names (``output``; ``output_0``...; or the dict keys)."""
    if isinstance(output, Tensor):
        return [output], ["output"]
    leaves, _ = pytree.tree_flatten(output)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        if isinstance(output, Mapping):  # e.g. a Hugging Face ModelOutput holding a key/value cache
            other = {str(k): type(v).__name__ for k, v in output.items() if not isinstance(v, Tensor)}
            raise ValueError(
                f"The model output {type(output).__name__} holds values that are not tensors: {other}. A Hugging Face "
                "model's cache (`past_key_values`) is left out with `use_cache=False`."
            )
        raise ValueError(f"The model output {type(output).__name__} is not a tensor or a container of tensors.")
    if isinstance(output, Mapping) and len(leaves) == len(output):
        return leaves, [str(k) for k in output]
    return leaves, [f"output_{i}" for i in range(len(leaves))]


def compare_outputs(
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
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """The modules in eval mode inside the block, their train/eval modes restored after."""
    modes = [(m, m.training) for m in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.train(mode)


def validate_runner(
    runner: Any,
    batches: Mapping[int, tuple[Tensor, ...]],
    reference: Mapping[int, tuple[list[Tensor], list[str]]],
    dtype: torch.dtype,
    device: torch.device,
    tolerance: Tolerance,
) -> list[ValidationResult]:
    """Compare a saved artifact's runner (``runner(inputs) -> outputs``, ``runner.output_names``) with the model's
    reference outputs at each batch size."""
    results = []
    for b, inputs in batches.items():
        outputs = runner(cast_inputs(inputs, dtype, device))
        checks = compare_outputs(outputs, runner.output_names, *reference[b], tolerance)
        problem = next((c.problem for c in checks if c.problem), None)
        results.append(ValidationResult(b, problem is None, checks, problem))
    return results


@dataclass
class ValidationSummary:
    """The quantized model against its reference (the fake-quantized or calibrated model) on real batches.

    ``cosine`` and ``max_abs_diff`` are over all outputs of all batches; ``top1_agreement`` is the share of samples
    whose argmax over the last output dimension agree. The accuracies are filled when batches carry integer labels
    matching the output (``(inputs, labels)`` with ``labels.shape == output.shape[:-1]``); ``accuracy_gap`` is the
    reference's accuracy minus the quantized model's, in percentage points.
    """

    batches: int
    samples: int
    cosine: float
    max_abs_diff: float
    non_finite: int
    top1_agreement: float | None = None
    reference_accuracy: float | None = None
    quantized_accuracy: float | None = None
    passed: bool = False
    problem: str | None = None

    @property
    def accuracy_gap(self) -> float | None:
        if self.reference_accuracy is None or self.quantized_accuracy is None:
            return None
        return 100.0 * (self.reference_accuracy - self.quantized_accuracy)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "accuracy_gap_pp": self.accuracy_gap}

    def failure(self, min_agreement: float | None = None) -> str | None:
        """Why the model fails: :attr:`problem`, or a top-1 agreement below ``min_agreement``; ``None`` if it passes."""
        agreement = self.top1_agreement
        if self.passed and min_agreement is not None and agreement is not None and agreement < min_agreement:
            return f"top-1 agreement {agreement:.3f} below {min_agreement}"
        return None if self.passed else self.problem

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The figures a logger records (those known), named ``<prefix>int8_cosine`` and so on."""
        figures = {
            "int8_cosine": self.cosine,
            "int8_top1_agreement": self.top1_agreement,
            "fake_quant_accuracy": self.reference_accuracy,
            "int8_accuracy": self.quantized_accuracy,
            "accuracy_gap_pp": self.accuracy_gap,
        }
        return {f"{prefix}{key}": float(value) for key, value in figures.items() if value is not None}

    def describe(self, reference: str = "fake-quantized") -> str:
        """One line: cosine, max abs difference, top-1 agreement and the accuracies (``reference``'s and int8's) when
        known."""
        text = f"cosine {self.cosine:.5f}, max abs diff {self.max_abs_diff:.3g}"
        if self.top1_agreement is not None:
            text += f", top-1 agreement {100 * self.top1_agreement:.1f}%"
        if self.accuracy_gap is not None:
            text += (
                f", accuracy {100 * self.reference_accuracy:.2f}% ({reference}) vs "  # type: ignore[operator]
                f"{100 * self.quantized_accuracy:.2f}% (int8), gap {self.accuracy_gap:+.2f} pp"  # type: ignore[operator]
            )
        return text


def _labels(batch: Any) -> Tensor | None:
    if isinstance(batch, (tuple, list)) and len(batch) > 1 and isinstance(batch[1], Tensor):
        label = batch[1]
        if not label.is_floating_point() and not label.is_complex():
            return label
    return None


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    quantized: nn.Module,
    batches: Iterable[Any],
    *,
    input_key: str | None = None,
    max_batches: int | None = None,
    min_cosine: float = 0.99,
) -> ValidationSummary:
    """Run both models (in eval mode, each on its own device) on ``batches`` and compare their outputs.

    Passes when no output is NaN/Inf, every output has the reference's shape and the overall cosine similarity is at
    least ``min_cosine``. The models' train/eval modes are left as they were.

    Raises:
        ValueError: if there is no batch.
    """
    dot = ref_sq = out_sq = max_abs = 0.0
    non_finite = samples = count = agree = positions = labelled = 0
    correct = {"reference": 0, "quantized": 0}
    problem: str | None = None
    with eval_mode(reference, quantized):
        for batch in batches:
            if max_batches is not None and count >= max_batches:
                break
            inputs = split_inputs(batch, input_key)
            ref_out, _ = flat_outputs(reference(*(t.to(module_device(reference)) for t in inputs)))
            q_out, _ = flat_outputs(quantized(*(t.to(module_device(quantized)) for t in inputs)))
            count += 1
            samples += int(inputs[0].shape[0])
            if len(ref_out) != len(q_out) or any(r.shape != q.shape for r, q in zip(ref_out, q_out)):
                problem = "the quantized model's outputs differ in number or shape from the reference's"
                break
            for r, q in zip(ref_out, q_out):
                r64, q64 = r.detach().double().cpu(), q.detach().double().cpu()
                non_finite += int((~torch.isfinite(q64)).sum())
                if non_finite:
                    continue
                dot += float((r64 * q64).sum())
                ref_sq += float((r64 * r64).sum())
                out_sq += float((q64 * q64).sum())
                max_abs = max(max_abs, float((r64 - q64).abs().max()) if r64.numel() else 0.0)
            first_ref, first_q = ref_out[0].cpu(), q_out[0].cpu()
            if first_ref.dim() >= 2:
                ref_top, q_top = first_ref.argmax(-1), first_q.argmax(-1)
                agree += int((ref_top == q_top).sum())
                positions += ref_top.numel()
                labels = _labels(batch)
                if labels is not None and tuple(labels.shape) == tuple(ref_top.shape):
                    labels = labels.cpu()
                    correct["reference"] += int((ref_top == labels).sum())
                    correct["quantized"] += int((q_top == labels).sum())
                    labelled += labels.numel()
    if count == 0:
        raise ValueError("compare_models() got no batch to compare on.")
    norms = math.sqrt(ref_sq * out_sq)
    cosine = dot / norms if norms > 0 else (1.0 if ref_sq == out_sq == 0 else 0.0)
    if problem is None and non_finite:
        problem = f"{non_finite} NaN/Inf value(s) in the quantized model's outputs"
    if problem is None and cosine < min_cosine:
        problem = f"cosine similarity {cosine:.5f} to the reference is below {min_cosine}"
    return ValidationSummary(
        batches=count,
        samples=samples,
        cosine=cosine,
        max_abs_diff=max_abs,
        non_finite=non_finite,
        top1_agreement=agree / positions if positions else None,
        reference_accuracy=correct["reference"] / labelled if labelled else None,
        quantized_accuracy=correct["quantized"] / labelled if labelled else None,
        passed=problem is None,
        problem=problem,
    )
