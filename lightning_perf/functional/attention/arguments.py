"""The arguments a swapped attention module honours: the original's signature, and what its masks and flags mean.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there). Entry point:
:class:`ArgumentPlan`, built from the original's ``forward`` signature and taught by probe calls
(:meth:`ArgumentPlan.learn`). Which arguments reach the kernel and which fall back: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["ArgumentNotHonoured", "ArgumentPlan", "combine_masks"]

_CAUSAL_NAMES = ("is_causal", "causal")
_READINGS = ("keep", "blocked", "additive")
_LAYOUTS = ("padding", "full")


class ArgumentNotHonoured(Exception):
    """A call's argument the fused kernel cannot serve; ``name`` is the argument, the message says why."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"`{name}` {why}")
        self.name = name


@dataclass
class ArgumentPlan:
    """How a swapped module reads the calls of its original: ``(input, mask, causal)`` for the kernel.

    Attributes:
        parameters: the original ``forward``'s parameters ``(name, kind, default)``, in order; the first is the input.
        masks: mask parameter -> ``{(dtype, layout): reading}`` learned from the original; ``dtype`` is ``"bool"`` or
            ``"float"``, ``layout`` ``"padding"`` or ``"full"``, ``reading`` ``"keep"``, ``"blocked"`` or
            ``"additive"``.
        causal: the flags whose ``True`` the original reads as causal attention.
    """

    parameters: list[tuple[str, Any, Any]]
    masks: dict[str, dict[tuple[str, str], str]] = field(default_factory=dict)
    causal: set[str] = field(default_factory=set)

    @classmethod
    def from_forward(cls, forward: Callable[..., Any]) -> ArgumentPlan:
        """The plan of a bound ``forward`` (nothing learned yet: only default values are honoured)."""
        try:
            signature = inspect.signature(forward)
        except (TypeError, ValueError):  # a builtin or a C extension: take one input, nothing else
            return cls([("input", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)])
        params = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
        if not params or params[0][1] not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            params.insert(0, ("input", inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.empty))
        return cls(params)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.Signature([inspect.Parameter(n, k, default=d) for n, k, d in self.parameters])

    def optional(self) -> list[tuple[str, Any]]:
        """``(name, default)`` of the parameters after the input that have a default and can be passed by keyword."""
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return [(n, d) for n, k, d in self.parameters[1:] if k in keyword and d is not inspect.Parameter.empty]

    def learn(
        self,
        original: Callable[..., Tensor],
        fused: Callable[[Tensor, Tensor | None, bool], Tensor],
        x: Tensor,
        close: Callable[[Tensor, Tensor], bool],
    ) -> list[tuple[tuple[Any, ...], dict]]:
        """Learn what the mask arguments and causal flags mean by probing ``original`` (eval mode, no grad).

        Args:
            original: calls the original module.
            fused: ``fused(x, mask, causal)``, the swapped module's kernel path; ``mask`` as SDPA reads it.
            x: a sample input ``(batch, seq, embed)``.
            close: whether two outputs match.

        Returns:
            the calls that exercise what was learned (and the defaults, given explicitly), for the parity check.
        """
        batch, seq = x.shape[:2]
        calls: list[tuple[tuple[Any, ...], dict]] = []
        defaults = {name: default for name, default in self.optional()}
        if defaults:
            calls.append(((x,), defaults))
        generator = torch.Generator().manual_seed(1)
        for name, default in self.optional():
            if name in _CAUSAL_NAMES and default is False:
                expected = _try(original, x, {name: True})
                if expected is not None and close(fused(x, None, True), expected):
                    self.causal.add(name)
                    calls.append(((x,), {name: True}))
            elif "mask" in name.lower() and default is None:
                for dtype in ("bool", "float"):
                    for layout in _LAYOUTS:
                        mask = _probe_mask(dtype, layout, batch, seq, generator).to(x.device)
                        expected = _try(original, x, {name: mask})
                        if expected is None:
                            continue
                        for reading in _READINGS:
                            if close(fused(x, read_mask(mask, layout, reading, x.dtype), False), expected):
                                self.masks.setdefault(name, {})[(dtype, layout)] = reading
                                calls.append(((x,), {name: mask}))
                                break
        return calls

    def resolve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None, bool]:
        """``(input, mask, causal)`` for the kernel from a call of the original's signature.

        Raises:
            ArgumentNotHonoured: for the first argument the kernel cannot serve.
            TypeError: when the call does not fit the signature (the original would raise too).
        """
        if len(args) == 1 and not kwargs:  # the common call: the input alone
            items = [(self.parameters[0][0], args[0])]
        else:
            items = list(self.signature.bind(*args, **kwargs).arguments.items())
        x = items[0][1]
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ArgumentNotHonoured(items[0][0], f"is not a (batch, seq, embed) tensor ({type(x).__name__})")
        kinds = {n: (k, d) for n, k, d in self.parameters}
        masks: list[Tensor] = []
        causal = False
        for name, value in items[1:]:
            kind, default = kinds[name]
            if kind is inspect.Parameter.VAR_POSITIONAL:
                raise ArgumentNotHonoured(name, f"(extra positional arguments {len(value)}) is not understood")
            if kind is inspect.Parameter.VAR_KEYWORD:
                raise ArgumentNotHonoured(next(iter(value)), "is not a parameter of the original forward it can read")
            if _is_default(value, default):
                continue
            if name in self.causal and value is True:
                causal = True
            elif name in self.masks and isinstance(value, Tensor):
                masks.append(self._mask(name, value, x))
            else:
                raise ArgumentNotHonoured(name, f"= {_short(value)} has no meaning learned from the original")
        mask = combine_masks(masks, x.dtype) if masks else None
        return x, mask, causal

    def _mask(self, name: str, mask: Tensor, x: Tensor) -> Tensor:
        dtype = "bool" if mask.dtype == torch.bool else "float"
        learned = self.masks[name]
        layouts = [layout for layout in _LAYOUTS if (dtype, layout) in learned]
        is_padding = mask.dim() == 2 and tuple(mask.shape) == tuple(x.shape[:2])
        if is_padding and "padding" in layouts:
            if "full" in layouts and x.shape[0] == x.shape[1]:
                raise ArgumentNotHonoured(name, f"of shape {tuple(mask.shape)} reads as a padding or a full mask")
            layout = "padding"
        elif "full" in layouts and not is_padding:
            layout = "full"
        else:
            raise ArgumentNotHonoured(name, f"as a {dtype} mask of shape {tuple(mask.shape)} was never seen to work")
        return read_mask(mask, layout, learned[(dtype, layout)], x.dtype)


