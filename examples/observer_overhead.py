"""What observing costs, measured from outside: this library's observers against no observer and Lightning's profilers.

Design, so that a cost of a few tenths of a percent can be resolved on a VM whose fits swing 20-50% between each
other (``--design``):

- ``toggle`` (default): **one fit per observer and round, the observer switched off and on in short blocks**
  (:class:`Toggle`: a callback leaves ``trainer.callbacks`` and comes back at its place; a profiler is swapped for
  ``PassThroughProfiler``). This VM's step times drift between speed regimes that last hundreds of steps (consecutive
  steps correlate at ~0.86), so adjacent short blocks cancel most of the noise: pairs of equal blocks
  (``--block`` 4: 2-6 steps), random length and random order (:func:`toggle_schedule`; an observer's sampled steps,
  one in 32 or 100, cannot lock onto one side); per pair the mean "on" step over the mean "off" step, steps timed by
  the toggle itself (placed last: it reads the clock after every other callback's end of step, then switches, so a
  step runs under one state whole); :func:`~lightning_perf.profiling.intervals.paired_ratio` gives the mean
  ratio with its 95% t interval over all pairs of all rounds. ``none`` runs the same schedule switching nothing: its
  ratio is an A/A check of the design and must come out 1; ``empty`` toggles a callback with no hooks of its own
  (what Lightning's dispatch of any callback costs). Steps are timed on the main thread's CPU clock (``--clock
  thread``: the hooks, Lightning and the single-process data loading all run there; time the hypervisor or another
  process takes from the core is not counted) or the wall clock (``--clock wall``). Each round also runs one plain fit
  per configuration, for the self-report and the end of fit (a toggled observer's self-report would cover steps it
  was not there for);
- ``fits``: **whole fits, interleaved, paired per round**: a round runs every configuration once (``--steps``
  measured steps after ``--warmup`` dropped ones), in an order shuffled per round; a fit's figure is its **mean** step
  time (a rare dear step counts in full, which a median would drop), divided by the no-observer fit of the round;
- **a fair comparison** in both: every fit gets a fresh model from the same seed, the same data in the same order, the
  same Trainer settings and the same logger (one that discards, at the Trainer's default ``log_every_n_steps``:
  observers log as they would in a run), ``torch`` on ``--threads`` threads; garbage is collected before each fit.

Sizes: ``short`` (a tiny MLP, 32-64-10, batch 32: 1.1-1.3 ms steps on one core of a quiet 2-core AVX-512 EPYC,
3 ms on an AVX2 one, most of it Lightning's own per-step work; ``--short-hidden`` widens the MLP for longer steps;
the output prints how much a plain PyTorch loop of the same model takes) and ``long`` (the demos' convnet ``tiny`` at
width 28: 20-50 ms). Printed per size and configuration: the mean step; the ratio to
no observer with its interval and the outside cost (ratio - 1); what this library's observers report about
themselves (``report["overhead"]["share_of_step"]``, steady state: their hooks' calls counted, the dear ones timed
whole, Lightning's dispatch per call timed at fit start) and its gap to the outside cost in percentage points; and the
end of fit (from the last step's end until ``fit`` returns, minus the same for no observer: reports, summaries).

Configurations: ``none``; ``empty`` (``pl.Callback()``); ``bottleneck`` (``BottleneckCallback()``); ``memory``
(``MemoryProfilerCallback()``); ``simple`` (Lightning's ``SimpleProfiler``); ``advanced`` (Lightning's
``AdvancedProfiler``, with ``--advanced``).
Run it on a quiet machine: on a busy one the intervals widen and say so. Usage::

    python examples/observer_overhead.py --quick                 # a smoke run, well under a minute
    python examples/observer_overhead.py --rounds 4 --steps 2560 --long-steps 256 --output overhead.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.profilers import AdvancedProfiler, PassThroughProfiler, SimpleProfiler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.callbacks import BottleneckCallback, MemoryProfilerCallback
from lightning_perf.demos import make_workload
from lightning_perf.profiling import format_seconds, write_json
from lightning_perf.profiling.intervals import paired_ratio
from lightning_perf.profiling.report import text_table

LONG_WIDTH = 28  # convnet "tiny" width of the long steps
BATCH = 32


class TinyMLP(pl.LightningModule):
    """The short steps: so little compute that Lightning's own per-step work is most of the step."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class NullLogger(Logger):
    """A logger that keeps nothing: every configuration logs at the Trainer's interval, none pays for storage."""

    name, version = "null", 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def workload(size: str, steps: int, hidden: int = 64) -> tuple[pl.LightningModule, Any]:
    """A fresh model from seed 0 and its data (one epoch covers the fit): ``(module, loader or datamodule)``."""
    if size == "short":
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(steps * BATCH, 32, generator=generator),
                             torch.randint(0, 10, (steps * BATCH,), generator=generator))  # fmt: skip
        return TinyMLP(hidden), DataLoader(data, batch_size=BATCH)
    model, datamodule = make_workload("convnet", "tiny", seed=0, width=LONG_WIDTH)
    datamodule.num_samples["train"] = steps * datamodule.batch_size
    return model, datamodule


