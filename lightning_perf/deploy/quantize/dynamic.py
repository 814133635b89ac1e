"""Dynamic int8 quantization for CPU inference: int8 weights, activations quantized per batch at run time.

Entry point: :func:`quantize_dynamic` (``backend="auto"``: the fastest of ``"eager"``, ``"onnxruntime"`` and
``"torchao"`` measured on the module that agrees with it, cached per machine; :func:`clear_cache`). The back-ends'
measured speed and error, ``reduce_range``, the tie rule and the caches: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from lightning_perf._imports import is_available, require
from lightning_perf._io import DecisionCache, failure_reason
from lightning_perf._validation import check_bool, check_choice, check_number
from lightning_perf._warnings import MeasurementWarning
from lightning_perf.deploy.inputs import Inputs
from lightning_perf.deploy.onnx import _onnx_export, equal_thread_options
from lightning_perf.deploy.quantize.dynamic_cache import (
    code_key,
    int8_onnx_file,
    read_int8_onnx,
    weights_key,
    write_int8_onnx,
)
from lightning_perf.deploy.validate import ValidationSummary, compare_models, eval_mode
from lightning_perf.functional.inputs import as_input_tuple, export_shapes
from lightning_perf.functional.quantization.device import disable_cache
from lightning_perf.functional.quantization.qat import QuantizationError, with_batch
from lightning_perf.profiling.latency import LatencyRow, measure_latency
from lightning_perf.profiling.machine import cpu_flags, decision_key
from lightning_perf.profiling.report import to_jsonable

__all__ = [
    "CACHE_FILE",
    "DYNAMIC_BACKENDS",
    "SIMPLICITY",
    "TIE_RULE",
    "DynamicCandidate",
    "DynamicQuantization",
    "OnnxRuntimeModule",
    "choose",
    "clear_cache",
    "dynamic_candidates",
    "eager_latency",
    "figure_line",
    "has_int8_dot_product",
    "machine_key",
    "model_key",
    "onnx_cache_dir",
    "quantize_dynamic",
    "quantize_dynamic_eager",
    "quantize_dynamic_onnxruntime",
    "quantize_dynamic_torchao",
    "size_bytes",
]

DYNAMIC_BACKENDS: tuple[str, ...] = ("auto", "eager", "onnxruntime", "torchao")

SIMPLICITY: tuple[str, ...] = ("eager", "torchao", "onnxruntime")
"""The back-ends from the simplest up: torch alone and a ``state_dict``; torch with torchao and ``torch.export``; a
second runtime and an ONNX export."""
TIE_RULE = (
    "the fastest back-end whose speed-up interval lies above 1, unless a simpler one (eager < torchao < onnxruntime) "
    "is faster too and its interval overlaps the fastest's: within noise, the simplest is kept"
)
CACHE_FILE = "dynamic_int8.json"
_CACHE = DecisionCache(CACHE_FILE, "dynamic int8 cache")
_EAGER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, nn.RNNCell)


def has_int8_dot_product(flags: dict[str, bool] | None) -> bool:
    """Whether the CPU has VNNI or AMX int8 dot products (``False`` when the flags are unknown)."""
    return any((flags or {}).get(name) for name in ("avx512_vnni", "amx_int8", "avx_vnni"))


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
        # nn.Transformer*Layer's eval fast path reads `linear.weight.device`, which int8 layers have as a method: the
        # fast path is off for this call only (it needs float weights anyway).
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with _quiet():
                return self.module(*args, **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)


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

    from_cache = False  # loaded from the int8 ONNX cache (quantize_dynamic_onnxruntime), not converted in this call

    def __init__(self, onnx_bytes: bytes, output_spec: pytree.TreeSpec, threads: int | None = None) -> None:
        super().__init__()
        self.onnx_bytes = onnx_bytes
        self.output_spec = output_spec
        self.threads = threads
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            ort = require("onnxruntime", "quantize_dynamic(backend='onnxruntime')")
            # As many threads as torch uses, so that the comparison with the float module is fair, and no spinning
            # workers taking the cores from the rest of the process between calls.
            options = equal_thread_options(ort, self.threads)
            self._session = ort.InferenceSession(self.onnx_bytes, options, providers=["CPUExecutionProvider"])
        return self._session

    def forward(self, *inputs: Tensor) -> Any:
        session = self._get_session()
        feed = {i.name: t.detach().cpu().contiguous().numpy() for i, t in zip(session.get_inputs(), inputs)}
        return pytree.tree_unflatten([torch.from_numpy(a) for a in session.run(None, feed)], self.output_spec)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None}

    def __deepcopy__(self, memo: dict[int, Any]) -> OnnxRuntimeModule:
        copied = OnnxRuntimeModule(self.onnx_bytes, self.output_spec, self.threads)
        copied.train(self.training)
        return copied


def _output_spec(output: Any) -> pytree.TreeSpec:
    """How to rebuild the float module's output (tensors in tuples, lists and dicts) from the session's flat list."""
    leaves, spec = pytree.tree_flatten(output)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        raise QuantizationError(
            f"the onnxruntime back-end rebuilds tensors in tuples, lists and dicts; the module returns a "
            f"{type(output).__name__} holding other things"
        )
    return spec


@torch.no_grad()
def quantize_dynamic_onnxruntime(
    module: nn.Module,
    example_inputs: Any,
    *,
    reduce_range: bool | None = None,
    per_channel: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> OnnxRuntimeModule:
    """An int8 ONNX Runtime copy of ``module``: ONNX export (dynamic batch) and ``onnxruntime``'s dynamic
    quantization. ``reduce_range=None`` means ``True`` on CPUs without VNNI/AMX int8 (see the module notes).

    With ``cache_dir``, the int8 model's bytes are kept there (:func:`read_int8_onnx`), one file per machine
    (:func:`machine_key`), module structure and input shapes (:func:`model_key`) and options, recording a hash of the
    weights (:func:`weights_key`): a later call with the same weights, in any process, loads them and neither exports
    nor quantizes (the two take seconds; ``refresh=True`` converts again and replaces the file).

    Raises:
        ModuleNotFoundError: if onnx, onnxscript or onnxruntime is missing (the ``onnx`` extra).
        QuantizationError: if the export or the quantization fails.
    """
    require("onnxruntime", "quantize_dynamic(backend='onnxruntime')")
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "quantize_dynamic(example_inputs)"))
    source = copy.deepcopy(module).cpu().eval()
    spec = _output_spec(source(*example))
    if reduce_range is None:
        reduce_range = not has_int8_dot_product(cpu_flags())
    if cache_dir is None:
        return OnnxRuntimeModule(_int8_onnx_bytes(source, example, reduce_range, per_channel), spec)
    key = {
        "machine": machine_key(),
        "model": model_key(source, example),
        "options": f"per_channel={per_channel}; reduce_range={reduce_range}; weights=qint8",
        "weights": weights_key(source),
    }
    file = int8_onnx_file(cache_dir, key)
    payload = None if refresh else read_int8_onnx(file, key)
    loaded = payload is not None
    if payload is None:
        payload = _int8_onnx_bytes(source, example, reduce_range, per_channel)
        write_int8_onnx(file, key, payload)
    quantized = OnnxRuntimeModule(payload, spec)
    quantized.from_cache = loaded
    return quantized


def _int8_onnx_bytes(source: nn.Module, example: tuple[Tensor, ...], reduce_range: bool, per_channel: bool) -> bytes:
    """Export ``source`` to ONNX (dynamic batch) and quantize it with onnxruntime: the int8 model's bytes."""
    for name in ("onnx", "onnxscript"):
        require(name, "quantize_dynamic(backend='onnxruntime')")
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic
    from torch.export import Dim

    with tempfile.TemporaryDirectory(prefix="lightning_perf_dynamic_") as tmp:
        float_path, int8_path = Path(tmp) / "float.onnx", Path(tmp) / "int8.onnx"
        try:
            with _quiet():
                # The exporter's optimize=True is kept: optimize=False was not clearly faster on a 2-core machine, and
                # on nn.TransformerEncoder it gives a graph that onnxruntime quantizes less (not the same int8 model).
                # One Dim for every batch dimension (separate ones fail where the model combines two inputs), traced
                # on two samples at least: torch.export specializes a named Dim whose example size is 1.
                batch = Dim("batch")
                example = with_batch(example, max(2, int(example[0].shape[0])))
                shapes = export_shapes(source, [{0: batch} for _ in example])
                program = _onnx_export(source, example, dynamic_shapes=shapes)
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
        return int8_path.read_bytes()


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


