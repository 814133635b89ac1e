"""A shorter cold start for regional ``torch.compile`` on a CPU.

Entry point: :func:`cpu_startup` (``cpp_wrapper`` and the vector-ISA probe on background threads), applied only with the
``inductor`` backend and no ``mode`` or ``options``. Where a CPU cold start goes and why each measure lowers it:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_perf.profiling.machine import usable_cpu_count

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
    """``compile_kwargs`` (from :func:`~lightning_perf.functional.compile.regions.compile_options`) for a quicker cold
    start.

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

    Inductor runs the probe (for each vector ISA the CPU reports: build a small kernel, load it in a child process)
    the first time it generates CPU code, in the middle of the first compiled step; run ahead of it, the probe
    overlaps with tracing, and the ISAs are checked side by side (:func:`_probe`). Each answer is cached by torch, so
    the compile finds them done (or waits on the same file lock while one finishes).
    """
    global _probe_started
    with _probe_lock:
        if _probe_started:
            return False
        _probe_started = True
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:  # pragma: no cover - a later torch that moved it
        return False
    candidates = _isa_candidates(cpu_vec_isa)
    threading.Thread(
        target=_probe, args=(cpu_vec_isa.pick_vec_isa, candidates), name="inductor-cpu-isa-probe", daemon=True
    ).start()
    return True


def _isa_candidates(cpu_vec_isa: Any) -> list[Any]:
    """The vector ISAs inductor will check on this CPU: those of its list whose CPU flags the CPU reports (torch's
    own filter in ``valid_vec_isa_list``, without the checks); none off x86 or where torch's names moved."""
    try:
        reported = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in reported for f in str(isa).split())]
    except Exception:  # pragma: no cover - a later torch that renamed them: the plain probe only
        return []


def _probe(pick_vec_isa: Any, candidates: Sequence[Any] = ()) -> None:
    """Check ``candidates`` side by side (``bool(isa)`` builds and loads each ISA's test kernel; torch caches the
    answer per ISA), then let torch pick one (``pick_vec_isa``) from those answers."""
    workers = min(len(candidates), usable_cpu_count())
    if workers > 1:  # daemon threads (a pool's would hold the interpreter's exit until their builds end)
        todo, lock = list(candidates), threading.Lock()

        def check() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    isa = todo.pop(0)
                with contextlib.suppress(Exception):  # a failed check is repeated, and reported, by the compile
                    bool(isa)

        threads = [
            threading.Thread(target=check, name=f"inductor-cpu-isa-check-{i}", daemon=True) for i in range(workers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    with contextlib.suppress(Exception):  # a failed probe is repeated, and reported, by the compile itself
        pick_vec_isa()
