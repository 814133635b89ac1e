"""Mechanisms of ``benchmarks/checkpoint_budget_curve.py``: the variants train the same model, the turns and the
paired ratios (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_perf.demos import make_workload
from lightning_perf.functional.checkpoint.apply import checkpointed_modules

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_budget_curve.py"


@pytest.fixture(scope="module")
def curve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("checkpoint_budget_curve", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def tiny_vit() -> tuple[torch.nn.Module, list[object]]:
    torch.manual_seed(0)
    model, data = make_workload("vit", "tiny", seed=0)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    return model, [next(loader) for _ in range(2)]


def test_every_variant_trains_the_same_model_through_the_library(curve: ModuleType) -> None:
    base, batches = tiny_vit()
    _, plans = curve.plan_on_warm_step(base, batches[0], curve.BUDGETS, warmup=1)
    runners = [curve.build_runner(name, base, plans) for name in curve.VARIANTS]
    assert checkpointed_modules(base) == []  # the plain model is left plain
    for runner in runners:
        patched = checkpointed_modules(runner.model)
        assert bool(patched) == (runner.name not in curve.PLAIN), runner.name
        if runner.name in plans:
            assert sorted(patched) == sorted(plans[runner.name].regions)
        for batch in batches:
            runner.step(batch)
    reference = dict(runners[0].model.named_parameters())
    for runner in runners[1:]:
        for name, param in runner.model.named_parameters():
            torch.testing.assert_close(param, reference[name], msg=f"{runner.name}: {name}")


def test_turns_rotate_and_ratios_pair_rounds(curve: ModuleType) -> None:
    base, batches = tiny_vit()
    runners = [curve.build_runner(name, base, {}) for name in ("none", "none-again")]
    order: list[str] = []
    for runner in runners:
        runner.step = lambda batch, name=runner.name: (order.append(name), (1, 1))[1]
    curve.run_rounds(runners, batches, rounds=2, steps=2, log=False)
    assert order == ["none", "none", "none-again", "none-again", "none-again", "none-again", "none", "none"]
    runners[0].thread_ns = [[100, 110], [200, 220], [100, 100], [300, 310], [150, 150]]
    runners[1].thread_ns = [[200, 220], [400, 440], [200, 200], [600, 620], [300, 300]]
    full = curve.Runner("full", None, None, "full")
    full.thread_ns = [[1.5 * 2**0.5 * statistics.median(r)] for r in runners[0].thread_ns]
    estimates = curve.ratios([*runners, full], "thread")
    assert estimates["full"].ratio == pytest.approx(1.5)  # over the geometric mean of the two plain models
    assert estimates["none"] is None
    est = estimates["none-again"]
    assert est.ratio == pytest.approx(2.0) and est.low <= 2.0 <= est.high and est.n == 5  # A/A: over none alone


def test_main_prints_the_curve_and_explains_the_plans(curve: ModuleType, tmp_path: Path, capsys) -> None:
    out = tmp_path / "curve.json"
    argv = ["--workload", "vit", "--preset", "tiny", "--rounds", "2", "--steps", "1", "--warmup", "1"]
    results = curve.main([*argv, "--explain", "--json", str(out)])
    printed = capsys.readouterr().out
    assert set(results) == set(curve.VARIANTS) and out.exists()
    assert "MiB freed per ms" in printed and "| budget-0.5 |" in printed and "| none-again |" in printed
    assert results["none"]["step_x_none"] is None and len(results["none-again"]["step_x_none"]) == 3
    assert results["budget-0.25"]["activations_x_none"] < results["budget-0.75"]["activations_x_none"]
    with pytest.raises(SystemExit, match="Unknown variants"):
        curve.main([*argv, "--variants", "none,bogus"])
