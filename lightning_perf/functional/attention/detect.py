"""How attention modules are recognised: one :class:`AttentionAdapter` per kind of module, and the adapter registry.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import module_device
from lightning_perf.functional.attention.kernels import AttentionNotSwappable
from lightning_perf.functional.attention.modules import FusedMultiheadAttention, FusedQKVAttention, FusedQKVSpec
from lightning_perf.functional.attention.parity import (
    eval_without_dropout,
    module_dtype,
    outputs_close,
    train_without_dropout,
)
from lightning_perf.functional.attention.trace import SDPACalls

__all__ = [
    "AttentionAdapter",
    "FusedQKVAttentionAdapter",
    "MultiheadAttentionAdapter",
    "attention_adapters",
    "register_attention_adapter",
]


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
            x = torch.randn(2, seq, embed, generator=generator).to(module_device(module), module_dtype(module))
            try:
                with torch.no_grad(), eval_without_dropout(module):
                    module(x)
            except Exception:
                continue
            return [((x,), {})]
        raise AttentionNotSwappable(f"its forward does not accept a (batch, seq, {embed}) tensor")

    def already_fused(self, module: nn.Module, calls: list[tuple[tuple[Any, ...], dict]]) -> bool:
        """Whether ``module`` already computes its attention with SDPA: its first sample call (eval mode, no grad)
        calls :func:`torch.nn.functional.scaled_dot_product_attention` (:class:`SDPACalls`). Such a module (timm's
        ``Attention`` with ``fused_attn=True``, MONAI's ``SABlock(use_flash_attention=True)``) is left alone."""
        if not calls:
            return False
        args, kwargs = calls[0]
        with torch.no_grad(), eval_without_dropout(module), SDPACalls() as seen:
            module(*args, **kwargs)
        return seen.total > 0

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

    def already_fused(self, module: nn.Module, calls: list[tuple[tuple[Any, ...], dict]]) -> bool:
        # torch runs SDPA inside nn.MultiheadAttention only for need_weights=False calls (the sample calls): the swap
        # still serves need_weights=False callers with flash-attn on GPUs, and is kept as before.
        return False

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
        with torch.no_grad(), eval_without_dropout(module):
            expected = module(x)
            for heads in candidates:
                for causal in (True, False):
                    for layout in ("qkv", "head"):
                        spec = FusedQKVSpec(qkv_name, out_name, heads, causal, layout, attn_dropout, out_dropout)
                        candidate = FusedQKVAttention.from_module(module, spec, kernel)
                        if outputs_close(candidate.fused(x), expected, x.dtype):
                            # the calls exercising the learned arguments, for swap_attention's parity check
                            candidate.__dict__["parity_calls"] = candidate.learn_arguments(x)
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
        with torch.no_grad(), train_without_dropout(module):
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