class StepClock(pl.Callback):
    """Ends of training steps (wall clock, a whole step with its data loading)."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.cpu_ends: list[int] = []  # the main thread's CPU time (where the observers' hooks and Lightning run)

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter_ns())
        self.cpu_ends.append(time.thread_time_ns())

    def mean_s(self, warmup: int) -> float:
        ends = self.ends[warmup - 1 :]
        return (ends[-1] - ends[0]) / 1e9 / (len(ends) - 1)

    def median_s(self, warmup: int) -> float:
        return statistics.median((b - a) / 1e9 for a, b in zip(self.ends[warmup - 1 :], self.ends[warmup:]))


Pairs = list[tuple[int, int, int]]  # (start, middle, end) of two adjacent blocks of equal length


def toggle_schedule(steps: int, warmup: int, block: int, seed: int = 0) -> tuple[list[bool], Pairs]:
    """Per step whether the observer runs, and the pairs of blocks ``(start, middle, end)`` compared: observed through
    the warm-up, then pairs of equal blocks whose length is drawn from ``[block/2, 3 block/2]`` and whose order (on
    first or off first) is a coin toss, both from ``seed``. Random lengths keep an observer's sampled steps (one in
    32, one in 100) from locking onto one side; a random order keeps a drift from
    favouring either side. Steps after the last pair are observed (the observer ends its fit as it would)."""
    rng = random.Random(seed)
    states, pairs, start = [True] * min(warmup, steps), [], warmup
    while True:
        length = rng.randint(max(2, block // 2), max(2, block + block // 2))
        if start + 2 * length > steps:
            break
        first = rng.random() < 0.5
        states += [first] * length + [not first] * length
        pairs.append((start, start + length, start + 2 * length))
        start += 2 * length
    return states + [True] * (steps - len(states)), pairs


class Toggle(pl.Callback):
    """Switches an observer off and on within one fit as ``states`` says, step by step, and times the steps (placed
    last: at a step's end it reads the clocks after every other callback's hook, then switches, so each timed step
    runs under one state from its start to its end; the switch itself, a list insert or pop, falls into the next
    step, as often on each side): a callback leaves ``trainer.callbacks`` (Lightning calls none of its hooks, as if
    it had not been passed; its optimizer post-hooks are taken out too, hooks it put on the model still run: a flag
    check each) and comes back at its place; a profiler is swapped for Lightning's ``PassThroughProfiler``. With no
    observer nothing is switched: the schedule alone (an A/A comparison, whose ratio must come out 1)."""

    def __init__(self, observer: Any, states: list[bool]) -> None:
        self.observer, self.states = observer, states
        self.on: list[bool] = []  # per step: whether the observer ran during it (or would have: no observer)
        self.ends: list[int] = []  # per step: its end, wall clock (ns)
        self.cpu_ends: list[int] = []  # per step: its end, the main thread's CPU clock (ns)
        self._place: int | None = None  # where a detached callback goes back
        self._profiler: Any = None
        self._off = False  # no observer: the state the schedule is in
        self._detached: list[tuple[Any, int, Any]] = []  # the observer's optimizer post-hooks while it is off

    def _switch(self, trainer: pl.Trainer, on: bool) -> None:
        if self.observer is None:
            self._off = not on
        elif isinstance(self.observer, pl.Callback):
            # A new list: Lightning is iterating over the current one (an insert would have this hook called again)
            if on and self._place is not None:
                callbacks = list(trainer.callbacks)
                callbacks.insert(self._place, self.observer)
                trainer.callbacks, self._place = callbacks, None
                self._optimizer_hooks(trainer, on)
            elif not on and self._place is None:
                self._place = trainer.callbacks.index(self.observer)
                trainer.callbacks = [c for c in trainer.callbacks if c is not self.observer]
                self._optimizer_hooks(trainer, on)
        elif on and self._profiler is not None:
            trainer.profiler, self._profiler = self._profiler, None
        elif not on and self._profiler is None:
            self._profiler, trainer.profiler = trainer.profiler, PassThroughProfiler()

    def _optimizer_hooks(self, trainer: pl.Trainer, on: bool) -> None:
        """Off, the observer's optimizer step post-hooks are taken out too (they count steps and wake the observer's
        hooks): an observer switched off runs nothing, and sees none of the steps it was off for."""
        if on:
            for hooks, key, hook in self._detached:
                hooks[key] = hook
            self._detached = []
            return
        for optimizer in trainer.optimizers:
            hooks = optimizer._optimizer_step_post_hooks
            for key, hook in list(hooks.items()):
                if getattr(hook, "__self__", None) is self.observer:
                    self._detached.append((hooks, key, hooks.pop(key)))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.on.append(self._place is None and self._profiler is None and not self._off)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter_ns())
        self.cpu_ends.append(time.thread_time_ns())
        step = len(self.on)  # the next step's index
        self._switch(trainer, self.states[step] if step < len(self.states) else True)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._switch(trainer, True)  # the observer's end-of-fit work runs as it would


def toggled_pairs(durations: list[float], on: list[bool], pairs: Pairs) -> tuple[list[float], list[float]]:
    """Mean step of the "on" and the "off" block of each pair (``durations[i]``: step ``i``, from the end of the step
    before); a pair whose blocks did not run as planned (one state each) is skipped."""
    ons, offs = [], []
    for start, middle, end in pairs:
        first, second = on[start:middle], on[middle:end]
        if end > len(durations) or len(set(first)) != 1 or len(set(second)) != 1 or first[0] == second[0]:
            continue
        a, b = statistics.fmean(durations[start:middle]), statistics.fmean(durations[middle:end])
        ons.append(a if first[0] else b)
        offs.append(b if first[0] else a)
    return ons, offs


def configurations(out: Path, advanced: bool) -> dict[str, Callable[[], dict[str, Any]]]:
    """Name -> the extra Trainer arguments (fresh objects for every run); observers at their defaults."""
    configs: dict[str, Callable[[], dict[str, Any]]] = {
        "none": dict,
        "empty": lambda: {"callbacks": [pl.Callback()]},  # Lightning's dispatch of a callback's hooks, alone
        "bottleneck": lambda: {"callbacks": [BottleneckCallback(dirpath=str(out), verbose=False)]},
        "memory": lambda: {"callbacks": [MemoryProfilerCallback(dirpath=str(out), verbose=False)]},
        "simple": lambda: {"profiler": SimpleProfiler(dirpath=out, filename="simple")},
    }
    if advanced:
        configs["advanced"] = lambda: {"profiler": AdvancedProfiler(dirpath=out, filename="advanced")}
    return configs


def fit(
    model: pl.LightningModule, data: Any, steps: int, callbacks: list[Any], out: Path, extra: dict[str, Any]
) -> None:
    """``steps`` training steps with the benchmark's Trainer settings (no validation, checkpoint, bar or summary; the
    discarding logger), after a garbage collection."""
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=NullLogger(),
                         limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=out, **extra)  # fmt: skip
    gc.collect()
    if isinstance(data, DataLoader):
        trainer.fit(model, data)
    else:
        trainer.fit(model, datamodule=data)


def run_once(args: argparse.Namespace, size: str, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    """One fit: its mean and median steady step, the observer's self-reported share, the time after the last step."""
    steps = args.warmup + (args.steps if size == "short" else args.long_steps)
    pl.seed_everything(0, verbose=False)
    model, data = workload(size, steps, args.short_hidden)
    clock = StepClock()
    observers = extra.pop("callbacks", [])
    fit(model, data, steps, [clock, *observers], out, extra)
    tail_s = (time.perf_counter_ns() - clock.ends[-1]) / 1e9
    own = [cb.report["overhead"]["share_of_step"] for cb in observers if getattr(cb, "report", None)]
    return {"mean": clock.mean_s(args.warmup), "median": clock.median_s(args.warmup),
            "own": own[0] if own else None, "tail_s": tail_s}  # fmt: skip