def _build(
    backend: str, module: nn.Module, example: tuple[Tensor, ...], cache_dir: Path | None = None, refresh: bool = False
) -> nn.Module:
    if backend == "eager":
        return quantize_dynamic_eager(module)
    if backend == "onnxruntime":
        return quantize_dynamic_onnxruntime(module, example, cache_dir=cache_dir, refresh=refresh)
    return quantize_dynamic_torchao(module)


# ---------------------------------------------------------------------------------------------------- the choice


@dataclass
class DynamicCandidate:
    """One back-end tried on the module: its parity with the float module and its speed against it."""

    backend: str
    validation: ValidationSummary | None = None
    latency: LatencyRow | None = None
    problem: str | None = None

    def figures(self) -> dict[str, Any]:
        """What the choice rests on, as cached and reported: times, speed-up, its 95% interval, verdict, problem."""
        row = self.latency
        if row is None:
            return {"backend": self.backend, "problem": self.problem}
        return {
            "backend": self.backend,
            "batch_size": row.batch_size,
            "float_median_s": row.baseline_median_s,
            "int8_median_s": row.candidate_median_s,
            "speedup": row.speedup,
            "speedup_ci95": row.speedup_ci95,
            "speedup_verdict": row.speedup_verdict,
            "problem": self.problem,
        }


