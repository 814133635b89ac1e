"""FLOPs per step against hand formulas, the peak FLOP/s (given, GPU table, cached CPU matmul) and utilization.

No test depends on the machine's speed: the CPU peak's matmul timer is mocked everywhere except one tiny sanity
check that a real measurement gives a positive figure.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_perf._io import CACHE_ENV
from lightning_perf._warnings import MeasurementWarning
from lightning_perf.profiling import flops
from lightning_perf.profiling.flops import (
    GPU_PEAK_FLOPS,
    FlopCount,
    PeakFlops,
    count_flops,
    cpu_sdpa_backward_flops,
    cpu_sdpa_flops,
    dtype_of_precision,
    format_flops,
    gpu_peak_flops,
    machine_key,
    measure_cpu_peak_flops,
    peak_flops,
    utilization,
)
from lightning_perf.profiling.reliability import Probes

CPU_SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"


def _train_step(model: nn.Module, x: torch.Tensor):
    return lambda: model(x).sum().backward()


# ---------------------------------------------------------------------------------------------------------------------
# Counting


def test_mlp_training_step_matches_the_hand_formula() -> None:
    torch.manual_seed(0)
    b, d_in, d_hidden, d_out = 8, 64, 32, 16
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))
    x = torch.randn(b, d_in)  # the input needs no gradient: the first layer's backward computes only dW
    first, second = 2 * b * d_in * d_hidden, 2 * b * d_hidden * d_out
    expected = (first + second) + first + 2 * second
    count = count_flops(_train_step(model, x))
    assert isinstance(count, FlopCount)
    assert count.total == expected
    assert sum(count.by_operator.values()) == count.total
    assert set(count.by_operator) == {"aten.addmm", "aten.mm"}


def test_forward_only_arguments_an_empty_step_and_a_non_callable() -> None:
    model = nn.Linear(10, 5, bias=False)
    with torch.no_grad():
        assert count_flops(lambda: model(torch.randn(8, 10))).total == 2 * 8 * 10 * 5  # the forward alone
    assert count_flops(model, torch.randn(3, 10)).total == 2 * 3 * 10 * 5  # arguments are passed to the step
    assert count_flops(lambda *, x: model(x), x=torch.randn(4, 10)).total == 2 * 4 * 10 * 5
    count = count_flops(lambda: torch.randn(4, 4).relu().sum())
    assert count.total == 0 and count.by_operator == {}
    with pytest.raises(TypeError, match=r"count_flops\(fn=3\)"):
        count_flops(3)


def test_conv_training_step_matches_the_hand_formula() -> None:
    b, c_in, c_out, k, size = 2, 3, 8, 3, 16
    model = nn.Conv2d(c_in, c_out, k, padding=1)
    x = torch.randn(b, c_in, size, size)
    forward = 2 * b * c_out * size * size * c_in * k * k
    assert count_flops(_train_step(model, x)).total == 2 * forward  # forward + dW (the input needs no dX)
    x.requires_grad_(True)
    assert count_flops(_train_step(model, x)).total == 3 * forward  # forward + dW + dX


def _qkv(b: int = 2, h: int = 3, s: int = 8, d: int = 4, s_kv: int | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    shapes = [(b, h, s, d), (b, h, s_kv or s, d), (b, h, s_kv or s, d)]
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def test_torch_alone_counts_zero_for_the_cpu_attention_kernel() -> None:
    # The reason for flop_mapping(): if torch starts counting this kernel itself, this test says the mapping is moot.
    q, k, v = _qkv()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    assert counter.get_total_flops() == 0


@pytest.mark.parametrize("s_kv", [8, 5])
def test_cpu_attention_kernel_is_counted_as_the_math_path_counts_it(s_kv: int) -> None:
    b, h, s, d = 2, 3, 8, 4
    q, k, v = _qkv(b, h, s, d, s_kv)
    forward = 4 * b * h * s * s_kv * d

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fused = count_flops(step)
    with sdpa_kernel(SDPBackend.MATH):
        math_path = count_flops(step)
    assert fused.by_operator == {CPU_SDPA: forward, f"{CPU_SDPA}_backward": 2 * forward}
    assert fused.total == 3 * forward == math_path.total
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert count_flops(F.scaled_dot_product_attention, q, k, v).total == forward


def test_attention_formulas_cover_grouped_heads_and_another_value_width() -> None:
    b, h_q, h_kv, s_q, s_kv, d, d_v = 2, 8, 2, 5, 7, 16, 4
    q, k, v = torch.empty(b, h_q, s_q, d), torch.empty(b, h_kv, s_kv, d), torch.empty(b, h_kv, s_kv, d_v)
    forward = 2 * b * h_q * s_q * s_kv * (d + d_v)
    assert cpu_sdpa_flops(q, k, v, 0.0, False, out_val=None) == forward
    assert cpu_sdpa_backward_flops(torch.empty(b, h_q, s_q, d_v), q, k, v, out_val=None) == 2 * forward
    with pytest.raises(ValueError, match="do not fit together"):
        cpu_sdpa_flops(q, torch.empty(b, 3, s_kv, d), torch.empty(b, 3, s_kv, d_v))


def _mha_flops(b: int, s: int, e: int) -> tuple[int, int]:
    """Forward and training-step FLOPs of self-attention nn.MultiheadAttention on an input that needs no gradient."""
    in_proj, attention, out_proj = 2 * b * s * e * 3 * e, 4 * b * s * s * e, 2 * b * s * e * e
    forward = in_proj + attention + out_proj
    backward = in_proj + 2 * attention + 2 * out_proj  # in_proj: dW only
    return forward, forward + backward


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_step_matches_the_hand_formula(need_weights: bool) -> None:
    b, s, e, heads = 2, 8, 12, 3
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(e, heads, batch_first=True)
    x = torch.randn(b, s, e)
    forward, step = _mha_flops(b, s, e)
    # need_weights=False runs the fused CPU kernel; need_weights=True the explicit bmm path: both count the same.
    count = count_flops(lambda: mha(x, x, x, need_weights=need_weights)[0].sum().backward())
    assert count.total > 0
    assert count.total == pytest.approx(step, rel=1e-9)
    mha.eval()
    with torch.no_grad():
        assert count_flops(lambda: mha(x, x, x, need_weights=need_weights)).total == pytest.approx(forward, rel=1e-9)


def test_transformer_layer_in_eval_mode_counts_its_attention() -> None:
    b, s, e, ff = 2, 8, 12, 24
    layer = nn.TransformerEncoderLayer(e, 3, ff, batch_first=True).eval()
    attention_forward, _ = _mha_flops(b, s, e)
    with torch.no_grad():
        total = count_flops(layer, torch.randn(b, s, e)).total
    assert total == attention_forward + 2 * (2 * b * s * e * ff)


# ---------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s: given and GPU table


def test_a_given_peak_is_used_as_is() -> None:
    assert peak_flops("cpu", torch.float32, given=1e12) == PeakFlops(1e12, "given")
    assert peak_flops(torch.device("cuda"), torch.bfloat16, given=5) == PeakFlops(5.0, "given")
    lightning = peak_flops("cuda", torch.bfloat16, given=312e12, given_source="given: Lightning get_available_flops")
    assert lightning == PeakFlops(312e12, "given: Lightning get_available_flops")
    for bad in ("", "  ", None, 3):
        with pytest.raises(ValueError, match="given_source="):
            peak_flops("cpu", torch.float32, given=1.0, given_source=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("given", [0, -1.0, math.nan, math.inf, True, "1e12"])
def test_a_bad_given_peak_is_refused(given: object) -> None:
    with pytest.raises(ValueError, match=r"peak_flops\(given="):
        peak_flops("cpu", torch.float32, given=given)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "dtype", "precision", "row", "short"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, "highest", "H100 SXM", "bf16"),
        ("NVIDIA H100 PCIe", torch.float16, "highest", "H100 PCIe", "fp16"),
        ("NVIDIA H100 NVL", torch.float32, "highest", "H100 NVL", "fp32"),
        ("NVIDIA H200", torch.bfloat16, "highest", "H200 SXM", "bf16"),
        ("NVIDIA H200 NVL", torch.bfloat16, "highest", "H200 NVL", "bf16"),
        ("NVIDIA A100-SXM4-80GB", torch.float32, "high", "A100", "tf32"),
        ("NVIDIA A100 80GB PCIe", torch.float32, "highest", "A100", "fp32"),
        ("NVIDIA L4", torch.bfloat16, "highest", "L4", "bf16"),
        ("NVIDIA GeForce RTX 4090", torch.float32, "medium", "RTX 4090", "tf32"),
    ],
)
def test_gpu_table_lookup(name: str, dtype: torch.dtype, precision: str, row: str, short: str) -> None:
    peak = gpu_peak_flops(name, dtype, precision)
    assert peak == PeakFlops(GPU_PEAK_FLOPS[row][short], f"table: {row} {short} dense")


def test_gpu_table_holds_dense_figures_in_a_plausible_order() -> None:
    for row, rates in GPU_PEAK_FLOPS.items():
        assert rates["fp32"] <= rates["tf32"] <= rates["bf16"] == rates["fp16"], row
    assert GPU_PEAK_FLOPS["H100 SXM"]["bf16"] == pytest.approx(989.5e12)  # dense, not the 1979 sparse figure


def test_unknown_gpu_or_dtype_gives_no_peak() -> None:
    unknown = gpu_peak_flops("NVIDIA Tesla K80", torch.float32)
    assert unknown.flops_per_second is None and unknown.source.startswith("unknown:") and "K80" in unknown.source
    no_fp64 = gpu_peak_flops("NVIDIA L4", torch.float64)
    assert no_fp64.flops_per_second is None and "L4" in no_fp64.source
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16).flops_per_second is None  # not mistaken for an L4
    other = peak_flops("meta", torch.float32)  # another device
    assert other.flops_per_second is None and other.source.startswith("unknown:")


def test_peak_on_cuda_reads_the_device_name_and_matmul_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", torch.bfloat16).source == "table: H100 SXM bf16 dense"
    assert peak_flops("cuda:0", torch.float32).source == "table: H100 SXM fp32 dense"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_flops("cuda", torch.float32).source == "table: H100 SXM tf32 dense"


def test_dtype_of_precision_and_an_unknown_one_refused() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    known = {"32-true": f32, "32": f32, "bf16-mixed": bf16, "bf16-true": bf16, "16-mixed": torch.float16}
    for precision, dtype in {**known, "64-true": torch.float64}.items():
        assert dtype_of_precision(precision) is dtype, precision
    for precision in ("bf16-fast", "8-true", "", "transformer-engine"):
        with pytest.raises(ValueError, match="dtype_of_precision"):
            dtype_of_precision(precision)


# ---------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s: CPU measurement and its cache


class FakeTimer:
    """Stands in for the matmul timer: a machine computing ``rate`` FLOP/s, every call recorded.

    The timed repeats spread around the true time (1.5x, 1x, 0.5x), so only their median gives ``rate`` back.
    """

    def __init__(self, rate: float = 1e11) -> None:
        self.rate = rate
        self.calls: list[tuple[int, torch.dtype, int, int]] = []

    def __call__(self, size: int, dtype: torch.dtype, threads: int, repeats: int) -> list[float]:
        self.calls.append((size, dtype, threads, repeats))
        seconds = [2.0 * size**3 / self.rate] * repeats
        if repeats >= 3:
            seconds[0], seconds[-1] = 1.5 * seconds[0], seconds[-1] / 2
        return seconds

    @property
    def measurements(self) -> list[tuple[int, torch.dtype, int, int]]:
        """The timed runs, without the 256^3 probes that pick the size."""
        return [call for call in self.calls if call[:1] + call[3:] != (256, flops._PROBE_REPEATS)]


def fake_probes(other_cores: float = 0.0, cpu_count: int = 2) -> Probes:
    """Counters of a machine where other processes keep ``other_cores`` cores busy (each reading is 1 s later)."""
    clock_ticks, busy_ticks = itertools.count(), itertools.count()
    return Probes(
        clock=lambda: float(next(clock_ticks)),
        system_cpu=lambda: (other_cores * next(busy_ticks), 0.0),
        own_cpu=lambda: 0.0,
        load_average=lambda: None,
        frequency=lambda: None,
        cpu_count=lambda: cpu_count,
    )


@pytest.fixture
def fake_timer(monkeypatch: pytest.MonkeyPatch) -> FakeTimer:
    """A mocked matmul timer on a quiet machine (the machine's counters are mocked too)."""
    timer = FakeTimer()
    monkeypatch.setattr(flops, "_time_matmuls", timer)
    monkeypatch.setattr(flops, "_probes", fake_probes)
    return timer


def test_cpu_peak_is_measured_once_and_then_read_from_the_cache(tmp_path: Path, fake_timer: FakeTimer) -> None:
    cache = tmp_path / "cache" / "peak_flops.json"
    first = peak_flops("cpu", torch.float32, threads=2, cache_path=cache)
    assert first.source == "measured matmul 2048^3 fp32, 2 threads"
    assert first.flops_per_second == pytest.approx(1e11)
    assert fake_timer.calls == [
        (256, torch.float32, 2, flops._PROBE_REPEATS),
        (2048, torch.float32, 2, 3),
    ]  # probe, then the peak
    assert cache.is_file()
    assert [p.name for p in cache.parent.iterdir()] == ["peak_flops.json"]  # no temporary file left behind
    second = peak_flops("cpu", torch.float32, threads=2, cache_path=cache)
    assert len(fake_timer.calls) == 2
    assert second == PeakFlops(first.flops_per_second, "measured matmul 2048^3 fp32, 2 threads (cached)")
    stored = json.loads(cache.read_text())
    assert stored["entries"][machine_key(torch.float32, 2, 2048)]["flops_per_second"] == first.flops_per_second


def test_a_slow_dtype_is_measured_on_a_smaller_matmul(tmp_path: Path, fake_timer: FakeTimer) -> None:
    fake_timer.rate = 1e9  # an emulated bf16: 2048^3 would take 17 s a matmul, 1024^3 2.1 s, 512^3 0.27 s
    cache = tmp_path / "peak_flops.json"
    peak = peak_flops("cpu", torch.bfloat16, threads=2, cache_path=cache)
    assert peak.source == "measured matmul 512^3 bf16, 2 threads"
    assert peak.flops_per_second == pytest.approx(1e9)
    assert fake_timer.measurements == [(512, torch.bfloat16, 2, 3)]
    cached = peak_flops("cpu", torch.bfloat16, threads=2, cache_path=cache)
    assert cached.source == "measured matmul 512^3 bf16, 2 threads (cached)" and len(fake_timer.calls) == 2
    fake_timer.rate = 1e6  # never below the probe's own size
    assert measure_cpu_peak_flops(torch.float32, 1, 2048, 1).source == "measured matmul 256^3 fp32, 1 thread"
    fake_timer.rate = 1e11
    assert measure_cpu_peak_flops(torch.float32, 1, 4096, 1, max_matmul_s=10.0).source.startswith(
        "measured matmul 4096^3"
    )


def test_cpu_peak_cache_is_keyed_by_dtype_threads_and_size(tmp_path: Path, fake_timer: FakeTimer) -> None:
    cache = tmp_path / "peak_flops.json"
    peak_flops("cpu", torch.float32, threads=2, cache_path=cache)
    bf16 = peak_flops("cpu", torch.bfloat16, threads=2, cache_path=cache)
    one_thread = peak_flops("cpu", torch.float32, threads=1, cache_path=cache, size=256, repeats=2)
    assert len(fake_timer.measurements) == 3
    assert bf16.source == "measured matmul 2048^3 bf16, 2 threads"
    assert one_thread.source == "measured matmul 256^3 fp32, 1 thread"
    assert fake_timer.calls[-1] == (256, torch.float32, 1, 2) and fake_timer.calls[-2][1] is torch.bfloat16  # no probe
    assert len(json.loads(cache.read_text())["entries"]) == 3  # earlier entries kept
    for dtype, threads, size in ((torch.float32, 2, 2048), (torch.bfloat16, 2, 2048), (torch.float32, 1, 256)):
        assert peak_flops("cpu", dtype, threads=threads, size=size, cache_path=cache).source.endswith("(cached)")
    assert len(fake_timer.measurements) == 3


def test_a_disturbed_measurement_says_so_and_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_timer: FakeTimer
) -> None:
    monkeypatch.setattr(flops, "_probes", lambda: fake_probes(other_cores=1.5))
    cache = tmp_path / "peak_flops.json"
    peak = peak_flops("cpu", torch.float32, threads=2, cache_path=cache)
    assert peak.source == "measured matmul 2048^3 fp32, 2 threads (disturbed, not cached)"
    assert len(peak.causes) == 1 and peak.causes[0].startswith("other processes' load")
    assert not cache.exists()
    row = utilization(10**9, 0.1, peak)
    assert row["peak_causes"] == list(peak.causes) and row["peak_source"] == peak.source
    monkeypatch.setattr(flops, "_probes", fake_probes)  # quiet again: measured anew, then cached
    again = peak_flops("cpu", torch.float32, threads=2, cache_path=cache)
    assert again.causes == () and not again.source.endswith(")") and cache.is_file()
    assert len(fake_timer.measurements) == 2