def run_toggled(args: argparse.Namespace, size: str, extra: dict[str, Any], out: Path, seed: int) -> dict[str, Any]:
    """One fit with the observer switched off and on by :func:`toggle_schedule` (no observer: the schedule alone,
    nothing switched): per pair of blocks the two mean steps."""
    steps = args.warmup + (args.steps if size == "short" else args.long_steps)
    states, pairs = toggle_schedule(steps, args.warmup, args.block, seed)
    pl.seed_everything(0, verbose=False)
    model, data = workload(size, steps, args.short_hidden)
    observers = extra.pop("callbacks", [])
    toggle = Toggle(observers[0] if observers else extra.get("profiler"), states)
    fit(model, data, steps, [*observers, toggle], out, extra)
    ends = toggle.cpu_ends if args.clock == "thread" else toggle.ends
    durations = [float("nan")] + [(b - a) / 1e9 for a, b in itertools.pairwise(ends)]
    ons, offs = toggled_pairs(durations, toggle.on, pairs)
    return {"ons": ons, "offs": offs, "mean": statistics.fmean(ons), "median": statistics.median(ons)}


def size_rounds(args: argparse.Namespace, size: str) -> int:
    """Rounds for ``size``: ``--long-rounds`` for long steps when given, else ``--rounds``."""
    return args.long_rounds if size == "long" and args.long_rounds else args.rounds