def read_mask(mask: Tensor, layout: str, reading: str, dtype: torch.dtype) -> Tensor:
    """``mask`` as SDPA reads it: boolean (``True`` takes part) or additive float, broadcastable to ``(B, H, L, S)``."""
    if layout == "padding":
        mask = mask.view(mask.shape[0], 1, 1, mask.shape[1])
    if reading == "additive":
        return mask.to(dtype)
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep if reading == "keep" else ~keep


def combine_masks(masks: list[Tensor], dtype: torch.dtype, causal_shape: tuple[int, int] | None = None) -> Tensor:
    """One SDPA mask from several (boolean: ``True`` takes part; float: additive), plus a causal one if asked."""
    masks = list(masks)
    if causal_shape is not None:
        device = masks[0].device if masks else None
        masks.append(torch.ones(causal_shape, dtype=torch.bool, device=device).tril())
    if all(m.dtype == torch.bool for m in masks):
        keep = masks[0]
        for m in masks[1:]:
            keep = keep & m
        return keep
    total: Tensor | None = None
    for m in masks:
        additive = torch.zeros_like(m, dtype=dtype).masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else m
        total = additive.to(dtype) if total is None else total + additive.to(dtype)
    assert total is not None
    return total


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, Tensor) or isinstance(default, Tensor) or default is inspect.Parameter.empty:
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:
        return False


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _try(original: Callable[..., Tensor], x: Tensor, kwargs: dict[str, Any]) -> Tensor | None:
    try:
        out = original(x, **kwargs)
    except Exception:  # the original refuses this argument: nothing to learn from it
        return None
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out if isinstance(out, Tensor) and out.shape[:2] == x.shape[:2] else None


def _probe_mask(dtype: str, layout: str, batch: int, seq: int, generator: torch.Generator) -> Tensor:
    """A probe mask that no reading confuses with another, and that blocks no query row entirely."""
    if layout == "padding":
        keep = torch.ones(batch, seq, dtype=torch.bool)
        keep[0, seq // 2 :] = False
    else:
        keep = torch.rand(batch, 1, seq, seq, generator=generator) > 0.4
        keep |= torch.eye(seq, dtype=torch.bool)
    if dtype == "bool":
        return keep
    if layout == "padding":
        return keep.float()  # 1 takes part, 0 is blocked (MONAI's SABlock reads it so; additive reads differ)
    return torch.randn(keep.shape, generator=generator)
