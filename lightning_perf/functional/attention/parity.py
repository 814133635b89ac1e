"""Whether a swapped attention module computes what its original computes, in eval and in training mode.

Part of :mod:`lightning_perf.functional.attention.swap` (import :func:`check_parity` from there). The mode helpers here
are shared with the adapters, which call a module to learn its layout.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import as_device, module_device
from lightning_perf.functional.attention.kernels import HALF_DTYPES, AttentionNotSwappable

__all__ = [
    "DROPOUT_STREAM_NOTE",
    "check_parity",
    "dropout_off",
    "eval_without_dropout",
    "module_dtype",
    "outputs_close",
    "relative_error",
    "time_against_original",
    "train_without_dropout",
]

DROPOUT_STREAM_NOTE = "training-mode dropout draws its masks from another random stream than the original (same rate)"
"""The note :func:`check_parity` adds when the swap applies dropout as the original does, but with other masks."""

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-7, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _has_dropout(*modules: nn.Module) -> bool:
    return any(
        (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
        or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
        for module in modules
        for m in module.modules()
    )


@contextlib.contextmanager
def dropout_off(*modules: nn.Module) -> Iterator[None]:
    """Set every dropout rate in ``modules`` (``nn.Dropout*``, ``nn.MultiheadAttention.dropout``) to 0 for a while."""
    saved: list[tuple[nn.Module, str, float]] = []
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                saved.append((m, "p", m.p))
                m.p = 0.0
            elif isinstance(m, nn.MultiheadAttention):
                saved.append((m, "dropout", m.dropout))
                m.dropout = 0.0
    try:
        yield
    finally:
        for m, attr, value in reversed(saved):
            setattr(m, attr, value)


@contextlib.contextmanager
def _mode(modules: Sequence[nn.Module], training: bool) -> Iterator[None]:
    saved = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.train(training)
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


@contextlib.contextmanager
def train_without_dropout(*modules: nn.Module) -> Iterator[None]:
    """Training mode with every dropout rate at 0; modes and rates are restored after."""
    with _mode(modules, True), dropout_off(*modules):
        yield


@contextlib.contextmanager
def eval_without_dropout(*modules: nn.Module) -> Iterator[None]:
    """Eval mode with every dropout rate at 0; modes and rates are restored after."""
    with _mode(modules, False), dropout_off(*modules):
        yield


def outputs_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> bool:
    """Whether ``actual`` matches ``expected`` within the tolerance of ``dtype`` (relative to the largest value)."""
    return relative_error(actual, expected) <= _TOLERANCE.get(dtype, 1e-4)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``expected`` (inf for a shape mismatch or NaN)."""
    if actual.shape != expected.shape:
        return math.inf
    a, e = actual.detach().double(), expected.detach().double()
    error = (a - e).abs().max().item() if a.numel() else 0.0
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-12)
    return math.inf if math.isnan(error) else error / scale


