"""Dynamic int8 quantization for CPU inference: int8 weights, activations quantized per batch at run time.

No calibration and no training change: a float module goes in, an int8 copy comes out (the float module is left as it
is). Three back-ends, one chosen at run time by measuring on the actual module (:func:`quantize_dynamic`):

- ``"eager"``: ``torch.ao.quantization.quantize_dynamic`` with the ``x86``/``fbgemm`` engine (``nn.Linear``,
  ``nn.LSTM``, ``nn.GRU``, ``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``). It is deprecated in torch 2.13 and warns
  on every call; the warning is silenced locally here (it says nothing the user can act on: the API still works and
  torch offers no eager replacement that is fast on AVX2). On an AMD EPYC (Zen 3, AVX2 only, 1 thread, two MLP blocks
  1024->4096->1024, batch 64) it ran in 0.39-0.41x the fp32 time, relative error 4e-2.
- ``"onnxruntime"``: the module exported to ONNX (``torch.onnx.export(dynamo=True)``, dynamic batch dimension), then
  ``onnxruntime.quantization.quantize_dynamic(per_channel=True, reduce_range=...)``, run by an ONNX Runtime session
  wrapped as an ``nn.Module`` (:class:`OnnxRuntimeModule`). ``reduce_range=True`` (7-bit weights) on CPUs without
  VNNI: their u8*s8 ``VPMADDUBSW`` path saturates its 16-bit intermediate sums, and ONNX Runtime's own docstring
  recommends ``reduce_range=False`` on VNNI CPUs, whose dot products accumulate in 32 bits. Same machine: 0.32-0.36x
  the fp32 eager time; relative error 2.5e-2 with per-channel, reduced-range weights (0.16 with the defaults).
- ``"torchao"``: ``quantize_(module, Int8DynamicActivationInt8WeightConfig())``, offered only where the CPU has
  VNNI or AMX int8 instructions: its ``torch._int_mm`` is about 100x slower than an fp32 matmul on AVX2, and the
  model ran 18.5x *slower* than fp32 there (torchao issue #4365 reports the same).

``backend="auto"`` keeps the fastest candidate that agrees with the float module, none when no candidate is faster
than fp32 (:func:`quantize_dynamic`); the choice is cached per (CPU flags, threads, module structure, input shapes).
"""

from __future__ import annotations

import copy
import functools
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._imports import is_available, require
from lightning_perf.deploy.backend import failure_reason
from lightning_perf.deploy.inputs import Inputs, as_input_tuple
from lightning_perf.deploy.validate import ValidationSummary, compare_models, eval_mode
from lightning_perf.functional.qat import QuantizationError, with_batch
from lightning_perf.functional.qat_device import disable_cache
from lightning_perf.profiling.latency import LatencyRow, paired_blocks
from lightning_perf.profiling.machine import cpu_flags

__all__ = [
    "DYNAMIC_BACKENDS",
    "DynamicCandidate",
    "DynamicQuantization",
    "OnnxRuntimeModule",
    "check_dynamic_backend",
    "clear_cache",
    "dynamic_candidates",
    "eager_latency",
    "has_int8_dot_product",
    "int8_size_bytes",
    "quantize_dynamic",
    "quantize_dynamic_eager",
    "quantize_dynamic_onnxruntime",
    "quantize_dynamic_torchao",
]

DYNAMIC_BACKENDS: tuple[str, ...] = ("auto", "eager", "onnxruntime", "torchao")

_EAGER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, nn.RNNCell)
_CHOICES: dict[tuple[Any, ...], str | None] = {}  # the auto choice per (CPU, threads, module structure, shapes)


def check_dynamic_backend(owner: str, backend: Any) -> str:
    """Return ``backend`` if it is one of :data:`DYNAMIC_BACKENDS`; raise ``ValueError`` naming ``owner`` else."""
    if not isinstance(backend, str) or backend not in DYNAMIC_BACKENDS:
        raise ValueError(
            f"`{owner}(backend={backend!r})` is not valid for mode 'dynamic'. Expected one of: "
            f"{', '.join(map(repr, DYNAMIC_BACKENDS))}."
        )
    return backend


def has_int8_dot_product(flags: dict[str, bool] | None) -> bool:
    """Whether the CPU has VNNI or AMX int8 dot products (``False`` when the flags are unknown)."""
    if not flags:
        return False
    return bool(flags.get("avx512_vnni") or flags.get("amx_int8") or flags.get("avx_vnni"))


