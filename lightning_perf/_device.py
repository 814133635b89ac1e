"""Small named hardware predicates, so no callback does version or capability arithmetic inline."""

from __future__ import annotations

import torch


def as_device(device: torch.device | str | None) -> torch.device:
    """Normalize ``device``; ``None`` means CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_cuda(device: torch.device | str | None) -> bool:
    return as_device(device).type == "cuda"


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, or ``None`` off CUDA."""
    dev = as_device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(dev)


def is_sm_at_least(major: int, minor: int = 0, device: torch.device | str | None = None) -> bool:
    cap = cuda_capability(device)
    return cap is not None and cap >= (major, minor)


def supports_tf32(device: torch.device | str | None = None) -> bool:
    """TF32 tensor cores exist from Ampere (sm 80) on; CPUs have none."""
    return is_sm_at_least(8, 0, device)


def supports_bf16(device: torch.device | str | None = None) -> bool:
    dev = as_device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return dev.type == "cpu"


def has_fast_cpu_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (avx512_bf16, AMX): the hardware, not just the dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU). Never call this per step on a hot path."""
    if is_cuda(device):
        torch.cuda.synchronize(as_device(device))


def module_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` lives: its first parameter's device, else its first buffer's, else the CPU."""
    tensor: torch.Tensor | None = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")
