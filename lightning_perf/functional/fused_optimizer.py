"""Switch existing torch optimizers to their fused or foreach (multi-tensor) implementations, in place.

Entry points: :func:`switch_implementation`, :func:`set_implementation`, :func:`choose_implementation`,
:func:`match_state_layout`. Why flipping the flags is enough, the one flag left unset, and the measured step ratios:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from lightning_perf._validation import check_choice, check_instance
from lightning_perf.functional.sharding import is_sharded_parameter

Mode = Literal["fused", "foreach", "auto"]
Implementation = Literal["fused", "foreach"]

MODES: tuple[str, ...] = ("fused", "foreach", "auto")


@dataclass(frozen=True)
class OptimizerChoice:
    """What :func:`choose_implementation` decided for one optimizer.

    Attributes:
        implementation: ``"fused"`` or ``"foreach"`` to switch to, or ``None`` to leave it as it is.
        reason: why it was left alone (``None`` when it switches).
    """

    implementation: Implementation | None
    reason: str | None = None


def validate_mode(mode: Any, owner: str = "switch_implementation") -> Mode:
    """Return ``mode`` if it is one of :data:`MODES`; raise ``ValueError`` naming ``owner`` otherwise."""
    return check_choice(owner, "mode", mode, MODES)  # type: ignore[no-any-return]


IMPLEMENTATIONS: tuple[str, ...] = ("fused", "foreach")


def _check_optimizer(optimizer: Any, owner: str) -> Optimizer:
    return check_instance(owner, "optimizer", optimizer, Optimizer, "a torch.optim.Optimizer")  # type: ignore[no-any-return]


def _check_sparse_params(sparse_params: Any, owner: str) -> Collection[torch.Tensor]:
    if (
        isinstance(sparse_params, (str, bytes, torch.Tensor))
        or not isinstance(sparse_params, Collection)
        or not all(isinstance(p, torch.Tensor) for p in sparse_params)
    ):
        raise TypeError(
            f"`{owner}(sparse_params={sparse_params!r})` is not valid. Expected a collection of parameters (tensors)."
        )
    return sparse_params


def _torch_optimizer_class(cls: type[Optimizer]) -> type[Optimizer] | None:
    """The nearest class of torch.optim among ``cls`` and its bases whose constructor takes ``fused``."""
    for base in cls.__mro__:
        if (
            base.__module__.startswith("torch.optim")
            and base is not Optimizer
            and "fused" in inspect.signature(base).parameters
        ):
            return base
    return None


@cache
def fused_kernel_error(cls: type[Optimizer], device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch's fused step of ``cls`` fails for parameters of ``device`` and ``dtype``, or ``None`` if it runs.

    Found by running one fused step on a 2-element tensor, once per class, device and dtype: the kernel registry of
    the installed torch build is the only exact answer (CPU fused Adam/AdamW/SGD/Adagrad exist from torch 2.4).
    """
    torch_cls = _torch_optimizer_class(cls)
    if torch_cls is None:
        return f"{cls.__name__} has no fused implementation in torch"
    param = torch.zeros(2, device=device, dtype=dtype)
    param.grad = torch.ones_like(param)
    try:
        torch_cls([param], fused=True).step()  # type: ignore[call-arg]
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _fused_problem(optimizer: Optimizer, sparse_params: Collection[torch.Tensor]) -> str | None:
    """Why the fused implementation cannot run this optimizer's parameters, or ``None``."""
    if "fused" not in optimizer.defaults:
        return f"{type(optimizer).__name__} has no fused implementation in torch"
    sparse_ids = {id(p) for p in sparse_params}
    for p in _params(optimizer):
        if not p.is_floating_point():
            return f"it holds {p.dtype} parameters (fused needs floating point)"
        if id(p) in sparse_ids:
            return "it updates parameters with sparse gradients (sparse nn.Embedding), which fused kernels reject"
    for device, dtype in sorted({(p.device, p.dtype) for p in _params(optimizer)}, key=str):
        error = fused_kernel_error(type(optimizer), device, dtype)  # type: ignore[arg-type]
        if error is not None:
            return f"torch has no fused {type(optimizer).__name__} step for {dtype} on {device} ({error})"
    if any(is_sharded_parameter(p) for p in _params(optimizer)) and not _dtensor_has_fused_step(optimizer):
        return (
            f"its parameters are DTensors (FSDP2) and torch has no DTensor rule for the fused "
            f"{type(optimizer).__name__} kernel (aten._fused_{type(optimizer).__name__.lower()}_)"
        )
    return None


def _dtensor_has_fused_step(optimizer: Optimizer) -> bool:
    """Whether DTensor can run this optimizer class's fused kernel (torch 2.13: Adam and AdamW only, not SGD)."""
    op = getattr(getattr(torch.ops.aten, f"_fused_{type(optimizer).__name__.lower()}_", None), "default", None)
    if op is None:
        return False
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
    except (ImportError, AttributeError):  # pragma: no cover - private registry moved: let torch decide at the step
        return True
    registries = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(propagator, name, {}) for name in registries)