def dynamic_candidates(flags: dict[str, bool] | None = None) -> tuple[list[str], dict[str, str]]:
    """The back-ends this CPU and installation offer, in order, and why each other one is left out."""
    flags = cpu_flags() if flags is None else flags
    offered: list[str] = []
    skipped: dict[str, str] = {}
    engines = torch.backends.quantized.supported_engines
    if "x86" in engines or "fbgemm" in engines:
        offered.append("eager")
    else:
        skipped["eager"] = f"torch has no x86/fbgemm quantized engine here ({engines})"
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if not is_available(m)]
    if missing:
        skipped["onnxruntime"] = f"not installed: {', '.join(missing)} (the `onnx` extra)"
    else:
        offered.append("onnxruntime")
    if not has_int8_dot_product(flags):
        skipped["torchao"] = "the CPU has no VNNI/AMX int8 dot products: torch._int_mm is ~100x slower than fp32 there"
    elif not is_available("torchao"):
        skipped["torchao"] = "torchao is not installed (the `qat` extra)"
    else:
        offered.append("torchao")
    return offered, skipped


@contextmanager
def _quiet() -> Iterator[None]:
    # torch.ao's deprecation notices, ONNX export chatter and onnxruntime's advice logged on the root logger say
    # nothing the user can act on here.
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning, UserWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        root.setLevel(level)


# ------------------------------------------------------------------------------------------------------ back-ends


