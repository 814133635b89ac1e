"""The benchmark harness (``lightning-perf bench``), its configuration registry and the pytest-benchmark helper."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_perf._lazy import lazy_exports

# Names load on first use, so that a light user of one module (`lightning-perf compare` reads JSON only) does not
# pay for torch, psutil or Lightning through this package's __init__.
_EXPORTS = {
    "available_configs": "lightning_perf.benchmark.configs",
    "BenchConfig": "lightning_perf.benchmark.configs",
    "BenchSpec": "lightning_perf.benchmark.spec",
    "run_bench": "lightning_perf.benchmark.session",
    "benchmark_training_steps": "lightning_perf.benchmark.pytest_helpers",
    "get_config": "lightning_perf.benchmark.configs",
}

__all__ = [
    "BenchConfig",
    "BenchSpec",
    "available_configs",
    "benchmark_training_steps",
    "get_config",
    "run_bench",
]

if TYPE_CHECKING:
    from lightning_perf.benchmark.configs import (
        BenchConfig,
        available_configs,
        get_config,
    )
    from lightning_perf.benchmark.pytest_helpers import benchmark_training_steps
    from lightning_perf.benchmark.session import run_bench
    from lightning_perf.benchmark.spec import BenchSpec


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
