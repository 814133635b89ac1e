"""What a measurement was taken on and how it was started: the ``machine`` and ``run`` objects of a results file.

:func:`describe_machine` names the CPU (model, cores, the threads torch uses, the instruction-set flags that decide
which kernels exist: AVX2, AVX-512, VNNI, bf16, AMX), the GPU and its driver, and the versions of lightning_perf,
torch and lightning. :func:`run_metadata` adds the git commit of the working directory's repository (and whether it
had uncommitted changes), the command line and the start time; :func:`finish_run` stamps the end. Everything degrades
to ``None`` where the platform does not say (no ``/proc/cpuinfo``, no git, no GPU): describing the machine never
fails a run.
"""

from __future__ import annotations

import functools
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_FLAGS",
    "cpu_flags",
    "cpu_key",
    "decision_key",
    "describe_machine",
    "finish_run",
    "fixed_environment",
    "git_state",
    "has_cpu_bf16_instructions",
    "installed_version",
    "run_metadata",
    "usable_cpu_count",
]

CPU_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
                              "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")  # fmt: skip
"""The x86 flags that decide which oneDNN kernels a CPU gets: fp32 vector width, int8 dot products (VNNI, AMX-INT8),
bf16 and fp16 math."""


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool] | None:
    """Which of :data:`CPU_FLAGS` the CPU has, from ``/proc/cpuinfo`` (or the text given); ``None`` where unknown.

    Example::

        >>> cpu_flags("flags : fpu avx2 fma")["avx2"]
        True
    """
    text = _read_cpuinfo() if cpuinfo is None else cpuinfo
    if not text:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            present = set(value.split())
            return {flag: flag in present for flag in CPU_FLAGS}
    return None


def has_cpu_bf16_instructions(flags: dict[str, bool] | None) -> bool | None:
    """Whether the CPU computes in bf16 natively (avx512_bf16 or AMX); ``None`` when the flags are unknown."""
    if flags is None:
        return None
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def _cpu_model(cpuinfo: str | None) -> str | None:
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Hardware", "cpu model"):
            return value.strip() or None
    return platform.processor() or None


def cpu_key(flags: dict[str, bool] | None = None) -> str:
    """``cpu=<model>; flags=<the CPU_FLAGS it has>``: how a cache key names the CPU (``flags``: read when ``None``)."""
    cpuinfo = _read_cpuinfo()
    flags = cpu_flags(cpuinfo) if flags is None and cpuinfo else flags
    present = ",".join(sorted(name for name, on in flags.items() if on)) if flags is not None else "unknown"
    return f"cpu={_cpu_model(cpuinfo) or 'unknown'}; flags={present or 'none'}"


def decision_key(
    device: Any = "cpu", packages: Sequence[str] = (), *, flags: dict[str, bool] | None = None, **decides: object
) -> str:
    """The key of a measured decision (:class:`lightning_perf._io.DecisionCache`): the machine (a CUDA device's model
    and compute capability, else :func:`cpu_key` with ``flags``), what else decides it (``decides``, in order), and
    the versions of torch and of ``packages``. Any change among these measures anew."""
    import torch

    from lightning_perf._device import cuda_capability

    capability = cuda_capability(device)
    head = f"gpu={torch.cuda.get_device_name(device)} (sm {capability[0]}{capability[1]})" if capability else None
    versions = [f"torch={torch.__version__}"] + [f"{name}={installed_version(name) or 'none'}" for name in packages]
    return "; ".join([head or cpu_key(flags), *(f"{k}={v}" for k, v in decides.items()), *versions])


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed, or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def fixed_environment() -> dict[str, Any]:
    """What cannot change within a process (versions, the platform, the CPU model, the libc), read once: it costs tens
    of milliseconds (package metadata, the libc's version from the interpreter's binary)."""
    import torch

    from lightning_perf import __version__

    return {
        "lightning_perf": __version__,
        "torch": torch.__version__,
        "lightning": installed_version("lightning", "pytorch-lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(_read_cpuinfo()),
        "cpu_count": os.cpu_count(),
        "libc": " ".join(part for part in platform.libc_ver() if part) or None,
        "cuda": torch.version.cuda,
    }


def _gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_count": 0, "gpu_driver": None, "gpu_bf16": None}
    driver = None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        driver = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "gpu_driver": driver,
        "gpu_bf16": bool(torch.cuda.is_bf16_supported()),
    }


def usable_cpu_count() -> int:
    """The logical CPUs this process may run on (its affinity; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def describe_machine() -> dict[str, Any]:
    """The hardware and software of this machine, for the ``machine`` key of a results file.

    Returns:
        :func:`fixed_environment` (versions, ``platform``, ``machine``, ``cpu`` model, ``cpu_count``, ``libc``,
        ``cuda``), ``cpu_count_usable`` (this process's affinity), ``torch_threads``, ``cpu_flags`` (:data:`CPU_FLAGS`
        -> bool, or ``None`` where unknown), ``cpu_bf16_instructions``, ``gpu``, ``gpu_count``, ``gpu_driver`` and
        ``gpu_bf16``.
    """
    import torch

    flags = cpu_flags()
    return {
        **fixed_environment(),
        "cpu_count_usable": usable_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "cpu_bf16_instructions": has_cpu_bf16_instructions(flags),
        **_gpu(),
    }


def git_state(cwd: str | Path | None = None) -> dict[str, Any]:
    """The commit and dirty flag of the git repository containing ``cwd`` (default: the working directory).

    Returns:
        ``{"git_commit": str | None, "git_dirty": bool | None}``; both ``None`` outside a repository or without git.
    """

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit.strip(), "git_dirty": None if status is None else bool(status.strip())}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_metadata(argv: Sequence[str] | None = None, cwd: str | Path | None = None) -> dict[str, Any]:
    """How this run was started, for the ``run`` key of a results file.

    Args:
        argv: the command line (default: ``["lightning-perf"]``); written joined as a shell would read it.
        cwd: the directory whose repository's commit is recorded (default: the working directory).

    Returns:
        ``command``, ``argv``, ``cwd``, ``git_commit``, ``git_dirty``, ``start_time`` (UTC, ISO 8601) and
        ``end_time`` (``None`` until :func:`finish_run`).
    """
    args = list(argv) if argv is not None else ["lightning-perf"]
    where = Path(cwd) if cwd is not None else Path.cwd()
    return {
        "command": shlex.join(args),
        "argv": args,
        "cwd": str(where),
        **git_state(where),
        "start_time": _now(),
        "end_time": None,
    }


def finish_run(run: dict[str, Any]) -> dict[str, Any]:
    """Stamp ``end_time`` on a :func:`run_metadata` dict (in place) and return it."""
    run["end_time"] = _now()
    return run
