"""MemoryProbe: CPU heap bytes follow a known allocation, the peak resets, and a truthful subprocess sees it exactly."""

from __future__ import annotations

import gc
import json
import os
import pickle
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_perf import MeasurementWarning
from lightning_perf.profiling import TRUTHFUL_CPU_MEMORY_ENV, MemoryProbe, MemorySample, peak_rss_bytes
from lightning_perf.profiling import memory as memory_module

MB = 1 << 20
PACKAGE_DIR = str(Path(memory_module.__file__).resolve().parents[1])
on_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")


def _clear_refs_permitted() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _rss_from_statm() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def filled(n_bytes: int) -> torch.Tensor:
    # torch.ones writes every page, so the memory is resident, not just reserved address space.
    return torch.ones(n_bytes // 4, dtype=torch.float32)


@pytest.fixture
def probe() -> Iterator[MemoryProbe]:
    p = MemoryProbe("cpu")
    if p.source != "cpu-mallinfo2":
        pytest.skip("needs glibc mallinfo2")
    yield p
    p.close()


def test_allocated_follows_a_64_mb_tensor(probe: MemoryProbe) -> None:
    gc.collect()
    before = probe.sample().allocated
    x = filled(64 * MB)
    during = probe.sample().allocated
    del x
    after = probe.sample().allocated
    assert during - before >= 64 * MB
    assert during - after >= 64 * MB - MB


def test_allocated_alone_is_the_heap_reading_of_a_sample(probe: MemoryProbe) -> None:
    gc.collect()
    before = probe.allocated()
    x = filled(64 * MB)
    during = probe.allocated()
    del x
    assert during - before >= 64 * MB
    assert probe.allocated() <= during - 64 * MB + MB
    assert isinstance(probe.allocated(), int)


def test_allocated_alone_on_cuda_and_without_mallinfo2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 123)
    assert MemoryProbe("cuda:0").allocated() == 123
    monkeypatch.setattr(memory_module, "_load_mallinfo2", lambda: None)
    with pytest.warns(MeasurementWarning, match="mallinfo2"):
        p = MemoryProbe("cpu")
    monkeypatch.setattr(p, "_rss_and_peak", lambda: (777, 888))
    assert p.allocated() == 777 == p.sample().allocated  # the resident set, as in a full sample


@on_linux
def test_reserved_is_the_resident_set_and_peak_is_at_least_that(probe: MemoryProbe) -> None:
    s = probe.sample()
    assert abs(s.reserved - _rss_from_statm()) < 4 * MB
    assert s.peak >= s.reserved
    assert s.device == "cpu"
    assert s.source == "cpu-mallinfo2"
    assert s.peak_since_reset is False  # never reset by this probe: the process lifetime's peak
    assert set(s.notes) == {"allocated", "reserved", "peak"}
    later = probe.sample()
    assert later.timestamp_ns > s.timestamp_ns


@on_linux
def test_reset_peak_forgets_an_earlier_larger_peak(probe: MemoryProbe) -> None:
    if not _clear_refs_permitted():
        pytest.skip("writing /proc/self/clear_refs is not permitted here: the CPU peak cannot be reset")
    x = filled(96 * MB)
    high = probe.sample().peak
    del x
    assert probe.reset_peak() is True
    after_reset = probe.sample()
    assert after_reset.peak_since_reset is True
    y = filled(8 * MB)
    low = probe.sample()
    del y
    assert low.peak < high - 64 * MB
    assert low.peak >= low.reserved


def test_reset_peak_that_is_not_permitted_warns_once_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path, probe: MemoryProbe
) -> None:
    monkeypatch.setattr(memory_module, "_CLEAR_REFS_PATH", str(tmp_path / "missing" / "clear_refs"))
    with pytest.warns(MeasurementWarning, match="cannot reset the CPU peak"):
        assert probe.reset_peak() is False
    assert probe.reset_peak() is False  # warned once only; a second warning would be an error here
    assert probe.sample().peak_since_reset is False


