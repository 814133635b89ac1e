"""What observing costs: steady-state step time with no observer, this library's observers, and Lightning's profilers.

Runs the same short fit once per configuration, several rounds, in one process, with the order rotated every round
so machine drift spreads evenly; every run gets a fresh model from the same seed. A step is timed from one
``on_train_batch_end`` to the next by a callback placed before all others (data loading included), the first
``--warmup`` steps are dropped, and each run contributes its median. Reported per configuration: the median step
over rounds and its ratio to ``none``, paired within a round (median and range over rounds), and for this library's
observers the cost they measured themselves (their hooks' time over the median step: unlike the ratio, it hardly
moves with other load on the machine). Configurations:

- ``none``: no observer;
- ``bottleneck``: :class:`~lightning_perf.callbacks.BottleneckCallback` (defaults: host-sync check on 2 warm-up
  steps, live logging off without a logger);
- ``memory``: :class:`~lightning_perf.callbacks.MemoryProfilerCallback` at its default interval (every 10 steps);
- ``memory-every-step``: the same, sampling every step;
- ``simple``: Lightning's ``SimpleProfiler``;
- ``pytorch``: Lightning's ``PyTorchProfiler`` with its defaults.

Run it on a quiet machine: on a shared one the spread between rounds says how far to trust the ratios. Usage::

    python examples/observer_overhead.py                          # convnet tiny on CPU, about a minute
    python examples/observer_overhead.py --steps 200 --rounds 5 --output overhead.json
    python examples/observer_overhead.py --preset default --accelerator gpu
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
from lightning.pytorch.profilers import PyTorchProfiler, SimpleProfiler

from lightning_perf.callbacks import BottleneckCallback, MemoryProfilerCallback
from lightning_perf.demos import make_workload
from lightning_perf.profiling import format_seconds, print_table, write_json


class StepClock(pl.Callback):
    """Wall time between consecutive ends of training steps (a whole step, data loading included)."""

    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter_ns())

    def steps_s(self) -> list[float]:
        return [(b - a) / 1e9 for a, b in zip(self.ends, self.ends[1:])]


def configurations(out: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """Name -> a function giving the extra Trainer arguments (fresh objects for every run)."""
    return {
        "none": dict,
        "bottleneck": lambda: {"callbacks": [BottleneckCallback(verbose=False, dirpath=str(out))]},
        "memory": lambda: {"callbacks": [MemoryProfilerCallback(verbose=False, dirpath=str(out))]},
        "memory-every-step": lambda: {
            "callbacks": [MemoryProfilerCallback(every_n_steps=1, verbose=False, dirpath=str(out))]
        },
        "simple": lambda: {"profiler": SimpleProfiler(dirpath=out, filename="simple")},
        "pytorch": lambda: {"profiler": PyTorchProfiler(dirpath=out, filename="pytorch")},
    }


def run_once(args: argparse.Namespace, extra: dict[str, Any], out: Path) -> tuple[float, float | None]:
    """Median steady-state step time of one fit, and the observer's own measure of its cost (a share of a step)."""
    pl.seed_everything(0, verbose=False)
    model, data = make_workload(args.workload, args.preset, seed=0)
    clock = StepClock()
    observers = extra.pop("callbacks", [])
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator=args.accelerator,
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
    own = [cb.report["overhead"]["share_of_step"] for cb in observers if getattr(cb, "report", None)]
    return statistics.median(clock.steps_s()[args.warmup :]), (own[0] if own else None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="convnet")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=15, help="leading steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--configs", default=None, help="comma-separated subset of the configurations")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps - args.warmup < 10:
        parser.error("--steps must exceed --warmup by at least 10")

    out = Path(tempfile.mkdtemp(prefix="observer-overhead-"))
    configs = configurations(out)
    names = list(configs) if args.configs is None else args.configs.split(",")
    unknown = [n for n in names if n not in configs]
    if unknown or "none" not in names:
        parser.error(f"--configs needs 'none' and names from {list(configs)}; unknown: {unknown}")
    medians: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    own: dict[str, list[float]] = {name: [] for name in names}
    warnings.filterwarnings("ignore")  # the profilers' and Lightning's own notes would drown the table
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        this_round = {name: run_once(args, configs[name](), out) for name in names[shift:] + names[:shift]}
        for name, (median, own_share) in this_round.items():
            medians[name].append(median)
            ratios[name].append(median / this_round["none"][0])
            if own_share is not None:
                own[name].append(own_share)
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{n} {format_seconds(s)}" for n, (s, _) in this_round.items())
        )

    rows = []
    results: dict[str, Any] = {}
    for name in names:
        ratio = statistics.median(ratios[name])
        rows.append(
            [
                name,
                format_seconds(statistics.median(medians[name])),
                f"{ratio:.3f}",
                f"{min(ratios[name]):.3f}-{max(ratios[name]):.3f}",
                f"{100 * statistics.median(own[name]):.2f}%" if own[name] else "",
            ]
        )
        results[name] = {
            "step_median_s": medians[name],
            "ratio_to_none": ratios[name],
            "ratio_median": ratio,
            "own_cost_share": own[name] or None,
        }
    title = f"{args.workload}/{args.preset} on {args.accelerator}: {args.rounds} rounds of {args.steps} steps"
    print_table(["configuration", "median step", "ratio to none", "ratio range", "own cost"], rows, title=title)
    report = {"arguments": {k: str(v) for k, v in vars(args).items()}, "results": results}
    if args.output is not None:
        write_json(report, args.output)
    return report


if __name__ == "__main__":
    main()
