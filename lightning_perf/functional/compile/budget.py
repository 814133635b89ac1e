"""The compiler's own activation budget, made to take effect: ``torch._functorch.config.activation_memory_budget`` is
read only when a graph compiles, and dynamo does not guard on it, so a class compiled earlier in the process under
another budget would keep its old graph. Patching every forward to trace under
``torch.autograd.graph.region_activation_memory_budget`` puts the budget into the guards (a recompile per budget).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_perf.functional.checkpoint.budget import validate_memory_budget
from lightning_perf.functional.surgery import ForwardPatch, patch_forward

__all__ = ["CompilerBudgetForward", "aot_compilations", "apply_compiler_budget", "set_compiler_memory_budget"]


class CompilerBudgetForward(ForwardPatch):
    """A module's ``forward`` that, while ``torch.compile`` traces it, runs under the compiler's activation budget.

    Inside a trace the forward runs under ``torch.autograd.graph.region_activation_memory_budget(budget)``, which the
    partitioner reads off the graph, overriding the process-wide ``torch._functorch.config.activation_memory_budget``.
    The budget is held as a string: dynamo guards it by equality, so a graph compiled earlier under another budget (an
    earlier fit of the same class in the same process) fails its guard and the module is compiled again under this
    one (a float that changes between compilations would turn symbolic, which the annotation refuses). Run eagerly,
    it is the plain forward.
    """

    def __init__(self, module: nn.Module, budget: float) -> None:
        super().__init__(module)
        self.budget_key = repr(float(budget))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.call_original(*args, **kwargs)
        with torch.autograd.graph.region_activation_memory_budget(float(self.budget_key)):
            return self.call_original(*args, **kwargs)


def apply_compiler_budget(model: nn.Module, budget: float) -> list[nn.Module]:
    """Patch every module of ``model`` with :class:`CompilerBudgetForward`, before ``torch.compile`` traces it.

    Every module, so that whichever modules are compiled (the model, or its blocks) traces its whole forward under the
    budget, as the annotation requires. Returns the modules patched (none where torch lacks
    ``region_activation_memory_budget``: then only :func:`set_compiler_memory_budget` acts, on graphs compiled later).
    Undo with ``unpatch_forward(module, CompilerBudgetForward)``.
    """
    budget = validate_memory_budget("apply_compiler_budget", budget)
    if not hasattr(torch.autograd.graph, "region_activation_memory_budget"):
        return []
    return [m for m in model.modules() if patch_forward(m, lambda m: CompilerBudgetForward(m, budget)) is not None]


def aot_compilations() -> int:
    """How many graphs AOTAutograd (whose partitioner applies the activation budget) has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["total"])


def set_compiler_memory_budget(budget: float) -> float:
    """Set ``torch._functorch.config.activation_memory_budget`` (read when a graph compiles); returns the old value.

    It acts only on code compiled by ``torch.compile`` afterwards; restore the returned value when done, it is a
    process-wide setting.
    """
    from torch._functorch import config as functorch_config

    previous = float(functorch_config.activation_memory_budget)
    functorch_config.activation_memory_budget = float(budget)
    return previous
