"""Activation checkpointing of a model's blocks during ``fit``: less activation memory for some recompute time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._validation import FILTER_FN, check_bool, check_instance
from lightning_perf._warnings import warn_once
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.callbacks.compile import runs_compiled
from lightning_perf.functional.checkpoint.apply import (
    CheckpointedForward,
    apply_activation_checkpointing,
    resolve_module_classes,
    select_blocks,
    validate_portion,
)
from lightning_perf.functional.checkpoint.budget import (
    ActivationProfile,
    ActivationRecorder,
    CheckpointPlan,
    apply_plan,
    plan_checkpointing,
    validate_memory_budget,
)
from lightning_perf.functional.checkpoint.plan import _abbreviate
from lightning_perf.functional.compile.budget import (
    CompilerBudgetForward,
    aot_compilations,
    apply_compiler_budget,
    set_compiler_memory_budget,
)
from lightning_perf.functional.sharding import is_sharded
from lightning_perf.functional.surgery import find_forward_patch, unpatch_forward
from lightning_perf.profiling.memory import MemoryProbe


class GradCheckpointCallback(UndoOnExit):
    """Activation checkpointing (non-reentrant) of the model's blocks while it trains.

    Each chosen block drops its intermediate activations in forward and recomputes them in backward: peak activation
    memory falls to about the blocks' inputs plus one block's activations, for roughly one more forward pass of
    compute (typically +20-35% step time). Use the memory to train with a larger batch, longer sequences or a deeper
    model. Names, ``state_dict`` keys and gradients stay those of the plain model; BatchNorm running statistics are
    updated once per step, as without checkpointing. The blocks are patched in ``setup`` (after ``configure_model``,
    before the optimizer and DDP exist) and unpatched in ``teardown``, or in ``on_exception`` when the fit fails or is
    interrupted: after ``fit`` the model is as it was.

    Works on a single device, under DDP and under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` per block in
    ``configure_model``), with mixed precision and with ``torch.compile``. Under FSDP2 the checkpointed region is each
    block's ``forward``, inside its wrapper (FSDP2 gathers the block's parameters again for the recompute); the root is
    never wrapped. Under ``FSDPStrategy`` (FSDP1) use Lightning's own
    ``FSDPStrategy(activation_checkpointing_policy={Block})`` instead: this callback then warns and does nothing.

    Args:
        modules: which blocks: ``"auto"`` (repeated blocks that hold real work, found by structure: the layers of a
            transformer, Swin blocks, the stages of a ResNet or U-Net; never conv-norm-activation sub-blocks; see
            :func:`~lightning_perf.functional.checkpoint.blocks.find_checkpoint_blocks`), or block classes:
            ``nn.Module`` subclasses, dotted class paths (``"torch.nn.TransformerEncoderLayer"``, YAML-friendly) or
            bare class names (``"Block"``) matched against the classes in the model.
        filter_fn: ``filter_fn(module, name) -> bool`` choosing the blocks, instead of ``modules``. A block inside a
            chosen block is not wrapped again.
        every_n: checkpoint only every ``every_n``-th of the chosen blocks (1, 1 + n, ...): less recompute, less saved.
        fraction: checkpoint only the first ``fraction`` of the chosen blocks, in ``(0, 1]``.
        preserve_rng_state: make the recompute draw the same dropout masks (keep ``True`` unless the blocks have no
            randomness and the last bit of speed matters).
        memory_budget: instead of ``every_n``/``fraction``, a number in ``(0, 1]``: keep at most about that fraction
            of the activation memory that training without checkpointing keeps, at the least recompute time. The
            first two training batches run without checkpointing and the second, warm one is profiled (the first pays
            one-time costs; what each chosen block and its parts, attention and MLP, save for backward, which ops they
            run and their times; it must fit in memory; identical blocks are planned with their median times); then,
            per block: no checkpointing, recomputing only its norm and activation outputs from inputs kept anyway
            (the MLP's GELU output, the ``LayerNorm`` outputs: one elementwise op each in backward), selective
            checkpointing (keep matmul/convolution/attention outputs, or attention outputs only, recompute the cheap
            ops), checkpointing of some of its parts (with or without those recomputes), or full checkpointing,
            chosen as the least recompute time within the budget (a knapsack, see
            :mod:`lightning_perf.functional.checkpoint.budget`), so that the kept memory lands just under the budget.
            The plan is reported once, with the memory the allocator measured in the first checkpointed step.
            ``1.0`` means no checkpointing. Under ``torch.compile`` (a
            :class:`~lightning_perf.callbacks.CompileCallback` in the trainer, or a module compiled in place) the
            compiler's own budget is used instead: ``torch._functorch.config.activation_memory_budget`` for the fit,
            and the same budget inside the traced forward
            (:class:`~lightning_perf.functional.compile.budget.CompilerBudgetForward`), so that a graph compiled
            earlier in the process under another budget is compiled again under this one. After the first step it
            checks that a graph was compiled under the budget, and after the second it reports the activation memory;
            it warns once when the budget did not take effect (a backend without AOTAutograd, a fallback to eager, the
            same memory as another budget in an earlier fit). All restored after the fit.

    Attributes:
        wrapped: names of the modules this callback checkpointed in the last ``fit`` (blocks; with ``memory_budget``
            also parts of blocks).
        plan: with ``memory_budget``, the :class:`~lightning_perf.functional.checkpoint.budget.CheckpointPlan` of the
            last ``fit`` (None before the second batch, under ``torch.compile`` and for ``memory_budget=1.0``).
        compiled_kept_bytes: with ``memory_budget`` under ``torch.compile``, the activation memory measured in the
            second step of the last ``fit`` (the allocator's growth over its forward), else None.

    Raises:
        ValueError: for a class path that does not import, both ``modules`` and ``filter_fn``, an ``every_n`` below 1,
            a ``fraction`` or ``memory_budget`` outside ``(0, 1]``, ``memory_budget`` with ``every_n`` or ``fraction``,
            a lower-case name that no module class has (``"nonexistent"``) (at construction); for a bare class name
            the model does not use (at setup, naming ``modules``).
        TypeError: for arguments of the wrong type (a non-bool ``preserve_rng_state``, a ``filter_fn`` that is not
            callable, ``modules`` that are neither classes nor strings).

    Example::

        from lightning_perf.callbacks import GradCheckpointCallback

        trainer = Trainer(callbacks=[GradCheckpointCallback()])  # every transformer layer
        trainer = Trainer(callbacks=[GradCheckpointCallback("torch.nn.TransformerEncoderLayer", every_n=2)])
        trainer = Trainer(callbacks=[GradCheckpointCallback(memory_budget=0.5)])  # half the activation memory
    """

    def __init__(
        self,
        modules: str | type[nn.Module] | Sequence[str | type[nn.Module]] = "auto",
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        every_n: int | None = None,
        fraction: float | None = None,
        preserve_rng_state: bool = True,
        memory_budget: float | None = None,
    ) -> None:
        check_instance("GradCheckpointCallback", "filter_fn", filter_fn, (type(None), Callable), FILTER_FN)
        if filter_fn is not None and not (isinstance(modules, str) and modules == "auto"):
            raise ValueError(
                f"`GradCheckpointCallback(modules={modules!r}, filter_fn=...)`: give either `modules` or `filter_fn`."
            )
        if not (isinstance(modules, str) and modules == "auto"):
            try:
                # A class path that does not import, or a name no module class has, fails here, not at fit time.
                _, names = resolve_module_classes(modules)
                _check_class_names(names)
            except (TypeError, ValueError) as err:
                raise type(err)(f"`GradCheckpointCallback(modules={modules!r})` is not valid. {err}") from err
        validate_portion(every_n, fraction, "GradCheckpointCallback")
        if memory_budget is not None:
            validate_memory_budget("GradCheckpointCallback", memory_budget)
            if every_n is not None or fraction is not None:
                raise ValueError(
                    f"`GradCheckpointCallback(memory_budget={memory_budget!r}, every_n={every_n!r}, "
                    f"fraction={fraction!r})`: give `memory_budget` or `every_n`/`fraction`, not both (the budget "
                    "chooses the blocks itself)."
                )
        self.memory_budget = memory_budget
        self.plan: CheckpointPlan | None = None
        self.modules = modules
        self.filter_fn = filter_fn
        self.every_n = every_n
        self.fraction = fraction
        self.preserve_rng_state = check_bool("GradCheckpointCallback", "preserve_rng_state", preserve_rng_state)
        self.wrapped: list[str] = []
        self._patched: list[nn.Module] = []  # the blocks to unpatch, held by object (a name may be rebound meanwhile)
        self._budget_state: _BudgetState | None = None
        self.compiled_kept_bytes: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return  # nothing to save without a backward pass
        if isinstance(trainer.strategy, FSDPStrategy):
            warn_once(
                "GradCheckpointCallback does nothing under FSDP: use "
                "`FSDPStrategy(activation_checkpointing_policy={YourBlock})`, which checkpoints inside the FSDP units."
            )
            return
        self.wrapped = []
        self._patched = []
        self.plan = None
        self.compiled_kept_bytes = None
        if self.memory_budget is None:
            run_after_configure_model(pl_module, self._apply)
        else:
            run_after_configure_model(pl_module, lambda module: self._prepare_budget(trainer, module))

    def _select(self, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
        try:
            return select_blocks(pl_module, self.modules, self.filter_fn)
        except ValueError as err:  # a bare class name the model does not use: only known now
            raise ValueError(f"`GradCheckpointCallback(modules={self.modules!r})`: {err}") from err

    def _prepare_budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        budget = float(self.memory_budget)  # type: ignore[arg-type]
        if budget >= 1.0:
            rank_zero_info(
                "GradCheckpointCallback(memory_budget=1.0): no activation checkpointing (1.0 keeps all the activation "
                "memory of training without it)."
            )
            return
        if runs_compiled(trainer, pl_module):
            state = self._budget_state = _BudgetState(blocks=[], compile_check_next=True)
            state.compiler_previous = set_compiler_memory_budget(budget)
            state.compiler_patched = apply_compiler_budget(pl_module, budget)
            rank_zero_info(
                f"GradCheckpointCallback(memory_budget={budget:g}): the model runs under torch.compile, so the "
                f"compiler's own activation memory budget is used for this fit "
                f"(torch._functorch.config.activation_memory_budget={budget:g}, was {state.compiler_previous:g}, and "
                "the same budget in the traced forward, so that a graph compiled earlier under another budget is "
                "compiled again); no eager checkpointing. Checked after the first step."
            )
            return
        chosen = self._select(pl_module)
        if not chosen:
            self._apply(pl_module)  # warns once that nothing matched
            return
        if is_sharded(pl_module):
            warn_once(
                f"GradCheckpointCallback(memory_budget={budget:g}) under {type(trainer.strategy).__name__}: the budget "
                "planner profiles one step of tensors it can address, and FSDP2's sharded parameters (DTensors, "
                "gathered per block) are not; every chosen block is checkpointed fully instead (less activation "
                "memory than the budget, more recompute). Pass `every_n` or `fraction` to checkpoint fewer blocks."
            )
            self._apply(pl_module)
            return
        self._budget_state = _BudgetState(blocks=chosen, profile_next=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        state = self._budget_state
        if state is None:
            return
        if state.profile_next and state.warmup_left > 0:
            state.warmup_left -= 1  # the first step pays one-time costs (allocations, kernel choice): not profiled
        elif state.profile_next:
            state.profile_next = False
            state.recorder = ActivationRecorder(pl_module, state.blocks, pl_module.device)
            state.recorder.start()
        elif state.compile_check_next:
            state.compile_check_next = False
            state.aot_before = aot_compilations()
        elif state.measure_next:
            state.measure_next = False
            state.probe = _probe(pl_module)
            state.before = (state.probe.allocated(), _grad_bytes(pl_module)) if state.probe is not None else None

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._finish_forward(pl_module)

    def _finish_forward(self, pl_module: pl.LightningModule) -> None:
        state = self._budget_state
        if state is None:
            return
        if state.recorder is not None and state.recorder.active:
            state.profile = state.recorder.stop()
            state.recorder = None
        elif state.before is not None and state.probe is not None:
            allocated, grads = state.before
            # Lightning's zero_grad runs between training_step and backward: add back the gradients it freed.
            measured = state.probe.allocated() - allocated + grads - _grad_bytes(pl_module)
            state.before = None
            state.probe.close()
            state.probe = None
            if self.plan is not None:
                self.plan = self.plan.with_measurement(measured)
                self._report()
            else:
                self._check_compiled_memory(pl_module, measured)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._budget_state
        if state is None:
            return
        self._finish_forward(pl_module)  # a step without backward (training_step returned None)
        if state.aot_before is not None:
            self._check_compiled(pl_module, aot_compilations() - state.aot_before)
            state.aot_before = None
            state.measure_next = True  # the first step's memory holds the compilation's own allocations
        if state.profile is None:
            return
        profile, state.profile = state.profile, None
        plan = plan_checkpointing(profile, float(self.memory_budget)) if trainer.is_global_zero else None  # type: ignore[arg-type]
        plan = trainer.strategy.broadcast(plan, src=0)  # every rank checkpoints the same blocks
        assert plan is not None  # rank zero planned it
        self.plan = plan
        self.wrapped = apply_plan(pl_module, plan, self.preserve_rng_state)
        self._patched = [pl_module.get_submodule(n) for n in self.wrapped]
        if self.wrapped:
            state.measure_next = True
        else:
            self._report()

    def _check_compiled(self, pl_module: pl.LightningModule, compiled: int) -> None:
        """After the first compiled step: a graph was compiled under the budget now, or earlier in this process."""
        key = (_model_key(pl_module), repr(float(self.memory_budget)))  # type: ignore[arg-type]
        if compiled > 0:
            _COMPILED_UNDER.add(key)
            return
        if key in _COMPILED_UNDER:
            return  # compiled under this very budget in an earlier fit: the cached graph is the right one
        why = (
            "torch lacks `torch.autograd.graph.region_activation_memory_budget`, so a graph compiled earlier under "
            "another budget is reused (`torch._dynamo.reset()` would drop every compiled graph of the process)"
            if self._budget_state is not None and not self._budget_state.compiler_patched
            else "the backend does not use AOTAutograd's partitioner (backend='eager', say), or compilation fell back "
            "to eager"
        )
        warn_once(
            f"GradCheckpointCallback(memory_budget={self.memory_budget:g}) on a compiled model: no graph was compiled "
            f"under this budget in the first step ({compiled} AOTAutograd compilations): {why}. The budget has no "
            "effect on this fit; without torch.compile the callback checkpoints eagerly to the budget."
        )

    def _check_compiled_memory(self, pl_module: pl.LightningModule, measured: int) -> None:
        """Report the second compiled step's activation memory; warn when an earlier fit's other budget kept as much."""
        self.compiled_kept_bytes = measured
        budget = float(self.memory_budget)  # type: ignore[arg-type]
        earlier = _COMPILED_MEMORY.setdefault(_model_key(pl_module), {})
        same = [b for b, kept in earlier.items() if b != budget and abs(kept - measured) <= 0.01 * max(kept, 1)]
        earlier[budget] = measured
        rank_zero_info(
            f"GradCheckpointCallback(memory_budget={budget:g}) under torch.compile: activation memory "
            f"{measured / 2**20:.1f} MiB (allocator growth over the second step's forward)"
            + "".join(f"; {b:g}: {kept / 2**20:.1f} MiB" for b, kept in sorted(earlier.items()) if b != budget)
        )
        if same:
            warn_once(
                f"GradCheckpointCallback(memory_budget={budget:g}) under torch.compile kept the same activation memory "
                f"({measured / 2**20:.1f} MiB) as memory_budget={same[0]:g} did in an earlier fit in this process: the "
                "budget did not change what the compiled graph saves (a graph compiled under the other budget was "
                "reused, or the graph has nothing cheaper to recompute)."
            )

    def _report(self) -> None:
        state = self._budget_state
        if self.plan is None or state is None or state.reported:
            return
        state.reported = True
        rank_zero_info(f"GradCheckpointCallback: {self.plan.describe()}")

    def _apply(self, pl_module: pl.LightningModule) -> None:
        chosen = self._select(pl_module)
        if not chosen:
            what = (
                "found no repeated blocks or U-Net levels"
                if self.filter_fn is None and self.modules == "auto"
                else "matched nothing"
            )
            warn_once(
                f"GradCheckpointCallback({self._describe()}) {what} in {type(pl_module).__name__}: training goes on "
                "without activation checkpointing. Name the block class with `modules=` or pass `filter_fn=`."
            )
            return
        already = [name for name, m in chosen if find_forward_patch(m, CheckpointedForward) is not None]
        self.wrapped = apply_activation_checkpointing(
            pl_module,
            self.modules,
            filter_fn=self.filter_fn,
            every_n=self.every_n,
            fraction=self.fraction,
            preserve_rng_state=self.preserve_rng_state,
        )
        self._patched = [pl_module.get_submodule(n) for n in self.wrapped]
        classes = sorted({type(m).__name__ for m in self._patched})
        message = (
            f"GradCheckpointCallback: activation checkpointing on {len(self.wrapped)} of {len(chosen)} blocks "
            f"({', '.join(classes)}): {_abbreviate(self.wrapped)}"
        )
        if already:
            message += f"; already checkpointed before: {_abbreviate(already)}"
        rank_zero_info(message)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._undo(pl_module)

    def _undo(self, pl_module: pl.LightningModule) -> None:
        discard_pending_surgery(pl_module)
        state, self._budget_state = self._budget_state, None
        if state is not None:
            if state.recorder is not None:
                state.recorder.close()
            if state.probe is not None:
                state.probe.close()
            if state.compiler_previous is not None:
                set_compiler_memory_budget(state.compiler_previous)
            for module in state.compiler_patched:
                unpatch_forward(module, CompilerBudgetForward)
            if self.plan is not None and not state.reported:
                state.reported = True
                rank_zero_info(f"GradCheckpointCallback: {self.plan.describe()}")
        for block in self._patched:
            unpatch_forward(block, CheckpointedForward)
        self._patched = []

    def _describe(self) -> str:
        if self.filter_fn is not None:
            return f"filter_fn={getattr(self.filter_fn, '__name__', self.filter_fn)!r}"
        return f"modules={self.modules!r}"


@dataclass
class _BudgetState:
    """Where a ``memory_budget`` fit stands: profile a batch, plan, then measure the first checkpointed batch."""

    blocks: list[tuple[str, nn.Module]]
    profile_next: bool = False
    warmup_left: int = 1  # plain steps before the profiled one
    recorder: ActivationRecorder | None = None
    profile: ActivationProfile | None = None
    measure_next: bool = False
    probe: MemoryProbe | None = None
    before: tuple[int, int] | None = None
    reported: bool = False
    compiler_previous: float | None = None
    compiler_patched: list[nn.Module] = field(default_factory=list)
    compile_check_next: bool = False
    aot_before: int | None = None


# Process-wide, across fits: (model class, budget) compiled under by this callback, and the activation memory measured
# per model class and budget under torch.compile.
_COMPILED_UNDER: set[tuple[str, str]] = set()
_COMPILED_MEMORY: dict[str, dict[float, int]] = {}


def _model_key(pl_module: pl.LightningModule) -> str:
    return f"{type(pl_module).__module__}.{type(pl_module).__qualname__}"


def _probe(pl_module: pl.LightningModule) -> MemoryProbe | None:
    try:
        return MemoryProbe(pl_module.device)
    except ValueError:  # a device the probe cannot read (MPS, XLA): the plan is reported without a measurement
        return None


def _grad_bytes(module: nn.Module) -> int:
    return sum(p.grad.nbytes for p in module.parameters() if p.grad is not None)


def _check_class_names(names: list[str]) -> None:
    """Refuse a bare name that cannot be a module class: lower-case and no ``nn.Module`` subclass defined has it.

    A capitalised name may belong to a class not imported yet (checked at setup, against the model's classes).
    """
    unknown = [name for name in names if name[:1].islower() and name not in _module_class_names()]
    if unknown:
        raise ValueError(
            f"{', '.join(repr(n) for n in unknown)} is neither 'auto' nor the name of an nn.Module class. Expected "
            "'auto', module classes, class paths such as 'torch.nn.TransformerEncoderLayer', or class names such as "
            "'Block'."
        )


def _module_class_names() -> set[str]:
    seen: set[type] = set()
    pending: list[type] = [nn.Module]
    while pending:
        subclasses: list[type] = type.__subclasses__(pending.pop())
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
    return {cls.__name__ for cls in seen}
