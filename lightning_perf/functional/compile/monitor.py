"""Count what torch's compiler did in a window: compile time, graphs, graph breaks, recompilations.

:class:`CompileMonitor` reads process-global counters, so it reports everything compiled in the window. Also
importable from :mod:`lightning_perf.functional.compile.regions`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

__all__ = ["CompileMonitor", "CompileStats"]


@dataclass
class CompileStats:
    """What torch's compiler did in a window (process-wide).

    Attributes:
        compile_time_s: seconds spent compiling: tracing, backend compilation (also of a lazily compiled backward)
            and CUDA graph recording.
        compilations: frames compiled, recompilations included.
        recompiles: compilations of a frame that had been compiled before (guards failed: new shapes, dtypes,
            ``training`` flag, grad mode...).
        unique_graphs: graphs handed to the backend (a graph break splits a frame into several).
        graph_breaks: graph breaks, each a return to Python inside a compiled frame.
        graph_break_reasons: the reasons, with how often each occurred.
        cudagraph_recordings: CUDA graphs recorded (``mode="reduce-overhead"`` on CUDA).
    """

    compile_time_s: float = 0.0
    compilations: int = 0
    recompiles: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    graph_break_reasons: dict[str, int] = field(default_factory=dict)
    cudagraph_recordings: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "graph_break_reasons": dict(self.graph_break_reasons)}


def _counters() -> dict[str, Counter[str]]:
    from torch._dynamo.utils import counters

    return counters  # type: ignore[return-value]


class CompileMonitor:
    """Count compile time, graphs, graph breaks and recompilations between :meth:`start` and :meth:`stop`.

    Graphs and graph breaks are deltas of ``torch._dynamo.utils.counters``; compile time, compilations,
    recompilations and CUDA graph recordings come from torch's compile start/end callbacks
    (``torch._dynamo.callback_handler``), which ``torch._dynamo.reset()`` clears: a reset inside the window loses
    what follows it.

    Example::

        monitor = CompileMonitor()
        monitor.start()
        model(x)
        stats = monitor.stop()
        print(stats.compile_time_s, stats.recompiles)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._running = False
        self._baseline: dict[str, Counter[str]] = {}
        self._began: float | None = None
        self._compile_ids: set[str] = set()
        self._stats = CompileStats()

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Open a new window (a running one is restarted)."""
        self.stop()
        self._stats = CompileStats()
        self._compile_ids = set()
        self._baseline = {key: Counter(_counters()[key]) for key in ("stats", "graph_break")}
        handler = torch._dynamo.callback_handler
        handler.register_start_callback(self._on_compile_start)
        handler.register_end_callback(self._on_compile_end)
        self._running = True

    def stop(self) -> CompileStats:
        """Close the window and return its figures (the last window's again when none is open)."""
        if self._running:
            self._stats = self.stats
            self._running = False
            handler = torch._dynamo.callback_handler
            for remove, callback in (
                (handler.remove_start_callback, self._on_compile_start),
                (handler.remove_end_callback, self._on_compile_end),
            ):
                with contextlib.suppress(ValueError):  # torch._dynamo.reset() cleared it
                    remove(callback)
        return replace(self._stats, graph_break_reasons=dict(self._stats.graph_break_reasons))

    @property
    def stats(self) -> CompileStats:
        """The figures so far (a copy); the window stays open."""
        if not self._running:
            return replace(self._stats, graph_break_reasons=dict(self._stats.graph_break_reasons))
        counters = _counters()
        stats = self._baseline.get("stats", Counter())
        breaks = Counter(counters["graph_break"])
        breaks.subtract(self._baseline.get("graph_break", Counter()))
        reasons: Counter[str] = Counter()
        for reason, count in breaks.items():
            if count > 0:  # torch's reasons run over several lines; the first one names the cause
                reasons[reason.strip().splitlines()[0] if reason.strip() else reason] += count
        return CompileStats(
            compile_time_s=self._stats.compile_time_s,
            compilations=self._stats.compilations,
            recompiles=self._stats.recompiles,
            unique_graphs=max(0, counters["stats"]["unique_graphs"] - stats["unique_graphs"]),
            graph_breaks=sum(reasons.values()),
            graph_break_reasons=dict(reasons),
            cudagraph_recordings=self._stats.cudagraph_recordings,
        )

    def _on_compile_start(self, args: Any) -> None:
        self._began = self._clock()

    def _on_compile_end(self, args: Any) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if self._began is not None:
            self._stats.compile_time_s += self._clock() - self._began
            self._began = None
        trigger = getattr(args, "callback_trigger", None)
        compile_id = str(getattr(args, "compile_id", ""))
        if trigger is CallbackTrigger.CUDAGRAPH_RECORDING:
            self._stats.cudagraph_recordings += 1
        elif trigger is CallbackTrigger.DYNAMO and compile_id not in self._compile_ids:
            self._compile_ids.add(compile_id)
            self._stats.compilations += 1
            # "frame/attempt-of-this-frame", or "!autograd/frame/attempt": a later attempt is a recompilation.
            tail = compile_id.rsplit("/", 1)[-1]
            if tail.isdigit() and int(tail) > 0:
                self._stats.recompiles += 1
