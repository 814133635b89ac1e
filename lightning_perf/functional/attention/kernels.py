"""The attention kernels a swapped module calls (flash-attn 2 or PyTorch's SDPA) and the choice between them.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_perf._device import as_device, cuda_capability, is_sm_at_least
from lightning_perf._imports import is_available, require

__all__ = [
    "ACTIONS",
    "ALREADY_FUSED",
    "FLASH_ATTN",
    "HALF_DTYPES",
    "KEPT",
    "SDPA",
    "SDPA_FP32",
    "SWAPPED",
    "SWITCHED_CONFIG",
    "UNCHANGED",
    "AttentionDecision",
    "AttentionNotSwappable",
    "attention",
    "choose_kernel",
]

FLASH_ATTN = "flash_attn"
SDPA = "sdpa"
SDPA_FP32 = "sdpa_fp32"
"""SDPA computed in float32 on a CPU for half-precision inputs (the output in their dtype): chosen where this CPU's
half-precision SDPA, its backward above all, measures slower than float32 (:func:`choose_kernel`)."""
UNCHANGED = "unchanged"
HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The half-precision dtypes flash-attn computes in."""
_FLASH_MAX_HEAD_DIM = 256


SWAPPED = "swapped"
ALREADY_FUSED = "already fused"
SWITCHED_CONFIG = "switched config"
KEPT = "kept"
ACTIONS = (SWAPPED, ALREADY_FUSED, SWITCHED_CONFIG, KEPT)
"""What :func:`swap_attention` did with a module: swapped it for a fused-kernel version, found it already calling a
fused kernel (left alone), switched its model's configuration to SDPA (Hugging Face ``attn_implementation``), or kept
it unchanged because it cannot be swapped (the reason says why)."""


class _Decision(NamedTuple):
    kernel: str
    reason: str


class AttentionDecision(_Decision):
    """What was done with one attention module: the ``kernel`` it computes with (``"flash_attn"``, ``"sdpa"`` or
    ``"unchanged"``: the module's own code) and the ``reason``; unpacks as ``kernel, reason``.

    ``action`` is one of :data:`ACTIONS`; by default :data:`SWAPPED` for a fused kernel and :data:`KEPT` for
    ``"unchanged"``. An already fused module has kernel ``"unchanged"`` (its own code already calls SDPA) and action
    :data:`ALREADY_FUSED`: it is never counted as a swap.
    """

    action: str

    def __new__(cls, kernel: str, reason: str, action: str | None = None) -> AttentionDecision:
        self = super().__new__(cls, kernel, reason)
        self.action = action if action is not None else (KEPT if kernel == UNCHANGED else SWAPPED)
        if self.action not in ACTIONS:
            raise ValueError(f"`AttentionDecision(action={action!r})` is not valid. Expected one of {ACTIONS}.")
        return self

    def __repr__(self) -> str:
        return f"AttentionDecision(kernel={self.kernel!r}, reason={self.reason!r}, action={self.action!r})"

    def __reduce__(self) -> tuple:
        return (AttentionDecision, (self.kernel, self.reason, self.action))


class AttentionNotSwappable(Exception):
    """Raised by :meth:`AttentionAdapter.swap` for a module it recognises but cannot swap; the message is the reason."""


@cache
def _flash_attn_func() -> Callable[..., Tensor]:
    return require("flash_attn", "The flash-attn kernel of FlashAttentionCallback").flash_attn_func  # type: ignore[no-any-return]


