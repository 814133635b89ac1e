"""A shorter cold start for regional ``torch.compile`` on a CPU.

On a CPU most of a regional compile's cold start is not tracing (each block class is traced once, its copies reuse
the code) but building C++: inductor's default Python wrapper builds one shared library per fused kernel, each a
``g++`` run of about a second of fixed cost (loading the precompiled ``cpp_prefix.h``, linking against libtorch) plus
the kernel itself, and one block's forward and backward hold 15 or so kernels. The whole model builds hardly more,
since the blocks' kernels are identical and inductor builds each distinct source once: the builds set a floor under
the regional cold start that regions alone do not lower.

Two things lower it, and :func:`cpu_startup` applies them to a regional compile on a CPU:

- ``cpp_wrapper``: inductor writes each graph (one block's forward, its backward) with its kernels as one C++ file,
  so a block costs two ``g++`` runs instead of one per kernel. The wrapper then runs in C++, not Python, which does
  not slow the steady state. It is not used for a whole model: one file holding every block's calls compiles
  slower than the per-kernel libraries, several of which run in parallel.
- the CPU vector-ISA probe (a ``g++`` build and a child process loading it, seconds, once per inductor cache folder)
  starts on a background thread when the modules are compiled, so it overlaps with tracing instead of following it.

Each applies only with the ``inductor`` backend, no ``mode`` and no ``options`` given: a user's own ``options``
(``{"cpp_wrapper": False}`` to opt out) are left as they are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["CPU_REGIONAL_OPTIONS", "cpu_startup", "on_cpu", "startup_options", "warm_cpu_probe"]

#: Inductor options a regional compile on a CPU gets when none are given.
CPU_REGIONAL_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}

_probe_lock = threading.Lock()
_probe_started = False


def on_cpu(modules: Iterable[nn.Module]) -> bool:
    """Whether every parameter and buffer of ``modules`` is on the CPU (and there is at least one)."""
    devices = {t.device.type for module in modules for t in (*module.parameters(), *module.buffers())}
    return devices == {"cpu"}


def startup_options(
    model: nn.Module, modules: Sequence[tuple[str, nn.Module]], compile_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """:func:`cpu_startup` for ``modules`` (``(name, module)`` pairs) of ``model`` about to be compiled.

    The compile is regional when ``model`` itself is not among ``modules``, and on a CPU when all their parameters
    and buffers are.
    """
    regional = bool(modules) and all(module is not model for _, module in modules)
    return cpu_startup(compile_kwargs, regional=regional, cpu=on_cpu(module for _, module in modules))


def cpu_startup(compile_kwargs: Mapping[str, Any], *, regional: bool, cpu: bool) -> dict[str, Any]:
    """``compile_kwargs`` (from :func:`~lightning_perf.functional.compile.compile_options`) for a quicker cold start.

    For a regional compile (``regional``: repeated blocks rather than a whole model's forward) on a CPU (``cpu``)
    with the ``inductor`` backend and neither ``mode`` nor ``options`` given, the options become
    :data:`CPU_REGIONAL_OPTIONS`; with the ``inductor`` backend on a CPU the vector-ISA probe starts in the
    background (:func:`warm_cpu_probe`). Anything else is returned unchanged.
    """
    kwargs = dict(compile_kwargs)
    if not cpu or kwargs.get("backend") != "inductor":
        return kwargs
    warm_cpu_probe()
    if regional and kwargs.get("mode") is None and kwargs.get("options") is None:
        kwargs["options"] = dict(CPU_REGIONAL_OPTIONS)
    return kwargs


def warm_cpu_probe() -> bool:
    """Start inductor's CPU vector-ISA probe on a daemon thread, once per process; whether it was started now.

    Inductor runs the probe (build a small AVX kernel, load it in a child process) the first time it generates CPU
    code, in the middle of the first compiled step; run ahead of it, the probe overlaps with tracing. Its result is
    cached by torch, so the compile finds it done (or waits on the same file lock while it finishes).
    """
    global _probe_started
    with _probe_lock:
        if _probe_started:
            return False
        _probe_started = True
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:  # pragma: no cover - a later torch that moved it
        return False
    threading.Thread(target=_probe, args=(pick_vec_isa,), name="inductor-cpu-isa-probe", daemon=True).start()
    return True


def _probe(pick_vec_isa: Any) -> None:
    with contextlib.suppress(Exception):  # a failed probe is repeated, and reported, by the compile itself
        pick_vec_isa()
