"""pytest-benchmark timings of N training steps per reference workload, under baseline and each configuration.

Not part of the default run. Side by side, and comparable across commits::

    pytest tests/benchmarks --benchmark-only --benchmark-group-by=group
    pytest tests/benchmarks --benchmark-only --benchmark-autosave      # then, on another commit:
    pytest tests/benchmarks --benchmark-only --benchmark-compare

``LP_BENCH_PRESET=tiny`` shrinks the workloads (for a quick look); the default preset is what docs report.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_perf.benchmark import available_configs, benchmark_training_steps, get_config
from lightning_perf.demos import make_workload, workload_names

PRESET = os.environ.get("LP_BENCH_PRESET", "default")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = [name for name in available_configs() if get_config(name).why_not(DEVICE) is None]


@pytest.mark.benchmark
@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("workload", workload_names())
def test_training_steps(benchmark, workload: str, config_name: str) -> None:
    config = get_config(config_name)
    benchmark.group = f"{workload}-{PRESET}-{DEVICE.type}"
    benchmark.name = config_name
    torch.manual_seed(0)
    model, data = make_workload(workload, PRESET, seed=0)
    trainer_kwargs = {"accelerator": DEVICE.type, "devices": 1, **config.trainer_kwargs}
    if config.strategy is not None:
        trainer_kwargs["strategy"] = config.strategy()
    benchmark_training_steps(
        benchmark,
        model,
        data,
        callbacks=config.callbacks(),
        steps=5,
        warmup_steps=3,
        rounds=5,
        trainer_kwargs=trainer_kwargs,
    )
    assert benchmark.extra_info["step_median_s"] > 0
