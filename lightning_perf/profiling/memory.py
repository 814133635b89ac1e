"""Memory in use and peak memory, per device, cheap enough to sample every step.

Entry points: :class:`MemoryProbe` and :class:`MemorySample`; for a measured CPU process
:data:`TRUTHFUL_CPU_MEMORY_ENV`, :func:`truthful_cpu_peak` and :func:`fork_at_full_speed`. What each figure means on
CUDA and on a CPU (glibc), and why a CPU peak needs ``MALLOC_MMAP_THRESHOLD_``: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_perf._device import as_device

__all__ = [
    "TRUTHFUL_CPU_MEMORY_ENV",
    "MemoryProbe",
    "MemorySample",
    "fork_at_full_speed",
    "peak_rss_bytes",
    "truthful_cpu_peak",
]

TRUTHFUL_CPU_MEMORY_ENV: dict[str, str] = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Environment for a subprocess whose CPU peak RSS must equal its peak memory in use (see the module notes): every
large allocation it makes pays for it in time; :func:`truthful_cpu_peak` switches it off for what is timed next."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, <malloc.h>
_TRUTHFUL_MMAP_THRESHOLD = 64 * 1024
# glibc's DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit): where the dynamic threshold of a warmed-up process ends; the
# dynamic rule keeps the trim threshold at twice it.
_FAST_MMAP_THRESHOLD = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)


def truthful_cpu_peak(on: bool = True) -> bool:
    """Serve every block of 64 KiB or more from its own mmap, unmapped when freed, and return the free heap to the
    system now (``on``: what :data:`TRUTHFUL_CPU_MEMORY_ENV` does from a process's start), or give allocation its
    speed back (``on=False``: blocks under 32 MiB come from the heap again, the threshold a warmed-up process reaches
    by itself). glibc only; returns whether it took effect.

    Measure memory first, in a process started with :data:`TRUTHFUL_CPU_MEMORY_ENV`, then switch it off to time
    steps: every large allocation under it costs page faults (the default ``lm`` step: 300 ms instead of 156 ms on a
    2-core CPU). Switching it on later does not make the peak truthful again: glibc serves a request from a free heap
    block before it maps a new one, and a block used again stays resident after it is freed.
    """
    libc = _glibc()
    if libc is None:
        return False
    threshold = _TRUTHFUL_MMAP_THRESHOLD if on else _FAST_MMAP_THRESHOLD
    done = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    if on:
        libc.malloc_trim(0)
    return done


def fork_at_full_speed() -> bool:
    """Give every process forked from this one from now on full-speed allocation (``truthful_cpu_peak(False)`` in
    the child), while this one may still measure memory: a fork copies the allocator's settings, so a DataLoader
    worker forked at an epoch's start would otherwise allocate under :data:`TRUTHFUL_CPU_MEMORY_ENV` for its whole
    life, as no user's does. glibc only; returns whether it took effect."""
    if _glibc() is None:  # resolved here, not in the child: a fork may leave the dynamic loader's lock held
        return False
    os.register_at_fork(after_in_child=functools.partial(truthful_cpu_peak, False))
    return True


@functools.cache
def _glibc() -> Any | None:
    """This process's C library when it is glibc (``mallopt``, ``malloc_trim``, ``mallinfo2`` live there), else None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


SOURCES: dict[str, dict[str, str]] = {
    "cuda": {
        "allocated": "torch.cuda.memory_allocated: bytes in live tensors",
        "reserved": "torch.cuda.memory_reserved: bytes held by the caching allocator",
        "peak": "torch.cuda.max_memory_allocated since the last reset",
    },
    "cpu-mallinfo2": {
        "allocated": "glibc mallinfo2 uordblks + hblkhd: C heap bytes in use now (exact now, misses short peaks)",
        "reserved": "VmRSS: resident set size (overstates use after frees)",
        "peak": "VmHWM: peak RSS (exact peak of use only under MALLOC_MMAP_THRESHOLD_=65536)",
    },
    "cpu-rss": {
        "allocated": "resident set size (no mallinfo2 here: overstates use after frees)",
        "reserved": "resident set size",
        "peak": "peak RSS",
    },
}
"""What each field of a :class:`MemorySample` means, by its ``source``."""


@dataclass(frozen=True)
class MemorySample:
    """One reading of a :class:`MemoryProbe`; sizes in bytes.

    Attributes:
        device: the device measured, e.g. ``"cuda:0"`` or ``"cpu"``.
        allocated: memory in use (see :data:`SOURCES` for its exact meaning per ``source``).
        reserved: memory held from the system (CUDA: caching allocator; CPU: resident set size).
        peak: high-water mark since ``peak_since_reset`` (CUDA: of ``allocated``; CPU: of the resident set).
        timestamp_ns: ``time.perf_counter_ns()`` when sampled, the default clock of ``PhaseTimer``.
        source: ``"cuda"``, ``"cpu-mallinfo2"`` or ``"cpu-rss"``; :attr:`notes` spells out each field.
        peak_since_reset: True when ``peak`` covers the time since this probe's last successful
            :meth:`MemoryProbe.reset_peak`; False when it covers the whole process lifetime. Resets are
            process-wide: any other reset in the process (another probe, other code) restarts it too.
    """

    device: str
    allocated: int
    reserved: int
    peak: int
    timestamp_ns: int
    source: str
    peak_since_reset: bool

    @property
    def notes(self) -> dict[str, str]:
        """What ``allocated``, ``reserved`` and ``peak`` mean for this sample's ``source``."""
        return dict(SOURCES.get(self.source, {}))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, for JSON reports."""
        return asdict(self)

    def peak_above(self, before: MemorySample) -> int:
        """Bytes by which this sample's ``peak`` rose above the memory in use at ``before``.

        Compares like with like: on CUDA ``peak`` is a high-water mark of ``allocated``, on CPU one of the resident
        set (``reserved``); subtracting the CPU ``allocated`` instead would add the interpreter and libraries.
        Take ``before`` right after :meth:`MemoryProbe.reset_peak`.

        Raises:
            ValueError: if the two samples come from different devices or sources.
        """
        if (before.device, before.source) != (self.device, self.source):
            raise ValueError(
                f"`peak_above()` compares samples of one probe; got {self.device}/{self.source} and "
                f"{before.device}/{before.source}."
            )
        return self.peak - (before.allocated if self.source == "cuda" else before.reserved)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss``; Linux reports KiB, macOS bytes).

    Unlike ``VmHWM``, ``ru_maxrss`` may include the high-water mark of the process image replaced by ``exec``; it
    is the figure to read in a fresh subprocess started with :data:`TRUTHFUL_CPU_MEMORY_ENV`.
    """
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)


