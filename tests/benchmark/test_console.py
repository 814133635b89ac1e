"""The bench's closing output: 80 columns, nothing cut, every ? explained, the recommendation last."""

from __future__ import annotations

from lightning_perf.benchmark.console import console_lines, mark_lines
from lightning_perf.benchmark.results import BenchReport, ConfigSummary
from lightning_perf.profiling.intervals import METHOD_BOOTSTRAP, RatioEstimate


def row(config: str, step_s: float, ratio: float | None, low: float = 0.0, high: float = 0.0, **kw) -> ConfigSummary:
    s = ConfigSummary(config=config, runs=3, step_median_s=step_s, step_min_s=step_s * 0.9, step_max_s=step_s * 1.1)
    if ratio is not None:
        verdict = "faster" if low > 1 else "slower" if high < 1 else "no clear difference"
        s.set_estimate("speedup", RatioEstimate(ratio, low, high, METHOD_BOOTSTRAP, verdict, 3))
    else:
        s.speedup = 1.0
    for key, value in kw.items():
        setattr(s, key, value)
    return s


def report() -> BenchReport:
    cause = "recomputes part of the activations in the backward pass: time for memory"
    summaries = [
        row("baseline", 0.4252, None),
        row("fused_optimizer", 0.450, 0.94, 0.88, 1.01, disturbed=True),
        row("channels_last", 0.262, 1.62, 1.51, 1.82),
        row("grad_checkpoint_budget75", 0.55, 0.77, 0.7, 0.85, likely_cause=cause),
        row("channels_last+fused_optimizer", 0.25, 1.70, 1.6, 1.8),
    ]
    load = ("load average 9.6 on 2 cores during baseline, repeat 2 (above 1.5 per core), with a long tail of "
            "words that would go past eighty columns on any terminal")  # fmt: skip
    runs = ["baseline, repeat 2", "fused_optimizer, repeat 3"]
    reliability = {"reliable": False, "causes": [load], "disturbed_runs": runs, "disturbed_configs": []}
    return BenchReport(
        options={"workload": "convnet", "preset": "default", "device": "cpu", "repeats": None, "steps": 15},
        command="lightning-perf bench",
        summaries=summaries,
        reliability=reliability,
        notes=["fused_optimizer: precision 32-true overrides bf16-mixed (from --config), a note long enough to wrap"],
    )


def test_every_line_fits_80_columns_and_nothing_is_cut() -> None:
    r = report()
    r.settling = {  # type: ignore[attr-defined]
        "mode": "auto", "target": 0.05, "time_budget_s": 150, "rounds": 4, "stopped": "time budget spent",
        "unsettled": [{"config": "fused_optimizer", "text": "unsettled after 4 repeats (+-7%): about 8 repeats "
                       "(~1 min 40 s more) would settle it to +-5%"}],
    }  # fmt: skip
    r.recommendation = {"lines": ["Recommendation: channels_last+fused_optimizer: 1.70x [1.60-1.80] speed-up.",  # type: ignore[attr-defined]
                                  "Add to your Trainer:", "    trainer = Trainer(callbacks=[...])"]}  # fmt: skip
    lines = console_lines(r)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in text
    for name in ("fused_optimizer", "channels_last", "grad_checkpoint_budget75", "(disturbed)", "recomputes"):
        assert name in text
    assert "channels_last+\nfused_optimizer" not in text  # the stack breaks after its '+', each part whole
    assert any(line.startswith("channels_last+") for line in lines)
    assert "fused_optimizer: unsettled after 4 repeats" in text
    assert lines[-1].startswith("    trainer = Trainer(") and "Recommendation:" in lines[-3]


def test_every_question_mark_names_its_cause() -> None:
    r = report()
    warnings = mark_lines(r)
    assert len(warnings) == 1 and warnings[0].startswith("warning: fused_optimizer is marked ?")
    assert "fused_optimizer, repeat 3" in warnings[0] and "load average 9.6" in warnings[0]
    r.summaries[0].disturbed = True  # baseline itself
    r.summaries[2].disturbed = True  # disturbed only through its pairs with baseline
    warnings = mark_lines(r)
    cl = next(w for w in warnings if w.startswith("warning: channels_last is marked"))
    assert "pair with baseline" in cl and "baseline, repeat 2" in cl


def test_columns_with_nothing_measured_are_left_out() -> None:
    lines = console_lines(report())
    header = next(line for line in lines if line.startswith("config"))
    assert "predict" not in header and "memory" not in header and "MFU" not in header
    assert "speed-up" in header and "verdict" in header


def test_cold_first_steps_are_shown_for_the_configurations_that_compile() -> None:
    from lightning_perf.benchmark.console import cold_start_lines

    r = report()
    assert cold_start_lines(r) == []
    r.summaries[2].first_step_s = 49.0  # type: ignore[attr-defined]  # a slow first step alone is no compile
    r.runs = [{"spec": {"config": "channels_last", "repeat": 0}, "ok": True, "first_step_s": 49.0}]
    assert cold_start_lines(r) == []
    r.summaries[2].config = "compile"
    r.runs = [{"spec": {"config": "compile", "repeat": 0}, "ok": True, "first_step_s": 49.0}]
    assert cold_start_lines(r)[0].startswith("compile: cold first step 49.0 s; pays for itself after ~")
