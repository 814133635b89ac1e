"""Process-global backend settings (cuDNN autotuning, TF32, float32 matmul precision, SDPA kernels) as a snapshot.

``capture()`` reads the settings into a :class:`BackendFlags`, ``apply(flags)`` sets the fields that are not ``None``
and returns the snapshot taken before, ``restore(previous)`` puts that snapshot back exactly.

Since torch 2.9 the TF32/precision settings live in two places that must agree: the legacy switches
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``, ``torch.set_float32_matmul_precision``)
and a table of per-backend, per-operation ``fp32_precision`` values. Setting one through the new API alone leaves
them disagreeing, and torch then raises when a kernel reads the legacy switch. So :func:`apply` only uses the legacy
setters (which write both), and the snapshot records both, putting the table back last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Literal, TypeVar

import torch

from lightning_perf._device import has_fast_cpu_bf16, supports_tf32
from lightning_perf._validation import check_choice, check_optional_bool

Float32MatmulPrecision = Literal["highest", "high", "medium"]
SdpaBackend = Literal["flash", "efficient", "math", "cudnn"]
T = TypeVar("T")

FLOAT32_MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")
SDPA_BACKENDS: tuple[str, ...] = ("flash", "efficient", "math", "cudnn")
# SDPA kernels that exist on each device type (torch 2.13): CPU has its own flash kernel and the math fallback.
SDPA_BACKENDS_BY_DEVICE: dict[str, frozenset[str]] = {
    "cuda": frozenset(SDPA_BACKENDS),
    "cpu": frozenset({"flash", "math"}),
}

_SDPA_SWITCHES = {
    "flash": ("flash_sdp_enabled", "enable_flash_sdp"),
    "efficient": ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    "math": ("math_sdp_enabled", "enable_math_sdp"),
    "cudnn": ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
}
# (backend, operation) keys of torch's fp32_precision table, parents before children: setting a parent fills in
# children, so restoring in this order and then each child puts every value back as it was.
_FP32_PRECISION_KEYS = (
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)


@dataclass(frozen=True)
class BackendFlags:
    """Backend settings; a field set to ``None`` means "leave this setting alone" (in a request) or "unknown".

    Args:
        cudnn_benchmark: ``torch.backends.cudnn.benchmark`` (cuDNN autotunes convolution algorithms per shape).
        matmul_tf32: ``torch.backends.cuda.matmul.allow_tf32`` (TF32 tensor cores for float32 matmuls on CUDA).
        cudnn_tf32: ``torch.backends.cudnn.allow_tf32`` (TF32 for cuDNN convolutions).
        float32_matmul_precision: ``torch.set_float32_matmul_precision``: ``"highest"``, ``"high"`` (TF32 on CUDA)
            or ``"medium"`` (also lets oneDNN use bf16 arithmetic for float32 matmuls on CPUs that have it).
        sdpa_backends: the ``scaled_dot_product_attention`` kernels enabled, exactly these (others disabled).
        fp32_precision: torch's per-backend ``fp32_precision`` table, ``((backend, op, value), ...)``, filled by
            :func:`capture` (torch >= 2.9) so that :func:`restore` is exact; :func:`apply` ignores it.
    """

    cudnn_benchmark: bool | None = None
    matmul_tf32: bool | None = None
    cudnn_tf32: bool | None = None
    float32_matmul_precision: Float32MatmulPrecision | None = None
    sdpa_backends: frozenset[str] | None = None
    fp32_precision: tuple[tuple[str, str, str], ...] | None = None

    def __post_init__(self) -> None:
        for name in ("cudnn_benchmark", "matmul_tf32", "cudnn_tf32"):
            check_optional_bool("BackendFlags", name, getattr(self, name))
        precision = self.float32_matmul_precision
        check_choice("BackendFlags", "float32_matmul_precision", precision, (None, *FLOAT32_MATMUL_PRECISIONS))
        table = self.fp32_precision
        if table is not None and (
            not isinstance(table, tuple)
            or not all(
                isinstance(row, tuple) and len(row) == 3 and all(isinstance(x, str) for x in row) for row in table
            )
        ):
            raise TypeError(
                f"`BackendFlags(fp32_precision={table!r})` is not valid. Expected None or a tuple of "
                "(backend, operation, value) string triples, as `capture()` returns."
            )
        if self.sdpa_backends is not None:
            object.__setattr__(self, "sdpa_backends", validate_sdpa_backends(self.sdpa_backends, "BackendFlags"))
        # torch keeps one setting for both: "highest" is matmul TF32 off, "high"/"medium" is on.
        if self.matmul_tf32 is not None and precision is not None and self.matmul_tf32 != (precision != "highest"):
            raise ValueError(
                f"`BackendFlags(matmul_tf32={self.matmul_tf32}, "
                f"float32_matmul_precision={self.float32_matmul_precision!r})` contradict each other: "
                "'highest' turns TF32 matmuls off, 'high' and 'medium' turn them on."
            )

    def requested(self) -> dict[str, object]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def validate_sdpa_backends(backends: Iterable[str], owner: str) -> frozenset[str]:
    """``backends`` as a frozenset, checked against :data:`SDPA_BACKENDS`.

    Raises:
        ValueError: for an unknown name or an empty list (no kernel would be left to run attention).
    """
    expected = f"Expected a non-empty list of {', '.join(map(repr, SDPA_BACKENDS))}."
    if isinstance(backends, (str, bytes)) or not isinstance(backends, Iterable):
        raise TypeError(f"`{owner}(sdpa_backends={backends!r})` is not valid. {expected}")
    given = list(backends)
    if not all(isinstance(b, str) for b in given):
        raise TypeError(f"`{owner}(sdpa_backends={backends!r})` is not valid. {expected}")
    chosen = frozenset(given)
    unknown = sorted(chosen - set(SDPA_BACKENDS))
    if unknown or not chosen:
        raise ValueError(
            f"`{owner}(sdpa_backends={backends!r})` is not valid"
            + (f" ({', '.join(map(repr, unknown))}: no such kernel)" if unknown else "")
            + f". {expected}"
        )
    return chosen


def _read(getter: Callable[[], T]) -> T | None:
    """The value of a legacy setting, or ``None`` when torch refuses to read it (legacy and new APIs disagree)."""
    try:
        return getter()
    except RuntimeError:
        return None


def _has_fp32_precision_table() -> bool:
    return hasattr(torch._C, "_get_fp32_precision_getter") and hasattr(torch._C, "_set_fp32_precision_setter")


def capture() -> BackendFlags:
    """The current settings, every field filled (``fp32_precision`` only on torch >= 2.9)."""
    cuda = torch.backends.cuda
    table = None
    if _has_fp32_precision_table():
        table = tuple((b, op, torch._C._get_fp32_precision_getter(b, op)) for b, op in _FP32_PRECISION_KEYS)
    return BackendFlags(
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        matmul_tf32=_read(lambda: bool(cuda.matmul.allow_tf32)),
        cudnn_tf32=_read(lambda: bool(torch.backends.cudnn.allow_tf32)),
        float32_matmul_precision=_read(torch.get_float32_matmul_precision),  # type: ignore[arg-type]
        sdpa_backends=frozenset(name for name, (get, _) in _SDPA_SWITCHES.items() if getattr(cuda, get)()),
        fp32_precision=table,
    )


def _set_sdpa_backends(enabled: frozenset[str]) -> None:
    for name, (_, enable) in _SDPA_SWITCHES.items():
        getattr(torch.backends.cuda, enable)(name in enabled)


def apply(flags: BackendFlags) -> BackendFlags:
    """Set every field of ``flags`` that is not ``None``; return the snapshot taken before, for :func:`restore`.

    Example::

        previous = apply(BackendFlags(cudnn_benchmark=True, matmul_tf32=True, cudnn_tf32=True))
        try:
            train()
        finally:
            restore(previous)
    """
    previous = capture()
    if flags.float32_matmul_precision is not None:
        torch.set_float32_matmul_precision(flags.float32_matmul_precision)
    if flags.matmul_tf32 is not None and flags.float32_matmul_precision is None:
        # Through the precision setter, which keeps torch's legacy and new TF32 settings in agreement (setting
        # `allow_tf32` alone can leave a CPU bf16 setting that contradicts it, and torch then raises on every read).
        current = _read(torch.get_float32_matmul_precision)
        if not flags.matmul_tf32:
            torch.set_float32_matmul_precision("highest")
        elif current in (None, "highest"):
            torch.set_float32_matmul_precision("high")
    if flags.cudnn_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = flags.cudnn_tf32
        if _has_fp32_precision_table():
            # The legacy setter writes "none" (inherit) for convolutions; under a parent set to "tf32" through the
            # new API that would contradict it, so write the operations' values explicitly.
            for op in ("conv", "rnn"):
                torch._C._set_fp32_precision_setter("cuda", op, "tf32" if flags.cudnn_tf32 else "ieee")
    if flags.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = flags.cudnn_benchmark
    if flags.sdpa_backends is not None:
        _set_sdpa_backends(flags.sdpa_backends)
    return previous


def restore(previous: BackendFlags) -> None:
    """Put back a snapshot from :func:`capture` or :func:`apply` exactly.

    The legacy switches are set first (each also writes torch's ``fp32_precision`` table), then the table itself, so
    both end as they were, including states that mix the legacy and the new API.
    """
    if previous.float32_matmul_precision is not None:
        torch.set_float32_matmul_precision(previous.float32_matmul_precision)  # also sets the matmul TF32 switch
    elif previous.matmul_tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = previous.matmul_tf32
    if previous.cudnn_tf32 is not None:
        torch.backends.cudnn.allow_tf32 = previous.cudnn_tf32
    if previous.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = previous.cudnn_benchmark
    if previous.sdpa_backends is not None:
        _set_sdpa_backends(previous.sdpa_backends)
    if previous.fp32_precision is not None:
        for backend, op, value in previous.fp32_precision:
            torch._C._set_fp32_precision_setter(backend, op, value)


@contextlib.contextmanager
def backend_flags(flags: BackendFlags) -> Iterator[BackendFlags]:
    """Apply ``flags`` inside the block and restore the previous settings after it, also on an exception."""
    previous = apply(flags)
    try:
        yield previous
    finally:
        restore(previous)


def no_effect_reasons(flags: BackendFlags, device: torch.device) -> dict[str, str]:
    """The fields of ``flags`` that cannot change anything on ``device``, each with the reason.

    Measured on torch 2.13 (x86 CPU with avx512_bf16): ``float32_matmul_precision="medium"`` makes large float32
    matmuls about 12-15% faster through oneDNN's bf16 path; ``"high"`` changes nothing measurable (CPUs have no TF32
    units); cuDNN settings only concern CUDA; on CPU only the ``flash`` and ``math`` SDPA kernels exist.
    """
    reasons: dict[str, str] = {}
    kind = device.type
    if flags.cudnn_benchmark is not None and kind != "cuda":
        reasons["cudnn_benchmark"] = f"cuDNN autotuning only concerns CUDA convolutions, not {kind}"
    tf32 = flags.matmul_tf32 if flags.matmul_tf32 is not None else flags.cudnn_tf32
    if tf32 is not None and not supports_tf32(device):
        where = f"this GPU ({torch.cuda.get_device_name(device)})" if kind == "cuda" else kind
        reasons["tf32"] = f"TF32 needs an Ampere or newer GPU (sm 80+); {where} has no TF32 units"
    precision = flags.float32_matmul_precision
    if precision is not None and precision != "highest":
        if kind == "cpu" and precision == "high":
            reasons["float32_matmul_precision"] = (
                "'high' allows TF32, which CPUs do not have; 'medium' lets oneDNN use bf16 on CPUs with bf16 support"
            )
        elif kind == "cpu" and not has_fast_cpu_bf16():
            reasons["float32_matmul_precision"] = "this CPU has no bf16 matmul support for oneDNN to use"
        elif kind == "cuda" and not supports_tf32(device):
            reasons["float32_matmul_precision"] = "reduced-precision float32 matmuls need TF32 (Ampere, sm 80+)"
    if flags.sdpa_backends is not None and kind in SDPA_BACKENDS_BY_DEVICE:
        existing = SDPA_BACKENDS_BY_DEVICE[kind]
        if not flags.sdpa_backends & existing:
            reasons["sdpa_backends"] = (
                f"{kind} has only the {', '.join(sorted(existing))} SDPA kernels; enabling only "
                f"{', '.join(sorted(flags.sdpa_backends))} would leave attention no kernel to run"
            )
    return reasons


def without(flags: BackendFlags, names: Iterable[str]) -> BackendFlags:
    """``flags`` with the named request fields cleared (``"tf32"`` clears both TF32 switches)."""
    cleared: dict[str, None] = {}
    for name in names:
        if name == "tf32":
            cleared.update(matmul_tf32=None, cudnn_tf32=None)
        else:
            cleared[name] = None
    return replace(flags, **cleared)  # type: ignore[arg-type]


def recommended_flags(device: torch.device) -> BackendFlags:
    """The settings recommended for float32 training on ``device``: faster, with float32's accuracy kept for all but
    the mantissa of matmul and convolution inputs (TF32, what PyTorch and Lightning advise on Ampere and newer).

    CUDA with TF32 (sm 80+): cuDNN autotuning, TF32 for matmuls and cuDNN convolutions and float32 matmul precision
    ``"high"``. Older CUDA GPUs: cuDNN autotuning only. CPU: nothing; see :func:`recommended_note`.
    """
    if device.type == "cuda":
        if supports_tf32(device):
            return BackendFlags(
                cudnn_benchmark=True, matmul_tf32=True, cudnn_tf32=True, float32_matmul_precision="high"
            )
        return BackendFlags(cudnn_benchmark=True)
    return BackendFlags()


def recommended_note(device: torch.device) -> str:
    """Why :func:`recommended_flags` sets nothing on ``device``, and what the user may opt into instead."""
    if device.type != "cpu":
        return f"no backend setting is known to speed up float32 training on {device.type}"
    note = (
        "no backend setting speeds up float32 training on a CPU without changing its numerics (CPUs have no TF32; "
        "cuDNN is CUDA-only)"
    )
    if has_fast_cpu_bf16():
        note += (
            "; this CPU has bf16 matmul units: float32_matmul_precision='medium' (or preset='fastest') lets oneDNN "
            "run float32 matmuls in bf16, about 12-15% faster on large matmuls at bf16 accuracy"
        )
    return note


def fastest_flags(device: torch.device) -> BackendFlags:
    """The settings that make float32 training fastest on ``device`` while keeping it accurate.

    CUDA: cuDNN autotuning plus TF32 for matmuls and convolutions on GPUs that have TF32. CPU: float32 matmul
    precision ``"medium"`` (oneDNN's bf16 path) where the CPU has bf16 support. Elsewhere: nothing (empty flags).
    """
    if device.type == "cuda":
        tf32 = True if supports_tf32(device) else None
        return BackendFlags(cudnn_benchmark=True, matmul_tf32=tf32, cudnn_tf32=tf32)
    if device.type == "cpu" and has_fast_cpu_bf16():
        return BackendFlags(float32_matmul_precision="medium")
    return BackendFlags()
