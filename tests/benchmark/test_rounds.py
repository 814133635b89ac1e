"""The bench's schedule: interleaved rounds, fixed or until settled, with scripted runs and a scripted clock."""

from __future__ import annotations

import pytest

from lightning_perf.benchmark.rounds import rotated, run_rounds
from lightning_perf.benchmark.settle import STOP_BUDGET, STOP_SETTLED, Settling
from lightning_perf.profiling.intervals import METHOD_T, RatioEstimate
from tests._models import ScriptedClock


def test_rotation() -> None:
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]


def test_fixed_repeats_interleave_every_configuration() -> None:
    ran = []
    out = run_rounds(["baseline", "a"], lambda n, r: ran.append((n, r)) or (n, r), repeats=3)
    assert ran == [("baseline", 0), ("a", 0), ("a", 1), ("baseline", 1), ("baseline", 2), ("a", 2)]
    assert out.rounds == 3 and out.decision is None and len(out.results["a"]) == 3


def test_auto_repeats_drop_settled_configurations_and_stop() -> None:
    clock = ScriptedClock(0.0)
    ran = []

    def run_one(name: str, repeat: int):
        clock.now += 10
        ran.append((name, repeat))
        return repeat

    def estimates_of(results):
        n = len(results["b"])
        half = 0.19 / n  # b narrows with each repeat; a is settled from the start
        return {"a": RatioEstimate(1.5, 1.45, 1.55, METHOD_T, "faster", len(results["a"])),
                "b": RatioEstimate(1.2, 1.2 * (1 - half), 1.2 * (1 + half), METHOD_T, "faster", n)}  # fmt: skip

    settling = Settling(time_budget_s=1000, min_repeats=2, clock=clock)
    out = run_rounds(["baseline", "a", "b"], run_one, settling=settling, estimates_of=estimates_of)
    assert out.decision is not None and out.decision.reason == STOP_SETTLED
    assert [r for n, r in ran if n == "a"] == [0, 1, 2]  # narrow from the start, settled at 3: a win needs 3
    assert [r for n, r in ran if n == "b"] == [0, 1, 2, 3]  # 0.19/4 < +-5%
    assert [r for n, r in ran if n == "baseline"] == [0, 1, 2, 3]


def test_a_later_phase_continues_the_numbering_within_the_budget() -> None:
    clock = ScriptedClock(0.0)

    def run_one(name: str, repeat: int):
        clock.now += 20
        return repeat

    wide = {"s": RatioEstimate(1.3, 1.0, 1.6, METHOD_T, "no clear difference", 2)}
    settling = Settling(time_budget_s=100, min_repeats=2, clock=clock)
    results = {"baseline": [0, 1]}
    out = run_rounds(["baseline", "s"], run_one, settling=settling, estimates_of=lambda r: wide, first_repeat=2,
                     results=results)  # fmt: skip
    assert out.results["baseline"] == [0, 1, 2, 3] and out.results["s"] == [2, 3]
    assert out.decision is not None and out.decision.reason == STOP_BUDGET  # 80 s spent, a round needs 40
    assert out.decision.unsettled[0].config == "s"


def test_needs_one_way_to_stop() -> None:
    with pytest.raises(ValueError, match="repeats"):
        run_rounds(["baseline"], lambda n, r: None)
    with pytest.raises(ValueError, match="estimates_of"):
        run_rounds(["baseline"], lambda n, r: None, settling=Settling())


def test_a_disturbed_run_is_measured_again_at_the_round_end_and_the_budget_stretches() -> None:
    clock = ScriptedClock(0.0)
    ran: list[tuple[str, int]] = []
    busy = {("a", 0)}  # a load that has passed by the round's end

    def run_one(name: str, repeat: int):
        clock.now += 10
        ran.append((name, repeat))
        return (name, repeat, len(ran))

    def disturbed(result) -> str | None:
        name, repeat, attempt = result
        return "other processes' load" if (name, repeat) in busy and attempt <= 2 else None

    out = run_rounds(["baseline", "a"], run_one, repeats=2, disturbed=disturbed)
    assert ran == [("baseline", 0), ("a", 0), ("a", 0), ("a", 1), ("baseline", 1)]
    assert [r[:2] for r in out.results["a"]] == [("a", 0), ("a", 1)]  # the disturbed first try kept out
    assert out.set_aside == [("a", 0, "other processes' load")]
    # Under --repeats auto the time lost stretches the budget, up to max_stretch times it; a second try is kept.
    settling = Settling(time_budget_s=100, min_repeats=1, max_stretch=2.0, clock=clock)
    settling.lose(30)
    assert settling.budget_s == 130 and settling.can_stretch
    settling.lose(500)
    assert settling.budget_s == 200 and not settling.can_stretch
    always = run_rounds(["baseline", "a"], run_one, repeats=1, disturbed=lambda result: "steal")
    assert len(always.results["a"]) == 1 and len(always.set_aside) == 2  # each run tried twice, the second kept


@pytest.mark.parametrize("stretch", [2.0, 1.0])
def test_rounds_that_no_longer_count_are_set_aside_once_their_time_counted_lost(stretch: float) -> None:
    clock, ran, asked = ScriptedClock(0.0), [], []

    def run_one(name: str, repeat: int):
        clock.now += 10 if len(ran) < 2 else 5  # the threads were chosen again after the first round: faster runs
        ran.append((name, repeat))
        return (name, repeat, len(ran))

    def rethink(rounds: int) -> str | None:  # asked after each run: the first round's runs both count, then not
        asked.append(rounds)
        return "measured at 1 thread" if len(asked) == 2 else None

    wide = {"a": RatioEstimate(1.3, 1.0, 1.6, METHOD_T, "no clear difference", 2)}
    settling = Settling(time_budget_s=30, min_repeats=2, clock=clock, max_stretch=stretch)
    out = run_rounds(["baseline", "a"], run_one, settling=settling, estimates_of=lambda r: wide, rethink=rethink)
    if stretch == 1.0:  # no time left to measure them again: the rounds are kept as they are
        assert asked == [] and out.set_aside == [] and out.results["a"] == [("a", 0, 2), ("a", 1, 3)]
        return
    assert asked == [1, 1, 1, 1, 2, 2, 3, 3]
    assert out.set_aside == [("baseline", 0, "measured at 1 thread"), ("a", 0, "measured at 1 thread")]
    # The fresh rounds are numbered from 0 again and are the only ones in the results.
    assert out.results["baseline"] == [("baseline", 0, 3), ("baseline", 1, 6), ("baseline", 2, 7)]
    assert out.results["a"] == [("a", 0, 4), ("a", 1, 5), ("a", 2, 8)]
    # 20 s lost to the set-aside round: the budget holds three fresh rounds of 10 s after it.
    assert out.rounds == 3 and out.decision is not None and out.decision.reason == STOP_BUDGET
    assert settling.budget_s == 50
    assert settling.mean_run_s("a") == 5.0  # the projections start from the fresh rounds' pace
