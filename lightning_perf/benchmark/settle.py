"""When to stop adding repeats: the rule behind ``lightning-perf bench --repeats auto``.

A comparison is *settled* when its ratio's 95% interval lies within ``+-target`` of its estimate (5% by default). The
bench runs interleaved rounds (one repeat of baseline and of every configuration still unsettled) and asks
:meth:`Settling.decide` after each round whether to go on. It stops when every ratio has settled, when the next round
would not end within the time budget, or at ``max_repeats``. A ratio that did not settle is reported with how many
repeats, and how much more time, would settle it at the spread measured so far: the t interval's width shrinks as
``t(n-1)/sqrt(n)``.

Every ratio gets :data:`DEFAULT_MIN_REPEATS` paired repeats first, whatever the budget: the interval is a t interval
over repeats (it holds the variation between processes), and with fewer the t quantile makes it useless. Where those
rounds would not end within the budget at the first round's pace, the later runs time fewer steps
(:meth:`Settling.steps_within_budget`): repeats buy more certainty than steps do, because the spread between
processes, not the steps' noise, decides the interval. Stopping on the interval's width, not on its side of 1, moves
the false-verdict rate of :mod:`lightning_perf.profiling.intervals` little: simulated A/A benches (3 to 12 rounds,
5-30% spread per process) got a verdict 5-6% of the time (1,000 each), 1% at a 2% spread.

Pure logic over the ratios' intervals and a clock: :class:`Settling` takes an injectable ``clock`` (seconds, any
origin), so a test drives it with a scripted clock and scripted intervals, no process and no timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_perf._validation import check_int, check_number, is_number
from lightning_perf.benchmark.stack import MIN_EVIDENCE_REPEATS
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling.intervals import RatioEstimate, t_critical_95

__all__ = [
    "DEFAULT_MAX_REPEATS",
    "DEFAULT_MIN_REPEATS",
    "DEFAULT_TARGET",
    "DEFAULT_TIME_BUDGET_S",
    "MIN_STEPS",
    "Decision",
    "Settling",
    "Unsettled",
    "is_settled",
    "relative_half_width",
    "repeats_to_settle",
    "unsettled_item",
    "unsettled_text",
]

DEFAULT_TARGET = 0.05
"""A ratio is settled when its 95% interval lies within +-5% of its estimate."""
DEFAULT_TIME_BUDGET_S = 150.0
"""Seconds of measuring for the no-argument bench (single configurations and the winners' stack): on a 2-core CPU the
default convnet bench then ends within about three minutes, start-up and the report included."""
DEFAULT_MIN_REPEATS = 3
"""Repeats every configuration gets before the rule may stop, within the budget or not (shorter runs if need be): the
least for a t interval over processes that can exclude 1 (its quantile is 12.7 at 2 repeats, 4.3 at 3), and the
repeats a recommendation needs (:data:`~lightning_perf.benchmark.stack.MIN_EVIDENCE_REPEATS`)."""
MIN_STEPS = 5
"""The fewest timed steps a run is shortened to (a median of fewer is mostly one step's noise)."""
DEFAULT_MAX_REPEATS = 30
"""A cap on repeats per configuration, whatever the budget (past it, a ratio that has not settled is a drift of the
machine, which more repeats do not remove)."""

STOP_SETTLED = "every ratio settled"
STOP_BUDGET = "time budget spent"
STOP_MAX = "maximum repeats reached"


def relative_half_width(estimate: RatioEstimate) -> float | None:
    """The larger distance from the estimate to an end of its interval, relative to the estimate (0.05: +-5%); None
    without an interval."""
    if not estimate.has_interval or not estimate.ratio > 0:
        return None
    return max(estimate.ratio - estimate.low, estimate.high - estimate.ratio) / estimate.ratio


def is_settled(estimate: RatioEstimate, target: float = DEFAULT_TARGET) -> bool:
    """Whether the 95% interval of ``estimate`` lies within ``+-target`` of it, and a speed-up that looks like a win
    has the repeats a recommendation needs (:data:`~lightning_perf.benchmark.stack.MIN_EVIDENCE_REPEATS`)."""
    width = relative_half_width(estimate)
    if width is None or width > target:
        return False
    return not (estimate.low > 1.0 and estimate.n < MIN_EVIDENCE_REPEATS)


def _wants_evidence(estimate: RatioEstimate | None) -> bool:
    """A speed-up whose interval lies above 1 from fewer repeats than a recommendation needs."""
    return estimate is not None and estimate.low > 1.0 and estimate.n < MIN_EVIDENCE_REPEATS


def _width_factor(n: int) -> float:
    """How the t interval's width depends on the number of repeats ``n``, up to the spread: ``t(n-1)/sqrt(n)``."""
    return t_critical_95(max(n - 1, 1)) / math.sqrt(n)


def repeats_to_settle(estimate: RatioEstimate, target: float = DEFAULT_TARGET, limit: int = 10_000) -> int | None:
    """The number of repeats at which the interval of ``estimate`` would lie within ``+-target``, at the spread it
    shows now (``estimate.n`` when it already does); None without an interval or past ``limit``."""
    width = relative_half_width(estimate)
    if width is None:
        return None
    n = max(estimate.n, 1)
    if width <= target:  # settled, or a would-be winner short of the repeats a recommendation needs
        return max(n, MIN_EVIDENCE_REPEATS) if estimate.low > 1.0 else n
    if width == math.inf:
        return None
    now = _width_factor(n)
    return next((c for c in range(n + 1, limit + 1) if width * _width_factor(c) / now <= target), None)


@dataclass(frozen=True)
class Unsettled:
    """A ratio whose interval is still wider than the target, and what would settle it.

    Attributes:
        config: the configuration.
        repeats: the paired repeats measured.
        half_width: the interval's relative half-width now (0.12: +-12%).
        repeats_needed: the repeats that would settle it at the measured spread (None: unknown).
        seconds_needed: the further measuring time that would take, from the runs' mean durations (None: unknown).
    """

    config: str
    repeats: int
    half_width: float | None
    repeats_needed: int | None
    seconds_needed: float | None


@dataclass(frozen=True)
class Decision:
    """What :meth:`Settling.decide` concluded after a round.

    Attributes:
        stop: no further round.
        reason: why it stopped (:data:`STOP_SETTLED`, :data:`STOP_BUDGET`, :data:`STOP_MAX`), or ``""``.
        active: the configurations the next round measures (baseline first), empty when it stops.
        unsettled: every ratio that has not settled (also when going on).
    """

    stop: bool
    reason: str
    active: tuple[str, ...] = ()
    unsettled: tuple[Unsettled, ...] = ()


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def unsettled_text(item: Unsettled, target: float = DEFAULT_TARGET) -> str:
    """``"unsettled after 3 repeats (+-12%): about 14 repeats (~2 min 10 s more) would settle it to +-5%"``."""
    width = "" if item.half_width is None else f" (+-{item.half_width:.0%})"
    text = f"unsettled after {item.repeats} repeat{'s' if item.repeats != 1 else ''}{width}"
    if item.repeats_needed is None and item.half_width is not None:
        return text + f": the spread is too wide for repeats to settle it to +-{target:.0%}; quiet the machine"
    if item.repeats_needed is None:
        return text + f": no interval to project from; more repeats would settle it to +-{target:.0%}"
    more = "" if item.seconds_needed is None else f" (~{_clock_text(item.seconds_needed)} more)"
    if item.half_width is not None and item.half_width <= target:  # narrow enough, too few repeats to win
        return text + f": a recommendation needs {item.repeats_needed} repeats{more}"
    return text + f": about {item.repeats_needed} repeats{more} would settle it to +-{target:.0%}"


def unsettled_item(
    config: str, estimate: RatioEstimate, target: float = DEFAULT_TARGET, settling: Settling | None = None
) -> Unsettled:
    """What would settle ``config``'s ratio: the repeats, and with ``settling`` the further seconds they would take."""
    needed = repeats_to_settle(estimate, target)
    seconds = None
    if needed is not None and settling is not None:
        seconds = max(needed - estimate.n, 0) * settling.round_s([BASELINE, config])
    return Unsettled(config, estimate.n, relative_half_width(estimate), needed, seconds)


@dataclass
class Settling:
    """Adds repeats until every ratio settles or the time runs out (``--repeats auto``).

    Args:
        target: the relative half-width at which a ratio's interval counts as settled (0.05: +-5%).
        time_budget_s: seconds of measuring from the first call of :meth:`start` (or construction).
        min_repeats: repeats every configuration gets before the rule may stop.
        max_repeats: repeats after which it stops anyway.
        max_stretch: the budget grows by the time lost to disturbed runs measured again, up to this multiple; a
            would-be winner short of the repeats a recommendation needs gets them within this multiple too.
        clock: seconds (any origin), e.g. ``time.perf_counter``; a test passes a scripted one.

    Example::

        settling = Settling(target=0.05, time_budget_s=120)
        active = names
        while True:
            for name in active:  # interleaved, baseline first
                settling.record_run(name, seconds_it_took)
            decision = settling.decide({name: speedup_estimate(name) for name in names if name != "baseline"}, done)
            if decision.stop:
                break
            active = decision.active
    """

    target: float = DEFAULT_TARGET
    time_budget_s: float = DEFAULT_TIME_BUDGET_S
    min_repeats: int = DEFAULT_MIN_REPEATS
    max_repeats: int = DEFAULT_MAX_REPEATS
    clock: Callable[[], float] = time.perf_counter
    max_stretch: float = 2.0
    _start: float | None = field(default=None, init=False, repr=False)
    _lost_s: float = field(default=0.0, init=False, repr=False)
    _durations: dict[str, list[float]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not is_number(self.target) or not 0 < self.target < 1:
            raise ValueError(f"`Settling(target={self.target!r})` is not valid. Expected a fraction in (0, 1).")
        check_number("Settling", "time_budget_s", self.time_budget_s, 0.0, exclusive=True)
        for name in ("min_repeats", "max_repeats"):
            check_int("Settling", name, getattr(self, name), 1)
        if self.max_repeats < self.min_repeats:
            raise ValueError(
                f"`Settling(max_repeats={self.max_repeats!r})` is not valid. Expected at least min_repeats "
                f"({self.min_repeats})."
            )
        self.start()

    def start(self) -> None:
        """Start the budget's clock (construction does; call again to restart it)."""
        self._start = self.clock()

    @property
    def elapsed_s(self) -> float:
        """Seconds since :meth:`start`."""
        return self.clock() - (self._start if self._start is not None else self.clock())

    @property
    def budget_s(self) -> float:
        """The time budget stretched by the seconds lost to disturbed runs, at most ``max_stretch`` times it."""
        return self.time_budget_s + min(self._lost_s, (self.max_stretch - 1.0) * self.time_budget_s)

    @property
    def can_stretch(self) -> bool:
        """Whether the budget may still grow for a run measured again."""
        return self._lost_s < (self.max_stretch - 1.0) * self.time_budget_s

    def lose(self, seconds: float, pace: bool = False) -> None:
        """A disturbed run took ``seconds`` that measured nothing usable: the budget grows by them (up to the cap);
        ``pace``: the runs so far ran as later ones will not (other threads), so the projections forget them."""
        self._lost_s += max(0.0, float(seconds))
        if pace:
            self._durations.clear()

    @property
    def remaining_s(self) -> float:
        """Seconds of the budget left (negative once overspent)."""
        return self.budget_s - self.elapsed_s

    def record_run(self, config: str, seconds: float) -> None:
        """One run of ``config`` took ``seconds`` (wall, start-up included): the projections use the mean."""
        self._durations.setdefault(config, []).append(float(seconds))

    def mean_run_s(self, config: str) -> float | None:
        """The mean duration of ``config``'s runs so far (None before its first)."""
        runs = self._durations.get(config)
        return sum(runs) / len(runs) if runs else None

    def round_s(self, configs: Sequence[str]) -> float:
        """The projected duration of one round of ``configs`` (a configuration not yet run counts as the mean run)."""
        known = [d for runs in self._durations.values() for d in runs]
        fallback = sum(known) / len(known) if known else 0.0
        return sum(m if (m := self.mean_run_s(c)) is not None else fallback for c in configs)

    def steps_within_budget(self, steps: int, step_s: float, configs: Sequence[str], repeats: int) -> int:
        """The timed steps per run that let the rounds up to :attr:`min_repeats` end within the budget, after
        ``repeats`` rounds of ``configs`` at ``steps`` steps of ``step_s`` seconds (at least :data:`MIN_STEPS`, at
        most ``steps``): a run's other costs (start-up, warm-up) stay, so the steps pay for the whole overrun."""
        rounds_left = self.min_repeats - repeats
        over = self.elapsed_s + rounds_left * self.round_s(configs) - self.budget_s
        if rounds_left <= 0 or over <= 0 or not step_s > 0:
            return steps
        return max(min(MIN_STEPS, steps), steps - math.ceil(over / (rounds_left * len(configs) * step_s)))

    def decide(
        self, estimates: Mapping[str, RatioEstimate | None], repeats: int, *, reserve_s: float = 0.0
    ) -> Decision:
        """After a round: stop, or which configurations the next round measures.

        Args:
            estimates: configuration -> its ratio against baseline (the speed-up) as measured so far; ``None`` for
                one that measured nothing (failed or skipped: it is not run again).
            repeats: rounds done (every active configuration has this many repeats).
            reserve_s: seconds of the budget kept for what comes after (the winners' stack): a round that would eat
                into them is not started.
        """
        unsettled = tuple(
            unsettled_item(name, est, self.target, self)
            for name, est in estimates.items()
            if est is not None and not is_settled(est, self.target)
        )
        active = (BASELINE, *(u.config for u in unsettled))
        if repeats < self.min_repeats:
            # Settled or not, every configuration gets the minimum (one lucky narrow interval is not a settled one).
            measured = tuple(name for name, est in estimates.items() if est is not None)
            return Decision(False, "", (BASELINE, *measured), unsettled)
        if not unsettled:
            return Decision(True, STOP_SETTLED, (), ())
        if repeats >= self.max_repeats:
            return Decision(True, STOP_MAX, (), unsettled)
        if self.elapsed_s + self.round_s(active) + reserve_s > self.budget_s:
            # A would-be winner short of the repeats a recommendation needs gets them past the budget (up to
            # ``max_stretch`` times it, with baseline for its pairs; the reserve for a stack is not kept for it, the
            # stack then has what is left): otherwise a slow machine never gets an answer.
            wanting = tuple(u.config for u in unsettled if _wants_evidence(estimates[u.config]))
            evidence = (BASELINE, *wanting)
            if wanting and self.elapsed_s + self.round_s(evidence) <= self.max_stretch * self.time_budget_s:
                return Decision(False, "", evidence, unsettled)
            return Decision(True, STOP_BUDGET, (), unsettled)
        return Decision(False, "", active, unsettled)
