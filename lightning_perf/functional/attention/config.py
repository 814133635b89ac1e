"""Models that choose their attention code from a configuration: switch Hugging Face eager attention to SDPA.

Part of :mod:`lightning_perf.functional.attention.swap` (import the public names from there). Entry points:
:func:`configurable_attention_models`, :func:`switch_attention_implementation`,
:func:`restore_attention_implementations`. How such a model is found and switched: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_perf.functional.attention.kernels import (
    ALREADY_FUSED,
    SDPA,
    SWITCHED_CONFIG,
    UNCHANGED,
    AttentionDecision,
)
from lightning_perf.functional.attention.parity import check_parity, eval_without_dropout
from lightning_perf.functional.attention.trace import SDPACalls
from lightning_perf.functional.sharding import is_sharded

__all__ = ["configurable_attention_models", "restore_attention_implementations", "switch_attention_implementation"]

_EAGER = "eager"


def configurable_attention_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` (itself included) that choose their attention from ``config``."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            continue
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "_attn_implementation", None), str) and callable(
            getattr(module, "set_attn_implementation", None)
        ):
            found.append((name, module))
    return found


def switch_attention_implementation(
    name: str,
    model: nn.Module,
    *,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    parity_check: bool,
) -> tuple[dict[str, AttentionDecision], str | None, str | None]:
    """Switch one configurable model from eager attention to SDPA, or find it already fused.

    Returns:
        ``(decisions, previous, problem)``: the decision per attention module (or per model when no module could be
        named), the implementation to go back to when it was switched (else ``None``), and what went wrong (a refused
        switch, a parity mismatch: the model is then back on its implementation).
    """
    current = str(model.config._attn_implementation)  # type: ignore[union-attr]
    prefix = f"{name}." if name else ""
    # A call of an FSDP2-sharded model outside a training step would run its all-gathers (and FSDP2's lazy
    # initialisation) on this rank alone: no traced call and no parity check then; HF's own switch is trusted.
    sharded = is_sharded(model)
    callers: Callable[[nn.Module, str], list[str]] = (lambda m, p: []) if sharded else _sdpa_callers
    if current != _EAGER:
        reason = f"already fused: its config's attn_implementation is {current!r}"
        names = callers(model, prefix) or [name]
        return {n: AttentionDecision(UNCHANGED, reason, ALREADY_FUSED) for n in names}, None, None
    try:
        model.set_attn_implementation(SDPA)  # type: ignore[operator]
    except Exception as error:  # transformers refuses (model without SDPA support, too old a torch...)
        return {}, None, f"its config cannot switch to 'sdpa' ({type(error).__name__}: {error})"
    if model.config._attn_implementation != SDPA:  # type: ignore[union-attr]
        return {}, None, "set_attn_implementation('sdpa') left it unchanged (the model does not support switching)"
    problem = None
    if parity_check and not sharded:
        try:
            calls = [((), _sample_kwargs(model))]
            problem = check_parity(
                _Implementation(model, _EAGER),
                _Implementation(model, SDPA),
                calls,
                device=device,
                compute_dtype=compute_dtype,
            )
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        model.set_attn_implementation(current)  # type: ignore[operator]
        return {}, None, problem
    reason = f"switched config: attn_implementation {current!r} -> 'sdpa' on `{name or type(model).__name__}`"
    if sharded and parity_check:
        reason += " (sharded by FSDP2: not compared with eager attention, which would need a call outside a step)"
    names = callers(model, prefix) or [name]
    return {n: AttentionDecision(SDPA, reason, SWITCHED_CONFIG) for n in names}, current, None


def restore_attention_implementations(switched: dict[str, tuple[nn.Module, str]]) -> list[str]:
    """Put back each switched model's previous attention implementation; returns their names."""
    for model, previous in switched.values():
        model.set_attn_implementation(previous)  # type: ignore[operator]
    return list(switched)


class _Implementation(nn.Module):
    """Calls ``model`` with its config's attention implementation set to ``implementation`` (for the parity check)."""

    def __init__(self, model: nn.Module, implementation: str) -> None:
        super().__init__()
        self.model = model
        self.implementation = implementation

    def forward(self, **kwargs: Any) -> Any:
        saved = self.model.config._attn_implementation  # type: ignore[union-attr]
        self.model.set_attn_implementation(self.implementation)  # type: ignore[operator]
        try:
            out = self.model(**kwargs)
        finally:
            self.model.set_attn_implementation(saved)  # type: ignore[operator]
        return out.to_tuple() if callable(getattr(out, "to_tuple", None)) else out


def _sample_kwargs(model: nn.Module) -> dict[str, Any]:
    dummy = getattr(model, "dummy_inputs", None)
    if not isinstance(dummy, dict) or not dummy:
        raise RuntimeError("the model has no dummy_inputs to check it on")
    kwargs = dict(dummy)
    if "use_cache" in _parameters(model.forward):
        kwargs["use_cache"] = False  # nothing to cache in a check
    return kwargs


def _parameters(forward: Callable[..., Any]) -> Sequence[str]:
    try:
        return list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return []


def _sdpa_callers(model: nn.Module, prefix: str) -> list[str]:
    """The modules of ``model`` that call SDPA in one forward on its dummy inputs (eval mode, no grad)."""
    try:
        kwargs = _sample_kwargs(model)
        with torch.no_grad(), eval_without_dropout(model), SDPACalls(model) as calls:
            model(**{k: v.to(_device(model)) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    except Exception:  # only the names in a report
        return []
    return [f"{prefix}{n}" if n else prefix.rstrip(".") for n in calls.counts]


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
