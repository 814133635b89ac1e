"""The stopping rule of ``--repeats auto``: scripted intervals and a scripted clock, no process, no timing."""

from __future__ import annotations

import pytest

from lightning_perf.benchmark.settle import (
    STOP_BUDGET,
    STOP_MAX,
    STOP_SETTLED,
    Settling,
    is_settled,
    relative_half_width,
    repeats_to_settle,
    unsettled_text,
)
from lightning_perf.benchmark.stack import MIN_EVIDENCE_REPEATS
from lightning_perf.profiling.intervals import METHOD_SINGLE, METHOD_T, RatioEstimate, paired_ratio
from tests._models import ScriptedClock


def estimate(ratio: float, half: float, n: int, method: str = METHOD_T) -> RatioEstimate:
    return RatioEstimate(ratio, ratio * (1 - half), ratio * (1 + half), method, "faster", n)


def run_round(settling: Settling, clock: ScriptedClock, configs, seconds: float = 10.0) -> None:
    for name in configs:
        clock.now += seconds
        settling.record_run(name, seconds)


def test_settled_means_within_target_both_sides() -> None:
    assert is_settled(estimate(1.5, 0.04, 5))
    assert not is_settled(estimate(1.5, 0.06, 5))
    skewed = RatioEstimate(2.0, 1.98, 2.2, METHOD_T, "faster", 6)  # +10% above, -1% below
    assert relative_half_width(skewed) == pytest.approx(0.1)
    assert not is_settled(skewed)
    assert relative_half_width(RatioEstimate(1.2, 1.2, 1.2, METHOD_SINGLE, "x", 1)) is None


def test_projection_follows_one_over_sqrt_n() -> None:
    # A t interval of +-10% from 8 repeats: t(7)/sqrt(8) = 0.836; +-5% needs t(n-1)/sqrt(n) <= 0.418: n = 25.
    assert repeats_to_settle(estimate(1.3, 0.10, 8)) == 25
    assert repeats_to_settle(estimate(1.3, 0.04, 8)) == 8  # already settled
    assert repeats_to_settle(RatioEstimate(1.0, 1.0, 1.0, METHOD_SINGLE, "x", 1)) is None
    # The projection is what a real interval does: the same spread measured over more repeats narrows as predicted.
    pattern = [1.0, 1.1, 0.95, 1.05]
    few = paired_ratio([[2.0 * p] for p in pattern * 2], [[1.0]] * 8)
    many = paired_ratio([[2.0 * p] for p in pattern * 8], [[1.0]] * 32)
    need = repeats_to_settle(few, relative_half_width(many) * 1.05)  # type: ignore[operator]
    assert need is not None and 24 <= need <= 34


def test_repeats_are_bought_with_fewer_steps_where_the_budget_asks() -> None:
    # 3 configurations, first round 3 x 20 s (20 steps of 0.5 s and 10 s of start-up): 60 s of a 100 s budget spent,
    # 2 more rounds (120 s) would overrun by 80 s: each of their 6 runs drops ceil(80 / (6 * 0.5)) = 27 steps: floor 5.
    clock = ScriptedClock(1000.0)
    settling = Settling(time_budget_s=100, clock=clock)
    assert settling.min_repeats == 3 == MIN_EVIDENCE_REPEATS
    run_round(settling, clock, ["baseline", "a", "b"], seconds=20.0)
    assert settling.steps_within_budget(20, 0.5, ["baseline", "a", "b"], 1) == 5
    # A 200 s budget: 60 + 120 = 180 s fits, the steps stay.
    roomy = Settling(time_budget_s=200, clock=clock)
    run_round(roomy, clock, ["baseline", "a", "b"], seconds=20.0)
    assert roomy.steps_within_budget(20, 0.5, ["baseline", "a", "b"], 1) == 20
    # A 150 s budget: 30 s over, 6 runs: 10 steps fewer each.
    mid = Settling(time_budget_s=150, clock=clock)
    run_round(mid, clock, ["baseline", "a", "b"], seconds=20.0)
    assert mid.steps_within_budget(20, 0.5, ["baseline", "a", "b"], 1) == 10
    assert mid.steps_within_budget(20, 0.5, ["baseline", "a", "b"], 3) == 20  # the minimum done: nothing to buy


