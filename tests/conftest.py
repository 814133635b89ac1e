"""Shared test set-up: hardware markers, opt-in benchmarks, and a guard that no test leaves global state changed."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_perf._warnings import reset_warn_once
from tests import _device

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # `pytest -n 2` on 2 cores: one intra-op thread per worker (and in the processes it starts), or each oversubscribes.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        action="store",
        default=None,
        choices=_device.DEVICES,
        help=(
            "device for the registry's generic and trust tests (tests/test_generic.py, tests/test_trust.py): "
            f"cpu (default) or cuda; also the environment variable {_device.ENV_VAR}"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        device = _device.resolve(
            config.getoption("device", None), os.environ.get(_device.ENV_VAR), torch.cuda.is_available()
        )
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    _device.select(device)
    if device == "cuda":
        # Before any CUDA work: cuBLAS reads it once (the resume test runs deterministically, tests/_device.py).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _device.CUBLAS_WORKSPACE_CONFIG)


def pytest_report_header(config: pytest.Config) -> str:
    return f"lightning_perf registry tests on: {_device.device()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_benchmarks = config.getoption("benchmark_only", False) or config.getoption("benchmark_enable", False)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_bench = pytest.mark.skip(reason="a timing benchmark: run with `pytest tests/benchmarks --benchmark-only`")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if item.get_closest_marker("benchmark") is not None and not run_benchmarks:
            item.add_marker(skip_bench)


def _global_torch_state() -> dict[str, object]:
    state: dict[str, object] = {
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": torch.backends.cuda.math_sdp_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "grad_enabled": torch.is_grad_enabled(),
    }
    return state


@pytest.fixture(autouse=True)
def _peak_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes the measured-peak cache into the user's home (``~/.cache/lightning_perf``)."""
    monkeypatch.setenv("LIGHTNING_PERF_CACHE", str(tmp_path_factory.getbasetemp() / "lightning-perf-cache"))


@pytest.fixture(autouse=True)
def _no_start_load_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process bench never waits up to a minute for a shared machine's other load to pass (the watch's own
    tests turn it on)."""
    from lightning_perf.benchmark import threads

    monkeypatch.setattr(threads, "START_WATCH_S", 0.0)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Put ``os.environ`` back after each test.

    An in-process DDP fit (a strategy's generic tests on ``devices=1``) leaves ``LOCAL_RANK``, ``MASTER_PORT`` and
    more behind; a 2-process test started later would inherit them, and Lightning would take it for an externally
    launched rank and never start rank 1.
    """
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _global_state_unchanged():
    """Every test must leave process-global torch settings as it found them (DESIGN.md: restored at teardown)."""
    reset_warn_once()
    before = _global_torch_state()
    yield
    after = _global_torch_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # Put things back so one failure does not cascade into every later test, then fail this one.
    if changed:
        torch.backends.cudnn.benchmark = bool(before["cudnn.benchmark"])
        torch.backends.cudnn.deterministic = bool(before["cudnn.deterministic"])
        torch.backends.cudnn.allow_tf32 = bool(before["cudnn.allow_tf32"])
        torch.backends.cuda.matmul.allow_tf32 = bool(before["matmul.allow_tf32"])
        torch.set_float32_matmul_precision(str(before["float32_matmul_precision"]))
        torch.use_deterministic_algorithms(bool(before["deterministic_algorithms"]))
        torch.set_default_dtype(before["default_dtype"])  # type: ignore[arg-type]
        pytest.fail(f"test left global torch state changed: {changed}")
