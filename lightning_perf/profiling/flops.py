"""FLOPs per step, the machine's peak FLOP/s, and model-FLOPs utilization (MFU): how far a run is from the limit.

Entry points, each usable alone: :func:`count_flops` (:class:`FlopCount`), :func:`peak_flops` (:class:`PeakFlops`) and
:func:`utilization`. What torch counts, the counting convention and where a peak comes from: docs/architecture.md,
Module notes.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from lightning_perf import _validation
from lightning_perf._io import DecisionCache
from lightning_perf._validation import check_bool, check_choice, check_instance, check_int, check_number, is_number
from lightning_perf.profiling.stats import median as median_of

__all__ = [
    "GPU_PEAK_FLOPS",
    "FlopCount",
    "PeakFlops",
    "count_flops",
    "cpu_sdpa_backward_flops",
    "cpu_sdpa_flops",
    "dtype_of_precision",
    "flop_mapping",
    "format_flops",
    "gpu_peak_flops",
    "machine_key",
    "measure_cpu_peak_flops",
    "peak_flops",
    "utilization",
]

aten = torch.ops.aten
_CACHE = DecisionCache("peak_flops.json", "peak FLOP/s cache")


# ---------------------------------------------------------------------------------------------------------------------
# Counting


def _attention_shapes(query: Any, key: Any, value: Any) -> tuple[int, int, int, int, int, int]:
    """``(batch, query heads, query length, key length, query/key head dim, value head dim)`` of 4-D q/k/v."""
    b, h_q, s_q, d_qk = (int(x) for x in query.shape)
    b_k, h_kv, s_kv, d_k = (int(x) for x in key.shape)
    b_v, h_v, s_v, d_v = (int(x) for x in value.shape)
    if not (b == b_k == b_v and h_kv == h_v and s_kv == s_v and d_qk == d_k and h_kv > 0 and h_q % h_kv == 0):
        raise ValueError(
            f"Attention shapes do not fit together: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)} (expected [B, H, S, D] with key/value heads dividing query heads)."
        )
    return b, h_q, s_q, s_kv, d_qk, d_v


def _sdpa_forward(b: int, h: int, s_q: int, s_kv: int, d_qk: int, d_v: int) -> int:
    # scores = q @ k^T: 2*B*H*Sq*Skv*Dqk; out = softmax(scores) @ v: 2*B*H*Sq*Skv*Dv (GQA: key/value heads broadcast)
    return 2 * b * h * s_q * s_kv * (d_qk + d_v)


def cpu_sdpa_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu``: ``4*B*H*S_q*S_kv*D`` (``D`` the head dim).

    The two matmuls of attention, ``q @ k^T`` and ``probabilities @ v``; softmax and scaling are not counted (as for
    every other kernel). A formula for ``FlopCounterMode(custom_mapping=...)`` taking the op's raw arguments.
    """
    return _sdpa_forward(*_attention_shapes(query, key, value))


cpu_sdpa_flops._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes tensors, not shapes


def cpu_sdpa_backward_flops(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> int:
    """FLOPs of ``aten._scaled_dot_product_flash_attention_for_cpu_backward``: 2x the forward's.

    Each of the forward's two matmuls has two gradient matmuls (``dq, dk`` and ``dP, dv``) of the same size; the
    kernel's recomputation of the scores is not model work and is not counted.
    """
    return 2 * _sdpa_forward(*_attention_shapes(query, key, value))


cpu_sdpa_backward_flops._get_raw = True  # type: ignore[attr-defined]


def flop_mapping() -> dict[Any, Callable[..., int]]:
    """The formulas :func:`count_flops` adds to torch's own: the CPU attention kernel and its backward.

    Pass it as ``FlopCounterMode(custom_mapping=flop_mapping())`` to count the same way elsewhere.
    """
    formulas: dict[str, Callable[..., int]] = {
        "_scaled_dot_product_flash_attention_for_cpu": cpu_sdpa_flops,
        "_scaled_dot_product_flash_attention_for_cpu_backward": cpu_sdpa_backward_flops,
    }
    return {op: formula for name, formula in formulas.items() if (op := getattr(aten, name, None)) is not None}


@dataclass(frozen=True)
class FlopCount:
    """The FLOPs one call performed, in total and per operator (``"aten.mm"`` -> FLOPs)."""

    total: int
    by_operator: dict[str, int] = field(default_factory=dict)


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
    """Run ``fn(*args, **kwargs)`` once and count its FLOPs (the CPU attention kernel included).

    ``fn`` is whatever one step is: a forward and ``loss.backward()`` for a training step (the optimizer's
    element-wise update is not counted, as by every MFU convention), or a forward under ``torch.no_grad()`` for
    inference. The call really runs, on the tensors' device, slower than usual (every op goes through Python), so
    count on a step that is not timed. FLOPs depend on shapes, not on values or dtype: one count serves every
    configuration that computes the same model on the same batch size.

    Example::

        model = torch.nn.Linear(64, 32)
        x = torch.randn(8, 64)
        count_flops(lambda: model(x).sum().backward()).total  # forward + weight gradient: 2 * (2*8*64*32) = 65536
    """
    if not callable(fn):
        raise TypeError(f"`count_flops(fn={fn!r})` is not valid. Expected a callable that runs one step.")
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=flop_mapping()) as counter:
        fn(*args, **kwargs)
    per_op = counter.get_flop_counts().get("Global", {})
    by_operator = {str(op): int(n) for op, n in sorted(per_op.items(), key=lambda item: str(item[0])) if n}
    return FlopCount(total=int(counter.get_total_flops()), by_operator=by_operator)