class _MallInfo2(ctypes.Structure):
    # struct mallinfo2 from <malloc.h>, glibc >= 2.33: ten size_t fields in this order.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Any | None:
    """The C function ``mallinfo2``, or None where glibc does not provide it."""
    try:
        fn = _glibc().mallinfo2  # type: ignore[union-attr]
    except AttributeError:  # not glibc, or glibc < 2.33
        return None
    fn.argtypes = []
    fn.restype = _MallInfo2
    return fn


_STATUS_PATH = "/proc/self/status"
_STATM_PATH = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CLEAR_REFS_PATH = "/proc/self/clear_refs"
_HAS_PROC_STATUS = os.path.exists(_STATUS_PATH)
_FORKS = [0]  # forks seen by this process's children: "/proc/self" descriptors opened before one describe the parent


def _forked() -> None:
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _status_kib(buf: bytes, key: bytes) -> int:
    start = buf.index(key) + len(key)
    return int(buf[start : buf.index(b"kB", start)])


class MemoryProbe:
    """Sample memory in use and peak memory on a device; see the module notes for what each figure means.

    Args:
        device: the device to measure; ``None`` means CUDA when available, else CPU.

    Raises:
        ValueError: for a device other than CPU or CUDA.

    Example::

        probe = MemoryProbe("cpu")
        probe.reset_peak()
        before = probe.sample()
        train_one_step()
        step_memory = probe.sample().peak - before.reserved
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = as_device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"`MemoryProbe(device={str(self.device)!r})` is not supported. Expected a CPU or CUDA device."
            )
        self._cuda = self.device.type == "cuda"
        self._peak_since_reset = False
        self._fds: dict[str, int] = {}  # /proc files kept open, and what closes them
        self._finalizers: list[weakref.finalize] = []
        self._forks_seen = -1
        self._mallinfo2 = None if self._cuda else _load_mallinfo2()
        if self._cuda:
            self.source = "cuda"
        elif self._mallinfo2 is not None:
            self.source = "cpu-mallinfo2"
        else:
            self.source = "cpu-rss"
            from lightning_perf._warnings import MeasurementWarning, warn_once

            warn_once(
                "MemoryProbe: glibc `mallinfo2` is not available on this system, so CPU `allocated` falls back to "
                "the resident set size, which overstates memory in use after frees.",
                MeasurementWarning,
            )

    # ---------------------------------------------------------------------------------------------------- CPU

    def _proc(self, path: str, size: int = 8192) -> bytes | None:
        """The bytes of ``path`` (``/proc/self/...``), from a descriptor opened once per process (None off Linux)."""
        if not _HAS_PROC_STATUS:
            return None
        if self._forks_seen != _FORKS[0]:
            # "/proc/self" is resolved at open(): a descriptor inherited through fork would describe the parent.
            self._close_status()
            self._forks_seen = _FORKS[0]
        if (fd := self._fds.get(path)) is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            self._finalizers.append(weakref.finalize(self, os.close, fd))
        return os.pread(fd, size, 0)

    def _close_status(self) -> None:
        for finalizer in self._finalizers:
            # After a fork this closes the child's own copy of the descriptor; the parent's stays open.
            finalizer()
        self._finalizers, self._fds = [], {}

    def _rss_and_peak(self) -> tuple[int, int]:
        try:
            buf = self._proc(_STATUS_PATH)
        except OSError:  # /proc present but not readable (a locked-down sandbox)
            buf = None
        if buf is not None:
            try:
                return _status_kib(buf, b"VmRSS:") * 1024, _status_kib(buf, b"VmHWM:") * 1024
            except ValueError:  # a /proc without these lines: use the portable route below
                pass
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        return rss, max(rss, peak_rss_bytes())

    def _cpu_sample(self, heap: bool = True) -> MemorySample:
        rss, peak = self._rss_and_peak()
        if not heap:
            allocated = -1
        elif self._mallinfo2 is not None:
            info = self._mallinfo2()
            allocated = int(info.uordblks + info.hblkhd)
        else:
            allocated = rss
        return MemorySample(
            device=str(self.device),
            allocated=allocated,
            reserved=rss,
            peak=peak,
            timestamp_ns=time.perf_counter_ns(),
            source=self.source,
            peak_since_reset=self._peak_since_reset,
        )

    # --------------------------------------------------------------------------------------------------- public

    def sample(self, heap: bool = True) -> MemorySample:
        """Read the current figures (a few microseconds on CPU; no device synchronization on CUDA).

        Args:
            heap: on CPU, read ``allocated`` (a glibc heap walk: tens of microseconds in a training process, more on a
                fragmented heap); ``False``: ``allocated`` is -1 (not read), the rest from one ``/proc`` read.
        """
        if not self._cuda:
            return self._cpu_sample(heap)
        return MemorySample(
            device=str(self.device),
            allocated=int(torch.cuda.memory_allocated(self.device)),
            reserved=int(torch.cuda.memory_reserved(self.device)),
            peak=int(torch.cuda.max_memory_allocated(self.device)),
            timestamp_ns=time.perf_counter_ns(),
            source=self.source,
            peak_since_reset=self._peak_since_reset,
        )

    def allocated(self) -> int:
        """Only the ``allocated`` figure of :meth:`sample`: the cheap reading for a series taken every step.

        On CPU one ``mallinfo2`` call (about a microsecond, no file read); on CUDA ``torch.cuda.memory_allocated``
        (no synchronization). It allocates nothing on the C heap, so a series of these readings does not measure
        itself.
        """
        if self._cuda:
            return int(torch.cuda.memory_allocated(self.device))
        if self._mallinfo2 is not None:
            info = self._mallinfo2()
            return int(info.uordblks + info.hblkhd)
        return self._rss_and_peak()[0]

    def resident(self) -> int:
        """The resident set in bytes from one ``pread`` of ``/proc/self/statm`` (a kernel counter, no walk of the heap
        or the page tables): the cheap signal a leak screen reads every step on CPU. On CUDA, ``allocated``."""
        if self._cuda:
            return int(torch.cuda.memory_allocated(self.device))
        try:
            buf = self._proc(_STATM_PATH, 96)
        except OSError:
            buf = None
        if buf is None:
            return self._rss_and_peak()[0]
        start = buf.index(b" ") + 1
        return int(buf[start : buf.index(b" ", start)]) * _PAGE

    def reset_peak(self, level: MemorySample | None = None) -> bool:
        """Restart the peak from the current level (process-wide). Returns whether the reset was possible.

        On CPU this writes ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+; a hundred microseconds or more in a large
        process: the kernel walks its page tables). Where that is not permitted the peak stays the process lifetime's,
        later samples say so (``peak_since_reset=False``) and a :class:`~lightning_perf.MeasurementWarning` is
        emitted once.

        Args:
            level: a sample of this probe taken just now: on CPU, when its ``peak`` is its ``reserved`` (the resident
                set is at its high-water mark, common under glibc, which keeps freed memory), the peak from now on is
                already the peak since now, so nothing is written and the reset counts as done.
        """
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._peak_since_reset = True
            return True
        if level is not None and level.source == self.source and level.peak <= level.reserved:
            self._peak_since_reset = True
            return True
        try:
            with open(_CLEAR_REFS_PATH, "w") as f:
                f.write("5")
        except OSError as err:
            from lightning_perf._warnings import MeasurementWarning, warn_once

            warn_once(
                f"MemoryProbe: cannot reset the CPU peak ({_CLEAR_REFS_PATH}: {err.strerror or err}); "
                "`peak` is the peak resident set size of the whole process lifetime.",
                MeasurementWarning,
            )
            self._peak_since_reset = False
            return False
        self._peak_since_reset = True
        return True

    def close(self) -> None:
        """Close the descriptors kept open on /proc/self/status and statm (also done when the probe is collected)."""
        self._close_status()

    def __getstate__(self) -> dict[str, Any]:
        # A descriptor and a ctypes function do not survive pickling: the copy reopens and reloads them.
        state = self.__dict__.copy()
        # The peak reset happened in this process, not in the one that unpickles.
        state.update(_fds={}, _forks_seen=-1, _finalizers=[], _mallinfo2=None, _peak_since_reset=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.source == "cpu-mallinfo2":
            self._mallinfo2 = _load_mallinfo2()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, source={self.source!r})"
