"""The one process-isolation runner: each measured run trains in a fresh process, for the bench and the tuner alike.

Entry point: :func:`run_isolated`. Design notes (fork server, ``spawn``, memory and thread settings of the child):
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.spec import RunSpec
from lightning_perf.benchmark.threads import thread_env
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.profiling import TRUTHFUL_CPU_MEMORY_ENV
from lightning_perf.profiling.reliability import RUN_STARTERS

__all__ = ["run_isolated"]

# What the fork server imports before it forks any run (the worker imports torch and Lightning).
_PRELOAD = ("lightning_perf.benchmark.worker",)
# Read when a process starts (glibc's malloc, OpenMP, the warnings filters): a forked run has its server's values.
_READ_AT_START = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "PYTHONWARNINGS")
_server_env: list[dict[str, Any]] = []  # what the fork server started with (empty: not started by us)


def _start_method(env: dict[str, str]) -> str:
    """``forkserver`` on Linux when the server has (or, not yet started, will have) the environment that a process
    reads at its start that this run asks for, and the caller's working directory and ``sys.path``; else ``spawn``.
    The rest of the environment (the compile cache folders) is set in the child itself (:func:`_child`)."""
    import sys

    if not sys.platform.startswith("linux"):
        return "spawn"
    malloc = sorted({k for k in (*env, *os.environ) if k.startswith("MALLOC_")})
    wanted: dict[str, Any] = {k: env.get(k, os.environ.get(k)) for k in (*_READ_AT_START, *malloc)}
    # The directory and import path a child starts with (a forked one: the server's, where a source is unpickled).
    wanted["cwd"], wanted["sys.path"] = os.getcwd(), list(sys.path)
    if not _server_env:
        from multiprocessing import forkserver

        forkserver.set_forkserver_preload(list(_PRELOAD))
        _server_env.append(wanted)
    return "forkserver" if _server_env[0] == wanted else "spawn"


def _server_pid(context: Any) -> int | None:
    """The fork server's process id, once it runs (None for another start method)."""
    if getattr(context, "_name", None) != "forkserver":
        return None
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


@contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process when the one that started it is gone (killed, not just interrupted)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="lightning-perf-parent-watch", daemon=True).start()


def _child(spec: dict[str, Any], source: Any, result_path: str, log_path: str, env: dict[str, str]) -> None:
    """Body of the child process: build, train and measure, write the result as JSON. ``env`` is the caller's whole
    environment of now, set first (a child forked from the fork server has the server's, from when it started)."""
    import traceback

    from lightning_perf.profiling.memory import fork_at_full_speed

    policy = os.environ.get("OMP_WAIT_POLICY")  # as this process (or its fork server) started: what OpenMP read
    os.environ.clear()
    os.environ.update(env)
    # What this process starts runs as in a user's training: DataLoader workers the platform's default way (not the
    # way this process was started), forked ones allocating at full speed.
    multiprocessing.set_start_method(None, force=True)
    fork_at_full_speed()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _exit_with_parent()
    from lightning_perf._io import atomic_write_text
    from lightning_perf.benchmark.worker import run

    run_spec = RunSpec(**spec)
    try:
        result = run(run_spec, build=None if source is None else source.build)
    except BaseException as exc:  # reported to the parent, which decides whose fault it is
        traceback.print_exc()
        result = RunResult(
            spec=asdict(run_spec), ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()
        )
    result.wait_policy = policy
    atomic_write_text(result_path, json.dumps(asdict(result), default=str))


def run_isolated(
    spec: RunSpec, workdir: Path, timeout_s: float, *, source: Any = None, name: str = "lightning-perf-run"
) -> RunResult | None:
    """Run ``spec`` in a fresh process; its result, or ``None`` when it ran past ``timeout_s`` (it is then killed).

    Args:
        spec: what to run.
        workdir: an existing directory for the result and log files.
        timeout_s: seconds before the process is killed.
        source: builds the model and data module (``source.build(spec)``); ``None``: the reference workload.
        name: the process name (also the stem of its files).
    """
    stem = f"{name}-{spec.config.replace('+', '_')}-{spec.repeat}"
    attempt = 1
    while (workdir / f"{stem}.json").exists() or (workdir / f"{stem}.log").exists():  # a re-run keeps the first's files
        attempt += 1
        stem = f"{name}-{spec.config.replace('+', '_')}-{spec.repeat}-run{attempt}"
    result_path, log_path = workdir / f"{stem}.json", workdir / f"{stem}.log"
    # One compile cache per configuration within the workdir (one bench, one tuning): its first process pays the
    # cold compile, as on a new machine, and its later repeats start warm, as a user's second run does; the report
    # keeps that cold first step apart (benchmark.payback). Nothing is shared between configurations or benches.
    cache = workdir / f"{name}-{spec.config.replace('+', '_')}-compile-cache"
    env = {
        **thread_env(spec.threads, spec.wait_policy),
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    start_env = {**env, **TRUTHFUL_CPU_MEMORY_ENV}  # read by glibc at the start only; the child's os.environ: env
    # Objects of classes defined in the caller's __main__ (ObjectSource.defined_in_main) unpickle in a spawned child,
    # which imports the main script again, not in one forked from the fork server.
    method = "spawn" if getattr(source, "defined_in_main", False) else _start_method(start_env)
    context: Any = multiprocessing.get_context(method)  # spawn or forkserver: both have Process
    args = (asdict(spec), source, str(result_path), str(log_path), {**os.environ, **env})
    process = context.Process(target=_child, args=args, name=name)
    with _environ(start_env):  # a spawned child (and the fork server, started by the first run) inherits it
        process.start()
    if (server := _server_pid(context)) is not None:  # its runs' CPU time is the bench's own, not other processes'
        RUN_STARTERS.add(server)
    killed = False
    try:
        process.join(max(1.0, timeout_s))
    finally:  # also on Ctrl-C: no run outlives its parent
        if process.is_alive():
            process.kill()
            process.join()
            killed = True
    if killed:
        return None
    if not result_path.exists():
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        tail = "\n".join(log.strip().splitlines()[-8:])
        error = f"worker exited with status {process.exitcode}"
        if process.exitcode == -9:
            error += " (killed by the system: out of memory?)"
        return RunResult(
            spec=asdict(spec), ok=False, error=f"{error}: {tail.splitlines()[-1] if tail else ''}", traceback=tail
        )
    return RunResult(**json.loads(result_path.read_text()))
