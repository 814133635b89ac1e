"""Synthetic results files for the ``compare`` tests: the bench's JSON (old and new format) and pytest-benchmark's."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np


def step_times(seed: int, n: int = 20, median: float = 0.1) -> list[float]:
    rng = np.random.default_rng(seed)
    return (median * np.exp(rng.normal(0.0, 0.04, n))).tolist()


def bench_results(
    configs: dict[str, float] | None = None,
    *,
    repeats: int = 3,
    steps: int = 20,
    seed: int = 0,
    new_format: bool = True,
    workload: str = "convnet",
    batch_size: int = 32,
    device: str = "cpu",
    cpu: str = "Test CPU",
) -> dict[str, Any]:
    """A bench results file: each configuration's median step time in seconds (``baseline`` 0.1 s by default)."""
    configs = configs or {"baseline": 0.1, "channels_last": 0.08}
    runs, summary = [], []
    for c, (name, median) in enumerate(configs.items()):
        for r in range(repeats):
            times = step_times(seed * 1000 + c * 100 + r, steps, median)
            predict = step_times(seed * 1000 + c * 100 + r + 50, 8, median / 3)
            run: dict[str, Any] = {
                "spec": {"workload": workload, "config": name, "device": device, "repeat": r},
                "ok": True,
                "skipped": None,
                "error": None,
                "batch_size": batch_size,
                "step_times_s": times,
                "throughput": batch_size / float(np.median(times)),
                "step_memory_bytes": 100 * 2**20 + r * 1000,
                "predict_throughput": batch_size / float(np.median(predict)),
            }
            if new_format:
                run |= {"step_median_s": float(np.median(times)), "predict_step_times_s": predict}
                run["predict_step_median_s"] = float(np.median(predict))
            else:
                run |= {"step_s": {"median": float(np.median(times))}, "predict_step_s": {"median": np.median(predict)}}
            runs.append(run)
        summary.append({"config": name, "runs": repeats, "step_median_s": median, "speedup": 0.1 / median})
    data: dict[str, Any] = {
        "schema_version": 1,
        "kind": "lightning-perf-bench",
        "command": "lightning-perf bench",
        "options": {"workload": workload, "preset": "default", "batch_size": None, "device": device},
        "summary": summary,
        "runs": runs,
        "environment": {"cpu": cpu, "cpu_count": 2, "cuda_device": None, "lightning_perf": "0.1.0"},
    }
    if new_format:
        data["machine"] = {"cpu": cpu, "cpu_count": 2, "gpu": None}
        data["run"] = {"git_commit": "0123456789abcdef", "git_dirty": True, "start_time": "2025-01-01T00:00:00"}
    return json.loads(json.dumps(data))  # plain JSON types, as read back from a file


def scaled(data: dict[str, Any], factor: float, configs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A copy of a bench results file whose step times (of ``configs``, default all) are multiplied by ``factor``."""
    out = copy.deepcopy(data)
    for run in out["runs"]:
        if configs is not None and run["spec"]["config"] not in configs:
            continue
        run["step_times_s"] = [t * factor for t in run["step_times_s"]]
        run["throughput"] /= factor
        for key in ("step_median_s",):
            if key in run:
                run[key] *= factor
        if "step_s" in run:
            run["step_s"]["median"] *= factor
    for row in out["summary"]:
        if configs is None or row["config"] in configs:
            row["step_median_s"] *= factor
    return out


def pytest_benchmark_results(
    benchmarks: dict[str, float] | None = None, *, rounds: int = 30, seed: int = 0, save_data: bool = True
) -> dict[str, Any]:
    """A ``pytest --benchmark-json`` file: each benchmark's median round time in seconds."""
    benchmarks = benchmarks or {"test_steps[baseline]": 0.01, "test_steps[channels_last]": 0.008}
    entries = []
    for i, (name, median) in enumerate(benchmarks.items()):
        data = step_times(seed * 1000 + i, rounds, median)
        ordered = sorted(data)
        stats: dict[str, Any] = {
            "min": ordered[0],
            "max": ordered[-1],
            "mean": float(np.mean(data)),
            "stddev": float(np.std(data, ddof=1)),
            "rounds": rounds,
            "median": float(np.median(data)),
            "iqr": 0.0,
            "q1": ordered[rounds // 4],
            "q3": ordered[3 * rounds // 4],
            "ops": 1.0 / float(np.mean(data)),
            "total": float(np.sum(data)),
            "iterations": 1,
        }
        if save_data:
            stats["data"] = data
        entries.append(
            {
                "group": "my-model",
                "name": name,
                "fullname": f"tests/benchmarks/test_model.py::{name}",
                "params": None,
                "param": None,
                "extra_info": {},
                "options": {"disable_gc": False},
                "stats": stats,
            }
        )
    return {
        "machine_info": {"node": "host", "machine": "x86_64", "cpu": {"brand_raw": "Test CPU", "count": 2}},
        "commit_info": {"id": "fedcba9876543210", "dirty": False, "branch": "main"},
        "benchmarks": entries,
        "datetime": "2025-01-01T00:00:00",
        "version": "5.3.1",
    }


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path