def _flash_attn_applies(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> bool:
    """Whether flash-attn can serve this call (the per-call half of the decision; the module's was made at swap)."""
    return (
        attn_mask is None
        and q.is_cuda
        and q.dtype in HALF_DTYPES
        and k.dtype == q.dtype
        and q.shape[-1] <= _FLASH_MAX_HEAD_DIM
        # flash-attn aligns a causal mask to the bottom right when lengths differ, SDPA to the top left.
        and (not is_causal or q.shape[1] == k.shape[1])
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    kernel: str = SDPA,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Scaled dot-product attention on ``(batch, seq, heads, head_dim)`` tensors, with the kernel asked for.

    Args:
        q: queries ``(B, L, H, D)``.
        k: keys ``(B, S, H, D)``.
        v: values ``(B, S, H, D)``.
        kernel: ``"flash_attn"`` uses flash-attn when this call allows it (CUDA, fp16/bf16, no mask), else SDPA;
            ``"sdpa"`` always uses SDPA.
        attn_mask: boolean (``True`` takes part) or additive float mask broadcastable to ``(B, H, L, S)``.
        is_causal: causal attention (top-left aligned, as in SDPA).
        dropout_p: dropout probability on the attention weights (pass 0 in eval).
        scale: softmax scale; ``None`` is ``1 / sqrt(D)``.

    Returns:
        ``(B, L, H, D)``.
    """
    if kernel == FLASH_ATTN and _flash_attn_applies(q, k, attn_mask, is_causal):
        return _flash_attn_func()(q, k, v, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
    if kernel == SDPA_FP32 and q.device.type == "cpu":
        return _sdpa_in_float32(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
    )
    return out.transpose(1, 2)


def _sdpa_in_float32(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None, is_causal: bool, dropout_p: float, scale: float | None
) -> Tensor:
    """SDPA in float32 with CPU autocast off inside; the output in the dtype SDPA would have returned (autocast's, or
    the inputs')."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        out = attention(
            q.float(), k.float(), v.float(), attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale
        )
    return out.to(dtype)


@cache
def cpu_sdpa_ms(head_dim: int, dtype: torch.dtype, threads: int) -> tuple[float, float]:
    """Forward and backward of causal SDPA on this CPU at ``(8, 4, 128, head_dim)``, in ``dtype`` and in float32:
    ``(ms in dtype, ms in float32)``, each the median of 5 calls after 2 warm-up ones, alternating, at ``threads``
    threads (the caller's: both timed alike). About 0.1 s, once per process and kind."""
    import statistics
    import time

    times: dict[torch.dtype, list[float]] = {dtype: [], torch.float32: []}
    gen = torch.Generator().manual_seed(0)
    # Timed as training runs it, whatever the caller's context (no_grad, inference mode, autocast).
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        inputs = {
            d: [torch.randn(8, 4, 128, head_dim, generator=gen).to(d).requires_grad_() for _ in range(3)] for d in times
        }
        for round_ in range(7):
            for d, (q, k, v) in inputs.items():
                start = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                if round_ >= 2:
                    times[d].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[dtype]), statistics.median(times[torch.float32])


_FP32_FASTER = 0.85
"""SDPA runs in float32 for half-precision inputs on a CPU where that measures at most this fraction of the time."""


def _sdpa_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """The backend SDPA's dispatcher picks for an unmasked call of this kind (for the report), if it can be told."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    try:
        q = torch.zeros(1, 2, 16, head_dim, device=device, dtype=dtype)
        choice = torch._fused_sdp_choice(q, q, q)  # private but stable since 2.0; only used to name the backend
        return torch.nn.attention.SDPBackend(choice).name.lower()
    except Exception:  # a report detail: never fail a swap over it
        return None


def choose_kernel(head_dim: int, device: torch.device | str, compute_dtype: torch.dtype | None) -> AttentionDecision:
    """Pick flash-attn or SDPA for attention with heads of ``head_dim`` run on ``device`` in ``compute_dtype``.

    Args:
        head_dim: size of one attention head.
        device: where the model will run (``trainer.strategy.root_device``).
        compute_dtype: the dtype attention computes in: ``torch.bfloat16`` / ``torch.float16`` under mixed or half
            precision, ``None`` or ``torch.float32`` otherwise.
    """
    dev = as_device(device)
    dtype = compute_dtype or torch.float32
    if not is_available("flash_attn"):
        why = "flash-attn is not installed (`pip install 'lightning-perf[flash]'`, CUDA only)"
    elif dev.type != "cuda":
        why = f"flash-attn needs a CUDA GPU, the model runs on {dev.type}"
    elif not is_sm_at_least(8, 0, dev):
        cap = cuda_capability(dev)
        why = f"flash-attn needs compute capability 8.0+, this GPU has {cap[0]}.{cap[1]}" if cap else "no CUDA device"
    elif dtype not in HALF_DTYPES:
        why = f"flash-attn needs fp16/bf16 and attention runs in {dtype} (train with precision='bf16-mixed')"
    elif head_dim > _FLASH_MAX_HEAD_DIM:
        why = f"flash-attn supports head sizes up to {_FLASH_MAX_HEAD_DIM}, not {head_dim}"
    else:
        return AttentionDecision(
            FLASH_ATTN,
            f"flash-attn 2 ({dev}, {dtype}, head_dim {head_dim}); calls with an attention mask or in fp32 use SDPA",
        )
    if dev.type == "cpu" and dtype in HALF_DTYPES and head_dim > 0:
        try:
            half, single = cpu_sdpa_ms(head_dim, dtype, torch.get_num_threads())
        except Exception:  # a timing that cannot run here: never fail a swap over it, keep SDPA as it is
            half = single = 1.0
        if single <= _FP32_FASTER * half:
            name = str(dtype).removeprefix("torch.")
            return AttentionDecision(
                SDPA_FP32,
                f"SDPA computed in float32, inputs and output in {name}: on this CPU a forward and backward measured "
                f"{single:.1f} ms in float32 vs {half:.1f} ms in {name} (head_dim {head_dim}); {why}",
            )
    backend = _sdpa_backend(dev, dtype, head_dim)
    return AttentionDecision(SDPA, f"SDPA{f' (its {backend} backend)' if backend else ''}: {why}")
