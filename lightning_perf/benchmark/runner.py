"""The benchmark harness behind ``lightning-perf bench``: configurations side by side, measured, not guessed.

Entry point: :func:`run_benchmark` (takes a :class:`~lightning_perf.benchmark.spec.BenchSpec`). Every run is a fresh
worker process, repeats interleaved; ratios carry a 95% interval and a verdict. The results file's schema and the design
notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
import shlex
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.answer import (
    estimates_from,
    prefer_measured_stack,
    recommendation_record,
    settling_record,
)
from lightning_perf.benchmark.compare import DEFAULT_THRESHOLD
from lightning_perf.benchmark.isolation import run_isolated
from lightning_perf.benchmark.results import ONE_REPEAT, BenchReport, ConfigSummary, ProgressFn, RunEvent
from lightning_perf.benchmark.rounds import run_rounds
from lightning_perf.benchmark.settle import Settling
from lightning_perf.benchmark.spec import BenchSpec, RunSpec
from lightning_perf.benchmark.stack import Stack, choose_stack
from lightning_perf.benchmark.threads import ThreadChoice, choose_threads, recheck_threads, start_load_note
from lightning_perf.benchmark.utilization import PeakFn, add_utilization, machine_peak, matmul_setting
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import BASELINE, INFERENCE_STAGES
from lightning_perf.profiling.intervals import METHOD_SINGLE, RatioEstimate, paired_ratio
from lightning_perf.profiling.reliability import ConditionMonitor, Reliability, assess
from lightning_perf.profiling.stats import median, median_of_repeats, percentile

__all__ = [
    "INFERENCE_RATIOS",
    "add_likely_causes",
    "add_payback",
    "mark_disturbed",
    "precision_notes",
    "run_benchmark",
    "summarize_runs",
]


def _wait_policy_started(runs: _Runs, order: Sequence[str]) -> Any:
    """What the workers' OpenMP read at their start (``RunResult.wait_policy``), not what was meant: one value, or
    the sorted values where runs differed."""
    started = sorted({r.wait_policy for name in order for r in runs.results[name] if r.ok}, key=str)
    return started[0] if len(started) == 1 else started


def run_benchmark(
    spec: BenchSpec,
    progress: ProgressFn | None = None,
    command: str | None = None,
    *,
    on_run: Callable[[RunEvent], None] | None = None,
    monitor: ConditionMonitor | None = None,
    argv: Sequence[str] | None = None,
    peak: PeakFn | None = None,
    run: Callable[[RunSpec, Path, float], RunResult] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    stack_phase: bool = True,
    say: Callable[[str], None] | None = None,
) -> BenchReport:
    """Run every configuration ``spec.repeats`` times, interleaved, each in a fresh process, and summarize.

    Args:
        spec: what to run (validated and resolved on construction).
        progress: called before each run with ``(done, total, what)`` (a progress bar).
        command: the command line to record (default: one rebuilt from ``spec``).
        on_run: called after each run with a :class:`RunEvent` (a progress line).
        monitor: watches the machine around each run (default: a :class:`ConditionMonitor` on the real counters).
        argv: the command line for the ``run`` metadata (default: ``command`` split).
        peak: ``(device, precision, fast_fp32_matmul) -> PeakFlops`` for the MFU (default:
            :func:`~lightning_perf.benchmark.utilization.machine_peak`; a CPU peak is measured after every run, once
            per machine and dtype, and cached). Asked once per precision, only where FLOPs were counted.
        run: runs one worker (default: a fresh process, :func:`~lightning_perf.benchmark.isolation.run_isolated`);
            a test passes scripted results.
        clock: seconds, for the time budget of ``--repeats auto`` (a test passes a scripted one).
        stack_phase: after the single configurations, measure the winners' stack and recommend it.
        say: prints the one line that says a load present at the start is being watched (default: stderr).

    With ``spec.repeats`` None (``--repeats auto``) repeats are added until every speed-up's interval is within
    ``+-spec.target`` or ``spec.time_budget_s`` is spent (:class:`~lightning_perf.benchmark.settle.Settling`); the
    winners' stack is measured after the single configurations, interleaved with baseline, within the same budget.
    """
    from lightning_perf.profiling.machine import describe_machine, finish_run, run_metadata

    command = command or _command_for(spec)
    run_info = run_metadata(list(argv) if argv is not None else shlex.split(command))
    machine = describe_machine()
    monitor = monitor if monitor is not None else ConditionMonitor()
    settling = None if spec.repeats is not None else Settling(spec.target, spec.time_budget_s, clock=clock)
    order = list(spec.names)
    with tempfile.TemporaryDirectory(prefix="lightning-perf-bench-") as tmp:
        runs = _Runs(spec, run or _run_in_subprocess, Path(tmp), monitor, settling, progress, on_run, clock)
        runs.machine, runs.say = machine, say  # a load present at the start is watched first, up to a minute
        runs.use(choose_threads(monitor, spec.threads, machine, say))
        stack, decisions, rounds = _measure(runs, order, stack_phase)
    runs.report_progress("done")
    spec, threads = runs.spec, runs.choice  # the threads chosen last
    load_note = start_load_note(threads, monitor)
    summaries, reliability = _judged_summaries(runs, machine)
    if any(s.flops_per_step for s in summaries):
        runs.report_progress("peak FLOP/s")
    peaks: dict[tuple[str, bool], Any] = {}
    add_utilization(summaries, _peak_lookup(spec, machine, peak, peaks))
    machine = {**machine, "device": spec.device, "device_reason": spec.device_reason, "mfu_peaks": _peak_rows(peaks)}
    machine["threads"] = {**threads.to_dict(), "wait_policy": _wait_policy_started(runs, order)}
    source, stack_notes = spec.source or {}, list[str]()
    if stack_phase:  # a stack the user measured (--configs a+b) that beat the winners' stack is recommended instead
        stack = prefer_measured_stack(stack, summaries, stack_notes)
    answer = recommendation_record(stack, summaries, config_file=source.get("kind") == "config") if stack_phase else {}
    runs_done = [asdict(r) for name in order for r in runs.results[name]]
    if answer:
        add_payback(answer, stack, summaries, runs_done)
    return BenchReport(
        options=spec.to_dict(),
        command=command,
        summaries=summaries,
        runs=runs_done,
        wall_s=clock() - runs.start,
        settling=settling_record(settling, decisions, rounds, summaries),
        recommendation=answer,
        machine=machine,
        run=finish_run(run_info),
        reliability=reliability.to_dict(),
        left_out=[{"config": name, "reason": why} for name, why in spec.left_out],
        notes=_report_notes(spec, reliability, runs, summaries) + stack_notes + list(filter(None, [load_note])),
    )


def _report_notes(spec: BenchSpec, reliability: Reliability, runs: _Runs, summaries: list[ConfigSummary]) -> list[str]:
    """The report's notes: precision, the load present at start, re-runs, paired baselines, no effect, no predict."""
    start_load = reliability.figures.get("start_load")
    return (
        precision_notes(spec)
        + ([start_load] if start_load else [])
        + _rerun_notes(runs.set_aside)
        + _paired_baseline_notes(summaries)
        + _no_effect_notes(runs.results)
        + _decision_notes(runs.decided)
        + _shortened_notes(spec, runs.steps)
        + _predict_skipped_notes(runs.results)
    )


