"""Swap a model's attention modules for fused kernels: flash-attn 2 where it applies, else PyTorch's SDPA.

Entry points (import every public name of the attention family from here): :func:`swap_attention`, which checks each
swapped module against the original before putting it in the model and reports an :class:`AttentionDecision` per module,
:func:`restore_attention`, :func:`register_attention_adapter` and :class:`SDPACalls`. The kernels, the built-in
adapters, what is not swapped and the one sense in which a swap is not bit-exact: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_perf._device import as_device, module_device
from lightning_perf._warnings import FallbackWarning, warn_once
from lightning_perf.functional.attention.arguments import ArgumentNotHonoured, ArgumentPlan
from lightning_perf.functional.attention.config import (
    configurable_attention_models,
    restore_attention_implementations,
    switch_attention_implementation,
)
from lightning_perf.functional.attention.detect import (
    AttentionAdapter,
    FusedQKVAttentionAdapter,
    MultiheadAttentionAdapter,
    attention_adapters,
    register_attention_adapter,
)
from lightning_perf.functional.attention.kernels import (
    ACTIONS,
    ALREADY_FUSED,
    FLASH_ATTN,
    KEPT,
    SDPA,
    SWAPPED,
    SWITCHED_CONFIG,
    UNCHANGED,
    AttentionDecision,
    AttentionNotSwappable,
    attention,
    choose_kernel,
)
from lightning_perf.functional.attention.modules import (
    FusedMultiheadAttention,
    FusedQKVAttention,
    FusedQKVSpec,
    SwappedAttention,
)
from lightning_perf.functional.attention.parity import check_parity, time_against_original
from lightning_perf.functional.attention.trace import SDPACalls
from lightning_perf.functional.sharding import (
    is_fsdp_module,
    is_sharded_parameter,
    plain_parameters,
    rebind_parameters,
)
from lightning_perf.functional.surgery import FilterFn, find_modules, replace_modules, restore_modules

__all__ = [
    "ACTIONS",
    "ALREADY_FUSED",
    "FLASH_ATTN",
    "KEPT",
    "SDPA",
    "SWAPPED",
    "SWITCHED_CONFIG",
    "UNCHANGED",
    "ArgumentNotHonoured",
    "ArgumentPlan",
    "AttentionAdapter",
    "AttentionDecision",
    "AttentionNotSwappable",
    "FusedMultiheadAttention",
    "FusedQKVAttention",
    "FusedQKVAttentionAdapter",
    "FusedQKVSpec",
    "MultiheadAttentionAdapter",
    "SDPACalls",
    "SwapResult",
    "SwappedAttention",
    "attention",
    "attention_adapters",
    "check_parity",
    "choose_kernel",
    "register_attention_adapter",
    "restore_attention",
    "restore_attention_implementations",
    "swap_attention",
    "time_against_original",
]


@dataclass
class SwapResult:
    """What :func:`swap_attention` did.

    Attributes:
        decisions: module name -> :class:`AttentionDecision`, for every attention module found (swapped, already
            fused, switched by configuration, or kept with the reason).
        replaced: module name -> ``(original, swapped)``; give it to
            :func:`~lightning_perf.functional.surgery.restore_modules` to undo exactly this swap.
        switched: model name -> ``(model, previous implementation)`` for the models whose configuration was switched
            to SDPA; give it to :func:`restore_attention_implementations` to undo the switch (:meth:`undo` does both).
    """

    decisions: dict[str, AttentionDecision] = field(default_factory=dict)
    replaced: dict[str, tuple[nn.Module, nn.Module]] = field(default_factory=dict)
    switched: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)

    @property
    def swapped(self) -> list[str]:
        """The modules that now compute with a fused kernel because of this call (swapped or switched config)."""
        return [name for name, decision in self.decisions.items() if decision.action in (SWAPPED, SWITCHED_CONFIG)]

    def undo(self, model: nn.Module) -> None:
        """Put back every original module and every previous attention implementation."""
        restore_modules(model, self.replaced)
        restore_attention_implementations(self.switched)
        self.replaced, self.switched = {}, {}


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
    also stays valid). Modules swapped already or already fused are left alone, configured (Hugging Face) models are
    switched to SDPA instead (nothing inside them is swapped): each is reported, as the module notes say.

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
    checks = _Checks(target, compute_dtype, parity_check, strict)
    result = SwapResult()
    configured = _switch_configured(model, result, filter_fn, checks)
    all_adapters = attention_adapters(adapters)

    def adapter_for(module: nn.Module, name: str) -> AttentionAdapter | None:
        inside_configured = any(outer == "" or name == outer or name.startswith(f"{outer}.") for outer in configured)
        if inside_configured or (filter_fn is not None and not filter_fn(module, name)):
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
        result.decisions[name], swapped = _swap_one(name, module, adapter, checks)
        if swapped is not None:
            swaps[name] = swapped
    if swaps:
        result.replaced = replace_modules(model, list(swaps), lambda m, n: swaps[n])
    return result


@dataclass(frozen=True)
class _Checks:
    """Where the swapped modules run and how each swap is checked (the arguments of :func:`swap_attention`)."""

    target: torch.device
    compute_dtype: torch.dtype | None
    parity_check: bool
    strict: bool

    def fall_back(self, message: str) -> None:
        """Raise ``message`` under ``strict``; else warn (once) that the original is kept."""
        if self.strict:
            raise RuntimeError(message)
        warn_once(message, FallbackWarning)


def _switch_configured(model: nn.Module, result: SwapResult, filter_fn: FilterFn | None, checks: _Checks) -> list[str]:
    """Switch the configured (Hugging Face) models inside ``model`` to SDPA, into ``result``; their names."""
    configured: list[str] = []
    for name, hf_model in configurable_attention_models(model):
        if filter_fn is not None and not filter_fn(hf_model, name):
            continue
        configured.append(name)
        decisions, previous, problem = switch_attention_implementation(
            name, hf_model, device=checks.target, compute_dtype=checks.compute_dtype, parity_check=checks.parity_check
        )
        if problem is not None:
            checks.fall_back(
                f"The attention implementation of `{name or type(model).__name__}` stays 'eager': {problem}."
            )
            decisions = {name: AttentionDecision(UNCHANGED, f"config not switched: {problem}")}
        result.decisions.update(decisions)
        if previous is not None:
            result.switched[name] = (hf_model, previous)
    return configured


def _swap_one(
    name: str, module: nn.Module, adapter: AttentionAdapter, checks: _Checks
) -> tuple[AttentionDecision, nn.Module | None]:
    """What becomes of one attention module: the decision, and its fused version (``None``: the original stays)."""
    problem = None
    try:
        if any(is_fsdp_module(m) for m in module.modules()):
            # Probing it would run FSDP2's hooks (all-gathers, lazy initialisation) outside a step, on one rank.
            raise AttentionNotSwappable(
                "fully_shard was applied to the attention module itself or to a layer inside it; swapping it "
                "would drop FSDP2's hooks (shard the block around it instead)"
            )
        sharded = _sharded_refusal(module)
        notes: list[str] = []
        # Sharded (FSDP2) parameters are DTensors outside a training step: probe and check on plain stand-ins of
        # their full shapes (the same on every rank, no collective call), then give the swap the real ones back.
        with plain_parameters(module) as stand_ins:
            calls = adapter.sample_inputs(module, torch.Generator().manual_seed(0))
            if adapter.already_fused(module, calls):
                reason = f"already fused: {type(module).__name__} calls scaled_dot_product_attention itself"
                return AttentionDecision(UNCHANGED, reason, ALREADY_FUSED), None
            if sharded is not None:
                raise AttentionNotSwappable(sharded)
            swapped = adapter.swap(module, SDPA)
            calls += swapped.__dict__.pop("parity_calls", [])
            decision = choose_kernel(int(getattr(swapped, "head_dim", 0)), checks.target, checks.compute_dtype)
            setattr(swapped, "kernel", decision.kernel)  # noqa: B010 (any nn.Module an adapter returns)
            if checks.parity_check:
                dtype = checks.compute_dtype
                problem = check_parity(module, swapped, calls, device=checks.target, compute_dtype=dtype, notes=notes)
            rebind_parameters(swapped, stand_ins)
        if stand_ins:
            notes.append("parameters sharded by FSDP2: checked on stand-in weights of their full shapes")
        honoured = _honoured_arguments(swapped)
        if honoured:
            notes.append(honoured)
        if notes:
            decision = AttentionDecision(decision.kernel, f"{decision.reason}; {'; '.join(notes)}")
    except AttentionNotSwappable as reason:
        return AttentionDecision(UNCHANGED, f"{type(module).__name__}: {reason}"), None
    except Exception as error:  # an adapter's or a kernel's failure: keep the original, like a mismatch
        if checks.strict:
            raise
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        checks.fall_back(
            f"The fused-kernel version of `{name}` ({type(module).__name__}) does not compute what the original "
            f"does ({problem}); the original is kept."
        )
        return AttentionDecision(UNCHANGED, f"parity check failed: {problem}"), None
    return decision, swapped


def _sharded_refusal(module: nn.Module) -> str | None:
    """Why a module holding FSDP2-sharded parameters itself cannot be swapped, or ``None`` when it can.

    FSDP2 puts the gathered parameters back, before each forward, on the modules that held them when ``fully_shard``
    ran. A swapped module that holds such parameters itself (not through shared child modules) would keep the shards.
    """
    own = [n for n, p in module.named_parameters(recurse=False) if is_sharded_parameter(p)]
    if own:
        return (
            f"it holds FSDP2-sharded parameters itself ({', '.join(own)}), which FSDP2 gathers for the original "
            "module only (nn.MultiheadAttention called with need_weights=False already runs SDPA)"
        )
    return None


def _honoured_arguments(swapped: nn.Module) -> str:
    """What a swapped module's kernel serves besides its input (for the decision's reason)."""
    plan = getattr(swapped, "arguments", None)
    if not isinstance(plan, ArgumentPlan) or not plan.optional():
        return ""
    served = [f"{name}=<default>" for name, _ in plan.optional()]
    served += sorted(f"{name}=True" for name in plan.causal)
    served += [
        f"{name} ({', '.join(f'{dtype} {layout}: {reading}' for (dtype, layout), reading in masks.items())})"
        for name, masks in plan.masks.items()
    ]
    return "kernel serves " + ", ".join(served) + "; other arguments fall back per call (reported)"


def restore_attention(model: nn.Module) -> list[str]:
    """Put back the original of every swapped attention module in ``model``; returns their names.

    Configuration switches are undone by :meth:`SwapResult.undo` (or :func:`restore_attention_implementations`).
    """
    return list(replace_modules(model, lambda m, n: isinstance(m, SwappedAttention), _original_of))


def _original_of(module: nn.Module, name: str) -> nn.Module:
    assert isinstance(module, SwappedAttention)
    return module.original