def figure_line(figures: dict[str, Any]) -> str:
    """One candidate's figures (:meth:`DynamicCandidate.figures`) in a line for the log."""
    name = figures.get("backend")
    if figures.get("problem"):
        return f"{name}: {figures['problem']}"
    if figures.get("speedup") is None:
        return f"{name}: not timed"
    ci = figures.get("speedup_ci95")
    interval = f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
    return (
        f"{name}: {1e3 * figures['int8_median_s']:.3f} ms vs {1e3 * figures['float_median_s']:.3f} ms fp32 at batch "
        f"{figures['batch_size']}, {figures['speedup']:.2f}x{interval} (95% interval), {figures['speedup_verdict']}"
    )


@dataclass
class DynamicQuantization:
    """What :func:`quantize_dynamic` chose: the int8 module (``None`` when no back-end was correct and faster), the
    candidates built in this call (``candidates``: one, the chosen, when the choice came from the cache) and the
    figures the choice rests on (``measured``: this call's, or the cached ones)."""

    backend: str | None
    module: nn.Module | None
    requested: str
    candidates: list[DynamicCandidate] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    cached: bool = False
    cpu_flags: dict[str, bool] | None = None
    measured: list[dict[str, Any]] = field(default_factory=list)
    threads: int = field(default_factory=torch.get_num_threads)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "module"}
        return to_jsonable({**data, "rule": TIE_RULE if self.requested == "auto" else None})  # type: ignore[no-any-return]

    def describe(self) -> str:
        """What was chosen and why, in a few lines."""
        chosen = f"chose {self.backend!r}" if self.backend else "kept the float module (no back-end correct and faster)"
        source = ", from the cache (refresh=True measures again)" if self.cached else ""
        lines = [f"dynamic int8 ({self.requested}, {self.threads} threads each side){source}: {chosen}"]
        figures = self.measured or [c.figures() for c in self.candidates]
        lines += [f"  {figure_line(f)}" for f in figures]
        lines += [f"  {name}: not tried ({why})" for name, why in self.skipped.items()]
        if self.requested == "auto":
            lines.append(f"  rule: {TIE_RULE}")
        return "\n".join(lines)