def add_payback(
    answer: dict[str, Any], stack: Stack, summaries: Sequence[ConfigSummary], runs: Sequence[dict[str, Any]]
) -> None:
    """Where the recommended configuration compiles: its cold first step and break-even into the recommendation
    (``cold_first_step_s``, ``break_even_steps``) and a line before the code to add."""
    from lightning_perf.benchmark.answer import RATIO, estimates_from
    from lightning_perf.benchmark.payback import compile_costs, compiles, payback_phrase
    from lightning_perf.benchmark.stack import recommended_names

    row = next((s for s in summaries if s.config == stack.name), None)
    names = recommended_names(stack, row.estimate(RATIO) if row is not None else None, estimates_from(summaries))
    what = "+".join(names)
    cost = next((c for c in compile_costs(summaries, runs) if c.config == what), None)
    if not compiles(what) or cost is None:
        return
    answer["cold_first_step_s"], answer["break_even_steps"] = cost.cold_first_step_s, cost.break_even_steps
    text = f"It compiles: its first step took {cost.cold_first_step_s:.1f} s cold"
    if cost.break_even_steps is not None:
        text += f"; it {payback_phrase(cost.break_even_steps)}."
    else:
        text += f"; {cost.why}."
    lines = answer.setdefault("lines", [])
    at = next(
        (i for i, line in enumerate(lines) if line.startswith(("Add to your Trainer:", "Or in your"))), len(lines)
    )
    lines[at:at] = textwrap.wrap(text, 80, subsequent_indent="  ")