def _first_tensor(output: Any) -> Tensor:
    while isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, Tensor):
        raise AttentionNotSwappable(f"its output is a {type(output).__name__}, not a tensor")
    return output


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype in HALF_DTYPES and (device.type != "cuda" or torch.cuda.is_available()):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def _fork_rng(device: torch.device) -> contextlib.AbstractContextManager:
    """Leave the global RNG (CPU, and ``device`` when it is a GPU) as it was found."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    return torch.random.fork_rng(devices=devices)


def check_parity(
    original: nn.Module,
    swapped: nn.Module,
    calls: Sequence[tuple[tuple[Any, ...], dict]],
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    notes: list[str] | None = None,
) -> str | None:
    """Whether ``swapped`` computes what ``original`` computes: ``None`` if so, else what differs.

    Each call runs on ``device`` (copies are made when the modules are elsewhere, e.g. still on the CPU before
    Lightning moves them), under autocast to ``compute_dtype`` when that is fp16/bf16, in three settings:

    1. eval mode, and 2. training mode with dropout rates at 0: the first output tensor, and the gradients of a random
       projection of it with respect to the floating point inputs and every parameter, must match to a tolerance by
       dtype (relative to the largest magnitude).
    3. training mode with dropout on, when the original has dropout: from the same RNG state both must give the same
       output. A fused kernel may draw its dropout masks from another random stream (the CUDA kernels do); then two
       draws of the swapped module must differ exactly when two draws of the original do (dropout is applied), and
       :data:`DROPOUT_STREAM_NOTE` is appended to ``notes``: training computes the same thing up to which units
       dropout drops.

    Nothing is left behind: no ``.grad``, the global RNG as it was, modes and dropout rates restored.
    """
    dev = as_device(device) if device is not None else module_device(original)
    if dev != module_device(original):
        original, swapped = copy.deepcopy((original, swapped))  # attention modules are small
        original.to(dev)
        swapped.to(dev)
    with _fork_rng(dev):  # a module may draw random numbers in any mode: leave the global RNG as it was
        return _check_calls(original, swapped, calls, dev, compute_dtype, notes)


def _check_calls(
    original: nn.Module,
    swapped: nn.Module,
    calls: Sequence[tuple[tuple[Any, ...], dict]],
    dev: torch.device,
    compute_dtype: torch.dtype | None,
    notes: list[str] | None,
) -> str | None:
    dtype = module_dtype(original)  # inputs in the parameters' dtype (a model already cast to half precision)
    tolerance = max(_TOLERANCE.get(d, 1e-4) for d in (compute_dtype if compute_dtype in HALF_DTYPES else dtype, dtype))
    named_params = [(n, p) for n, p in original.named_parameters() if p.requires_grad]
    with_dropout = _has_dropout(original)

    def to_device(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        return value.to(dev, dtype) if value.is_floating_point() else value.to(dev)

    for index, (args, kwargs) in enumerate(calls):
        leaves = {id(a): to_device(a).detach().requires_grad_(True) for a in args if _is_float_tensor(a)}
        args = tuple(leaves.get(id(a), to_device(a)) for a in args)
        kwargs = {k: to_device(v) for k, v in kwargs.items()}
        wrt = [*leaves.values(), *(p for _, p in named_params)]
        names = [f"input {i}" for i in range(len(leaves))] + [n for n, _ in named_params]
        what = f"call {index + 1} of {len(calls)}"

        def run(
            module: nn.Module, seed: int | None = None, grads: bool = True, call: Any = (args, kwargs, wrt, index)
        ) -> _Result:
            call_args, call_kwargs, call_wrt, call_index = call
            if seed is not None:
                torch.manual_seed(seed)
            with torch.enable_grad(), _autocast(dev, compute_dtype):
                out = _first_tensor(module(*call_args, **call_kwargs))
                if not grads:
                    return out.detach(), ()
                direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(call_index))
                return out, torch.autograd.grad(out, call_wrt, direction.to(dev, out.dtype), allow_unused=True)

        for setting, context in (("eval mode", eval_without_dropout), ("training mode", train_without_dropout)):
            with context(original, swapped):
                problem = _compare(what, setting, run(original), run(swapped), names, tolerance)
            if problem is not None:
                return problem
        if not with_dropout:
            continue
        with _mode((original, swapped), True):
            setting = "training mode with dropout, same RNG state"
            if _compare(what, setting, run(original, seed=0), run(swapped, seed=0), names, tolerance) is None:
                continue
            original_varies = not torch.equal(run(original, 1, False)[0], run(original, 2, False)[0])
            swapped_varies = not torch.equal(run(swapped, 1, False)[0], run(swapped, 2, False)[0])
        if original_varies != swapped_varies:
            applies = "the swapped module applies dropout, the original does not"
            if original_varies:
                applies = "the original applies dropout, the swapped module does not"
            return f"{what}: in training mode {applies}"
        if notes is not None and DROPOUT_STREAM_NOTE not in notes:
            notes.append(DROPOUT_STREAM_NOTE)
    return None


_Result = tuple[Tensor, tuple[Tensor | None, ...]]


def _compare(what: str, setting: str, a: _Result, b: _Result, names: list[str], tolerance: float) -> str | None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    error = relative_error(out_b, out_a)
    if error > tolerance:
        return f"{what}: the output differs by {error:.2g} (relative; tolerance {tolerance:g}) in {setting}"
    for name, g_a, g_b in zip(names, grads_a, grads_b):
        if (g_a is None) != (g_b is None):
            return f"{what}: the gradient of {name} is missing on one side in {setting}"
        if g_a is not None and g_b is not None and (error := relative_error(g_b, g_a)) > tolerance:
            differs = f"differs by {error:.2g} (relative; tolerance {tolerance:g})"
            return f"{what}: the gradient of {name} {differs} in {setting}"
    return None


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def module_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of the module's first floating point parameter (float32 without any)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def time_against_original(
    original: nn.Module,
    swapped: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    compute_dtype: torch.dtype | None = None,
    repeats: int = 5,
) -> tuple[float, float]:
    """Forward and backward of ``original`` and of ``swapped`` on one real call (``args``, ``kwargs``: what the swapped
    module received in training), alternating, in their current mode and under autocast to ``compute_dtype``:
    ``(ms original, ms swapped)``, each the median of ``repeats`` after one warm-up call each.

    Gradients are taken with :func:`torch.autograd.grad` (no ``.grad`` is touched) with respect to the floating point
    inputs and the parameters; the global RNG is left as it was (dropout draws nothing a training step would).
    """
    dev = module_device(original)
    leaves = {id(a): a.detach().requires_grad_(True) for a in args if _is_float_tensor(a)}
    call_args = tuple(leaves.get(id(a), a) for a in args)
    params = [p for p in original.parameters() if p.requires_grad]  # the swapped module holds the same ones
    wrt = [*leaves.values(), *params]
    modules: list[tuple[list[float], nn.Module]] = [([], original), ([], swapped)]
    with _fork_rng(dev), torch.enable_grad(), _autocast(dev, compute_dtype):
        for round_ in range(repeats + 1):  # round 0 warms both up; the order alternates
            for times, module in modules if round_ % 2 else modules[::-1]:
                start = time.perf_counter()
                out = _first_tensor(module(*call_args, **kwargs))
                torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
                if round_:
                    times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(modules[0][0]), statistics.median(modules[1][0])