def choose(candidates: Sequence[DynamicCandidate]) -> DynamicCandidate | None:
    """The candidate :data:`TIE_RULE` keeps among the timed ones, ``None`` when none is faster than fp32."""

    def bounds(c: DynamicCandidate) -> tuple[float, float]:
        assert c.latency is not None
        ci = c.latency.speedup_ci95
        return (ci[0], ci[1]) if ci else (c.latency.speedup, c.latency.speedup)

    faster = [c for c in candidates if c.latency is not None and c.latency.speedup_verdict == "faster"]
    if not faster:
        return None
    best = max(faster, key=lambda c: c.latency.speedup)  # type: ignore[union-attr]
    tied = [c for c in faster if bounds(c)[1] >= bounds(best)[0]]
    rank = {name: i for i, name in enumerate(SIMPLICITY)}
    return min(tied, key=lambda c: rank.get(c.backend, len(rank)))


# ---------------------------------------------------------------------------------------------------- the cache


def machine_key(flags: dict[str, bool] | None = None) -> str:
    """The machine a choice holds for: CPU model and flags, torch's threads, torch, torchao and onnxruntime versions."""
    return decision_key("cpu", ("torchao", "onnxruntime"), flags=flags, threads=torch.get_num_threads())


def model_key(module: nn.Module, example: Sequence[Tensor]) -> str:
    """A hash of the module tree (names and class names), its classes' code (:func:`code_key`), its parameters'
    shapes and dtypes, and the input shapes."""
    parts = [f"{name}:{type(m).__qualname__}" for name, m in module.named_modules()] + [code_key(module)]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in module.named_parameters()]
    parts += [f"input:{tuple(t.shape)}:{t.dtype}" for t in example]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def onnx_cache_dir(cache_path: str | os.PathLike[str] | None = None) -> Path:
    """Where the int8 ONNX models are kept beside the cache file ``cache_path``: ``<its stem>_onnx/``."""
    path = _CACHE.path(cache_path or None)
    return path.with_name(f"{path.stem}_onnx")


