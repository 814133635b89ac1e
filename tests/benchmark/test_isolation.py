"""Each run in a fresh process: forked from a fork server on Linux, with the run's own environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_perf.benchmark import isolation
from lightning_perf.benchmark.spec import RunSpec


class EnvReport:
    """A model source whose build fails with what the run's process sees: its compile cache, threads, parent."""

    def build(self, spec: Any) -> Any:
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        raise RuntimeError(f"cache={cache} threads={os.environ.get('OMP_NUM_THREADS')} parent={os.getppid()}")


def _seen(result: Any) -> dict[str, str]:
    assert result is not None and not result.ok
    text = result.error.split("RuntimeError: ", 1)[1]
    return dict(item.split("=", 1) for item in text.split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
def test_runs_fork_from_the_server_each_with_its_own_compile_cache(tmp_path: Path) -> None:
    first = _seen(isolation.run_isolated(RunSpec(config="compile", threads=1), tmp_path, 60.0, source=EnvReport()))
    second = _seen(isolation.run_isolated(RunSpec(config="baseline", threads=1), tmp_path, 60.0, source=EnvReport()))
    assert first["cache"] != second["cache"]
    assert all(Path(seen["cache"]).is_relative_to(tmp_path) for seen in (first, second))
    assert first["threads"] == second["threads"] == "1"
    # Forked by the server (one process for both), not started by this one.
    assert first["parent"] == second["parent"] != str(os.getpid())


def test_a_run_asking_for_another_start_environment_is_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolation, "_server_env", [])
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr("multiprocessing.forkserver.set_forkserver_preload", lambda names: None)
    assert isolation._start_method({"OMP_NUM_THREADS": "1"}) == "forkserver"
    assert isolation._start_method({"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "x"}) == "forkserver"
    assert isolation._start_method({"OMP_NUM_THREADS": "2"}) == "spawn"  # the server has 1 thread's OpenMP set-up
    monkeypatch.setattr(sys, "platform", "darwin")
    assert isolation._start_method({"OMP_NUM_THREADS": "1"}) == "spawn"
