"""The observer benchmark's within-fit toggle (examples/observer_overhead.py): a schedule of random pairs of blocks,
the observer switched as it says and back at its place, every step timed by the toggle under one state."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest

from tests._models import trainer as make_trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "observer_overhead.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("observer_overhead", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pairs_take_each_pairs_on_and_off_block(example):
    on = [True, False, False, False, True, True, True, True, True, True, False, False]
    durations = [math.nan, 1.0, 1.0, 1.0, 2.0, 2.0, 5.0, 9.0, 4.0, 9.0, 1.0, 1.0]
    pairs = [(1, 4, 7), (7, 9, 11), (9, 11, 13)]
    # pair 1: off then on; pair 2's second block switched mid-way (not as planned: skipped);
    # pair 3 runs past the fit's end
    assert example.toggled_pairs(durations, on, pairs) == ([3.0], [1.0])
    assert example.toggled_pairs(durations, on, [(7, 9, 11)]) == ([], [])


def test_schedule_pairs_equal_blocks_of_random_length_and_order(example):
    states, pairs = example.toggle_schedule(steps=400, warmup=10, block=6, seed=3)
    assert len(states) == 400 and all(states[:10]) and all(states[pairs[-1][2] :])
    assert pairs[0][0] == 10 and all(b[0] == a[2] for a, b in itertools.pairwise(pairs))
    lengths = {middle - start for start, middle, _ in pairs}
    assert all(end - middle == middle - start for start, middle, end in pairs)
    assert lengths <= set(range(3, 10)) and len(lengths) > 3  # random lengths, not one period
    firsts = [states[start] for start, _, _ in pairs]
    assert 0 < sum(firsts) < len(firsts)  # both orders
    for start, middle, end in pairs:
        assert len(set(states[start:middle])) == 1 and states[middle:end] == [not states[start]] * (end - middle)
    assert example.toggle_schedule(400, 10, 6, seed=3) == (states, pairs)
    assert example.toggle_schedule(400, 10, 6, seed=4) != (states, pairs)


def test_an_observers_sampled_steps_fall_on_either_side(example):
    states, pairs = example.toggle_schedule(steps=5000, warmup=60, block=6, seed=0)
    for every in (32, 100):
        kept = [states[s] for start, middle, end in pairs for s in range(start, end)
                if s not in (start, middle) and s % every == 5]  # fmt: skip
        assert 0.3 < sum(kept) / len(kept) < 0.7, every


class Counter(pl.Callback):
    def __init__(self) -> None:
        self.ends = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.ends += 1


def toggled_fit(example, root, observer, states):
    """A fit of ``len(states)`` short steps with ``observer`` switched as ``states`` says: (toggle, trainer)."""
    toggle = example.Toggle(observer, states)
    model, data = example.workload("short", len(states))
    trainer = make_trainer(root, max_steps=len(states), callbacks=[observer, toggle])  # the model has no validation
    trainer.fit(model, data)
    return toggle, trainer


def test_toggle_alternates_and_gives_the_observer_its_hooks_back(example, tmp_path):
    observer = Counter()
    states = [True] + [False] * 4 + [True] * 5 + [False] * 5 + [True] * 25
    toggle, trainer = toggled_fit(example, tmp_path, observer, states)
    assert toggle.on[:15] == [True] + [False] * 4 + [True] * 5 + [False] * 5
    assert observer.ends == sum(toggle.on)  # its hook ran in the "on" steps only
    assert len(toggle.ends) == len(toggle.cpu_ends) == len(toggle.on) == 40  # one end per step
    assert trainer.callbacks.index(observer) == trainer.callbacks.index(toggle) - 1  # back at its place


def test_an_observer_switched_off_has_its_optimizer_post_hooks_taken_out(example, tmp_path):
    class Counting(pl.Callback):  # counts optimizer steps in a post-hook, as the observers do between readings
        def __init__(self) -> None:
            self.steps = 0

        def on_fit_start(self, trainer: pl.Trainer, *args: object) -> None:
            trainer.optimizers[0].register_step_post_hook(self.count)

        def count(self, *args: object) -> None:
            self.steps += 1

    observer = Counting()
    states = [True] * 3 + [False] * 6 + [True] * 3 + [False] * 4 + [True] * 14
    toggle, trainer = toggled_fit(example, tmp_path, observer, states)
    assert toggle.on == states and observer.steps == sum(states) == 20  # it saw none of the steps it was off for
    hooks = trainer.optimizers[0]._optimizer_step_post_hooks
    assert [h.__self__ for h in hooks.values()] == [observer] and not toggle._detached  # given back at the end


def test_toggle_swaps_a_profiler_and_restores_it(example, tmp_path):
    from lightning.pytorch.profilers import SimpleProfiler

    profiler = SimpleProfiler(dirpath=tmp_path, filename="simple")
    toggle = example.Toggle(profiler, [True] + [False] * 3 + [True] * 20)
    model, data = example.workload("short", 24)
    trainer = make_trainer(tmp_path, max_steps=24, callbacks=[toggle], profiler=profiler)
    trainer.fit(model, data)
    assert trainer.profiler is profiler
    assert toggle.on[:8] == [True] + [False] * 3 + [True] * 4


def test_toggle_without_observer_follows_the_schedule_and_switches_nothing(example, tmp_path):
    states = [True, False, False, True, True, False] * 4
    toggle = example.Toggle(None, states)
    model, data = example.workload("short", 24)
    trainer = make_trainer(tmp_path, max_steps=24, callbacks=[toggle])
    callbacks = list(trainer.callbacks)
    trainer.fit(model, data)
    assert toggle.on == states and trainer.callbacks == callbacks
