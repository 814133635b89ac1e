"""The benchmark harness (``lightning-perf bench``), its configuration registry and the pytest-benchmark helper."""

from lightning_perf.benchmark.configs import (
    BenchConfig,
    available_configs,
    get_config,
    register_config,
    resolve_configs,
)
from lightning_perf.benchmark.pytest_helpers import benchmark_training_steps

__all__ = [
    "BenchConfig",
    "available_configs",
    "benchmark_training_steps",
    "get_config",
    "register_config",
    "resolve_configs",
]