def test_stops_when_every_ratio_settles() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(target=0.05, time_budget_s=600, min_repeats=2, clock=clock)
    run_round(settling, clock, ["baseline", "a", "b"])
    first = settling.decide({"a": estimate(1.5, 0.03, 1), "b": estimate(1.2, 0.2, 1)}, repeats=1)
    assert not first.stop and first.active == ("baseline", "a", "b")  # the minimum, settled or not
    run_round(settling, clock, first.active)
    second = settling.decide({"a": estimate(1.5, 0.03, 2), "b": estimate(1.2, 0.2, 2)}, repeats=2)
    assert not second.stop
    # a is narrow, but a speed-up needs MIN_EVIDENCE_REPEATS (3) repeats to be recommended: it runs once more.
    assert second.active == ("baseline", "a", "b")
    assert (second.unsettled[0].config, second.unsettled[0].repeats_needed) == ("a", MIN_EVIDENCE_REPEATS)
    assert "a recommendation needs 3 repeats" in unsettled_text(second.unsettled[0])
    run_round(settling, clock, second.active)
    third = settling.decide({"a": estimate(1.5, 0.03, 3), "b": estimate(1.2, 0.2, 3)}, repeats=3)
    assert not third.stop and third.active == ("baseline", "b")  # a settled: only baseline and b run again
    run_round(settling, clock, third.active)
    fourth = settling.decide({"a": estimate(1.5, 0.03, 3), "b": estimate(1.2, 0.045, 4)}, repeats=4)
    assert fourth.stop and fourth.reason == STOP_SETTLED and not fourth.unsettled


def test_a_slower_or_unclear_ratio_settles_on_its_width_alone() -> None:
    slower = RatioEstimate(0.8, 0.78, 0.82, METHOD_T, "slower", 2)
    assert is_settled(slower) and not is_settled(estimate(1.5, 0.03, 2)) and is_settled(estimate(1.5, 0.03, 3))


def test_stops_at_the_budget_and_reports_unsettled() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(target=0.05, time_budget_s=100, min_repeats=2, clock=clock)
    for repeat in (1, 2, 3):
        run_round(settling, clock, ["baseline", "a"], seconds=15.0)
        decision = settling.decide({"a": estimate(1.1, 0.15, repeat)}, repeats=repeat)
        if decision.stop:
            break
    # 3 rounds of 30 s: 90 s spent, the next round (30 s) would end past 100 s.
    assert decision.stop and decision.reason == STOP_BUDGET and repeat == 3
    (item,) = decision.unsettled
    assert item.config == "a" and item.repeats == 3
    assert item.repeats_needed is not None and item.repeats_needed > 3
    assert item.seconds_needed == pytest.approx((item.repeats_needed - 3) * 30.0)
    text = unsettled_text(item)
    assert text.startswith("unsettled after 3 repeats (+-15%): about ")
    assert "would settle it to +-5%" in text and "min" in text


def test_the_budget_keeps_a_reserve_and_the_minimum_always_runs() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(time_budget_s=30, min_repeats=2, clock=clock)
    run_round(settling, clock, ["baseline", "a"], seconds=20.0)  # 40 s: past the budget already
    assert not settling.decide({"a": estimate(1.1, 0.3, 1)}, repeats=1).stop  # the minimum runs regardless
    clock2 = ScriptedClock(1000.0)
    settling2 = Settling(time_budget_s=100, min_repeats=2, clock=clock2)
    for _ in (1, 2):
        run_round(settling2, clock2, ["baseline", "a"], seconds=10.0)
    assert not settling2.decide({"a": estimate(1.1, 0.3, 2)}, repeats=2).stop  # 40 + 20 <= 100
    assert settling2.decide({"a": estimate(1.1, 0.3, 2)}, repeats=2, reserve_s=50).reason == STOP_BUDGET