class _QuietForward(nn.Module):
    """Runs an eager dynamically quantized module with torch.ao's per-call deprecation warnings silenced."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _quiet():
            return self.module(*args, **kwargs)


@torch.no_grad()
def quantize_dynamic_eager(module: nn.Module) -> nn.Module:
    """An int8 copy of ``module`` by ``torch.ao.quantization.quantize_dynamic`` (qint8 weights; Linear and recurrent
    layers); ``module`` is left as it is.

    Raises:
        QuantizationError: if the module holds no layer this back-end quantizes.
    """
    if not any(isinstance(m, _EAGER_TYPES) for m in module.modules()):
        raise QuantizationError("no nn.Linear or recurrent layer to quantize")
    source = copy.deepcopy(module).cpu().eval()
    with _quiet():
        quantized = torch.ao.quantization.quantize_dynamic(source, set(_EAGER_TYPES), dtype=torch.qint8)
    return _QuietForward(quantized)


class OnnxRuntimeModule(nn.Module):
    """An ONNX Runtime CPU session as an ``nn.Module``: tensors in, tensors out (the float module's output structure).

    Inference only (no autograd). The model's bytes are kept (``onnx_bytes``); the session is rebuilt after a deep
    copy or a pickle.
    """

    def __init__(self, onnx_bytes: bytes, output_spec: tuple[str, tuple[Any, ...]], threads: int | None = None) -> None:
        super().__init__()
        self.onnx_bytes = onnx_bytes
        self.output_spec = output_spec
        self.threads = threads
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            ort = require("onnxruntime", "quantize_dynamic(backend='onnxruntime')")
            options = ort.SessionOptions()
            options.log_severity_level = 3
            # As many threads as torch uses, so that the comparison with the float module is fair.
            options.intra_op_num_threads = self.threads or torch.get_num_threads()
            # No spinning worker threads between calls: they would take the cores from the rest of the process (the
            # user's own torch code, and the float module it is timed against).
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = ort.InferenceSession(self.onnx_bytes, options, providers=["CPUExecutionProvider"])
        return self._session

    def forward(self, *inputs: Tensor) -> Any:
        session = self._get_session()
        feed = {i.name: t.detach().cpu().contiguous().numpy() for i, t in zip(session.get_inputs(), inputs)}
        outputs = [torch.from_numpy(a) for a in session.run(None, feed)]
        kind, keys = self.output_spec
        if kind == "tensor":
            return outputs[0]
        if kind == "dict":
            return dict(zip(keys, outputs))
        return tuple(outputs) if kind == "tuple" else outputs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> OnnxRuntimeModule:
        copied = OnnxRuntimeModule(self.onnx_bytes, self.output_spec, self.threads)
        copied.train(self.training)
        return copied


def _output_spec(output: Any) -> tuple[str, tuple[Any, ...]]:
    """How to rebuild the float module's output from the session's flat list (a tensor, or a flat tuple, list or dict
    of tensors)."""
    if isinstance(output, Tensor):
        return ("tensor", ())
    if isinstance(output, (tuple, list)) and all(isinstance(t, Tensor) for t in output):
        return (type(output).__name__ if type(output) in (tuple, list) else "tuple", ())
    if isinstance(output, dict) and all(isinstance(t, Tensor) for t in output.values()):
        return ("dict", tuple(output))
    raise QuantizationError(
        f"the onnxruntime back-end rebuilds a tensor or a flat tuple, list or dict of tensors; the module returns a "
        f"{type(output).__name__} holding other things"
    )


@torch.no_grad()
def quantize_dynamic_onnxruntime(
    module: nn.Module, example_inputs: Any, *, reduce_range: bool | None = None, per_channel: bool = True
) -> OnnxRuntimeModule:
    """An int8 ONNX Runtime copy of ``module``: ONNX export (dynamic batch) and ``onnxruntime``'s dynamic
    quantization. ``reduce_range=None`` means ``True`` on CPUs without VNNI/AMX int8 (see the module docstring).

    Raises:
        ModuleNotFoundError: if onnx, onnxscript or onnxruntime is missing (the ``onnx`` extra).
        QuantizationError: if the export or the quantization fails.
    """
    for name in ("onnx", "onnxscript", "onnxruntime"):
        require(name, "quantize_dynamic(backend='onnxruntime')")
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic
    from torch.export import Dim

    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "quantize_dynamic(example_inputs)"))
    source = copy.deepcopy(module).cpu().eval()
    spec = _output_spec(source(*example))
    if reduce_range is None:
        reduce_range = not has_int8_dot_product(cpu_flags())
    with tempfile.TemporaryDirectory(prefix="lightning_perf_dynamic_") as tmp:
        float_path, int8_path = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        try:
            with _quiet():
                program = torch.onnx.export(
                    source,
                    example,
                    None,
                    dynamo=True,
                    dynamic_shapes=tuple({0: Dim.DYNAMIC} for _ in example),
                    verbose=False,
                )
                if program is None:
                    raise RuntimeError("torch.onnx.export returned no program")
                program.save(str(float_path))
                ort_quantize_dynamic(
                    float_path,
                    int8_path,
                    per_channel=per_channel,
                    reduce_range=reduce_range,
                    weight_type=QuantType.QInt8,
                )
        except Exception as exc:
            raise QuantizationError(f"ONNX export or quantization failed: {failure_reason(exc)}") from exc
        return OnnxRuntimeModule(int8_path.read_bytes(), spec)


@torch.no_grad()
def quantize_dynamic_torchao(module: nn.Module) -> nn.Module:
    """An int8 copy of ``module`` by torchao's ``Int8DynamicActivationInt8WeightConfig`` (its ``nn.Linear`` layers).

    Raises:
        ModuleNotFoundError: if torchao is missing (the ``qat`` extra).
    """
    torchao = require("torchao", "quantize_dynamic(backend='torchao')")
    quantized = copy.deepcopy(module).cpu().eval()
    with _quiet():
        torchao.quantization.quantize_(quantized, torchao.quantization.Int8DynamicActivationInt8WeightConfig())
    return quantized


def _build(backend: str, module: nn.Module, example: tuple[Tensor, ...]) -> nn.Module:
    if backend == "eager":
        return quantize_dynamic_eager(module)
    if backend == "onnxruntime":
        return quantize_dynamic_onnxruntime(module, example)
    return quantize_dynamic_torchao(module)


# ---------------------------------------------------------------------------------------------------- the choice


@dataclass
class DynamicCandidate:
    """One back-end tried on the module: its parity with the float module and its speed against it."""

    backend: str
    validation: ValidationSummary | None = None
    latency: LatencyRow | None = None
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "validation": None if self.validation is None else self.validation.to_dict(),
            "latency": None if self.latency is None else self.latency.to_dict(),
            "problem": self.problem,
        }

    def describe(self) -> str:
        if self.problem is not None:
            return f"{self.backend}: {self.problem}"
        text = f"{self.backend}: {self.validation.describe() if self.validation else 'not validated'}"
        if self.latency is not None:
            text += f"; speed-up {self.latency.format_speedup()} (95% interval)"
        return text


@dataclass
class DynamicQuantization:
    """What :func:`quantize_dynamic` chose: the int8 module (``None`` when no back-end was correct and faster) and
    every candidate's figures."""

    backend: str | None
    module: nn.Module | None
    requested: str
    candidates: list[DynamicCandidate] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    cached: bool = False
    cpu_flags: dict[str, bool] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "requested": self.requested,
            "cached": self.cached,
            "cpu_flags": self.cpu_flags,
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": dict(self.skipped),
        }

    def describe(self) -> str:
        """What was chosen and why, in a few lines."""
        chosen = f"chose {self.backend!r}" if self.backend else "kept the float module (no back-end correct and faster)"
        lines = [f"dynamic int8 ({self.requested}{', cached choice' if self.cached else ''}): {chosen}"]
        lines += [f"  {c.describe()}" for c in self.candidates]
        lines += [f"  {name}: not tried ({why})" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _cache_key(module: nn.Module, example: tuple[Tensor, ...], flags: dict[str, bool] | None) -> tuple[Any, ...]:
    structure = tuple((name, type(m).__name__) for name, m in module.named_modules())
    shapes = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
    return (
        tuple(sorted((flags or {}).items())),
        torch.get_num_threads(),
        structure,
        shapes,
        tuple((tuple(t.shape), str(t.dtype)) for t in example),
    )


def _check(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"`quantize_dynamic({name}={value!r})` is not valid. Expected a number in [{low}, {high}].")
    return float(value)


@torch.no_grad()
def quantize_dynamic(
    module: nn.Module,
    example_inputs: Any,
    backend: str = "auto",
    *,
    min_cosine: float = 0.99,
    min_agreement: float = 0.95,
    iterations: int = 10,
    warmup: int = 2,
    use_cache: bool = True,
) -> DynamicQuantization:
    """An int8 copy of ``module`` (dynamic quantization, CPU), by ``backend`` or the fastest correct one (``"auto"``).

    Each candidate is checked against ``module`` on ``example_inputs`` (cosine at least ``min_cosine``, top-1 agreement
    over the last output dimension at least ``min_agreement`` when the output has one); with ``"auto"`` the correct
    ones are timed against ``module`` (``iterations`` calls each, paired and interleaved) and the fastest whose
    speed-up interval lies above 1 is kept. ``module`` is left as it is (its copies are on the CPU, in eval mode).

    Raises:
        ValueError: for an unknown backend or an invalid threshold.
        QuantizationError: if an explicit ``backend`` fails or disagrees with the float module.
    """
    check_dynamic_backend("quantize_dynamic", backend)
    min_cosine = _check("min_cosine", min_cosine, 0.0, 1.0)
    min_agreement = _check("min_agreement", min_agreement, 0.0, 1.0)
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "quantize_dynamic(example_inputs)"))
    flags = cpu_flags()
    reference = copy.deepcopy(module).cpu().eval()
    disable_cache(reference)  # a Hugging Face model's int8 copy is built, checked and timed without its cache
    names, skipped = dynamic_candidates(flags) if backend == "auto" else ([backend], {})
    key = _cache_key(reference, example, flags)
    cached = backend == "auto" and use_cache and key in _CHOICES
    if cached:
        names = [name for name in [_CHOICES[key]] if name is not None]
    result = DynamicQuantization(None, None, backend, skipped=skipped, cached=cached, cpu_flags=flags)
    built: dict[str, nn.Module] = {}
    for name in names:
        candidate = DynamicCandidate(name)
        result.candidates.append(candidate)
        try:
            quantized = _build(name, reference, example)
            candidate.validation = compare_models(reference, quantized, [example], min_cosine=min_cosine)
        except Exception as exc:
            candidate.problem = f"failed: {failure_reason(exc)}"
            continue
        problem = candidate.validation.failure(min_agreement)
        if problem is None:
            built[name] = quantized
        else:
            candidate.problem = f"disagrees with fp32: {problem}"
    if backend != "auto" and not built:
        raise QuantizationError(f"dynamic int8 with backend {backend!r}: {result.candidates[0].problem}")
    if backend != "auto" or cached:  # one candidate: nothing to choose from
        result.backend, result.module = next(iter(built.items()), (None, None))
        return result
    for candidate in result.candidates:
        if candidate.backend in built:
            one_batch = [int(example[0].shape[0])]
            timed = eager_latency(
                reference,
                built[candidate.backend],
                example,
                one_batch,
                iterations=iterations,
                warmup=warmup,
                name=candidate.backend,
            )
            candidate.latency = timed[0]
    faster = [c for c in result.candidates if c.latency is not None and c.latency.speedup_verdict == "faster"]
    if faster:
        best = max(faster, key=lambda c: c.latency.speedup)  # type: ignore[union-attr]
        result.backend, result.module = best.backend, built[best.backend]
    if use_cache:
        _CHOICES[key] = result.backend
    return result