def _rerun_notes(set_aside: list[tuple[str, int, str]]) -> list[str]:
    """``"3 repeats re-run (measured while disturbed, kept out of the figures): other processes' load"``."""
    if not set_aside:
        return []
    count, causes = len(set_aside), "; ".join(sorted({why for _, _, why in set_aside}))
    return [f"{count} repeat{'s' if count != 1 else ''} re-run (disturbed, kept out of the figures): {causes}"]


class _Runs:
    """The bench's runs, one worker at a time: a progress call before each, the machine watched around it (what an
    ok run measured under goes to :attr:`watched`), a :class:`RunEvent` after it."""

    def __init__(self, spec: BenchSpec, run: Callable[[RunSpec, Path, float], RunResult], tmp: Path,
                 monitor: ConditionMonitor, settling: Settling | None, progress: ProgressFn | None,
                 on_run: Callable[[RunEvent], None] | None, clock: Callable[[], float]) -> None:  # fmt: skip
        self.spec, self.run, self.tmp, self.monitor, self.settling = spec, run, tmp, monitor, settling
        self.progress, self.on_run, self.clock = progress, on_run, clock
        # A fixed count, or the projection of an auto run: the minimum repeats, then what the budget allows.
        self.total = (spec.repeats or (settling.min_repeats if settling else 1)) * len(spec.names)
        self.results: dict[str, list[RunResult]] = {name: [] for name in spec.names}
        self.watched: list[Any] = []
        self.disturbed_now: dict[tuple[str, int], str | None] = {}  # each run's own verdict, as it ends
        self.set_aside: list[tuple[str, int, str]] = []  # disturbed runs measured again, kept out of the figures
        self.started: dict[str, Any] = {}  # the starting load the runs are judged against (assess's keywords)
        self.decided: dict[str, dict[str, Any]] = {}  # configuration -> its first run's RunResult.decided
        self.steps: int | None = None  # timed steps of the runs after the first round (fewer where the budget asks)
        self.done = 0
        self.start = clock()
        self.choice: ThreadChoice  # set by use(), before the first run
        self.asked_policy, self.machine = spec.wait_policy, dict[str, Any]()
        self.say: Callable[[str], None] | None = None

    def use(self, choice: ThreadChoice) -> None:
        """Run the workers at ``choice``'s threads, judged against the load it was chosen from."""
        self.choice = choice
        self.spec = replace(self.spec, threads=choice.threads, wait_policy=self.asked_policy or choice.wait_policy)
        self.started = {"start_other_cores": choice.other_cores, "threads_set": choice.set_by_hand}
        self.steps, self.decided = None, {}  # the pace and the per-model decisions are measured at this count

    def rethink(self, rounds: int) -> str | None:
        """After each run of round ``rounds``: the threads chosen again where the load present at the start that cost
        them is gone (once per bench run, :func:`~lightning_perf.benchmark.threads.recheck_threads`); why the runs so
        far no longer count."""
        if (choice := recheck_threads(self.choice, self.monitor, self.machine, rounds, self.say)) is not None:
            self.use(choice)
        return None if choice is None else choice.switch["why"]  # type: ignore[index]

    def report_progress(self, what: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, what)

    def __call__(self, name: str, repeat: int) -> RunResult:
        self.total = max(self.total, self.done + 1)
        self.report_progress(
            f"repeat {repeat + 1}/{self.spec.repeats}" if self.spec.repeats else f"repeat {repeat + 1}"
        )
        if self.settling is not None and repeat >= 1 and self.steps is None:  # at the first round's pace
            paces = [r.step_median_s for runs in self.results.values() for r in runs if r.ok and r.step_median_s]
            pace = sum(paces) / len(paces) if paces else 0.0
            self.steps = self.settling.steps_within_budget(self.spec.steps, pace, self.spec.names, 1)
        run_spec = replace(
            self.spec.run_spec(name, repeat, self.decided.get(name)), steps=self.steps or self.spec.steps
        )
        token = self.monitor.start()
        try:
            result = self.run(run_spec, self.tmp, self.spec.timeout_s)
        except BaseException:
            getattr(self.monitor, "close", lambda: None)()  # its sampler thread ends with the run
            raise
        conditions = self.monitor.stop(token, f"{name}, repeat {repeat + 1}", config=name, repeat=repeat)
        if result.ok and result.decided:  # decided once, by the configuration's first run: later ones replay it
            self.decided.setdefault(name, result.decided)
        if result.ok:  # a skipped or failed run measured nothing the conditions could have disturbed
            self.watched.append(conditions)
            self.disturbed_now[(name, repeat)] = self._judge(conditions)
        self.done += 1
        if self.on_run is not None:
            self.on_run(self._event(name, repeat, result))
        return result

    @property
    def cores_used(self) -> int:
        """The cores a run keeps busy: one on CUDA, else its threads."""
        import torch

        return 1 if self.spec.device.startswith("cuda") else self.spec.threads or torch.get_num_threads()

    def _judge(self, conditions: Any) -> str | None:
        """Why other processes disturbed this one run (the cause's name), judged by itself as it ends; None if not."""
        from lightning_perf.profiling.machine import usable_cpu_count

        verdict = assess([conditions], {}, cores_used=self.cores_used, cpu_count=usable_cpu_count(), **self.started)
        return verdict.causes[0].split(":")[0] if verdict.disturbed_runs else None

    def why_disturbed(self, result: RunResult) -> str | None:
        return self.disturbed_now.get((result.spec.get("config"), result.spec.get("repeat")))  # type: ignore[arg-type]

    def forget(self, set_aside: list[tuple[str, int, str]]) -> None:
        """Keep the set-aside runs' conditions out of the verdict: the run measured again in their place has its own."""
        for name, repeat, _ in set_aside:
            at = [i for i, c in enumerate(self.watched) if (getattr(c, "config", None), getattr(c, "repeat", None))
                  == (name, repeat)]  # fmt: skip
            if at:
                del self.watched[at[0]]
        self.set_aside += set_aside

    def _event(self, name: str, repeat: int, result: RunResult) -> RunEvent:
        elapsed = self.clock() - self.start
        status = "ok" if result.ok else f"skipped: {result.skipped}" if result.skipped else "failed"
        if result.error and not result.ok:
            status = f"failed: {' '.join(result.error.split())[:160]}"
        if self.spec.repeats:
            left = elapsed / self.done * (self.total - self.done)
        else:
            left = self.settling.remaining_s if self.settling else 0.0
        return RunEvent(name, repeat, self.spec.repeats or 0, self.done, self.total,
                        result.step_median_s if result.ok else None, elapsed, max(left, 0.0), status,
                        "step" if self.spec.stage == "fit" else "batch")  # fmt: skip


