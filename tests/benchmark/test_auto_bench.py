"""``--repeats auto`` and the winners' stack through the runner, with scripted runs and a scripted clock."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from lightning_perf.benchmark.console import console_lines
from lightning_perf.benchmark.runner import run_benchmark
from lightning_perf.benchmark.spec import BenchSpec, RunSpec
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling import PeakFlops

STEP = {BASELINE: 0.2, "channels_last": 0.12, "fused_optimizer": 0.18, "channels_last+fused_optimizer": 0.11}


class Quiet:
    """A condition monitor that sees an idle machine."""

    def start(self) -> None:
        return None

    def stop(self, token, label, config=None, repeat=None):
        from lightning_perf.profiling.reliability import RunConditions

        return RunConditions(label=label, wall_s=10.0, other_cores=0.0, steal_share=0.0, load_average=None,
                             frequency_share=None, config=config, repeat=repeat)  # fmt: skip


def scripted(noise: float, clock: list[float], ran: list[tuple[str, int]]):
    def run(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        clock[0] += 10.0
        ran.append((spec.config, spec.repeat))
        rng = np.random.default_rng(zlib.crc32(f"{spec.config}-{spec.repeat}".encode()))
        drift = 1 + noise * rng.standard_normal()  # process to process
        steps = (STEP[spec.config] * drift * (1 + 0.01 * rng.standard_normal(8))).tolist()
        return RunResult(spec={"config": spec.config, "repeat": spec.repeat}, batch_size=4,
                         step_median_s=float(np.median(steps)), step_times_s=steps, warmup_s=1.0)  # fmt: skip

    return run


def bench(noise: float, budget: float) -> tuple[object, list[tuple[str, int]]]:
    clock, ran = [0.0], []
    spec = BenchSpec(configs="channels_last,fused_optimizer", device="cpu", preset="tiny", time_budget_s=budget,
                     predict_batches=0)  # fmt: skip
    report = run_benchmark(spec, run=scripted(noise, clock, ran), clock=lambda: clock[0], monitor=Quiet(),
                           peak=lambda *a: PeakFlops(None, "unknown: test"))  # fmt: skip
    return report, ran


def test_quiet_runs_settle_and_end_with_the_measured_stack() -> None:
    report, ran = bench(noise=0.005, budget=600)
    assert report.settling["mode"] == "auto" and report.settling["stopped"].startswith("every ratio settled")
    stack = "channels_last+fused_optimizer"
    assert report.recommendation["stack"] == stack
    rows = {s.config: s for s in report.summaries}
    assert rows[stack].speedup is not None and rows[stack].speedup_verdict == "faster"
    assert all(rows[c].settled for c in ("channels_last", "fused_optimizer", stack))
    # the stack's runs pair with baseline's runs of the same (later) rounds, interleaved
    first_stack = ran.index((stack, next(r for c, r in ran if c == stack)))
    assert (BASELINE, ran[first_stack][1]) in ran[first_stack - 1 : first_stack + 2]
    lines = console_lines(report)
    assert all(len(line) <= 80 for line in lines) and "…" not in "\n".join(lines)
    assert any(line.startswith("Recommendation: channels_last+fused_optimizer:") for line in lines)
    assert any("FusedOptimizerCallback()" in line for line in lines)


def test_noisy_runs_stop_at_the_budget_and_say_what_would_settle_them() -> None:
    report, ran = bench(noise=0.15, budget=120)
    assert report.settling["stopped"].startswith("time budget spent")
    assert len(ran) * 10.0 <= 120 + 30  # the minimum rounds aside, no round starts past the budget
    unsettled = [s for s in report.summaries if s.unsettled]
    assert unsettled and all(s.unsettled.startswith("unsettled after ") for s in unsettled)
    text = "\n".join(console_lines(report))
    assert "would settle it to +-5%" in text


def test_fixed_repeats_keep_their_count() -> None:
    clock, ran = [0.0], []
    spec = BenchSpec(configs="channels_last", device="cpu", preset="tiny", repeats=3, predict_batches=0)
    report = run_benchmark(spec, run=scripted(0.005, clock, ran), clock=lambda: clock[0], monitor=Quiet(),
                           peak=lambda *a: PeakFlops(None, "unknown: test"))  # fmt: skip
    assert [c for c, _ in ran].count("channels_last") == 3 and report.settling == {"mode": "fixed", "rounds": 3}
    assert report.recommendation["stack"] == "channels_last"  # a single winner: its own row is the figure


def test_a_disturbed_winner_is_measured_again_and_never_recommended_from_the_disturbed_run() -> None:
    """A pip install beside the first round: fused_optimizer's disturbed run looks 4x faster; quiet, it is slower."""
    from lightning_perf.profiling.reliability import RunConditions

    class BusyOnce(Quiet):
        def stop(self, token, label, config=None, repeat=None):
            busy = (config, repeat) == ("fused_optimizer", 0) and not getattr(self, "seen", False)
            self.seen = getattr(self, "seen", False) or busy
            return RunConditions(label=label, wall_s=10.0, other_cores=8.0 if busy else 0.0, steal_share=0.0,
                                 load_average=None, frequency_share=None, config=config, repeat=repeat)  # fmt: skip

    clock, ran, attempts = [0.0], [], []
    quiet = scripted(0.005, clock, ran)

    def run(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        result = quiet(spec, tmp, timeout_s)
        attempts.append((spec.config, spec.repeat))
        if spec.config == "fused_optimizer":  # quiet: 10% slower than baseline; the disturbed first try: 4x faster
            first = attempts.count(("fused_optimizer", 0)) == 1 and spec.repeat == 0
            result.step_times_s = [s * (0.25 if first else 1.22) for s in result.step_times_s]
            result.step_median_s = float(np.median(result.step_times_s))
        return result

    spec = BenchSpec(configs="channels_last,fused_optimizer", device="cpu", preset="tiny", repeats=3, predict_batches=0)
    report = run_benchmark(spec, run=run, clock=lambda: clock[0], monitor=BusyOnce(),
                           peak=lambda *a: PeakFlops(None, "unknown: test"))  # fmt: skip
    assert attempts.count(("fused_optimizer", 0)) == 2  # measured again at the round's end
    rows = {s.config: s for s in report.summaries}
    assert rows["fused_optimizer"].speedup < 1 and rows["fused_optimizer"].runs == 3
    assert report.recommendation["stack"] == "channels_last"
    assert any(n.startswith("1 repeat re-run (disturbed, kept out of the figures): other processes' load")
               for n in report.notes)  # fmt: skip


def test_a_short_budget_buys_the_minimum_repeats_with_shorter_runs() -> None:
    # Each run takes 10 s: the first round (30 s) already spends a 30 s budget, the two more rounds an interval needs
    # would overrun it by 60 s, so their runs time the fewest steps; every configuration still gets 3 paired repeats.
    clock, ran, steps = [0.0], [], {}
    quiet = scripted(0.005, clock, ran)

    def run(spec: RunSpec, tmp: Path, timeout_s: float) -> RunResult:
        steps[(spec.config, spec.repeat)] = spec.steps
        return quiet(spec, tmp, timeout_s)

    spec = BenchSpec(configs="channels_last,fused_optimizer", device="cpu", preset="tiny", time_budget_s=30,
                     predict_batches=0)  # fmt: skip
    report = run_benchmark(spec, run=run, clock=lambda: clock[0], monitor=Quiet(),
                           peak=lambda *a: PeakFlops(None, "unknown: test"), stack_phase=False)  # fmt: skip
    assert {s for (_, r), s in steps.items() if r == 0} == {20}
    assert {s for (_, r), s in steps.items() if r > 0} == {5}
    assert all(s.speedup_n == 3 for s in report.summaries if s.config != BASELINE)
    assert any(n.startswith("the runs after the first round timed 5 steps, not 20") for n in report.notes)
