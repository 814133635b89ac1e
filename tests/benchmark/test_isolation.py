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


class Spin:
    """A model source that burns half a second of CPU time, then fails (no training)."""

    def build(self, spec: Any) -> Any:
        import time

        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass
        raise RuntimeError("spun")


def _threads() -> int | None:
    """The threads a run must ask for to be forked: the fork server's, once an earlier test started it."""
    if not isolation._server_env:
        return 1
    value = isolation._server_env[0].get("OMP_NUM_THREADS")
    return None if value is None else int(value)


def _seen(result: Any) -> dict[str, str]:
    assert result is not None and not result.ok
    text = result.error.split("RuntimeError: ", 1)[1]
    return dict(item.split("=", 1) for item in text.split())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
def test_runs_fork_from_the_server_each_with_its_own_compile_cache(tmp_path: Path) -> None:
    threads = _threads()
    first = _seen(
        isolation.run_isolated(RunSpec(config="compile", threads=threads), tmp_path, 60.0, source=EnvReport())
    )
    second = _seen(
        isolation.run_isolated(RunSpec(config="baseline", threads=threads), tmp_path, 60.0, source=EnvReport())
    )
    assert first["cache"] != second["cache"]
    assert all(Path(seen["cache"]).is_relative_to(tmp_path) for seen in (first, second))
    assert first["threads"] == second["threads"] == str(threads)
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
def test_a_forked_runs_cpu_time_is_the_bench_s_own_not_another_process_s(tmp_path: Path) -> None:
    from lightning_perf.profiling.reliability import RUN_STARTERS, Probes

    own_cpu = Probes.system().own_cpu
    isolation.run_isolated(
        RunSpec(config="baseline", threads=_threads()), tmp_path, 60.0, source=EnvReport()
    )  # server up
    before = own_cpu()
    result = isolation.run_isolated(RunSpec(config="baseline", threads=_threads()), tmp_path, 60.0, source=Spin())
    assert result is not None and "spun" in result.error
    assert own_cpu() - before >= 0.45  # reaped by the fork server, counted through it
    assert RUN_STARTERS and all(pid != os.getpid() for pid in RUN_STARTERS)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
def test_a_run_after_the_callers_directory_or_path_changed_is_spawned_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolation.run_isolated(
        RunSpec(config="baseline", threads=_threads()), tmp_path, 60.0, source=EnvReport()
    )  # server up
    code = tmp_path / "code"
    code.mkdir()
    (code / "later_source.py").write_text(
        "import os\nclass Source:\n    def build(self, spec):\n        raise RuntimeError('cwd=' + os.getcwd())\n"
    )
    monkeypatch.syspath_prepend(str(code))  # after the server started: only the caller has it
    monkeypatch.chdir(code)
    import later_source  # type: ignore[import-not-found]

    result = isolation.run_isolated(
        RunSpec(config="baseline", threads=_threads()), tmp_path, 60.0, source=later_source.Source()
    )
    assert result is not None and result.error.endswith(f"RuntimeError: cwd={code}")
    assert isolation._start_method({}) == "spawn"  # the fork server has another directory and path


class MainDefined(EnvReport):
    """As a snapshot of objects whose classes live in the caller's ``__main__`` says of itself."""

    defined_in_main = True


def test_objects_of_classes_from_main_run_in_a_spawned_process(tmp_path: Path) -> None:
    result = isolation.run_isolated(
        RunSpec(config="baseline", threads=_threads()), tmp_path, 60.0, source=MainDefined()
    )
    assert _seen(result)["parent"] == str(os.getpid())  # spawned by this process: it imports __main__ again
