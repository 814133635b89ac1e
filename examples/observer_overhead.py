"""What observing costs, measured from outside: this library's observers against no observer and Lightning's profilers.

The same short fit runs once per configuration and step size, several rounds, interleaved in one process (the order
rotated every round so machine drift spreads evenly; every run gets a fresh model from the same seed). A callback
placed before all others times each step from one ``on_train_batch_end`` to the next (data loading included); the
first ``--warmup`` steps are dropped. Printed per step size and configuration:

- the steady step time and its ratio to no observer, paired within each round, with a 95% interval
  (:func:`~lightning_perf.profiling.intervals.paired_ratio`);
- beside it, what this library's observers report about themselves (``report["overhead"]["share_of_step"]``: their
  hooks' calls counted, one step in 17 timed end to end, Lightning's dispatch per call timed once at fit start): the
  outside figure minus 1 and the self-report should agree;
- the end of fit: the time from the last step's end until ``fit`` returns, minus the same for no observer (the
  observers' reports, a profiler's summary).

Configurations: ``none``; ``bottleneck`` (``BottleneckCallback()``); ``memory`` (``MemoryProfilerCallback()``);
``simple`` (Lightning's ``SimpleProfiler``); ``advanced`` (Lightning's ``AdvancedProfiler``, with ``--advanced``).
Step sizes: ``short`` (convnet tiny, the demos' shortest steps: a few milliseconds on one thread of a quiet machine)
and ``long`` (the same net 5x wider, several times longer); the table shows the step time measured. Run it on a quiet
machine: on a busy one the intervals widen and say so. Usage::

    python examples/observer_overhead.py --quick                 # a smoke run, well under a minute
    python examples/observer_overhead.py --rounds 7 --advanced --output overhead.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import AdvancedProfiler, SimpleProfiler

from lightning_perf.callbacks import BottleneckCallback, MemoryProfilerCallback
from lightning_perf.demos import make_workload
from lightning_perf.profiling import format_seconds, write_json
from lightning_perf.profiling.intervals import paired_ratio
from lightning_perf.profiling.report import text_table

SIZES: dict[str, dict[str, Any]] = {"short": {}, "long": {"width": 40}}  # convnet "tiny" model overrides


class StepClock(pl.Callback):
    """Ends of training steps (wall clock, a whole step with its data loading)."""

    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter_ns())

    def steps_s(self, warmup: int) -> list[float]:
        return [(b - a) / 1e9 for a, b in zip(self.ends, self.ends[1:])][warmup:]


def configurations(out: Path, advanced: bool) -> dict[str, Callable[[], dict[str, Any]]]:
    """Name -> the extra Trainer arguments (fresh objects for every run); observers at their defaults."""
    configs: dict[str, Callable[[], dict[str, Any]]] = {
        "none": dict,
        "bottleneck": lambda: {"callbacks": [BottleneckCallback(dirpath=str(out))]},
        "memory": lambda: {"callbacks": [MemoryProfilerCallback(dirpath=str(out))]},
        "simple": lambda: {"profiler": SimpleProfiler(dirpath=out, filename="simple")},
    }
    if advanced:
        configs["advanced"] = lambda: {"profiler": AdvancedProfiler(dirpath=out, filename="advanced")}
    return configs


def run_once(args: argparse.Namespace, size: str, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """One fit: its steady step times, the observer's self-reported share, and the time after the last step."""
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0, **SIZES[size])
    clock = StepClock()
    observers = extra.pop("callbacks", [])
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=[clock, *observers],
        logger=False,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **extra,
    )
    trainer.fit(model, datamodule=data)
    tail_s = (time.perf_counter_ns() - clock.ends[-1]) / 1e9
    own = [cb.report["overhead"]["share_of_step"] for cb in observers if getattr(cb, "report", None)]
    return {"steps": clock.steps_s(args.warmup), "own": own[0] if own else None, "tail_s": tail_s}


def measure(args: argparse.Namespace, size: str, configs: dict[str, Callable[[], dict[str, Any]]], out: Path) -> Any:
    """Every configuration once per round, the order rotated each round."""
    names = list(configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(args.rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(run_once(args, size, configs[name](), out))
        medians = ", ".join(f"{n} {format_seconds(statistics.median(runs[n][-1]['steps']))}" for n in names)
        print(f"{size} round {index + 1}/{args.rounds}: {medians}", flush=True)
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[list[object]], dict[str, Any]]:
    """Table rows and JSON results: step, ratio to none with its interval, self-report, end-of-fit time."""
    base = runs["none"]
    rows: list[list[object]] = []
    results: dict[str, Any] = {}
    for name, mine in runs.items():
        estimate = paired_ratio([r["steps"] for r in mine], [r["steps"] for r in base], above_one="slower",
                                below_one="faster")  # fmt: skip
        own = [r["own"] for r in mine if r["own"] is not None]
        tails = [r["tail_s"] - b["tail_s"] for r, b in zip(mine, base)]
        step = statistics.median(statistics.median(r["steps"]) for r in mine)
        rows.append([
            name,
            format_seconds(step),
            "-" if name == "none" else estimate.format(3),
            "-" if name == "none" else f"{100 * (estimate.ratio - 1):+.2f}%",
            f"{100 * statistics.median(own):.2f}%" if own else "-",
            "-" if name == "none" else format_seconds(statistics.median(tails)),
        ])  # fmt: skip
        results[name] = {
            "step_median_s": step,
            **estimate.to_dict("ratio_to_none"),
            "self_reported_share": own or None,
            "end_of_fit_extra_s": tails,
        }
    return rows, results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30, help="leading steps left out of each run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="short,long", help=f"comma-separated, from {list(SIZES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the shortest steps)")
    parser.add_argument("--advanced", action="store_true", help="also Lightning's AdvancedProfiler (slow)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 40 steps, short steps only")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.sizes = 40, 10, 2, "short"
    sizes = args.sizes.split(",")
    if args.steps - args.warmup < 10 or args.rounds < 2 or any(s not in SIZES for s in sizes):
        parser.error(f"need --steps >= --warmup + 10, --rounds >= 2 and sizes from {list(SIZES)}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's and the profilers' notes would drown the table
    out = Path(tempfile.mkdtemp(prefix="observer-overhead-"))
    configs = configurations(out, args.advanced)
    report: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(args).items()}, "results": {}}
    for size in sizes:
        rows, report["results"][size] = summarize(measure(args, size, configs, out))
        columns = ["configuration", "step", "ratio to none [95%]", "outside cost", "self-report", "end of fit +"]
        print(text_table(columns, rows, title=f"{size} steps, {args.rounds} rounds of {args.steps}", width=100))
    if args.output is not None:
        write_json(report, args.output)
    return report


if __name__ == "__main__":
    main()