def test_refresh_measures_again_with_torch_s_threads_by_default(tmp_path: Path, fake_timer: FakeTimer) -> None:
    peak_flops("cpu", torch.float32, cache_path=tmp_path / "p.json")
    again = peak_flops("cpu", torch.float32, cache_path=tmp_path / "p.json", refresh=True)
    assert len(fake_timer.measurements) == 2 and not again.source.endswith("(cached)")
    assert {call[2] for call in fake_timer.calls} == {torch.get_num_threads()}


def test_cache_location_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_timer: FakeTimer
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "lp-cache"))
    peak_flops("cpu", torch.float32, threads=1)
    assert (tmp_path / "lp-cache" / "peak_flops.json").is_file()
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    peak_flops("cpu", torch.float32, threads=1)
    assert (tmp_path / "home" / ".cache" / "lightning_perf" / "peak_flops.json").is_file()


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"schema": 99, "entries": {}}', '{"schema": 1, "entries": [1]}', ""]
)
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path, fake_timer: FakeTimer, content: str
) -> None:
    cache = tmp_path / "peak_flops.json"
    cache.write_text(content)
    with pytest.warns(MeasurementWarning, match="not valid.*measuring again and rewriting"):
        peak = peak_flops("cpu", torch.float32, threads=1, cache_path=cache)
    assert len(fake_timer.measurements) == 1 and peak.flops_per_second == pytest.approx(1e11)
    assert json.loads(cache.read_text())["schema"] == 1
    assert peak_flops("cpu", torch.float32, threads=1, cache_path=cache).source.endswith("(cached)")  # no warning
    assert len(fake_timer.measurements) == 1