def _measure(runs: _Runs, order: list[str], stack_phase: bool) -> tuple[Stack, list[Any], int]:
    """The single configurations in interleaved rounds, then the winners' stack against baseline (appended to
    ``order``); returns the stack, the rounds' decisions and the number of rounds."""
    spec, settling = runs.spec, runs.settling

    def estimates_of(so_far: Any) -> dict[str, RatioEstimate | None]:
        return estimates_from(summarize_runs(so_far))

    def stack_reserve() -> float:  # the least rounds of baseline and the stack, kept for the recommendation
        return settling.min_repeats * settling.round_s([BASELINE, BASELINE]) if settling is not None else 0.0

    singles = run_rounds(order, runs, repeats=spec.repeats, settling=settling, estimates_of=estimates_of,
                         reserve_s=stack_reserve, results=runs.results, disturbed=runs.why_disturbed,
                         rethink=runs.rethink)  # fmt: skip
    runs.forget(singles.set_aside)
    stack = choose_stack(estimates_of(runs.results)) if stack_phase else Stack(())
    decisions, rounds = [singles.decision], singles.rounds
    if len(stack.names) > 1 and stack.name not in order:
        runs.total = runs.done + (spec.repeats or (settling.min_repeats if settling is not None else 2)) * 2
        measured = run_rounds([BASELINE, stack.name], runs, repeats=spec.repeats, settling=settling,
                              estimates_of=estimates_of, first_repeat=singles.rounds, results=runs.results,
                              disturbed=runs.why_disturbed)  # fmt: skip
        runs.forget(measured.set_aside)
        decisions.append(measured.decision)
        rounds += measured.rounds
        order.append(stack.name)
    return stack, decisions, rounds