def eager_latency(
    reference: nn.Module,
    quantized: nn.Module,
    example: Inputs,
    batch_sizes: Sequence[int],
    *,
    iterations: int,
    warmup: int,
    name: str = "int8",
) -> list[LatencyRow]:
    """Both modules eager, in eval mode, timed paired and interleaved at each batch size (samples reused cyclically)."""
    rows = []
    with eval_mode(reference, quantized):
        for size in batch_sizes:
            batch = with_batch(example, size)
            run = (functools.partial(reference, *batch), functools.partial(quantized, *batch))
            base, cand = paired_blocks(*run, iterations=iterations, warmup=warmup)
            rows.append(LatencyRow.from_blocks(size, base, cand, names=("float", name)))
    return rows


def clear_cache() -> None:
    """Forget the back-ends chosen so far (the next ``"auto"`` measures again)."""
    _CHOICES.clear()


def int8_size_bytes(module: nn.Module) -> int:
    """Bytes of the int8 module's weights as it is saved (ONNX bytes, else its ``state_dict`` tensors)."""
    if isinstance(module, OnnxRuntimeModule):
        return len(module.onnx_bytes)
    total = 0
    for value in module.state_dict().values():
        if isinstance(value, Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, tuple):  # packed params: (weight, bias)
            total += sum(t.numel() * t.element_size() for t in value if isinstance(t, Tensor))
    return total
