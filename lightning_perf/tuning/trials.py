"""How the tuner runs a trial and what it checks before one: isolation, in-process runs, memory, search lists."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from lightning_perf.optimizations import tuner_search_list

__all__ = ["check_search_lists", "memory_problem", "resolve_isolation", "run_in_process"]


def check_search_lists(precisions: Any, optimizations: Any, stage: str = "fit") -> tuple[str, ...]:
    """Validate the tuner's ``precisions`` (those searched for ``stage``) and ``optimizations``; returns the
    optimizations to search.

    Raises:
        TypeError: for something that is not a list of names.
        ValueError: naming an unknown name, or an optimization that sets the precision.
    """
    from lightning_perf.benchmark.configs import get_config
    from lightning_perf.tuning.inference import precision_names

    searchable = precision_names(stage)
    lists = {"precisions": f"names from {', '.join(searchable)}", "optimizations": "bench configuration names"}
    for name, value in (("precisions", precisions), ("optimizations", optimizations)):
        if value is not None and (isinstance(value, str) or not isinstance(value, Sequence)):
            raise TypeError(f"`AutoTuner({name}={value!r})` is not valid. Expected a list of {lists[name]}, or None.")
    if precisions is not None:
        bad = [p for p in precisions if p not in searchable]
        if bad:
            known = bad[0] in precision_names("predict") + precision_names("fit")
            what = f"is not searched for stage={stage!r}" if known else "is unknown"
            raise ValueError(
                f"`AutoTuner(precisions={list(precisions)!r})` is not valid: {bad[0]!r} {what}. Expected names from "
                f"{', '.join(searchable)}."
            )
    if optimizations is None:
        optimizations = tuner_search_list("optimization")
    for name in optimizations:
        try:
            config = get_config(name)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"`AutoTuner(optimizations={list(optimizations)!r})` is not valid: {exc}") from None
        if "precision" in config.trainer_kwargs:
            raise ValueError(
                f"`AutoTuner(optimizations={list(optimizations)!r})` is not valid: {name!r} sets the precision. "
                "Expected it in `precisions` instead."
            )
    return tuple(optimizations)


def resolve_isolation(isolation: str, source: Any) -> str:
    """``process`` or ``in-process`` for ``isolation`` ``auto``: in-process only for classes a fresh process cannot
    import (defined in a notebook or REPL)."""
    from lightning_perf.benchmark.sources import ObjectSource

    if isolation != "auto":
        return isolation
    if isinstance(source, ObjectSource):
        main = sys.modules.get("__main__")
        interactive = main is not None and getattr(main, "__file__", None) is None
        if interactive and source.defined_in_main:
            return "in-process"
    return "process"


def run_in_process(spec: Any, build: Callable[..., Any]) -> Any:
    """Run one trial in this process, then put back the global torch state it may have changed."""
    import traceback

    import torch

    from lightning_perf.benchmark.worker import RunResult, run
    from lightning_perf.functional import backend_flags

    flags = backend_flags.capture()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    rng = torch.random.get_rng_state()
    try:
        return run(spec, build=build)
    except Exception as exc:
        return RunResult(
            spec=asdict(spec), ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
        )
    finally:
        backend_flags.restore(flags)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.random.set_rng_state(rng)
        torch._dynamo.reset()


def memory_problem(device: str, result: Any, own: int, size: int) -> str | None:
    """Why batch ``size`` would not fit in CPU memory, extrapolated from the measured step memory; None if fine."""
    if device.startswith("cuda") or result.step_memory_bytes is None or result.peak_memory_bytes is None:
        return None  # CUDA: the trial itself finds out (out of memory is caught and reported)
    import psutil

    from lightning_perf.profiling import format_bytes

    batch = result.batch_size or own
    needed = result.peak_memory_bytes + result.step_memory_bytes * (size / batch - 1)
    available = psutil.virtual_memory().available
    if needed > 0.8 * available:
        return f"would need about {format_bytes(needed)}; {format_bytes(available)} is available"
    return None