@pytest.mark.parametrize("stored", [-1.0, 0, "fast", None, True])
def test_an_invalid_cache_entry_is_measured_again(tmp_path: Path, fake_timer: FakeTimer, stored: object) -> None:
    cache = tmp_path / "peak_flops.json"
    key = machine_key(torch.float32, 1, 2048)
    cache.write_text(json.dumps({"schema": 1, "entries": {key: {"flops_per_second": stored}}}))
    peak = peak_flops("cpu", torch.float32, threads=1, cache_path=cache)
    assert len(fake_timer.measurements) == 1 and peak.flops_per_second == pytest.approx(1e11)


def test_an_unwritable_cache_warns_and_still_gives_the_peak(tmp_path: Path, fake_timer: FakeTimer) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peak = peak_flops("cpu", torch.float32, threads=1, cache_path=blocker / "peak_flops.json")
    assert peak.flops_per_second == pytest.approx(1e11)
    messages = [str(w.message) for w in caught if issubclass(w.category, MeasurementWarning)]
    assert len(messages) == 2  # once for the read, once for the write; the re-read before writing is quiet
    assert "not valid or readable" in messages[0] and messages[1].startswith("Could not write")


def test_machine_key_names_what_decides_the_peak() -> None:
    key = machine_key(torch.bfloat16, 4, 1024)
    for part in ("cpu=", "flags=", "threads=4", "dtype=bf16", "matmul=1024", f"torch={torch.__version__}"):
        assert part in key
    assert machine_key(torch.float32, 4, 1024) != key


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"threads": 0}, "threads=0"), ({"size": 0}, "size=0"), ({"repeats": 0}, "repeats=0"),
     ({"refresh": "yes"}, "refresh='yes'"), ({"max_matmul_s": 0.0}, "max_matmul_s=0.0"),
     ({"threads": 2.0}, "threads=2.0"), ({"device": "nonsense"}, "ValueError: .*device='nonsense'"),
     ({"dtype": "float32"}, "TypeError: .*dtype='float32'")],
)  # fmt: skip
def test_peak_flops_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError)) as caught:
        peak_flops(**{"device": "cpu", "dtype": torch.float32, **kwargs})
    assert re.search(match, f"{caught.typename}: {caught.value}")
    assert peak_flops("cpu", torch.int8).flops_per_second is None  # a dtype without a peak is no error