def test_stops_at_max_repeats_and_skips_failed_configs() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(time_budget_s=10_000, min_repeats=1, max_repeats=2, clock=clock)
    run_round(settling, clock, ["baseline", "a", "broken"])
    decision = settling.decide({"a": estimate(1.1, 0.3, 1), "broken": None}, repeats=1)
    assert decision.active == ("baseline", "a")
    run_round(settling, clock, decision.active)
    assert settling.decide({"a": estimate(1.1, 0.3, 2), "broken": None}, repeats=2).reason == STOP_MAX


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"target": 0}, "target"),
        ({"target": 1.5}, "target"),
        ({"time_budget_s": 0}, "time_budget_s"),
        ({"min_repeats": 0}, "min_repeats"),
        ({"min_repeats": 3, "max_repeats": 2}, "max_repeats"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, word) -> None:
    with pytest.raises(ValueError, match=word):
        Settling(**kwargs)


def test_the_spec_and_the_command_line_default_to_the_rule_s_defaults() -> None:
    from lightning_perf.benchmark.settle import DEFAULT_TARGET, DEFAULT_TIME_BUDGET_S
    from lightning_perf.benchmark.spec import BenchSpec
    from lightning_perf.cli import bench

    fields = BenchSpec.__dataclass_fields__
    assert (fields["target"].default, fields["time_budget_s"].default) == (DEFAULT_TARGET, DEFAULT_TIME_BUDGET_S)
    assert bench.DEFAULT_TIME_BUDGET_S == DEFAULT_TIME_BUDGET_S and bench.setting("target")("5%") == 0.05


def test_a_spread_too_wide_to_settle_says_so() -> None:
    from lightning_perf.benchmark.settle import Unsettled

    text = unsettled_text(Unsettled("a", 2, 8.5, None, None))
    assert text == "unsettled after 2 repeats (+-850%): the spread is too wide for repeats to settle it to +-5%; " \
        "quiet the machine"  # fmt: skip


def test_a_would_be_winner_gets_its_third_repeat_past_the_budget_up_to_the_stretch_cap() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(target=0.05, time_budget_s=100, min_repeats=2, clock=clock)
    for _ in (1, 2):
        run_round(settling, clock, ["baseline", "win", "unclear"], seconds=20.0)  # 120 s: the budget is spent
    estimates = {"win": estimate(1.5, 0.1, 2), "unclear": estimate(1.0, 0.2, 2)}
    decision = settling.decide(estimates, repeats=2)
    # only the would-be winner (and baseline, its pairs) runs again: 120 + 40 <= 2 x 100
    assert not decision.stop and decision.active == ("baseline", "win")
    run_round(settling, clock, ["baseline", "win"], seconds=20.0)
    done = settling.decide({"win": estimate(1.5, 0.1, 3), "unclear": estimate(1.0, 0.2, 2)}, repeats=3)
    assert done.stop and done.reason == STOP_BUDGET  # it has its evidence; nothing else is worth the overrun
    capped = Settling(target=0.05, time_budget_s=100, min_repeats=2, clock=(late := ScriptedClock(1000.0)))
    for _ in (1, 2):
        run_round(capped, late, ["baseline", "win"], seconds=45.0)  # 180 s: one more round would end at 270 s
    assert capped.decide({"win": estimate(1.5, 0.1, 2)}, repeats=2).reason == STOP_BUDGET


def test_the_evidence_round_does_not_wait_on_the_stack_reserve() -> None:
    clock = ScriptedClock(1000.0)
    settling = Settling(target=0.05, time_budget_s=150, min_repeats=2, clock=clock)
    for _ in (1, 2):
        run_round(settling, clock, ["baseline", "fused", "attention"], seconds=31.0)  # 186 s, as the lm main job
    estimates = {"fused": estimate(0.96, 0.08, 2), "attention": estimate(1.34, 0.08, 2)}
    decision = settling.decide(estimates, repeats=2, reserve_s=132.0)
    assert not decision.stop and decision.active == ("baseline", "attention")  # 186 + 62 <= 300