def _judged_summaries(runs: _Runs, machine: dict[str, Any]) -> tuple[list[ConfigSummary], Reliability]:
    """The runs summarized, with the machine's conditions judged and every slower row's likely cause named."""
    summaries = summarize_runs(runs.results)
    reliability = assess(
        runs.watched,
        {s.config: s.step_times_s for s in summaries if s.step_times_s},
        cores_used=runs.cores_used,
        cpu_count=int(machine.get("cpu_count_usable") or machine.get("cpu_count") or 1),
        **runs.started,
    )
    mark_disturbed(summaries, reliability, runs.watched)
    add_likely_causes(summaries, machine, runs.spec)
    return summaries, reliability


def _ratio(numerator: Any, denominator: Any, above_one: str = "faster", below_one: str = "slower") -> RatioEstimate:
    """:func:`paired_ratio`, except that a single repeat gives the ratio alone, with :data:`ONE_REPEAT`."""
    estimate = paired_ratio(
        numerator, denominator, above_one=above_one, below_one=below_one, threshold=DEFAULT_THRESHOLD
    )
    if estimate.n == 1:
        return RatioEstimate(estimate.ratio, estimate.ratio, estimate.ratio, METHOD_SINGLE, ONE_REPEAT, 1)
    return estimate


def _no_effect_notes(results: dict[str, list[RunResult]]) -> list[str]:
    """One line per configuration and callback message that said it did not apply: that row measures without it."""
    notes = []
    for config, runs in results.items():
        for text in dict.fromkeys(text for r in runs for text in r.no_effect):
            notes.append(f"{config}: did not apply, so this row measures without it: {text}")
    return notes


def _decision_notes(decided: dict[str, dict[str, Any]]) -> list[str]:
    """One line per kind of module a configuration's first run decided on by timing (every repeat ran that code)."""
    return [
        f"{config}: {owner} decided at the first run, every repeat ran the same code: "
        f"{'own code' if t['kept_own'] else 'swapped'} for {', '.join(t['modules'])} (first batch: own "
        f"{t['own_ms']:.2f} ms, swapped {t['swapped_ms']:.2f} ms)"
        for config, states in decided.items()
        for owner, state in states.items()
        for t in state.get("first_batch", {}).get("timings", [])
    ]


def _shortened_notes(spec: BenchSpec, steps: int | None) -> list[str]:
    """The line that says the runs after the first round timed fewer steps, to fit the repeats into the budget."""
    if steps is None or steps >= spec.steps:
        return []
    return [f"the runs after the first round timed {steps} steps, not {spec.steps}: the repeats an interval needs "
            f"did not fit the {spec.time_budget_s:.0f} s budget at the first round's pace"]  # fmt: skip


def _predict_skipped_notes(results: dict[str, list[RunResult]]) -> list[str]:
    reasons = sorted({r.predict_skipped for runs in results.values() for r in runs if r.predict_skipped})
    return [f"no inference timing: {reason}" for reason in reasons]


def precision_notes(spec: BenchSpec) -> list[str]:
    """One line per configuration whose own precision replaces the run's (``--precision`` or the --config file's)."""
    from lightning_perf.benchmark.configs import get_config

    notes = []
    origin = f" (from {spec.precision_from})" if spec.precision_from else ""
    for name in spec.names:
        own = get_config(name).trainer_kwargs.get("precision")
        if own is not None and str(own) != spec.precision:
            notes.append(f"{name}: precision {own} overrides {spec.precision}{origin}")
    return notes


