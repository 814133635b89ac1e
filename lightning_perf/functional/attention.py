"""Swap a model's attention modules for fused kernels: flash-attn 2 where it applies, else PyTorch's SDPA.

:func:`swap_attention` walks the model, asks each :class:`AttentionAdapter` whether it knows a module, builds the
swapped module, checks on random inputs that it computes what the original computes (forward and backward, with a
tolerance by dtype), and only then puts it in the model. A swapped module holds the original's parameters and buffers
(the same objects, under the same names), so ``state_dict`` keys do not change and an optimizer built before or after
stays valid; :func:`restore_attention` puts the originals back.

Kernels, decided per module and reported with the reason (:class:`AttentionDecision`):

- ``"flash_attn"``: ``flash_attn.flash_attn_func`` (the optional ``flash`` extra), when it is installed and the model
  runs on a CUDA GPU of compute capability 8.0 or newer, in fp16/bf16 (autocast counts), with a head size of at most
  256. Calls it cannot serve (an arbitrary attention mask, fp32 inputs, a non-square causal call) take SDPA instead.
- ``"sdpa"``: :func:`torch.nn.functional.scaled_dot_product_attention`, whose dispatcher picks the best backend for
  the device and inputs (flash / memory-efficient / cuDNN on CUDA, a fused flash kernel on CPU, math as last resort);
  global backend flags are left alone.

Built-in adapters, tried after the ones you register (:func:`register_attention_adapter`):

- :class:`MultiheadAttentionAdapter`: ``nn.MultiheadAttention`` (also inside ``nn.TransformerEncoderLayer`` /
  ``nn.TransformerDecoderLayer``) becomes a :class:`FusedMultiheadAttention` with the same packed ``in_proj_weight``,
  ``in_proj_bias`` and ``out_proj``. Calls with ``need_weights=True`` (the default of ``nn.MultiheadAttention``!),
  unbatched or nested inputs take the original code path, so callers that read the weights keep working. Note that
  torch already runs SDPA inside ``nn.MultiheadAttention`` when called with ``need_weights=False``, and that
  ``nn.TransformerEncoderLayer`` has its own fused inference fast path (eval mode, no grad), which bypasses the swap.
- :class:`FusedQKVAttentionAdapter`: the common hand-written pattern (one ``Linear`` making q, k and v, one output
  ``Linear``, an eager ``softmax(q @ k^T * scale) @ v`` in between, optionally causal, optionally with dropout modules),
  recognised by structure and then by behaviour: among the standard variants (head count, q/k/v layout, causal or
  not) the one whose output matches the module's own is used; a module no variant reproduces (rotary embeddings, a
  different scale, extra inputs) is left unchanged with that reason.

Example::

    from lightning_perf.functional.attention import swap_attention

    result = swap_attention(model, device="cuda", compute_dtype=torch.bfloat16)
    for name, (kernel, reason) in result.decisions.items():
        print(name, kernel, reason)
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_perf._device import as_device, cuda_capability, is_sm_at_least, module_device
from lightning_perf._imports import is_flash_attn_available, require
from lightning_perf._warnings import FallbackWarning, warn_once
from lightning_perf.functional.surgery import FilterFn, adopt_tensors, find_modules, replace_modules

__all__ = [
    "FLASH_ATTN",
    "SDPA",
    "UNCHANGED",
    "AttentionAdapter",
    "AttentionDecision",
    "AttentionNotSwappable",
    "FusedMultiheadAttention",
    "FusedQKVAttention",
    "FusedQKVAttentionAdapter",
    "FusedQKVSpec",
    "MultiheadAttentionAdapter",
    "SwapResult",
    "SwappedAttention",
    "attention",
    "attention_adapters",
    "check_parity",
    "choose_kernel",
    "register_attention_adapter",
    "restore_attention",
    "swap_attention",
]

FLASH_ATTN = "flash_attn"
SDPA = "sdpa"
UNCHANGED = "unchanged"
_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


class AttentionDecision(NamedTuple):
    """What was done with one attention module: the ``kernel`` (``"flash_attn"``, ``"sdpa"`` or ``"unchanged"``)
    and the ``reason``."""

    kernel: str
    reason: str


class AttentionNotSwappable(Exception):
    """Raised by :meth:`AttentionAdapter.swap` for a module it recognises but cannot swap; the message is the reason."""


# --------------------------------------------------------------------------------------------------------- kernels


@cache
def _flash_attn_func() -> Callable[..., Tensor]:
    return require("flash_attn", "The flash-attn kernel of FlashAttentionCallback").flash_attn_func  # type: ignore[no-any-return]


def _flash_attn_applies(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> bool:
    """Whether flash-attn can serve this call (the per-call half of the decision; the module's was made at swap)."""
    return (
        attn_mask is None
        and q.is_cuda
        and q.dtype in _HALF
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
    if not is_flash_attn_available():
        why = "flash-attn is not installed (`pip install 'lightning-perf[flash]'`, CUDA only)"
    elif dev.type != "cuda":
        why = f"flash-attn needs a CUDA GPU, the model runs on {dev.type}"
    elif not is_sm_at_least(8, 0, dev):
        cap = cuda_capability(dev)
        why = f"flash-attn needs compute capability 8.0+, this GPU has {cap[0]}.{cap[1]}" if cap else "no CUDA device"
    elif dtype not in _HALF:
        why = f"flash-attn needs fp16/bf16 and attention runs in {dtype} (train with precision='bf16-mixed')"
    elif head_dim > _FLASH_MAX_HEAD_DIM:
        why = f"flash-attn supports head sizes up to {_FLASH_MAX_HEAD_DIM}, not {head_dim}"
    else:
        return AttentionDecision(
            FLASH_ATTN,
            f"flash-attn 2 ({dev}, {dtype}, head_dim {head_dim}); calls with an attention mask or in fp32 use SDPA",
        )
    backend = _sdpa_backend(dev, dtype, head_dim)
    return AttentionDecision(SDPA, f"SDPA{f' (its {backend} backend)' if backend else ''}: {why}")


# ---------------------------------------------------------------------------------------------- swapped modules


class SwappedAttention(nn.Module):
    """Base of every swapped attention module: the kernel it calls, its head size, and the module it replaced.

    A swapped module is built by :func:`clone_as`: a new object of the new class that holds the original's
    parameters, buffers, submodules and attributes (the same objects, under the same names). The original is kept
    (not as a submodule) for the calls the fused path does not cover and for :func:`restore_attention`.
    """

    kernel: str
    head_dim: int

    @property
    def original(self) -> nn.Module:
        """The module this one replaced, with this module's current tensors and train/eval mode."""
        original: nn.Module = self.__dict__["_original"]
        adopt_tensors(original, self)
        return original

    def call_original(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs)


def clone_as(module: nn.Module, cls: type[SwappedAttention], **attributes: Any) -> Any:
    """A new ``cls`` object holding ``module``'s state: same parameters, buffers, submodules and plain attributes.

    The module's registries (parameters, buffers, submodules, hooks) are copied one level deep, so later changes to
    one module's registries do not leak into the other, while the tensors and submodules themselves are shared.
    """
    clone = cls.__new__(cls)
    for key, value in module.__dict__.items():
        clone.__dict__[key] = copy.copy(value) if isinstance(value, (dict, set)) else value
    clone.__dict__["_original"] = module
    clone.__dict__.update(attributes)
    return clone


def _bool_or_additive(masks: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Merge masks where ``True`` means *blocked* (``nn.MultiheadAttention``'s convention) or additive floats."""
    if all(m.dtype == torch.bool for m in masks):
        blocked = masks[0]
        for m in masks[1:]:
            blocked = blocked | m
        return ~blocked  # SDPA's boolean convention: True takes part
    total: Tensor | None = None
    for m in masks:
        additive = torch.zeros_like(m, dtype=dtype).masked_fill_(m, float("-inf")) if m.dtype == torch.bool else m
        total = additive.to(dtype) if total is None else total + additive.to(dtype)
    assert total is not None
    return total


class FusedMultiheadAttention(nn.MultiheadAttention, SwappedAttention):
    """``nn.MultiheadAttention`` computing through flash-attn or SDPA; same parameters, same ``state_dict``.

    Calls with ``need_weights=True``, unbatched or nested inputs, or ``is_causal=True`` without ``attn_mask`` (an
    error in torch) go through ``nn.MultiheadAttention.forward`` unchanged. Masks follow ``nn.MultiheadAttention``:
    ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)``, ``key_padding_mask`` ``(N, S)``, boolean (``True`` is
    masked out) or additive float; ``is_causal=True`` with an ``attn_mask`` and no padding mask runs the causal kernel.
    """

    @classmethod
    def from_module(cls, module: nn.MultiheadAttention, kernel: str = SDPA) -> FusedMultiheadAttention:
        return clone_as(module, cls, kernel=kernel, head_dim=module.head_dim)  # type: ignore[no-any-return]

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if (
            need_weights
            or query.dim() != 3
            or query.is_nested
            or key.is_nested
            or value.is_nested
            or (is_causal and attn_mask is None)
        ):
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        self_attention = query is key and key is value
        if not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, embed = query.shape
        src_len, heads = key.shape[1], self.num_heads
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if self_attention:
            q, k, v = F.linear(query, weight, bias).view(batch, tgt_len, 3, heads, self.head_dim).unbind(2)
        else:
            w_q, w_k, w_v = weight.chunk(3)
            b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
            q = F.linear(query, w_q, b_q).view(batch, tgt_len, heads, self.head_dim)
            k = F.linear(key, w_k, b_k).view(batch, src_len, heads, self.head_dim)
            v = F.linear(value, w_v, b_v).view(batch, src_len, heads, self.head_dim)
        mask, causal = None, False
        if is_causal and key_padding_mask is None:
            causal = True  # attn_mask is the causal mask (torch's contract for the hint); the kernel builds it
        else:
            masks = []
            if attn_mask is not None:
                masks.append(attn_mask.view(batch, heads, tgt_len, src_len) if attn_mask.dim() == 3 else attn_mask)
            if key_padding_mask is not None:
                masks.append(key_padding_mask.view(batch, 1, 1, src_len))
            mask = _bool_or_additive(masks, q.dtype) if masks else None
        out = attention(
            q,
            k,
            v,
            kernel=self.kernel,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        out = F.linear(out.reshape(batch, tgt_len, embed), self.out_proj.weight, self.out_proj.bias)
        return (out if self.batch_first else out.transpose(0, 1)), None


@dataclass(frozen=True)
class FusedQKVSpec:
    """How a hand-written self-attention module is laid out, for :class:`FusedQKVAttention`.

    The module's ``forward(x)`` takes ``x`` of shape ``(batch, seq, embed)`` and computes
    ``out_dropout(out(attention(split(qkv(x)))))``.

    Args:
        qkv: name of the child ``nn.Linear`` that makes q, k and v together (``3 * embed`` outputs).
        out: name of the child ``nn.Linear`` output projection.
        num_heads: number of heads.
        causal: whether a position attends only to itself and earlier positions.
        layout: how ``qkv``'s outputs split: ``"qkv"`` is ``[q | k | v]``, each ``(heads, head_dim)`` (view
            ``(B, T, 3, H, D)``, nanoGPT, timm); ``"head"`` is per head ``[q k v]`` (view ``(B, T, H, 3, D)``).
        attn_dropout: name of the child dropout applied to the attention probabilities, if any.
        out_dropout: name of the child dropout applied after the output projection, if any.
        scale: softmax scale; ``None`` is ``1 / sqrt(head_dim)``.
    """

    qkv: str
    out: str
    num_heads: int
    causal: bool
    layout: str = "qkv"
    attn_dropout: str | None = None
    out_dropout: str | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("qkv", "head"):
            raise ValueError(f"`FusedQKVSpec(layout={self.layout!r})` is not valid. Expected 'qkv' or 'head'.")
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"`FusedQKVSpec(num_heads={self.num_heads!r})` is not valid. Expected an int >= 1.")


class FusedQKVAttention(SwappedAttention):
    """A hand-written fused-QKV self-attention module computing through flash-attn or SDPA, with its own parameters.

    Build it with :meth:`from_module`; calls with more than the input tensor go to the original module.
    """

    spec: FusedQKVSpec

    @classmethod
    def from_module(cls, module: nn.Module, spec: FusedQKVSpec, kernel: str = SDPA) -> FusedQKVAttention:
        """Wrap ``module`` as laid out by ``spec``.

        Raises:
            AttentionNotSwappable: if ``spec`` does not fit the module's children.
        """
        qkv, out = module._modules.get(spec.qkv), module._modules.get(spec.out)
        if not isinstance(qkv, nn.Linear) or not isinstance(out, nn.Linear):
            raise AttentionNotSwappable(f"`{spec.qkv}` and `{spec.out}` must be nn.Linear children of the module")
        embed = out.in_features
        if qkv.out_features != 3 * embed or embed % spec.num_heads:
            raise AttentionNotSwappable(
                f"`{spec.qkv}` has {qkv.out_features} outputs and `{spec.out}` {embed} inputs: expected 3x and a "
                f"multiple of num_heads={spec.num_heads}"
            )
        for name in (spec.attn_dropout, spec.out_dropout):
            if name is not None and not isinstance(module._modules.get(name), nn.Dropout):
                raise AttentionNotSwappable(f"`{name}` is not an nn.Dropout child of the module")
        return clone_as(module, cls, spec=spec, kernel=kernel, head_dim=embed // spec.num_heads)  # type: ignore[no-any-return]

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or x.dim() != 3:
            return self.call_original(x, *args, **kwargs)
        spec = self.spec
        batch, seq, _ = x.shape
        qkv = self._modules[spec.qkv](x)  # type: ignore[misc]
        embed = qkv.shape[-1] // 3
        split = (3, spec.num_heads) if spec.layout == "qkv" else (spec.num_heads, 3)
        q, k, v = qkv.view(batch, seq, *split, self.head_dim).unbind(2 if spec.layout == "qkv" else 3)
        dropout = self._modules[spec.attn_dropout] if spec.attn_dropout else None
        p = float(dropout.p) if isinstance(dropout, nn.Dropout) and self.training else 0.0
        out = attention(q, k, v, kernel=self.kernel, is_causal=spec.causal, dropout_p=p, scale=spec.scale)
        out = self._modules[spec.out](out.reshape(batch, seq, embed))  # type: ignore[misc]
        if spec.out_dropout:
            out = self._modules[spec.out_dropout](out)  # type: ignore[misc]
        return out

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, {self.spec}"


# ---------------------------------------------------------------------------------------------------- adapters


class AttentionAdapter:
    """Teaches :func:`swap_attention` one kind of attention module. Subclass it and register an instance.

    Override :meth:`matches` (a cheap structural check: is this module of my kind?) and :meth:`swap` (build the
    swapped module: it must hold the same parameters and buffers under the same names and accept the same calls, and
    expose ``kernel`` (read at call time) and ``head_dim``; :class:`FusedQKVAttention` and :class:`SwappedAttention`
    do the work for most modules). Override :meth:`sample_inputs` when the module's ``forward`` takes something else
    than one ``(batch, seq, embed)`` tensor: the parity check calls the module with them.

    Example::

        class MyAttentionAdapter(AttentionAdapter):
            def matches(self, module, name):
                return isinstance(module, MyAttention)

            def swap(self, module, kernel):
                spec = FusedQKVSpec(qkv="to_qkv", out="to_out", num_heads=module.heads, causal=True)
                return FusedQKVAttention.from_module(module, spec, kernel)

        register_attention_adapter(MyAttentionAdapter())
    """

    def matches(self, module: nn.Module, name: str) -> bool:
        raise NotImplementedError

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        """The swapped module; raise :class:`AttentionNotSwappable` with the reason when this one cannot be swapped."""
        raise NotImplementedError

    def sample_inputs(self, module: nn.Module, generator: torch.Generator) -> list[tuple[tuple[Any, ...], dict]]:
        """Calls ``(args, kwargs)`` for the parity check; by default one ``(2, T, embed)`` tensor, ``T`` the longest
        of 16, 8, 4, 2 that the module accepts."""
        embed = _embed_dim(module)
        for seq in (16, 8, 4, 2):
            x = torch.randn(2, seq, embed, generator=generator).to(module_device(module), _module_dtype(module))
            try:
                with torch.no_grad(), _eval_without_dropout(module):
                    module(x)
            except Exception:
                continue
            return [((x,), {})]
        raise AttentionNotSwappable(f"its forward does not accept a (batch, seq, {embed}) tensor")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _embed_dim(module: nn.Module) -> int:
    for attr in ("embed_dim", "dim", "hidden_size", "d_model", "n_embd"):
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    linears = [m for m in module.children() if isinstance(m, nn.Linear)]
    if linears:
        return linears[0].in_features
    raise AttentionNotSwappable("cannot tell its embedding size: override AttentionAdapter.sample_inputs")


class MultiheadAttentionAdapter(AttentionAdapter):
    """``torch.nn.MultiheadAttention`` (exactly that class: a subclass may compute something else)."""

    def matches(self, module: nn.Module, name: str) -> bool:
        return type(module) is nn.MultiheadAttention

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        assert isinstance(module, nn.MultiheadAttention)
        if not module._qkv_same_embed_dim:
            raise AttentionNotSwappable("kdim/vdim differ from embed_dim (separate q/k/v projections)")
        if module.bias_k is not None or module.add_zero_attn:
            raise AttentionNotSwappable("add_bias_kv / add_zero_attn change the key sequence; SDPA has no such option")
        return FusedMultiheadAttention.from_module(module, kernel)

    def sample_inputs(self, module: nn.Module, generator: torch.Generator) -> list[tuple[tuple[Any, ...], dict]]:
        assert isinstance(module, nn.MultiheadAttention)
        batch, seq, embed = 2, 8, module.embed_dim
        x = torch.randn(batch, seq, embed, generator=generator)
        if not module.batch_first:
            x = x.transpose(0, 1)
        memory = torch.randn(*x.shape[:-1], embed, generator=generator)
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        padding = torch.zeros(batch, seq, dtype=torch.bool)
        padding[0, -3:] = True
        plain: dict[str, Any] = {"need_weights": False}
        return [
            ((x, x, x), plain),
            ((x, x, x), {**plain, "attn_mask": causal, "is_causal": True}),
            ((x, x, x), {**plain, "key_padding_mask": padding}),
            ((x, memory, memory), {**plain, "attn_mask": torch.randn(seq, seq, generator=generator)}),
        ]


_HEAD_COUNT_ATTRS = ("num_heads", "n_heads", "n_head", "nhead", "heads", "num_attention_heads")


class FusedQKVAttentionAdapter(AttentionAdapter):
    """Hand-written self-attention with one fused q/k/v ``Linear`` and an output ``Linear``, found by structure.

    A module matches when its children are exactly one ``Linear`` with ``3 * E`` outputs (q, k, v), one ``E -> E``
    ``Linear`` (output) and any number of dropout modules, and it has no parameters of its own (buffers, like a
    causal mask, are fine). :meth:`swap` then finds the layout by behaviour: one probe call with hooks tells which
    dropout acts on the attention probabilities (a ``(B, H, T, T)`` input, which also gives the head count) and which
    after the output projection; the head count is otherwise read from an integer attribute (``num_heads``,
    ``n_head``...) or tried over the divisors of ``E``; the variant (heads x layout x causal) whose output equals the
    module's own is used. No match leaves the module unchanged, with the reason.
    """

    def matches(self, module: nn.Module, name: str) -> bool:
        return _fused_qkv_children(module) is not None

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        names = _fused_qkv_children(module)
        if names is None:
            raise AttentionNotSwappable("not a fused-QKV attention module")
        qkv_name, out_name, dropout_names = names
        embed = module.get_submodule(out_name).in_features
        assert isinstance(embed, int)
        ((x,), _) = self.sample_inputs(module, torch.Generator().manual_seed(0))[0]
        roles = _probe_dropout_roles(module, x, out_name, dropout_names)
        attn_dropout, out_dropout, heads_seen = roles
        candidates = [heads_seen] if heads_seen else _head_count_candidates(module, embed)
        with torch.no_grad(), _eval_without_dropout(module):
            expected = module(x)
            for heads in candidates:
                for causal in (True, False):
                    for layout in ("qkv", "head"):
                        spec = FusedQKVSpec(qkv_name, out_name, heads, causal, layout, attn_dropout, out_dropout)
                        candidate = FusedQKVAttention.from_module(module, spec, kernel)
                        if _close(candidate(x), expected, x.dtype):
                            return candidate
        raise AttentionNotSwappable(
            f"its output matches no standard fused-QKV attention (heads {candidates}, layouts qkv/head, causal or "
            "not): it may use rotary embeddings, another scale or extra inputs; register an AttentionAdapter for it"
        )


def _fused_qkv_children(module: nn.Module) -> tuple[str, str, list[str]] | None:
    """``(qkv, out, dropouts)`` child names when ``module`` has the fused-QKV structure, else ``None``."""
    if module._parameters and any(p is not None for p in module._parameters.values()):
        return None
    qkv: list[str] = []
    out: list[str] = []
    dropouts: list[str] = []
    linears = {name: m for name, m in module.named_children() if isinstance(m, nn.Linear)}
    for name, child in module.named_children():
        if isinstance(child, nn.Dropout):
            dropouts.append(name)
        elif not isinstance(child, nn.Linear) and next(child.parameters(), None) is not None:
            return None  # a child with parameters we do not understand (a norm, rotary tables...)
    if len(linears) != 2:
        return None
    for name, linear in linears.items():
        if linear.out_features == 3 * linear.in_features:
            qkv.append(name)
        elif linear.out_features == linear.in_features:
            out.append(name)
    if len(qkv) != 1 or len(out) != 1:
        return None
    if linears[qkv[0]].in_features != linears[out[0]].in_features:
        return None
    return qkv[0], out[0], dropouts


def _probe_dropout_roles(
    module: nn.Module, x: Tensor, out_name: str, dropout_names: list[str]
) -> tuple[str | None, str | None, int | None]:
    """Which dropout acts on the attention probabilities and which after the output projection, from one hooked call.

    Returns ``(attn_dropout, out_dropout, heads)``, ``heads`` from the attention dropout's input, if there is one.

    Raises:
        AttentionNotSwappable: if a dropout acts anywhere else, or more than once.
    """
    if not dropout_names:
        return None, None, None
    calls: list[tuple[str, tuple[int, ...]]] = []
    handles = []
    named = dict(module.named_children())
    for name in [out_name, *dropout_names]:
        handles.append(named[name].register_forward_hook(lambda m, a, o, n=name: calls.append((n, tuple(a[0].shape)))))
    try:
        with torch.no_grad(), _train_without_dropout(module):
            module(x)
    finally:
        for handle in handles:
            handle.remove()
    attn_dropout = out_dropout = None
    heads = None
    out_seen = False
    batch, seq = x.shape[:2]
    for name, shape in calls:
        if name == out_name:
            out_seen = True
        elif (
            len(shape) == 4 and shape[0] == batch and shape[2:] == (seq, seq) and attn_dropout is None and not out_seen
        ):
            attn_dropout, heads = name, shape[1]
        elif out_seen and out_dropout is None and shape == tuple(x.shape):
            out_dropout = name
        else:
            raise AttentionNotSwappable(f"its dropout `{name}` acts on a {shape} tensor, not on attention or output")
    return attn_dropout, out_dropout, heads


def _head_count_candidates(module: nn.Module, embed: int) -> list[int]:
    for attr in _HEAD_COUNT_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and embed % value == 0:
            return [value]
    return [h for h in range(1, embed + 1) if embed % h == 0]


_ADAPTERS: list[AttentionAdapter] = []
_BUILTIN_ADAPTERS: tuple[AttentionAdapter, ...] = (MultiheadAttentionAdapter(), FusedQKVAttentionAdapter())


def register_attention_adapter(adapter: AttentionAdapter) -> AttentionAdapter:
    """Register ``adapter`` for every later :func:`swap_attention` call (before the built-in adapters)."""
    if not isinstance(adapter, AttentionAdapter):
        raise TypeError(f"`register_attention_adapter({adapter!r})` expects an AttentionAdapter instance.")
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)
    return adapter


def attention_adapters(extra: Sequence[AttentionAdapter] = ()) -> list[AttentionAdapter]:
    """Adapters in the order they are tried: ``extra``, the registered ones, the built-in ones."""
    return [*extra, *_ADAPTERS, *_BUILTIN_ADAPTERS]


# ------------------------------------------------------------------------------------------------- parity check


@contextlib.contextmanager
def _dropout_off(*modules: nn.Module) -> Iterator[None]:
    saved: list[tuple[nn.Module, str, float]] = []
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                saved.append((m, "p", m.p))
                m.p = 0.0
            elif isinstance(m, nn.MultiheadAttention):
                saved.append((m, "dropout", m.dropout))
                m.dropout = 0.0
    try:
        yield
    finally:
        for m, attr, value in reversed(saved):
            setattr(m, attr, value)


@contextlib.contextmanager
def _mode(modules: Sequence[nn.Module], training: bool) -> Iterator[None]:
    saved = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.train(training)
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


@contextlib.contextmanager
def _train_without_dropout(*modules: nn.Module) -> Iterator[None]:
    with _mode(modules, True), _dropout_off(*modules):
        yield


@contextlib.contextmanager
def _eval_without_dropout(*modules: nn.Module) -> Iterator[None]:
    with _mode(modules, False), _dropout_off(*modules):
        yield


_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-7, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> bool:
    return _relative_error(actual, expected) <= _TOLERANCE.get(dtype, 1e-4)


def _relative_error(actual: Tensor, expected: Tensor) -> float:
    """Largest difference relative to the largest magnitude of ``expected`` (inf for a shape mismatch or NaN)."""
    if actual.shape != expected.shape:
        return math.inf
    a, e = actual.detach().double(), expected.detach().double()
    error = (a - e).abs().max().item() if a.numel() else 0.0
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-12)
    return math.inf if math.isnan(error) else error / scale


def _first_tensor(output: Any) -> Tensor:
    while isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, Tensor):
        raise AttentionNotSwappable(f"its output is a {type(output).__name__}, not a tensor")
    return output


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype in _HALF and (device.type != "cuda" or torch.cuda.is_available()):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def check_parity(
    original: nn.Module,
    swapped: nn.Module,
    calls: Sequence[tuple[tuple[Any, ...], dict]],
    *,
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
) -> str | None:
    """Whether ``swapped`` computes what ``original`` computes: ``None`` if so, else what differs.

    Both run in training mode with dropout off, under autocast to ``compute_dtype`` when that is fp16/bf16, on
    ``device`` (copies are made when the modules are elsewhere, e.g. still on the CPU before Lightning moves them).
    Compared: the first output tensor, and the gradients of a random projection of it with respect to the floating
    point inputs and every parameter, each to a tolerance by dtype (relative to the largest magnitude). Nothing is
    left behind: no ``.grad``, no RNG draw (inputs come from ``calls``), modes and dropout restored.
    """
    dev = as_device(device) if device is not None else module_device(original)
    if dev != module_device(original):
        original, swapped = copy.deepcopy((original, swapped))  # attention modules are small
        original.to(dev)
        swapped.to(dev)
    dtype = _module_dtype(original)  # inputs in the parameters' dtype (a model already cast to half precision)
    tolerance = max(_TOLERANCE.get(d, 1e-4) for d in (compute_dtype if compute_dtype in _HALF else dtype, dtype))
    named_params = [(n, p) for n, p in original.named_parameters() if p.requires_grad]

    def to_device(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        return value.to(dev, dtype) if value.is_floating_point() else value.to(dev)

    for index, (args, kwargs) in enumerate(calls):
        leaves = {id(a): to_device(a).detach().requires_grad_(True) for a in args if _is_float_tensor(a)}
        args = tuple(leaves.get(id(a), to_device(a)) for a in args)
        kwargs = {k: to_device(v) for k, v in kwargs.items()}
        wrt = [*leaves.values(), *(p for _, p in named_params)]
        results = []
        with torch.enable_grad(), _train_without_dropout(original, swapped), _autocast(dev, compute_dtype):
            for module in (original, swapped):
                out = _first_tensor(module(*args, **kwargs))
                direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(index)).to(dev, out.dtype)
                results.append((out, torch.autograd.grad(out, wrt, direction, allow_unused=True)))
        (out_a, grads_a), (out_b, grads_b) = results
        what = f"call {index + 1} of {len(calls)}"
        error = _relative_error(out_b, out_a)
        if error > tolerance:
            return f"{what}: the output differs by {error:.2g} (relative; tolerance {tolerance:g})"
        names = [f"input {i}" for i in range(len(leaves))] + [n for n, _ in named_params]
        for name, g_a, g_b in zip(names, grads_a, grads_b):
            if (g_a is None) != (g_b is None):
                return f"{what}: the gradient of {name} is missing on one side"
            if g_a is not None and g_b is not None and (error := _relative_error(g_b, g_a)) > tolerance:
                return f"{what}: the gradient of {name} differs by {error:.2g} (relative; tolerance {tolerance:g})"
    return None


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _module_dtype(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


# ------------------------------------------------------------------------------------------------------ swapping


@dataclass
class SwapResult:
    """What :func:`swap_attention` did.

    Attributes:
        decisions: module name -> :class:`AttentionDecision`, for every attention module found (swapped or not).
        replaced: module name -> ``(original, swapped)``; give it to
            :func:`~lightning_perf.functional.surgery.restore_modules` to undo exactly this swap.
    """

    decisions: dict[str, AttentionDecision] = field(default_factory=dict)
    replaced: dict[str, tuple[nn.Module, nn.Module]] = field(default_factory=dict)

    @property
    def swapped(self) -> list[str]:
        return [name for name, decision in self.decisions.items() if decision.kernel != UNCHANGED]


def swap_attention(
    model: nn.Module,
    *,
    adapters: Sequence[AttentionAdapter] = (),
    device: torch.device | str | None = None,
    compute_dtype: torch.dtype | None = None,
    filter_fn: FilterFn | None = None,
    parity_check: bool = True,
    strict: bool = False,
) -> SwapResult:
    """Swap every attention module of ``model`` that an adapter knows for a fused-kernel version, in place.

    Call it before building the optimizer (the swapped modules reuse the original parameters, so an existing optimizer
    also stays valid). Modules swapped already are reported and left as they are.

    Args:
        model: the model.
        adapters: extra adapters, tried before the registered and built-in ones.
        device: where the model will run; decides the kernel and where the parity check runs. ``None``: where its
            parameters are.
        compute_dtype: the dtype attention computes in (``torch.bfloat16`` for ``bf16-mixed``...); ``None``: fp32.
        filter_fn: ``filter_fn(module, name) -> bool`` restricting which modules are considered.
        parity_check: compare each swapped module with its original on random inputs before installing it; a
            mismatch keeps the original and warns (:class:`~lightning_perf.FallbackWarning`).
        strict: raise instead of falling back when the parity check fails.

    Raises:
        RuntimeError: with ``strict=True``, when a swapped module does not match its original.
    """
    target = as_device(device) if device is not None else module_device(model)
    all_adapters = attention_adapters(adapters)
    result = SwapResult()

    def adapter_for(module: nn.Module, name: str) -> AttentionAdapter | None:
        if filter_fn is not None and not filter_fn(module, name):
            return None
        return next((a for a in all_adapters if a.matches(module, name)), None)

    found = find_modules(
        model, lambda m, n: isinstance(m, SwappedAttention) or adapter_for(m, n) is not None, outermost=True
    )
    swaps: dict[str, nn.Module] = {}
    for name, module in found:
        if isinstance(module, SwappedAttention):
            result.decisions[name] = AttentionDecision(module.kernel, "swapped already")
            continue
        adapter = adapter_for(module, name)
        assert adapter is not None
        try:
            swapped = adapter.swap(module, SDPA)
            decision = choose_kernel(int(getattr(swapped, "head_dim", 0)), target, compute_dtype)
            setattr(swapped, "kernel", decision.kernel)  # noqa: B010 (any nn.Module an adapter returns)
            calls = adapter.sample_inputs(module, torch.Generator().manual_seed(0)) if parity_check else []
            problem = check_parity(module, swapped, calls, device=target, compute_dtype=compute_dtype)
        except AttentionNotSwappable as reason:
            result.decisions[name] = AttentionDecision(UNCHANGED, f"{type(module).__name__}: {reason}")
            continue
        except Exception as error:  # an adapter's or a kernel's failure: keep the original, like a mismatch
            if strict:
                raise
            problem = f"{type(error).__name__}: {error}"
        if problem is not None:
            message = (
                f"The fused-kernel version of `{name}` ({type(module).__name__}) does not compute what the original "
                f"does ({problem}); the original is kept."
            )
            if strict:
                raise RuntimeError(message)
            warn_once(message, FallbackWarning)
            result.decisions[name] = AttentionDecision(UNCHANGED, f"parity check failed: {problem}")
            continue
        swaps[name] = swapped
        result.decisions[name] = decision
    if swaps:
        result.replaced = replace_modules(model, list(swaps), lambda m, n: swaps[n])
    return result


def restore_attention(model: nn.Module) -> list[str]:
    """Put back the original of every swapped attention module in ``model``; returns their names."""
    return list(replace_modules(model, lambda m, n: isinstance(m, SwappedAttention), _original_of))


def _original_of(module: nn.Module, name: str) -> nn.Module:
    assert isinstance(module, SwappedAttention)
    return module.original
