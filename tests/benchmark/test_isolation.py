"""Each run in a fresh process: forked from a fork server on Linux, with the run's own environment."""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.utils import data as torch_data

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
def test_runs_fork_from_the_server_each_with_its_own_compile_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = _threads()
    if isolation._server_env:  # started by an earlier test file's bench (`pytest -n 2`): from its directory, path
        monkeypatch.chdir(isolation._server_env[0]["cwd"])
        monkeypatch.setattr(sys, "path", list(isolation._server_env[0]["sys.path"]))
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


def _sees(path: Path) -> None:
    """Write what this process sees once: its MALLOC_*/OMP_* environment, and whether a 16 MiB block is its own mmap
    (the allocator's settings, which a fork copies whatever the environment says)."""
    import ctypes
    import json

    from lightning_perf.profiling.memory import _MallInfo2

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], _MallInfo2
    before = libc.mallinfo2().hblks
    block = libc.malloc(16 << 20)
    mapped = libc.mallinfo2().hblks > before
    libc.free(block)
    seen = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_"))}
    try:
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as file:
            json.dump({"env": seen, "mapped": mapped}, file)
    except FileExistsError:  # one record per process
        pass


class _Samples(torch_data.Dataset):
    def __init__(self, path: Path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> Any:
        import torch

        if torch_data.get_worker_info() is not None:
            _sees(self.path)
        return torch.ones(8), 0


class LoaderWorkers:
    """A user's model whose data comes from a DataLoader worker (forked at the epoch's start, while the run measures
    memory); the loader worker and a subprocess the build starts report what they see."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def build(self, spec: Any) -> Any:
        import subprocess

        from tests.benchmark._own_models import Classifier, Points

        code = f"from tests.benchmark.test_isolation import _sees; _sees({str(self.folder / 'subprocess.json')!r})"
        subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
        data = Points()
        data.train_dataloader = lambda: torch_data.DataLoader(  # type: ignore[method-assign]
            _Samples(self.folder / "loader.json"), batch_size=4, num_workers=1
        )
        return Classifier(), data


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator's settings are glibc's")
def test_a_runs_loader_workers_and_subprocesses_see_the_users_allocator_and_the_recorded_wait_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's own
    spec = RunSpec(config="baseline", threads=1, wait_policy="PASSIVE", steps=2, warmup_steps=1, predict_batches=0)
    result = isolation.run_isolated(spec, tmp_path, 120.0, source=LoaderWorkers(tmp_path))
    assert result is not None and result.ok, result and result.error
    assert result.wait_policy == "PASSIVE"  # what the process started with, so what its OpenMP read
    for name in ("subprocess", "loader"):
        seen = json.loads((tmp_path / f"{name}.json").read_text())
        assert seen["env"] == {"MALLOC_ARENA_MAX": "4", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}, name
    if multiprocessing.get_all_start_methods()[0] == "fork":  # the platform's default, as a user's loader starts
        # Forked, as a user's would be, and allocating as the timed steps do, not as the memory steps it was forked in.
        assert not json.loads((tmp_path / "loader.json").read_text())["mapped"]
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