def _peak_lookup(
    spec: BenchSpec, machine: dict[str, Any], peak: PeakFn | None, known: dict[tuple[str, bool], Any] | None = None
) -> Callable[[str], Any]:
    """config -> its peak, asked once per (precision, fast float32 matmuls) setting (kept in ``known``)."""
    bf16 = machine.get("cpu_bf16_instructions")
    ask = peak or (lambda d, p, f: machine_peak(d, p, f, cpu_bf16_instructions=bool(bf16)))
    known = {} if known is None else known

    def lookup(config: str) -> Any:
        setting = matmul_setting(config, spec.precision)
        if setting not in known:
            known[setting] = ask(spec.device, *setting)
        return known[setting]

    return lookup


def _peak_rows(peaks: dict[tuple[str, bool], Any]) -> list[dict[str, Any]]:
    """The peaks the MFU was taken against, one per (precision, fast float32 matmuls) setting, for the results file."""
    return [
        {"precision": precision, "fast_fp32_matmul": fast, "peak_flops_per_second": p.flops_per_second,
         "source": p.source, "causes": list(p.causes)}
        for (precision, fast), p in peaks.items()
    ]  # fmt: skip


def _run_in_subprocess(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
    result = run_isolated(spec, tmp, timeout_s, name="lightning-perf-bench")
    if result is None:
        return RunResult(spec=asdict(spec), ok=False, error=f"timed out after {timeout_s:.0f} s")
    return result


def _median(values: Sequence[float | int | None]) -> float | None:
    """The median of the values present (``None`` and NaN dropped), or ``None`` when there are none."""
    present = sorted(float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    return median(present) if present else None


def _step_samples(result: RunResult) -> list[float]:
    return list(result.step_times_s) or ([result.step_median_s] if result.step_median_s else [])


_MEDIAN_FIGURES = ("throughput", "warmup_s", "model_init_s", "first_batch_s", "first_forward_s",
                   "peak_memory_bytes", "step_memory_bytes", "predict_step_median_s", "predict_throughput",
                   "final_train_loss")  # fmt: skip
"""The one-per-run figures a summary takes the median of over its repeats (``first_step_s`` is the first process's:
the cold one, where the configuration's processes share a compile cache)."""


def summarize_runs(results: dict[str, list[RunResult]]) -> list[ConfigSummary]:
    """Aggregate per-repeat results into one summary per configuration, with ratios paired against baseline."""
    baseline_by_repeat = {r.spec["repeat"]: r for r in results.get(BASELINE, []) if r.ok}
    summaries = []
    for name, runs in results.items():
        summary = ConfigSummary(config=name)
        ok = sorted((r for r in runs if r.ok), key=lambda r: r.spec.get("repeat", 0))
        summary.runs = len(ok)
        if not ok:
            summary.skipped = next((r.skipped for r in runs if r.skipped), None)
            if summary.skipped is None:
                summary.error = next((r.error for r in runs if r.error), "no result")
            summaries.append(summary)
            continue
        failures = [r.error for r in runs if r.error]
        if failures:
            summary.error = f"{len(failures)} of {len(runs)} runs failed: {failures[0]}"
        medians = [r.step_median_s for r in ok if r.step_median_s is not None]
        summary.step_median_s = median_of_repeats([_step_samples(r) for r in ok]) if medians else None
        summary.step_min_s, summary.step_max_s = min(medians), max(medians)
        summary.step_times_s = [list(r.step_times_s) for r in ok]
        summary.predict_step_times_s = [list(r.predict_step_times_s) for r in ok if r.predict_step_times_s]
        pooled = [t for r in ok for t in r.step_times_s]
        if pooled:
            summary.step_p10_s, summary.step_p90_s = percentile(pooled, 10.0), percentile(pooled, 90.0)
        for figure in _MEDIAN_FIGURES:
            setattr(summary, figure, _median([getattr(r, figure, None) for r in ok]))
        summary.first_step_s = next((r.first_step_s for r in runs if r.ok and r.first_step_s), None)  # in run order
        summary.flops_per_step = next((r.flops_per_step for r in ok if r.flops_per_step), None)
        if summary.flops_per_step is None:
            summary.flops_error = next((r.flops_error for r in ok if r.flops_error), None)
        inference = ok[0].spec.get("stage", "fit") != "fit"
        if inference:
            for q in ("50", "95", "99"):
                summary.inference[f"latency_p{q}_s"] = _median([getattr(r, f"latency_p{q}_s") for r in ok])
        if name == BASELINE:
            summary.speedup = 1.0
        elif paired := [
            (baseline_by_repeat[r.spec["repeat"]], r) for r in ok if r.spec["repeat"] in baseline_by_repeat
        ]:
            _paired_ratios(summary, paired)
            summary.paired_baseline_step_s = median_of_repeats([_step_samples(b) for b, _ in paired])
            if inference:
                _inference_ratios(summary, paired)
        summaries.append(summary)
    _share_flops(summaries)
    return summaries


def _share_flops(summaries: list[ConfigSummary]) -> None:
    """The FLOPs are those of the untransformed workload, counted on repeat 0: a row without that repeat (the
    winners' stack, measured in later rounds) takes baseline's count, so its MFU is known too."""
    base = next((s for s in summaries if s.config == BASELINE), None)
    for s in summaries:
        if base is not None and s.flops_per_step is None and s.flops_error is None and s.runs:
            s.flops_per_step = base.flops_per_step


def _paired_baseline_notes(summaries: list[ConfigSummary]) -> list[str]:
    """Where a row's ratio pairs with baseline runs whose step differs from the baseline row's (which spans every
    baseline repeat, the stack's rounds included): the figure its ratio used."""
    base = next((s for s in summaries if s.config == BASELINE and s.step_median_s), None)
    notes = []
    for s in summaries:
        paired, shown = s.paired_baseline_step_s, base.step_median_s if base is not None else None
        if base is None or s is base or not paired or not shown or abs(paired / shown - 1) <= 0.02:
            continue
        notes.append(
            f"{s.config}: its speed-up pairs with baseline's runs of the same repeats, {paired * 1e3:.1f} ms a step "
            f"(the baseline row, {shown * 1e3:.1f} ms, spans all {base.runs})"
        )
    return notes


INFERENCE_RATIOS: dict[str, tuple[str, bool, tuple[str, str]]] = {
    # name: (RunResult figure, larger is better, (verdict above 1, verdict below 1)). Time ratios are speed-ups,
    # baseline / configuration, so > 1 is faster throughout.
    "latency_p50_speedup": ("latency_p50_s", False, ("faster", "slower")),
    "latency_p95_speedup": ("latency_p95_s", False, ("faster", "slower")),
    "latency_p99_speedup": ("latency_p99_s", False, ("faster", "slower")),
    "predict_throughput_ratio": ("predict_throughput", True, ("faster", "slower")),
    "first_batch_speedup": ("first_batch_s", False, ("faster", "slower")),
    "warmup_speedup": ("warmup_s", False, ("faster", "slower")),
    "peak_memory_ratio": ("peak_memory_bytes", True, ("more memory", "less memory")),
}
"""The ratios an inference stage reports against baseline, each with its interval and verdict."""


def _inference_ratios(summary: ConfigSummary, paired: list[tuple[RunResult, RunResult]]) -> None:
    """The inference figures against baseline: the median latency from the per-batch samples (bootstrap or t), the
    tail percentiles and the one-per-run figures paired per repeat (an interval from two repeats on)."""
    for name, (figure, larger_better, (above, below)) in INFERENCE_RATIOS.items():
        if figure == "latency_p50_s":
            pairs = [(b.predict_step_times_s, r.predict_step_times_s) for b, r in paired]
        else:
            pairs = [([getattr(b, figure)], [getattr(r, figure)]) for b, r in paired]
        pairs = [(b, r) for b, r in pairs if b and r and all(v is not None and v > 0 for v in (*b, *r))]
        if not pairs:
            continue
        if larger_better:  # configuration / baseline
            summary.set_estimate(name, _ratio([r for _, r in pairs], [b for b, _ in pairs], above_one=above,
                                                    below_one=below))  # fmt: skip
        else:  # baseline / configuration
            summary.set_estimate(name, _ratio([b for b, _ in pairs], [r for _, r in pairs]))


def _paired_ratios(summary: ConfigSummary, paired: list[tuple[RunResult, RunResult]]) -> None:
    steps = [(_step_samples(b), _step_samples(r)) for b, r in paired]
    steps = [(b, r) for b, r in steps if b and r]
    if steps:
        summary.set_estimate("speedup", _ratio([b for b, _ in steps], [r for _, r in steps]))
        ratios = [_median(b) / _median(r) for b, r in steps]  # type: ignore[operator]
        summary.speedup_min, summary.speedup_max = min(ratios), max(ratios)
    memory = [
        (r.step_memory_bytes, b.step_memory_bytes) for b, r in paired if b.step_memory_bytes and r.step_memory_bytes
    ]
    if memory:
        estimate = _ratio([float(m) for m, _ in memory], [float(m) for _, m in memory], "more memory", "less memory")
        summary.set_estimate("memory_ratio", estimate)
    predict = [
        (b.predict_step_times_s or [b.predict_step_median_s], r.predict_step_times_s or [r.predict_step_median_s])
        for b, r in paired
        if b.predict_step_median_s and r.predict_step_median_s
    ]
    if predict and changes_inference(summary.config):  # a training-only change leaves inference as it was
        summary.set_estimate("predict_speedup", _ratio([b for b, _ in predict], [r for _, r in predict]))


def changes_inference(config: str) -> bool:
    """Whether ``config`` applies to an inference stage (its entries' ``stages``): a fit-only one (a fused optimizer,
    checkpointing) gets no predict ratio, which would only measure noise."""
    from lightning_perf.benchmark.configs import get_config

    try:
        stages = get_config(config).stages
    except ValueError:
        return True
    return any(stage in stages for stage in INFERENCE_STAGES)


def mark_disturbed(summaries: Sequence[ConfigSummary], reliability: Reliability, watched: Sequence[Any]) -> None:
    """Flag the rows whose figures a disturbance touched: their own runs, or baseline's (every ratio pairs with it)."""
    hit = {(r.config, r.repeat) for r in watched if r.label in reliability.disturbed_runs}
    by_config = {config for config, _ in hit}
    for s in summaries:
        own = s.config in by_config or s.config in reliability.disturbed_configs
        via_baseline = (
            s.config != BASELINE
            and s.speedup is not None
            and (BASELINE in by_config or BASELINE in reliability.disturbed_configs)
        )
        s.disturbed = own or via_baseline


def add_likely_causes(summaries: Sequence[ConfigSummary], machine: dict[str, Any], spec: BenchSpec) -> None:
    """Name a likely cause for each configuration slower than baseline, from the optimizations' slowdown causes whose
    facts hold for its run (:data:`~lightning_perf.optimizations.RUN_FACTS`)."""
    import lightning_perf.optimizations as optimizations

    base = next((s for s in summaries if s.config == BASELINE), None)
    for s in summaries:
        if s.speedup_verdict != "slower":
            continue
        facts = _run_facts(s, base, machine, spec)
        parts = [o for part in s.config.split("+") if (o := optimizations.find(part)) is not None]
        causes = [c.text for o in parts for c in o.slowdown_causes if optimizations.holds(c.when, facts)]
        s.likely_cause = "; ".join(causes[:2]) or None


def _run_facts(
    s: ConfigSummary, base: ConfigSummary | None, machine: dict[str, Any], spec: BenchSpec
) -> dict[str, bool]:
    """What the bench knows about ``s``'s run (the facts a :class:`~lightning_perf.optimizations.SlowdownCause`
    names): bf16 emulated on a CPU without bf16 instructions; a warm-up longer than baseline's by more than the steady
    state saved over the run's steps (and by more than half of baseline's)."""
    not_amortized = False
    if base is not None and s.warmup_s is not None and base.warmup_s is not None:
        saved = ((base.step_median_s or 0.0) - (s.step_median_s or 0.0)) * spec.steps
        not_amortized = s.warmup_s - base.warmup_s > max(saved, 0.5 * base.warmup_s)
    return {
        "bf16_emulated": not spec.device.startswith("cuda") and machine.get("cpu_bf16_instructions") is False,
        "warmup_not_amortized": not_amortized,
    }


def _command_for(spec: BenchSpec) -> str:
    args = ["lightning-perf", "bench", "--workload", spec.workload, "--configs", ",".join(spec.names)]
    args += ["--preset", str(spec.preset), "--steps", str(spec.steps), "--warmup-steps", str(spec.warmup_steps)]
    args += ["--repeats", str(spec.repeats), "--device", spec.device, "--precision", spec.precision]
    if spec.batch_size is not None:
        args += ["--batch-size", str(spec.batch_size)]
    return shlex.join(args)