def _uses_foreach_already(optimizer: Optimizer) -> bool:
    """Whether steps already take the foreach path: asked for, or torch's own default (all parameters on CUDA)."""
    groups = optimizer.param_groups
    if all(g.get("foreach") for g in groups):
        return True
    if any(g.get("foreach") is not None for g in groups):
        return False
    try:  # the rule torch applies when neither flag is set (private, hence the guard)
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - older or newer torch
        return False
    return bool(_default_to_fused_or_foreach(_params(optimizer), differentiable=False, use_fused=False)[1])


def choose_implementation(
    optimizer: Optimizer, mode: Mode = "auto", sparse_params: Collection[torch.Tensor] = ()
) -> OptimizerChoice:
    """Decide which implementation ``optimizer`` should switch to under ``mode``, or why it stays as it is.

    ``"fused"`` where torch has a fused kernel for the optimizer class and every parameter's device and dtype;
    ``"foreach"`` where the class has a foreach implementation; ``"auto"`` takes fused where it can, else foreach.
    An optimizer built with ``fused=False`` or ``foreach=False`` asked for the single-tensor loop (torch's documented
    way to force it) and is left alone, as is one that is ``differentiable`` or already takes the chosen path.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        mode: ``"fused"``, ``"foreach"`` or ``"auto"``.
        sparse_params: parameters that get sparse gradients (fused kernels reject them).
    """
    _check_optimizer(optimizer, "choose_implementation")
    mode = validate_mode(mode, "choose_implementation")
    _check_sparse_params(sparse_params, "choose_implementation")
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if "fused" not in defaults and "foreach" not in defaults:
        return OptimizerChoice(None, f"{name} has neither a fused nor a foreach implementation in torch")
    groups = optimizer.param_groups
    if any(g.get("differentiable") for g in groups):
        return OptimizerChoice(
            None, "it is built with differentiable=True, which only the for-loop implementation supports"
        )
    if any(g.get("fused") for g in groups):
        return OptimizerChoice(None, "it is already fused")
    forced = [flag for flag in ("fused", "foreach") if any(g.get(flag) is False for g in groups)]
    if forced:
        return OptimizerChoice(None, f"configure_optimizers asked for the for-loop implementation ({forced[0]}=False)")
    problem = None
    if mode in ("fused", "auto"):
        problem = _fused_problem(optimizer, sparse_params)
        if problem is None:
            return OptimizerChoice("fused")
        if mode == "fused":
            return OptimizerChoice(None, problem)
    if "foreach" not in defaults:
        return OptimizerChoice(None, problem or f"{name} has no foreach implementation in torch")
    if _uses_foreach_already(optimizer):
        return OptimizerChoice(None, "it already uses foreach" + (f" and {problem}" if problem else ""))
    return OptimizerChoice("foreach")


def set_implementation(optimizer: Optimizer, implementation: Implementation) -> None:
    """Make ``optimizer`` step with ``implementation`` from its next step on, keeping its state and param groups.

    Sets the flags in every param group and in ``defaults`` (read by ``zero_grad`` and ``add_param_group``); for the
    fused path also moves existing ``step`` counters to their parameter's device in float32, as the fused kernels
    need them (``torch.optim.Optimizer.load_state_dict`` does the same for fused groups).
    """
    _check_optimizer(optimizer, "set_implementation")
    check_choice("set_implementation", "implementation", implementation, IMPLEMENTATIONS)
    fused = implementation == "fused"
    for target in (*optimizer.param_groups, optimizer.defaults):
        if "fused" in target:
            target["fused"] = True if fused else None
        if "foreach" in target:
            target["foreach"] = None if fused else True
    if not fused:
        return
    for p in _params(optimizer):
        state = optimizer.state.get(p)
        step = state.get("step") if state else None
        if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
            state["step"] = step.to(device=p.device, dtype=torch.float32)  # type: ignore[index]
    match_state_layout(optimizer)


def match_state_layout(optimizer: Optimizer) -> int:
    """Give every state tensor shaped like its parameter (``exp_avg``, ``momentum_buffer``...) the parameter's strides.

    torch 2.13's fused CPU kernels (Adam, AdamW, SGD with momentum, Adagrad) compute wrong updates when a state tensor
    is laid out differently from its parameter, e.g. a channels-last weight whose state was loaded from a checkpoint
    written in contiguous format (measured: 0.07 to 0.45 off after one step; the for-loop and foreach paths are
    exact). Values are kept; only the layout changes. Returns how many tensors were rewritten.
    """
    rewritten = 0
    for p in _params(optimizer):
        state = optimizer.state.get(p)
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.stride() != p.stride():
                state[key] = torch.empty_like(p, dtype=value.dtype, device=value.device).copy_(value)  # type: ignore[index]
                rewritten += 1
    return rewritten


def switch_implementation(
    optimizer: Optimizer, mode: Mode = "auto", sparse_params: Collection[torch.Tensor] = ()
) -> OptimizerChoice:
    """:func:`choose_implementation` then :func:`set_implementation`; returns the choice.

    Example::

        optimizer = torch.optim.AdamW(model.parameters())
        choice = switch_implementation(optimizer)  # fused on CPU and CUDA in torch 2.13
    """
    _check_optimizer(optimizer, "switch_implementation")
    validate_mode(mode, "switch_implementation")
    _check_sparse_params(sparse_params, "switch_implementation")
    choice = choose_implementation(optimizer, mode, sparse_params)
    if choice.implementation is not None:
        set_implementation(optimizer, choice.implementation)
    return choice
