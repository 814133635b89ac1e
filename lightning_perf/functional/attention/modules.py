"""The modules put in place of attention modules: they hold the original's tensors and compute through a fused kernel.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_perf._validation import check_choice, check_int
from lightning_perf._warnings import FallbackWarning, warn_once
from lightning_perf.functional.attention.arguments import ArgumentNotHonoured, ArgumentPlan, combine_masks
from lightning_perf.functional.attention.kernels import SDPA, AttentionNotSwappable, attention
from lightning_perf.functional.attention.parity import eval_without_dropout, outputs_close
from lightning_perf.functional.surgery import adopt_tensors

__all__ = [
    "FusedMultiheadAttention",
    "FusedQKVAttention",
    "FusedQKVSpec",
    "SwappedAttention",
    "clone_as",
]


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
        # Projected in (seq, batch, embed) memory order, as nn.MultiheadAttention does: the output then has the
        # original's strides, so a dropout after it (TransformerEncoderLayer's dropout1) draws the same mask.
        out = F.linear(out.reshape(batch, tgt_len, embed).transpose(0, 1), self.out_proj.weight, self.out_proj.bias)
        return (out.transpose(0, 1) if self.batch_first else out), None


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
        check_choice("FusedQKVSpec", "layout", self.layout, ("qkv", "head"))
        check_int("FusedQKVSpec", "num_heads", self.num_heads, 1)


class FusedQKVAttention(SwappedAttention):
    """A hand-written fused-QKV self-attention module computing through flash-attn or SDPA, with its own parameters.

    Build it with :meth:`from_module`. It takes the calls its original takes (same signature): arguments given their
    default value (``attn_mask=None``, ``is_causal=False``) go to the kernel, and so do masks and causal flags whose
    meaning :meth:`learn_arguments` learned from the original (:class:`ArgumentPlan`); a call with any other argument
    runs the original code, reported once by the argument's name and counted in :attr:`fallbacks`.
    """

    spec: FusedQKVSpec
    arguments: ArgumentPlan
    fallbacks: Counter[str]

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
        plan = ArgumentPlan.from_forward(module.forward)
        attributes = {"spec": spec, "kernel": kernel, "head_dim": embed // spec.num_heads, "arguments": plan}
        return clone_as(module, cls, fallbacks=Counter(), **attributes)  # type: ignore[no-any-return]

    def learn_arguments(self, x: Tensor) -> list[tuple[tuple[Any, ...], dict]]:
        """Learn from the original what its mask arguments and causal flags mean (probe calls on ``x``, eval mode).

        Returns the calls that exercise them, for the parity check (:func:`check_parity`).
        """
        original = self.original
        with torch.no_grad(), eval_without_dropout(original, self):
            return self.arguments.learn(
                original,
                lambda x, mask, causal: self.fused(x, mask, causal),
                x,
                lambda a, b: outputs_close(a, b, x.dtype),
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            x, mask, causal = self.arguments.resolve(args, kwargs)
        except ArgumentNotHonoured as reason:
            self._fall_back(reason)
            return self.call_original(*args, **kwargs)
        return self.fused(x, mask, causal)

    def fused(self, x: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        """The kernel path: ``x`` ``(batch, seq, embed)``; ``mask`` as SDPA reads it; ``causal`` adds to the spec's."""
        spec = self.spec
        batch, seq, _ = x.shape
        qkv = self._modules[spec.qkv](x)  # type: ignore[misc]
        embed = qkv.shape[-1] // 3
        split = (3, spec.num_heads) if spec.layout == "qkv" else (spec.num_heads, 3)
        q, k, v = qkv.view(batch, seq, *split, self.head_dim).unbind(2 if spec.layout == "qkv" else 3)
        dropout = self._modules[spec.attn_dropout] if spec.attn_dropout else None
        p = float(dropout.p) if isinstance(dropout, nn.Dropout) and self.training else 0.0
        causal = causal or spec.causal
        if mask is not None and causal:  # SDPA takes a mask or the causal flag, not both
            mask, causal = combine_masks([mask], q.dtype, causal_shape=(seq, seq)), False
        out = attention(q, k, v, kernel=self.kernel, attn_mask=mask, is_causal=causal, dropout_p=p, scale=spec.scale)
        out = self._modules[spec.out](out.reshape(batch, seq, embed))  # type: ignore[misc]
        if spec.out_dropout:
            out = self._modules[spec.out_dropout](out)  # type: ignore[misc]
        return out

    def _fall_back(self, reason: ArgumentNotHonoured) -> None:
        self.fallbacks[reason.name] += 1
        warn_once(
            f"A swapped {type(self.original).__name__} ran its original (eager) attention code for a call: {reason}. "
            "Only calls with that argument fall back; the others run the fused kernel.",
            FallbackWarning,
        )

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, {self.spec}"