def clear_cache(cache_path: str | os.PathLike[str] | None = None) -> None:
    """Forget the back-ends chosen so far and the int8 ONNX models kept (the next ``"auto"`` measures again): removes
    the cache file and its ``_onnx`` folder."""
    _CACHE.path(cache_path or None).unlink(missing_ok=True)
    shutil.rmtree(onnx_cache_dir(cache_path), ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- the entry


def _try(
    result: DynamicQuantization,
    names: Sequence[str],
    reference: nn.Module,
    example: tuple[Tensor, ...],
    min_cosine: float,
    min_agreement: float,
    cache_dir: Path | None = None,
    refresh: bool = False,
) -> dict[str, nn.Module]:
    """Build each back-end and check it against ``reference``; the ones that agree, by name."""
    built: dict[str, nn.Module] = {}
    for name in names:
        candidate = DynamicCandidate(name)
        result.candidates.append(candidate)
        try:
            quantized = _build(name, reference, example, cache_dir, refresh)
            candidate.validation = compare_models(reference, quantized, [(example,)], min_cosine=min_cosine)
            if getattr(quantized, "from_cache", False) and (stale := candidate.validation.failure(min_agreement)):
                # A kept file whose key matched but that no longer fits (code the key cannot see): convert once more.
                warnings.warn(f"The cached {name} int8 model in {str(cache_dir)!r} disagrees with the float module "
                              f"({stale}); converting again.", MeasurementWarning, stacklevel=4)  # fmt: skip
                quantized = _build(name, reference, example, cache_dir, True)
                candidate.validation = compare_models(reference, quantized, [(example,)], min_cosine=min_cosine)
        except Exception as exc:
            candidate.problem = f"failed: {failure_reason(exc)}"
            continue
        problem = candidate.validation.failure(min_agreement)
        if problem is None:
            built[name] = quantized
        else:
            candidate.problem = f"disagrees with fp32: {problem}"
    return built


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
    refresh: bool = False,
    cache_path: str | os.PathLike[str] | None = None,
) -> DynamicQuantization:
    """An int8 copy of ``module`` (dynamic quantization, CPU), by ``backend`` or the fastest correct one (``"auto"``).

    Each candidate is checked against ``module`` on ``example_inputs`` (cosine at least ``min_cosine``, top-1 agreement
    over the last output dimension at least ``min_agreement`` when the output has one); with ``"auto"`` the correct
    ones are timed against ``module`` (``iterations`` calls each, paired and interleaved, at equal threads) and one is
    kept by :data:`TIE_RULE`. The choice and the figures are cached (``cache_path``, default ``dynamic_int8.json``
    in the user's cache folder) per :func:`machine_key` and :func:`model_key`: with a cached choice only that
    back-end is built and checked, nothing is timed (``refresh=True`` measures again; a cached back-end that no
    longer passes the checks is measured again too). The onnxruntime back-end's int8 model is kept beside the cache
    file (:func:`onnx_cache_dir`) with a hash of the weights: with the same weights a later call, in any process,
    loads it instead of exporting and quantizing again (:func:`quantize_dynamic_onnxruntime`; ``refresh=True``
    converts again). ``module`` is left as it is (its copies are on the CPU, in eval mode).

    Raises:
        ValueError: for an unknown backend or an invalid threshold.
        QuantizationError: if an explicit ``backend`` fails or disagrees with the float module.
    """
    check_choice("quantize_dynamic", "backend", backend, DYNAMIC_BACKENDS)
    min_cosine = check_number("quantize_dynamic", "min_cosine", min_cosine, 0.0, 1.0)
    min_agreement = check_number("quantize_dynamic", "min_agreement", min_agreement, 0.0, 1.0)
    check_bool("quantize_dynamic", "refresh", refresh)
    example = tuple(t.detach().cpu() for t in as_input_tuple(example_inputs, "quantize_dynamic(example_inputs)"))
    flags = cpu_flags()
    reference = copy.deepcopy(module).cpu().eval()
    disable_cache(reference)  # a Hugging Face model's int8 copy is built, checked and timed without its cache
    path = _CACHE.path(cache_path)
    checks = (reference, example, min_cosine, min_agreement, onnx_cache_dir(path))
    if backend != "auto":
        result = DynamicQuantization(None, None, backend, cpu_flags=flags)
        built = _try(result, [backend], *checks, refresh)
        if not built:
            raise QuantizationError(f"dynamic int8 with backend {backend!r}: {result.candidates[0].problem}")
        result.backend, result.module = next(iter(built.items()))
        return result
    keys = (machine_key(flags), model_key(reference, example))
    entry: Any = {} if refresh else _CACHE.entry(path, keys[0]).get(keys[1])
    valid = isinstance(entry, dict) and entry.get("backend", "") in (None, *SIMPLICITY)
    if valid and isinstance(entry.get("measured"), list) and isinstance(entry.get("skipped"), dict):
        result = DynamicQuantization(None, None, "auto", skipped=entry["skipped"], cached=True, cpu_flags=flags)
        result.measured = entry["measured"]
        built = _try(result, [entry["backend"]], *checks) if entry["backend"] else {}
        if built or entry["backend"] is None:
            result.backend, result.module = next(iter(built.items()), (None, None))
            return result
    names, skipped = dynamic_candidates(flags)
    result = DynamicQuantization(None, None, "auto", skipped=skipped, cpu_flags=flags)
    built = _try(result, names, *checks, refresh)
    size = [int(example[0].shape[0])]
    for candidate in result.candidates:
        if (quantized := built.get(candidate.backend)) is not None:
            timing: dict[str, Any] = {"iterations": iterations, "warmup": warmup, "name": candidate.backend}
            candidate.latency = eager_latency(reference, quantized, example, size, **timing)[0]
    best = choose(result.candidates)
    if best is not None:
        result.backend, result.module = best.backend, built[best.backend]
    result.measured = [c.figures() for c in result.candidates]
    _CACHE.store(
        path, keys[0], {keys[1]: {"backend": result.backend, "measured": result.measured, "skipped": result.skipped}}
    )
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
            timing: dict[str, Any] = {"iterations": iterations, "warmup": warmup, "names": ("float", name)}
            rows.append(measure_latency(*run, batch_size=size, **timing))
    return rows


def size_bytes(module: nn.Module) -> int:
    """Bytes of a float or int8 module's weights as it is saved (ONNX bytes, else its ``state_dict`` tensors)."""
    if isinstance(module, OnnxRuntimeModule):
        return len(module.onnx_bytes)
    total = 0
    for value in module.state_dict().values():
        if isinstance(value, Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, tuple):  # packed params: (weight, bias)
            total += sum(t.numel() * t.element_size() for t in value if isinstance(t, Tensor))
    return total
