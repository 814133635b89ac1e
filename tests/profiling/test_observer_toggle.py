"""The observer benchmark's within-fit toggle (examples/observer_overhead.py): states alternate by block, the pairs
leave out each block's first step, and the observer comes back to its place."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "observer_overhead.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("observer_overhead", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pairs_take_adjacent_off_on_blocks_without_their_first_step(example):
    block = 3
    on = [True, False, False, True, True, True, False, False, False, True, True, True]
    durations = [math.nan, 9.0, 1.0, 9.0, 2.0, 2.0, 9.0, 1.0, 1.0, 9.0, 4.0, 4.0]
    ons, offs = example.toggled_pairs(durations, on, block, warmup=0)
    # the block at 0 holds an "on" step (the fit starts observed): only the pair starting at 6 counts
    assert (ons, offs) == ([4.0], [1.0])
    assert example.toggled_pairs(durations, on, block, warmup=7) == ([], [])


class Counter(pl.Callback):
    def __init__(self) -> None:
        self.ends = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.ends += 1


def test_toggle_alternates_and_gives_the_observer_its_hooks_back(example, tmp_path):
    observer = Counter()
    toggle = example.Toggle(observer, block=5)
    model, data = example.workload("short", 40)
    trainer = pl.Trainer(max_steps=40, accelerator="cpu", devices=1, callbacks=[observer, toggle],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, data)
    assert toggle.on[:15] == [True] + [False] * 4 + [True] * 5 + [False] * 5
    assert observer.ends == sum(toggle.on)  # its hook ran in the "on" steps only
    assert trainer.callbacks.index(observer) == trainer.callbacks.index(toggle) - 1  # back at its place


def test_toggle_swaps_a_profiler_and_restores_it(example, tmp_path):
    from lightning.pytorch.profilers import SimpleProfiler

    profiler = SimpleProfiler(dirpath=tmp_path, filename="simple")
    toggle = example.Toggle(profiler, block=4)
    model, data = example.workload("short", 24)
    trainer = pl.Trainer(max_steps=24, accelerator="cpu", devices=1, callbacks=[toggle], profiler=profiler,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, data)
    assert trainer.profiler is profiler
    assert toggle.on[:8] == [True] + [False] * 3 + [True] * 4