def test_a_real_tiny_matmul_measures_a_positive_rate_and_restores_threads() -> None:
    threads = torch.get_num_threads()
    peak = measure_cpu_peak_flops(torch.float32, threads=1, size=32, repeats=1)
    assert peak.flops_per_second is not None and peak.flops_per_second > 0 and math.isfinite(peak.flops_per_second)
    assert peak.source == "measured matmul 32^3 fp32, 1 thread"  # causes: whatever this machine is doing now
    assert torch.get_num_threads() == threads


def test_a_zero_timing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops, "_time_matmuls", lambda *args: [0.0])
    with pytest.raises(RuntimeError, match="timer gave"):
        measure_cpu_peak_flops(size=64, repeats=1)


# ---------------------------------------------------------------------------------------------------------------------
# Utilization


def test_utilization_arithmetic() -> None:
    row = utilization(2 * 10**9, 0.01, PeakFlops(1e12, "given"), step_time_ci95_s=[0.008, 0.0125])
    assert row == {
        "flops_per_step": 2 * 10**9,
        "achieved_flops_per_second": pytest.approx(2e11),
        "achieved_flops_per_second_ci95": pytest.approx([1.6e11, 2.5e11]),
        "peak_flops_per_second": 1e12,
        "peak_source": "given",
        "peak_causes": [],
        "mfu": pytest.approx(0.2),
        "mfu_ci95": pytest.approx([0.16, 0.25]),
    }
    low, high = row["mfu_ci95"]
    assert low <= row["mfu"] <= high
    assert not [key for key in row if key.endswith("_s")]  # only times end in _s, and none of these is a time
    json.dumps(row)


