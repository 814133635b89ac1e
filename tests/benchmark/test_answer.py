"""The report's settling and recommendation entries, from scripted summaries."""

from __future__ import annotations

from lightning_perf.benchmark.answer import estimates_from, recommendation_record, settling_record
from lightning_perf.benchmark.results import ConfigSummary
from lightning_perf.benchmark.settle import STOP_BUDGET, STOP_SETTLED, Decision, Settling
from lightning_perf.benchmark.stack import choose_stack
from lightning_perf.profiling.intervals import METHOD_T, RatioEstimate


def summary(config: str, ratio: float | None = None, low: float = 0, high: float = 0, n: int = 4) -> ConfigSummary:
    s = ConfigSummary(config=config, runs=n, step_median_s=0.1)
    if ratio is None:
        s.speedup = 1.0
    else:
        verdict = "faster" if low > 1 else "slower" if high < 1 else "no clear difference"
        s.set_estimate("speedup", RatioEstimate(ratio, low, high, METHOD_T, verdict, n))
    return s


def test_settling_record_marks_rows_and_says_what_would_settle_them() -> None:
    rows = [summary("baseline"), summary("a", 1.5, 1.47, 1.53), summary("b", 1.1, 0.95, 1.25)]
    clock = iter(range(0, 1000, 10)).__next__
    settling = Settling(time_budget_s=100, clock=lambda: float(clock()))
    for name in ("baseline", "a", "b"):
        settling.record_run(name, 10.0)
    record = settling_record(settling, [Decision(True, STOP_BUDGET)], 4, rows)
    assert record["mode"] == "auto" and record["stopped"] == STOP_BUDGET and record["rounds"] == 4
    assert rows[1].settled is True and rows[1].unsettled is None
    assert rows[2].settled is False and rows[2].unsettled.startswith("unsettled after 4 repeats (+-14%)")
    assert [u["config"] for u in record["unsettled"]] == ["b"]
    assert settling_record(None, [], 3, rows) == {"mode": "fixed", "rounds": 3}
    # singles stopped at the budget, then the stack settled: the two are told apart, not run together
    both = settling_record(settling, [Decision(True, STOP_BUDGET), Decision(True, STOP_SETTLED)], 5, rows)
    assert both["stopped"] == f"{STOP_BUDGET}; the winners' stack: {STOP_SETTLED}"


def test_recommendation_record_of_a_measured_stack() -> None:
    rows = [summary("baseline"), summary("channels_last", 1.6, 1.5, 1.7), summary("fused_optimizer", 1.1, 1.05, 1.15)]
    stack = choose_stack(estimates_from(rows))
    rows.append(summary(stack.name, 1.72, 1.66, 1.78))
    record = recommendation_record(stack, rows)
    assert record["stack"] == "channels_last+fused_optimizer"
    assert record["speedup"]["speedup"] == 1.72
    assert record["lines"][0] == "Recommendation: channels_last+fused_optimizer: 1.72x [1.66-1.78] speed-up."
    single = recommendation_record(choose_stack(estimates_from(rows[:2])), rows[:2], config_file=True)
    assert single["lines"][0].startswith("Recommendation: channels_last: 1.60x [1.50-1.70]")
    assert single["lines"][1] == "Or in your LightningCLI --config file:"


def test_one_repeat_recommends_nothing_and_says_why() -> None:
    from lightning_perf.profiling.intervals import METHOD_SINGLE

    one = summary("channels_last")
    one.set_estimate("speedup", RatioEstimate(2.0, 2.0, 2.0, METHOD_SINGLE, "one repeat: no interval", 1))
    rows = [summary("baseline"), one]
    lines = recommendation_record(choose_stack(estimates_from(rows)), rows)["lines"]
    assert lines[0].startswith("Recommendation: none yet: with one repeat no speed-up has an interval")


def test_a_stack_measured_by_the_user_that_beat_the_winners_stack_is_recommended() -> None:
    from lightning_perf.benchmark.answer import prefer_measured_stack

    given = "bf16-mixed+flash_attention+compile_regional"
    rows = [summary("baseline"), summary("bf16-mixed", 1.21, 1.09, 1.35), summary("flash_attention", 1.23, 1.12, 1.37)]
    rows.append(summary(given, 1.80, 1.68, 1.98))
    stack = choose_stack(estimates_from(rows))  # the winners, the measured stack passed over
    assert stack.name == "bf16-mixed+flash_attention"
    rows.append(summary(stack.name, 1.47, 1.36, 1.56))
    chosen = prefer_measured_stack(stack, rows)
    assert chosen.name == given
    record = recommendation_record(chosen, rows)
    assert record["stack"] == given and record["lines"][0].startswith(f"Recommendation: {given}: 1.80x [1.68-1.98]")
    rows[3].disturbed = True  # disturbed, slower or without enough evidence: the winners' stack stays
    assert prefer_measured_stack(stack, rows) == stack
    rows[3].disturbed = False
    rows[3] = summary(given, 1.40, 1.30, 1.50)
    assert prefer_measured_stack(stack, rows) == stack
    rows[3] = summary(given, 1.80, 1.68, 1.98, n=2)
    assert prefer_measured_stack(stack, rows) == stack
    # Faster by the point estimate only: its interval overlaps the winners' stack's, so that one stays, and it says so.
    rows[3], notes = summary(given, 1.52, 1.42, 1.62), []
    assert prefer_measured_stack(stack, rows, notes) == stack
    assert notes == [f"{given} 1.52x [1.42-1.62] is not clearly faster than bf16-mixed+flash_attention 1.47x "
                     "[1.36-1.56] (the intervals overlap): the recommendation keeps the latter"]  # fmt: skip
    rows[3] = summary(given, 1.70, 1.57, 1.85)  # clear of it: preferred
    assert prefer_measured_stack(stack, rows, notes).name == given and len(notes) == 1
