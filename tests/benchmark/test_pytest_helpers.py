"""benchmark_training_steps: the same warm-up for every configuration, interleaved rounds, and a verdict that marks a
difference inside the noise. Mechanisms only: the clock is scripted, so nothing depends on this machine's speed."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.benchmark import pytest_helpers
from lightning_perf.benchmark.pytest_helpers import benchmark_training_steps


class FakeBenchmark:
    """pytest-benchmark's fixture, as far as the helper uses it: ``pedantic`` runs setup then target, per round."""

    def __init__(self) -> None:
        self.extra_info: dict[str, Any] = {}
        self.calls: list[dict[str, Any]] = []

    def pedantic(
        self, target: Callable[..., Any], args: tuple = (), setup: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        self.calls.append(kwargs)
        for _ in range(kwargs["rounds"]):
            if setup is not None:
                setup()
            target(*args)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)


class Log(Callback):
    """Records (configuration, steps of the fit) for each fit it takes part in, and who is running now."""

    fits: list[tuple[str, int]] = []
    running: list[str] = []

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Log.running.append(self.name)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Log.fits.append((self.name, trainer.global_step))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    Log.fits, Log.running = [], []
    monkeypatch.setattr(pytest_helpers, "_process_warmed_up", True)


def _script_clock(monkeypatch: pytest.MonkeyPatch, step_s: dict[str, Callable[[int], float]]) -> None:
    """``time.perf_counter_ns`` of the helper: each reading advances by the running configuration's step time."""
    state = {"now": 0, "reads": 0}

    def perf_counter_ns() -> int:
        state["reads"] += 1
        state["now"] += int(step_s[Log.running[-1]](state["reads"]) * 1e9)
        return state["now"]

    monkeypatch.setattr(pytest_helpers, "time", types.SimpleNamespace(perf_counter_ns=perf_counter_ns))


def _run(**kwargs: Any) -> FakeBenchmark:
    bench = FakeBenchmark()
    benchmark_training_steps(
        bench, Tiny(), train_dataloaders=_loader(), **{"steps": 4, "warmup_steps": 2, "rounds": 3, **kwargs}
    )
    return bench


def test_every_configuration_is_warmed_up_the_same_way_and_rounds_interleave(monkeypatch: pytest.MonkeyPatch) -> None:
    _script_clock(monkeypatch, {"a": lambda i: 0.01, "b": lambda i: 0.01})
    bench = _run(callbacks=[Log("a")], compare_with={"b": [Log("b")]}, name="a")
    # Warm-up fits first, one per configuration, the measured one included, each of warmup_steps steps ...
    assert Log.fits[:2] == [("a", 2), ("b", 2)]
    # ... then rounds alternate: b's round runs just before each timed round of a.
    assert Log.fits[2:] == [("b", 4), ("a", 4)] * 3
    assert bench.extra_info["order"] == ["b", "a"] * 3
    assert bench.calls == [{"rounds": 3, "iterations": 1}]
    assert [len(f) for f in bench.extra_info["step_times_s"]] == [3, 3, 3]  # steps - 1 timed per fit


def test_the_first_call_in_a_process_warms_the_process_up_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pytest_helpers, "_process_warmed_up", False)
    _script_clock(monkeypatch, {"a": lambda i: 0.01})
    fits: list[int] = []
    monkeypatch.setattr(pl.Trainer, "fit", _counting(pl.Trainer.fit, fits))
    _run(callbacks=[Log("a")], name="a", rounds=1)
    assert fits == [2, 2, 4]  # a throwaway fit (without the callbacks under test), then a's warm-up, then its round
    assert Log.fits == [("a", 2), ("a", 4)]
    fits.clear()
    _run(callbacks=[Log("a")], name="a", rounds=1)
    assert fits == [2, 4]  # once per process


def _counting(fit: Callable[..., Any], fits: list[int]) -> Callable[..., Any]:
    def counted(self: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        fits.append(self.max_steps)
        return fit(self, *args, **kwargs)

    return counted


def test_a_clear_difference_gets_a_verdict_and_an_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    # a: 10 ms a step; baseline: 20 ms, with a little scatter: a is about 2x faster.
    _script_clock(monkeypatch, {"a": lambda i: 0.010, "baseline": lambda i: 0.020 + 0.0005 * (i % 3)})
    info = _run(callbacks=[Log("a")], compare_with={"baseline": [Log("baseline")]}, name="a", rounds=5).extra_info
    assert info["compared_with"] == "baseline" and info["verdict"] == "faster"
    low, high = info["speedup_ci95"]
    assert 1.0 < low <= info["speedup"] <= high and info["speedup"] == pytest.approx(2.05, rel=0.03)
    assert info["comparisons"]["baseline"]["speedup_verdict"] == "faster"
    assert info["step_median_s"] == pytest.approx(0.010)


def test_a_difference_inside_the_noise_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same step times, scattered: whichever ran first must not look faster.
    noisy = {
        "a": lambda i: 0.010 * (1 + 0.3 * ((i * 7) % 5 - 2) / 2),
        "b": lambda i: 0.010 * (1 + 0.3 * ((i * 3) % 5 - 2) / 2),
    }
    _script_clock(monkeypatch, noisy)
    info = _run(callbacks=[Log("a")], compare_with={"b": [Log("b")]}, name="a", rounds=5).extra_info
    assert info["verdict"] == "no clear difference"
    low, high = info["speedup_ci95"]
    assert low <= 1.0 <= high


def test_a_single_configuration_has_no_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    _script_clock(monkeypatch, {"a": lambda i: 0.01})
    info = _run(callbacks=[Log("a")], name="a").extra_info
    assert "verdict" not in info and "comparisons" not in info and info["step_median_s"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 1}, r"steps=1\)` is not valid. Expected an integer >= 2"),
        ({"rounds": 0}, r"rounds=0\)` is not valid"),
        ({"warmup_steps": -1}, r"warmup_steps=-1\)` is not valid"),
        ({"steps": True}, r"steps=True\)` is not valid"),
        ({"compare_with": ["baseline"]}, r"compare_with=\['baseline'\]\)` is not valid. Expected a dict"),
        ({"compare_with": {"a": []}, "name": "a"}, r"name='a'\)` is also a key of compare_with"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        benchmark_training_steps(FakeBenchmark(), Tiny(), train_dataloaders=_loader(), **kwargs)