def measure_toggled(args: argparse.Namespace, size: str, configs: dict[str, Callable[[], dict[str, Any]]],
                    out: Path) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Per round and configuration, order shuffled per round: a toggled fit (``none``: the schedule alone, an A/A
    check of the design) and a plain fit (the self-report and the end of fit; a toggled observer's self-report would
    cover steps it was not there for; only in the first ``--plain-rounds`` rounds). Each round draws a new
    schedule."""
    names, order, rounds = list(configs), random.Random(0), size_rounds(args, size)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(rounds):
        for name in order.sample(names, len(names)):
            toggled = run_toggled(args, size, configs[name](), out, seed=index)
            plain = run_once(args, size, configs[name](), out) if index < args.plain_rounds else {}
            runs[name].append({**toggled, "own": plain.get("own"), "tail_s": plain.get("tail_s")})
        if index % max(1, rounds // 10) == 0 or index == rounds - 1:
            means = ", ".join(f"{n} {format_seconds(runs[n][-1]['mean'])}" for n in names)
            print(f"{size} round {index + 1}/{rounds}: {means}", flush=True)
    return runs


def summarize_toggled(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[list[object]], dict[str, Any]]:
    """Table rows and JSON results: per configuration the mean "off" step, the ratio "on"/"off" paired over the pairs
    of blocks of all rounds with its 95% t interval (``none``: the A/A ratio, nothing switched), the outside cost, the
    self-report of a plain fit and its gap, the end of fit against a plain fit without observer."""
    rows: list[list[object]] = []
    results: dict[str, Any] = {}
    for name, mine in runs.items():
        ons = [x for r in mine for x in r["ons"]]
        offs = [x for r in mine for x in r["offs"]]
        estimate = paired_ratio(ons, offs, above_one="slower", below_one="faster")
        # The same ratio per round (one fit each), its interval over rounds: it holds what varies from fit to fit,
        # which the pairs of one fit share (a fit's own speed regime, where its rare dear steps fell)
        rounds = paired_ratio([statistics.fmean(r["ons"]) for r in mine], [statistics.fmean(r["offs"]) for r in mine],
                              above_one="slower", below_one="faster")  # fmt: skip
        own = [r["own"] for r in mine if r["own"] is not None]
        tails = [r["tail_s"] - b["tail_s"] for r, b in zip(mine, runs["none"]) if r["tail_s"] is not None]
        outside = estimate.ratio - 1
        gap = 100 * (statistics.median(own) - outside) if own else None
        own_cell = f"{100 * statistics.median(own):.2f}%" if own else "-"
        rows.append([name + (" (A/A)" if name == "none" else ""), format_seconds(statistics.fmean(offs)),
                     estimate.format(4), rounds.format(4), f"{100 * outside:+.2f}%", own_cell,
                     f"{gap:+.2f} pp" if gap is not None else "-",
                     "-" if name == "none" else format_seconds(statistics.median(tails))])  # fmt: skip
        results[name] = {"step_mean_s": statistics.fmean(ons), "step_off_mean_s": statistics.fmean(offs),
                         "pairs": len(ons), **estimate.to_dict("ratio_to_none"), **rounds.to_dict("over_rounds"),
                         "round_ratios": [statistics.fmean(r["ons"]) / statistics.fmean(r["offs"]) for r in mine],
                         "self_reported_share": own or None,
                         "self_minus_outside_pp": gap, "end_of_fit_extra_s": tails}  # fmt: skip
    return rows, results


def plain_step_s(size: str, hidden: int = 64, steps: int = 200) -> float:
    """The same model, batch and optimizer in a plain PyTorch loop: the median step without Lightning."""
    model, data = workload(size, steps, hidden)
    if not isinstance(data, DataLoader):
        data.setup("fit")
        data = data.train_dataloader()
    optimizer = model.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
    ends = []
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    for index, batch in enumerate(data):
        loss = model.training_step(batch, index)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter_ns())
    return statistics.median((b - a) / 1e9 for a, b in itertools.pairwise(ends[20:]))


def measure(args: argparse.Namespace, size: str, configs: dict[str, Callable[[], dict[str, Any]]], out: Path) -> Any:
    """Every configuration once per round, in an order shuffled per round."""
    names, order, rounds = list(configs), random.Random(0), size_rounds(args, size)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for index in range(rounds):
        for name in order.sample(names, len(names)):
            runs[name].append(run_once(args, size, configs[name](), out))
        if index % max(1, rounds // 10) == 0 or index == rounds - 1:
            means = ", ".join(f"{n} {format_seconds(runs[n][-1]['mean'])}" for n in names)
            print(f"{size} round {index + 1}/{rounds}: {means}", flush=True)
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[list[list[object]], dict[str, Any]]:
    """Table rows and JSON results: step, ratio to none with its interval, self-report and its gap, end of fit."""
    base = runs["none"]
    rows: list[list[object]] = []
    results: dict[str, Any] = {}
    for name, mine in runs.items():
        estimate = paired_ratio([r["mean"] for r in mine], [r["mean"] for r in base], above_one="slower",
                                below_one="faster")  # fmt: skip
        own = [r["own"] for r in mine if r["own"] is not None]
        tails = [r["tail_s"] - b["tail_s"] for r, b in zip(mine, base)]
        step = statistics.median(r["mean"] for r in mine)
        outside = estimate.ratio - 1
        gap = 100 * (statistics.median(own) - outside) if own else None
        rows.append([
            name,
            format_seconds(step),
            "-" if name == "none" else estimate.format(4),
            "-" if name == "none" else f"{100 * outside:+.2f}%",
            f"{100 * statistics.median(own):.2f}%" if own else "-",
            f"{gap:+.2f} pp" if gap is not None else "-",
            "-" if name == "none" else format_seconds(statistics.median(tails)),
        ])  # fmt: skip
        results[name] = {
            "step_mean_s": step,
            "step_median_s": statistics.median(r["median"] for r in mine),
            **estimate.to_dict("ratio_to_none"),
            "self_reported_share": own or None,
            "self_minus_outside_pp": gap,
            "end_of_fit_extra_s": tails,
        }
    return rows, results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="measured steps of a short-step fit")
    parser.add_argument("--long-steps", type=int, default=50, help="measured steps of a long-step fit")
    parser.add_argument("--warmup", type=int, default=60, help="leading steps left out of each fit (>= 51: the "
                        "memory observer's dense leak readings before its first verdict are warm-up)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--long-rounds", type=int, default=None, help="rounds of long steps (default: --rounds)")
    parser.add_argument("--sizes", default="short,long", help="comma-separated, from short, long")
    parser.add_argument("--short-hidden", type=int, default=64, help="hidden width of the short steps' MLP (64; "
                        "wider for longer steps, e.g. to match 2 ms steps on a faster CPU)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the shortest steps)")
    parser.add_argument("--advanced", action="store_true", help="also Lightning's AdvancedProfiler (slow)")
    parser.add_argument("--design", choices=("toggle", "fits"), default="toggle",
                        help="toggle: each observer switched off and on in short random blocks within one fit, "
                        "paired by adjacent blocks (resolves small costs on a noisy machine); fits: whole fits "
                        "against a fit without observer")  # fmt: skip
    parser.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="toggle design: the main thread's CPU time per step (where the hooks run; blind to "
        "the hypervisor's and other processes' share of the core, this VM's main noise) or wall time",
    )
    parser.add_argument("--block", type=int, default=4, help="mean steps per off/on block (lengths drawn from "
                        "[block/2, 3 block/2]); short blocks cancel this VM's slow speed drifts best")  # fmt: skip
    parser.add_argument("--plain-rounds", type=int, default=3, help="toggle design: rounds that also run a plain fit "
                        "per configuration (the self-report and the end of fit)")  # fmt: skip
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated configurations to run (none is always run), e.g. memory: a quicker look at one observer",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 320 steps, short steps only")
    parser.add_argument("--output", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.sizes, args.plain_rounds = 320, 2, "short", 1
    sizes = args.sizes.split(",")
    if min(args.steps, args.long_steps) < 10 or args.warmup < 2 or args.rounds < 2 or args.block < 2:
        parser.error("need --steps and --long-steps >= 10, --warmup >= 2, --rounds >= 2 and --block >= 2")
    if args.long_rounds is not None and args.long_rounds < 2:
        parser.error(f"--long-rounds {args.long_rounds}: need >= 2")
    if args.short_hidden < 1:
        parser.error(f"--short-hidden {args.short_hidden}: need >= 1")
    if args.plain_rounds < 1:
        parser.error(f"--plain-rounds {args.plain_rounds}: need >= 1 (the self-report and the end of fit)")
    if any(s not in ("short", "long") for s in sizes):
        parser.error("sizes are short and long")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Lightning's and the profilers' notes would drown the table
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_perf"):
        logging.getLogger(name).setLevel(logging.ERROR)
    out = Path(tempfile.mkdtemp(prefix="observer-overhead-"))
    configs = configurations(out, args.advanced)
    if args.only is not None:
        wanted = {"none", *(name.strip() for name in args.only.split(","))}
        if unknown := wanted - set(configs):
            parser.error(
                f"--only {args.only!r}: unknown configuration(s) {sorted(unknown)}; expected some of {sorted(configs)}"
            )
        configs = {name: make for name, make in configs.items() if name in wanted}
    report: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(args).items()}, "results": {}, "plain": {}}
    for size in sizes:
        if args.design == "toggle":
            runs = measure_toggled(args, size, configs, out)
            rows, report["results"][size] = summarize_toggled(runs)
        else:
            runs = measure(args, size, configs, out)
            rows, report["results"][size] = summarize(runs)
        plain, step = plain_step_s(size, args.short_hidden), report["results"][size]["none"]["step_mean_s"]
        report["plain"][size] = {"plain_pytorch_step_s": plain, "lightning_step_s": step}
        columns = ["configuration", "step (mean)", "ratio to none [95%]", "over rounds [95%]", "outside", "self-report",
                   "self - outside", "end of fit +"]  # fmt: skip
        if args.design != "toggle":  # a fit is a round there: its interval is over rounds already
            columns.remove("over rounds [95%]")
        measured = args.steps if size == "short" else args.long_steps
        design = args.design + (f", {args.clock} clock" if args.design == "toggle" else "")
        rounds = size_rounds(args, size)
        title = f"{size} steps: {rounds} rounds, {args.warmup} + {measured} steps a fit, design {design}"
        print(text_table(columns, rows, title=title, width=110))
        print(f"{size}: the same model in a plain PyTorch loop takes {format_seconds(plain)} a step; with Lightning "
              f"(no observer) {format_seconds(step)}: Lightning's own per-step work and data loading are "
              f"{100 * max(0.0, 1 - plain / step):.0f}% of it.")  # fmt: skip
    if args.output is not None:
        write_json(report, args.output)
    return report


if __name__ == "__main__":
    main()