def test_utilization_without_a_peak_or_an_interval() -> None:
    row = utilization(10**6, 0.5, None)
    assert row["achieved_flops_per_second"] == pytest.approx(2e6)
    assert row["mfu"] is None and row["mfu_ci95"] is None and row["achieved_flops_per_second_ci95"] is None
    assert row["peak_flops_per_second"] is None and row["peak_source"].startswith("unknown")
    unknown = utilization(10**6, 0.5, PeakFlops(None, "unknown: no table entry for 'X'"))
    assert unknown["mfu"] is None and unknown["peak_source"] == "unknown: no table entry for 'X'"
    assert utilization(0, 0.5, PeakFlops(1e9, "given"))["mfu"] == 0.0


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((-1, 0.1, None), {}, "flops_per_step=-1"),
        ((1.5, 0.1, None), {}, "flops_per_step=1.5"),
        ((True, 0.1, None), {}, "flops_per_step=True"),
        ((10, 0.0, None), {}, "step_time_s=0.0"),
        ((10, math.nan, None), {}, "step_time_s=nan"),
        ((10, 0.1, 1e12), {}, "peak=1000000000000.0"),
        ((10, 0.1, None), {"step_time_ci95_s": [0.2, 0.3]}, "does not contain"),
        ((10, 0.1, None), {"step_time_ci95_s": [0.05]}, "step_time_ci95_s"),
        ((10, 0.1, None), {"step_time_ci95_s": [0.2, 0.05]}, r"step_time_ci95_s\[1\]"),
        ((10, 0.1, None), {"step_time_ci95_s": "ab"}, "step_time_ci95_s"),
    ],
)
def test_utilization_rejects_bad_arguments(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        utilization(*args, **kwargs)


def test_format_flops() -> None:
    assert format_flops(1.234e12) == "1.23 TFLOP"
    assert format_flops(5e9, "FLOP/s") == "5 GFLOP/s"
    assert format_flops(12) == "12 FLOP"
    assert format_flops(None) == "-"