# ---------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s


@dataclass(frozen=True)
class PeakFlops:
    """What the machine can compute per second in one dtype, and how that figure was obtained.

    ``source`` is ``"given"``, ``"table: H100 SXM bf16 dense"``, ``"measured matmul 2048^3 fp32, 2 threads"`` (or
    ``"... (cached)"``, or ``"... (disturbed, not cached)"``), or ``"unknown: <why>"`` with ``flops_per_second``
    None. ``causes`` says what disturbed a CPU measurement (other processes' load, steal time, ...): such a peak is
    too low, so an MFU against it too high, and it is not cached.
    """

    flops_per_second: float | None
    source: str
    causes: tuple[str, ...] = ()


_SHORT_DTYPE = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Dense (no 2:4 sparsity) peak FLOP/s per GPU, as NVIDIA's datasheets give them; "tf32" is fp32 matmuls on tensor
# cores (torch.set_float32_matmul_precision("high"/"medium")). Datasheets print the sparse figure, marked with an
# asterisk, for tensor-core formats: those are halved here. Lightning's own table (get_available_flops) lists some
# sparse figures (H200, H100 NVL) and the RTX 4090's bf16 at its fp32 rate, so its MFU can be off by 2x for them.
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # H100 SXM5 / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (2023/2024), sparse tensor figures halved.
    "H100 SXM": {"fp64": 34e12, "fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H100 PCIe": {"fp64": 26e12, "fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "H100 NVL": {"fp64": 30e12, "fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    # H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet (2024), sparse tensor figures halved.
    "H200 SXM": {"fp64": 34e12, "fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H200 NVL": {"fp64": 30e12, "fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    # A100 SXM4 and PCIe (40 and 80 GB have the same rates): NVIDIA A100 datasheet, dense column.
    "A100": {"fp64": 9.7e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    # L4: NVIDIA L4 datasheet (2023), sparse tensor figures halved.
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    # GeForce RTX 4090: NVIDIA Ada GPU architecture whitepaper v2.1, appendix table; tensor figures with FP32
    # accumulate (what torch's matmuls use), dense.
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
}


def _gpu_table_name(device_name: str) -> str | None:
    """The :data:`GPU_PEAK_FLOPS` row for a ``torch.cuda.get_device_name`` string, or None."""
    name = device_name.lower()
    if "h200" in name:
        return "H200 NVL" if "nvl" in name else "H200 SXM"
    if "h100" in name:
        if "nvl" in name:
            return "H100 NVL"
        if "pcie" in name:
            return "H100 PCIe"
        return "H100 SXM"  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    if "a100" in name:
        return "A100"
    if "rtx 4090" in name:
        return "RTX 4090"
    if name.replace("nvidia", "").strip() == "l4":
        return "L4"
    return None


def gpu_peak_flops(device_name: str, dtype: torch.dtype, float32_matmul_precision: str = "highest") -> PeakFlops:
    """The dense datasheet peak of a GPU named ``device_name`` (as ``torch.cuda.get_device_name`` spells it).

    Args:
        device_name: e.g. ``"NVIDIA H100 80GB HBM3"``.
        dtype: the dtype the matmuls run in (bf16 for ``bf16-mixed``).
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``; anything but ``"highest"`` means fp32
            matmuls run as TF32 on tensor cores.
    """
    check_instance("gpu_peak_flops", "device_name", device_name, str, "a GPU name")
    row = _gpu_table_name(device_name)
    short = _SHORT_DTYPE.get(dtype)
    if short == "fp32" and float32_matmul_precision != "highest":
        short = "tf32"
    if row is None:
        return PeakFlops(None, f"unknown: no table entry for {device_name!r}")
    if short is None or short not in GPU_PEAK_FLOPS[row]:
        return PeakFlops(None, f"unknown: no table entry for {row} in {dtype}")
    return PeakFlops(GPU_PEAK_FLOPS[row][short], f"table: {row} {short} dense")


def dtype_of_precision(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning ``precision`` string (``"bf16-mixed"`` -> ``torch.bfloat16``)."""
    check_instance("dtype_of_precision", "precision", precision, str, "a precision string such as '32-true'")
    head = precision.split("-")[0]
    dtypes = {"64": torch.float64, "32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}
    if head not in dtypes or precision.split("-", 1)[-1] not in (head, "true", "mixed"):
        raise ValueError(
            f"`dtype_of_precision(precision={precision!r})` is not valid. Expected one of '64-true', '32-true', "
            "'bf16-mixed', 'bf16-true', '16-mixed', '16-true'."
        )
    return dtypes[head]


def machine_key(dtype: torch.dtype, threads: int, size: int) -> str:
    """The cache key of a CPU peak: CPU model, its instruction-set flags, threads, dtype, matmul size, torch version.

    Any change among these (another machine, a new torch with other kernels, another thread count) measures anew.
    """
    from lightning_perf.profiling.machine import decision_key

    return decision_key(threads=threads, dtype=_SHORT_DTYPE.get(dtype, str(dtype)), matmul=size)


def _time_matmuls(size: int, dtype: torch.dtype, threads: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` ``size x size @ size x size`` CPU matmuls in ``dtype`` on ``threads`` threads, after
    one untimed warm-up."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up: page in the buffers, pick the kernel
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            torch.mm(a, b, out=out)
            seconds.append((time.perf_counter_ns() - start) / 1e9)
        return seconds
    finally:
        torch.set_num_threads(previous)


_PROBE_SIZE = 256  # small enough to take milliseconds even where a dtype is emulated
_PROBE_REPEATS = 5  # the probe's median: a single small matmul right after start-up can be several times slower


def _label(size: int, dtype: torch.dtype, threads: int) -> str:
    return f"measured matmul {size}^3 {_SHORT_DTYPE[dtype]}, {threads} thread{'s' if threads != 1 else ''}"


def measure_cpu_peak_flops(
    dtype: torch.dtype = torch.float32,
    threads: int | None = None,
    size: int = 2048,
    repeats: int = 3,
    max_matmul_s: float = 2.0,
) -> PeakFlops:
    """FLOP/s of a ``size``-cubed matmul in ``dtype`` on ``threads`` CPU threads: ``2*size^3`` over the median time.

    Not cached (:func:`peak_flops` caches it). A ``256``-cubed probe first estimates the rate; ``size`` is halved
    (down to 256) until one matmul takes at most ``max_matmul_s``, so a dtype the CPU only emulates (bf16 without
    avx512_bf16/AMX: measured 0.7 GFLOP/s against 32 GFLOP/s in fp32 on a 2-core AVX2 machine) costs seconds, not
    minutes. The figure is then that emulated rate: what a model in that dtype can reach on this machine. Smaller
    matmuls run below the peak (512^3 fp32 reached half the 2048^3 rate there), so the source names the size used.
    The machine's conditions are watched as the bench watches its runs
    (:mod:`lightning_perf.profiling.reliability`); :attr:`PeakFlops.causes` names what disturbed the measurement.
    """
    threads = torch.get_num_threads() if threads is None else threads
    check_int("measure_cpu_peak_flops", "threads", threads, 1)
    check_int("measure_cpu_peak_flops", "size", size, 1)
    check_int("measure_cpu_peak_flops", "repeats", repeats, 1)
    check_number("measure_cpu_peak_flops", "max_matmul_s", max_matmul_s, 0.0, exclusive=True)
    check_choice("measure_cpu_peak_flops", "dtype", dtype, tuple(_SHORT_DTYPE))
    from lightning_perf.profiling.reliability import ConditionMonitor, assess

    monitor = ConditionMonitor(_probes())
    start = monitor.start()
    if size > _PROBE_SIZE:
        probe = median_of(_time_matmuls(_PROBE_SIZE, dtype, threads, _PROBE_REPEATS))
        rate = 2.0 * _PROBE_SIZE**3 / probe if probe > 0 and math.isfinite(probe) else math.inf
        while size > _PROBE_SIZE and 2.0 * size**3 / rate > max_matmul_s:
            size = max(_PROBE_SIZE, size // 2)
    seconds = _time_matmuls(size, dtype, threads, repeats)
    label = _label(size, dtype, threads)
    monitor.stop(start, "the peak matmul")
    median = median_of(seconds)
    if not (median > 0 and math.isfinite(median)):
        raise RuntimeError(f"The matmul timer gave {median!r} s; a CPU peak cannot be measured here.")
    # The same judgement as the bench's: other processes' load, steal time, load average, frequency, outliers.
    verdict = assess(monitor.runs, {label: [seconds]}, cores_used=threads, cpu_count=monitor.probes.cpu_count())
    return PeakFlops(2.0 * size**3 / median, label, tuple(verdict.causes))


def _probes() -> Any:
    """The machine's counters for :class:`~lightning_perf.profiling.reliability.ConditionMonitor` (tests replace
    this)."""
    from lightning_perf.profiling.reliability import Probes

    return Probes.system()


def _cpu_peak(
    dtype: torch.dtype, threads: int, size: int, repeats: int, max_matmul_s: float, cache_path: Path, refresh: bool
) -> PeakFlops:
    key = machine_key(dtype, threads, size)
    entry = {} if refresh else _CACHE.entry(cache_path, key)
    if is_number(entry.get("flops_per_second")) and entry["flops_per_second"] > 0:
        source = entry.get("source") if isinstance(entry.get("source"), str) else _label(size, dtype, threads)
        return PeakFlops(float(entry["flops_per_second"]), f"{source} (cached)")
    peak = measure_cpu_peak_flops(dtype, threads, size, repeats, max_matmul_s)
    if peak.causes:
        # Too low a peak would stay in the cache and inflate every later MFU: measure again next time.
        return PeakFlops(peak.flops_per_second, f"{peak.source} (disturbed, not cached)", peak.causes)
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    _CACHE.store(cache_path, key, {"flops_per_second": peak.flops_per_second, "source": peak.source,
                                   "repeats": repeats, "measured_at": measured_at})  # fmt: skip
    return peak


def peak_flops(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    given: float | None = None,
    given_source: str = "given",
    threads: int | None = None,
    size: int = 2048,
    repeats: int = 3,
    max_matmul_s: float = 2.0,
    cache_path: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> PeakFlops:
    """What ``device`` can compute per second in ``dtype``, and how that was found out.

    In order: ``given`` when not None; on CUDA the dense datasheet figure of :data:`GPU_PEAK_FLOPS` (fp32 counts as
    TF32 unless ``torch.get_float32_matmul_precision()`` is ``"highest"``); on CPU a ``size``-cubed matmul in
    ``dtype`` on ``threads`` threads (default: torch's current count), measured once per machine and cached in
    ``cache_path`` (default: ``peak_flops.json`` in the user's cache folder, :func:`lightning_perf._io.cache_file`)
    under :func:`machine_key`. Other devices: unknown.

    On a GPU without a table entry, pass Lightning's figure:
    ``given=get_available_flops(device, dtype), given_source="given: Lightning get_available_flops"``. Not before the
    table: Lightning 2.6 lists the sparse figure for the H100 NVL and H200 (and finds no H200 named plainly
    ``"NVIDIA H200"``) and the fp32 rate as the RTX 4090's bf16 rate, so an MFU against those is off by 2x or more.

    Args:
        device: where the run computes.
        dtype: the dtype its matmuls run in (see :func:`dtype_of_precision`).
        given: a peak FLOP/s the caller knows; finite and > 0.
        given_source: how the caller knows it, for the report (e.g. ``"given: Lightning get_available_flops"``).
        threads: CPU threads for the measurement; the run's own count.
        size: matmul size for the CPU measurement (halved while one matmul would take over ``max_matmul_s``).
        repeats: timed matmuls (after one warm-up); their median counts.
        max_matmul_s: the longest one timed CPU matmul may take.
        cache_path: the JSON cache file.
        refresh: measure again even when the cache holds this machine's figure.

    Example::

        peak = peak_flops("cpu", torch.float32)
        peak.source  # 'measured matmul 2048^3 fp32, 2 threads'
    """
    device = torch.device(_validation.check_device("peak_flops", "device", device))
    check_instance("peak_flops", "dtype", dtype, torch.dtype, "a torch.dtype")
    if not isinstance(given_source, str) or not given_source.strip():
        raise ValueError(f"`peak_flops(given_source={given_source!r})` is not valid. Expected a non-empty string.")
    if given is not None:
        return PeakFlops(check_number("peak_flops", "given", given, 0.0, exclusive=True), given_source)
    check_int("peak_flops", "threads", threads, 1, allow_none=True)
    check_int("peak_flops", "size", size, 1)
    check_int("peak_flops", "repeats", repeats, 1)
    check_number("peak_flops", "max_matmul_s", max_matmul_s, 0.0, exclusive=True)
    check_bool("peak_flops", "refresh", refresh)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak_flops(name, dtype, torch.get_float32_matmul_precision())
    if device.type != "cpu":
        return PeakFlops(None, f"unknown: no peak known for {device.type} devices; pass given=")
    if dtype not in _SHORT_DTYPE:
        return PeakFlops(None, f"unknown: no CPU measurement in {dtype}")
    path = _CACHE.path(cache_path)
    return _cpu_peak(dtype, threads or torch.get_num_threads(), size, repeats, max_matmul_s, path, refresh)


# ---------------------------------------------------------------------------------------------------------------------
# Utilization


def utilization(
    flops_per_step: int,
    step_time_s: float,
    peak: PeakFlops | None,
    *,
    step_time_ci95_s: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Achieved FLOP/s and model-FLOPs utilization of a run, for a results file.

    Args:
        flops_per_step: FLOPs of one step (:attr:`FlopCount.total`).
        step_time_s: the run's median step time in seconds.
        peak: the machine's peak (:func:`peak_flops`), or None where it is not known.
        step_time_ci95_s: ``[low, high]`` 95% interval of the median step time; gives the intervals of the rates.

    Returns:
        ``flops_per_step``, ``achieved_flops_per_second`` and its ``_ci95``, ``peak_flops_per_second``,
        ``peak_source``, ``peak_causes`` (what disturbed a measured peak; empty when nothing did), ``mfu``
        (achieved / peak, a fraction; None when the peak is unknown) and ``mfu_ci95``. Only times
        end in ``_s``; an interval is None where no step-time interval was given. A measured CPU peak is a real
        matmul's rate, so a model can come near or (with a disturbed peak measurement) above 1.
    """
    check_int("utilization", "flops_per_step", flops_per_step, 0)
    step_time = check_number("utilization", "step_time_s", step_time_s, 0.0, exclusive=True)
    if peak is not None:
        check_instance("utilization", "peak", peak, PeakFlops, "a PeakFlops or None")
    achieved = flops_per_step / step_time
    achieved_ci: list[float] | None = None
    if step_time_ci95_s is not None:
        if isinstance(step_time_ci95_s, (str, bytes)) or len(step_time_ci95_s) != 2:
            raise ValueError(
                f"`utilization(step_time_ci95_s={step_time_ci95_s!r})` is not valid. Expected [low, high] in seconds."
            )
        low = check_number("utilization", "step_time_ci95_s[0]", step_time_ci95_s[0], 0.0, exclusive=True)
        high = check_number("utilization", "step_time_ci95_s[1]", step_time_ci95_s[1], low)
        if not low <= step_time <= high:
            raise ValueError(
                f"`utilization(step_time_ci95_s={list(step_time_ci95_s)!r})` does not contain "
                f"step_time_s={step_time_s!r}. Expected low <= step_time_s <= high."
            )
        achieved_ci = [flops_per_step / high, flops_per_step / low]  # a longer step is a lower rate
    peak_value = peak.flops_per_second if peak is not None else None
    mfu = achieved / peak_value if peak_value else None
    mfu_ci = [x / peak_value for x in achieved_ci] if peak_value and achieved_ci is not None else None
    return {
        "flops_per_step": int(flops_per_step),
        "achieved_flops_per_second": achieved,
        "achieved_flops_per_second_ci95": achieved_ci,
        "peak_flops_per_second": peak_value,
        "peak_source": peak.source if peak is not None else "unknown: not asked",
        "peak_causes": list(peak.causes) if peak is not None else [],
        "mfu": mfu,
        "mfu_ci95": mfu_ci,
    }


def format_flops(value: float | None, unit: str = "FLOP") -> str:
    """``1.23e12`` -> ``"1.23 TFLOP"`` (``unit="FLOP/s"`` for rates); ``None`` -> ``"-"``."""
    if value is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
