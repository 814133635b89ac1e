"""The device of the registry's generic and trust tests: ``pytest --device cuda`` or ``LIGHTNING_PERF_TEST_DEVICE``.

``tests/conftest.py`` resolves the choice once per session (:func:`resolve`) and stores it here (:func:`select`); the
helpers that build trainers take the accelerator from :func:`accelerator`. Without the option or the variable every
test runs on the CPU as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ENV_VAR = "LIGHTNING_PERF_TEST_DEVICE"
DEVICES = ("cpu", "cuda")
# cuBLAS reads its workspace configuration once, at its first use: conftest sets it before any test when the tests
# run on CUDA, so the resume test's deterministic mode holds for matrix products too.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

_selected = "cpu"


def resolve(option: str | None, env: str | None, cuda_available: bool) -> str:
    """The device from the command-line option (first) or the environment variable; ``"cpu"`` without either.

    Raises:
        ValueError: a device that is not one of :data:`DEVICES`, or ``"cuda"`` without a visible CUDA device.
    """
    if option is not None:
        source, value = "--device", option
    elif env:
        source, value = ENV_VAR, env
    else:
        return "cpu"
    value = value.strip().lower()
    if value not in DEVICES:
        raise ValueError(f"{source}={value!r} is not a test device. Expected one of {DEVICES}.")
    if value == "cuda" and not cuda_available:
        raise ValueError(
            f"{source}=cuda asks for the registry's tests on CUDA, but torch sees no CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False)."
        )
    return value


def select(device: str) -> None:
    global _selected
    if device not in DEVICES:
        raise ValueError(f"select(device={device!r}) is not valid. Expected one of {DEVICES}.")
    _selected = device


def device() -> str:
    """``"cpu"`` or ``"cuda"``: where the registry's tests train in this session."""
    return _selected


def on_cuda() -> bool:
    return _selected == "cuda"


def accelerator() -> str:
    """The ``Trainer(accelerator=...)`` value for the selected device."""
    return "gpu" if _selected == "cuda" else "cpu"


@contextlib.contextmanager
def deterministic() -> Iterator[str]:
    """On CUDA, deterministic kernels for the duration (restored after); on the CPU, nothing changes.

    Turns on ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an op without a deterministic kernel warns
    instead of failing the test before its comparison), ``cudnn.deterministic = True`` and ``cudnn.benchmark = False``
    (cuDNN's autotuner may pick another algorithm per run); ``CUBLAS_WORKSPACE_CONFIG`` is set for the session by
    conftest. Yields a description of what it set, for failure messages.
    """
    if not on_cuda():
        yield "cpu: no change (CPU kernels are deterministic for these models)"
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield (
            "cuda: torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic=True, "
            f"cudnn.benchmark=False, CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}"
        )
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic = saved[2]
        torch.backends.cudnn.benchmark = saved[3]