def test_without_mallinfo2_allocated_falls_back_to_rss_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_module, "_load_mallinfo2", lambda: None)
    with pytest.warns(MeasurementWarning, match="mallinfo2"):
        p = MemoryProbe("cpu")
    s = p.sample()
    assert s.source == "cpu-rss"
    assert s.allocated == s.reserved


def test_probe_survives_pickling(probe: MemoryProbe) -> None:
    probe.sample()
    copy = pickle.loads(pickle.dumps(probe))
    assert copy.source == probe.source
    assert copy.sample().reserved > 0
    copy.close()


def _pid_in(status: bytes) -> int:
    return int(status.split(b"\nPid:")[1].split()[0])


@on_linux
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_reads_its_own_figures(probe: MemoryProbe) -> None:
    # "/proc/self" is resolved when opened: a descriptor inherited through fork would describe the parent. The test
    # asks the descriptor the probe reads whose status it is (the "Pid:" line), not whether two memory figures differ
    # by some margin: other processes' load can move resident sizes, never a process id.
    probe.sample()  # the parent's descriptor is open before the fork
    parent = os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain Python only, then leave without running any test machinery
        try:
            probe.sample()  # reopens the descriptor if it notices the fork
            status = probe._proc("/proc/self/status")  # what that descriptor reads now
            assert status is not None
            with open("/proc/self/status", "rb") as f:  # the child's own status, read the plain way
                own = f.read()
            message = [os.getpid(), _pid_in(status), probe._forks_seen, _pid_in(own)]
            os.write(write_end, json.dumps(message).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        child_pid, probe_pid, opened_by, own_pid = json.loads(f.read())
    os.waitpid(pid, 0)
    assert child_pid == pid == own_pid != parent
    assert probe_pid == child_pid and opened_by > probe._forks_seen  # the child reopened: it reads its own status
    parent_status = probe._proc("/proc/self/status")
    assert parent_status is not None and _pid_in(parent_status) == parent  # the parent's descriptor still works


def test_unsupported_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"MemoryProbe\(device='meta'\)"):
        MemoryProbe("meta")


def test_cuda_figures_come_from_the_caching_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    resets: list[object] = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 200)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    p = MemoryProbe("cuda:0")
    assert p.reset_peak() is True
    s = p.sample()
    assert (s.allocated, s.reserved, s.peak, s.device, s.source) == (100, 300, 200, "cuda:0", "cuda")
    assert s.peak_since_reset is True
    assert resets == [torch.device("cuda:0")]


def test_peak_above_compares_like_with_like() -> None:
    cpu_before = MemorySample("cpu", allocated=100, reserved=400, peak=400, timestamp_ns=0, source="cpu-mallinfo2",
                              peak_since_reset=True)  # fmt: skip
    cpu_after = MemorySample("cpu", 150, 420, 900, 1, "cpu-mallinfo2", True)
    assert cpu_after.peak_above(cpu_before) == 500  # a peak of the resident set, so minus the resident set
    cuda_before = MemorySample("cuda:0", 100, 400, 100, 0, "cuda", True)
    cuda_after = MemorySample("cuda:0", 100, 400, 700, 1, "cuda", True)
    assert cuda_after.peak_above(cuda_before) == 600  # a peak of allocated bytes, so minus allocated
    with pytest.raises(ValueError, match="compares samples of one probe"):
        cuda_after.peak_above(cpu_before)


def test_sample_is_a_frozen_record() -> None:
    s = MemorySample("cpu", 1, 2, 3, 4, "cpu-mallinfo2", False)
    assert s.to_dict()["peak"] == 3
    with pytest.raises(AttributeError):
        s.peak = 5  # type: ignore[misc]


@on_linux
def test_peak_rss_bytes_is_in_bytes() -> None:
    # ru_maxrss is KiB on Linux: read as bytes unscaled, it would be 1024 times smaller than the resident set.
    assert peak_rss_bytes() >= _rss_from_statm() - 4 * MB


_PRELUDE = """
import ctypes, json, sys, types
# Load the measurement layer without running lightning_perf/__init__.py (which imports Lightning, seconds of
# start-up): profiling/ itself must not need Lightning, and this checks that too.
package = types.ModuleType("lightning_perf")
package.__path__ = [PACKAGE_DIR]
sys.modules["lightning_perf"] = package
import torch
"""


def _run_truthful(script: str) -> dict:
    """Runs ``script`` after the prelude in a child under the truthful environment; its last line, as JSON."""
    env = {**os.environ, **TRUTHFUL_CPU_MEMORY_ENV, "PYTHONWARNINGS": "ignore"}
    code = (_PRELUDE + script).replace("PACKAGE_DIR", repr(PACKAGE_DIR))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_TRUTHFUL_SCRIPT = """
from lightning_perf.profiling import MemoryProbe, peak_rss_bytes
assert "lightning" not in sys.modules, "the profiling layer imported Lightning"
MB = 1 << 20
probe = MemoryProbe("cpu")
# Without the truthful environment glibc raises its mmap threshold after this free, and the 1 MB blocks
# below would come from the heap and stay resident after they are freed.
warm = torch.ones(24 * MB // 4); del warm
probe.reset_peak()
base = probe.sample()
blocks = [torch.ones(MB // 4) for _ in range(128)]
during = probe.sample()
del blocks
after = probe.sample()
print(json.dumps({"base_rss": base.reserved, "base_alloc": base.allocated, "peak": after.peak,
                  "during_alloc": during.allocated, "after_rss": after.reserved, "after_alloc": after.allocated,
                  "ru_maxrss": peak_rss_bytes()}))
"""


@on_linux
def test_truthful_environment_makes_peak_rss_track_a_known_allocation() -> None:
    if not _clear_refs_permitted():
        pytest.skip("writing /proc/self/clear_refs is not permitted here: the CPU peak cannot be reset")
    r = _run_truthful(_TRUTHFUL_SCRIPT)
    assert abs((r["peak"] - r["base_rss"]) - 128 * MB) < 4 * MB
    assert abs(r["after_rss"] - r["base_rss"]) < 4 * MB  # freed memory really went back to the OS
    assert abs((r["during_alloc"] - r["base_alloc"]) - 128 * MB) < 2 * MB
    assert abs(r["after_alloc"] - r["base_alloc"]) < 2 * MB
    assert r["ru_maxrss"] >= r["peak"] - 4 * MB


_SWITCH_SCRIPT = """
from lightning_perf.profiling.memory import _MallInfo2, truthful_cpu_peak
info = ctypes.CDLL(None).mallinfo2
info.restype = _MallInfo2
MB = 1 << 20

def mapped_by(size):  # bytes glibc mmapped for one live block of `size` bytes
    before = info().hblkhd
    block = torch.empty(size, dtype=torch.uint8)
    grown = info().hblkhd - before
    del block
    return grown

found = {"start": mapped_by(4 * MB), "off": truthful_cpu_peak(False)}
found["after_off"] = mapped_by(4 * MB)
found["on"] = truthful_cpu_peak(True)
found["after_on"] = mapped_by(8 * MB)  # larger than any free heap block left: a fresh map again
print(json.dumps(found))
"""


@on_linux
def test_the_truthful_setting_is_switched_off_and_on_within_a_process() -> None:
    """Memory is measured under the truthful setting, steps are timed without it (benchmark.worker): each large block
    is its own mmap under it, from the heap after it is switched off."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt and mallinfo2 are glibc's")
    found = _run_truthful(_SWITCH_SCRIPT)
    assert found["start"] >= 4 * MB and found["off"] is True and found["on"] is True
    assert found["after_off"] == 0  # served from the heap: no page faults of a fresh map per block
    assert found["after_on"] >= 8 * MB
