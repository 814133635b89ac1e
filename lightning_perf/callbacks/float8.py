"""Train the model's large ``nn.Linear`` layers in float8 (torchao) on GPUs that have float8 tensor cores.

The logic is :mod:`lightning_perf.functional.quantization.float8`; this callback checks the hardware and the stack,
picks the layers
(measured per shape by default), converts them before the optimizers exist and swaps them back at the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._imports import require
from lightning_perf._validation import check_bool, check_choice, check_int
from lightning_perf._warnings import LightningPerfWarning, NoEffectWarning, warn_once
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.callbacks.compile import runs_compiled
from lightning_perf.functional.quantization.float8 import (
    DEFAULT_ROWS,
    FILTERS,
    RECIPES,
    Blocks,
    Float8Conversion,
    Float8Plan,
    LinearShape,
    convert_to_float8,
    float8_unsupported_reason,
    linear_rows,
    machine_key,
    plan_float8,
    sharded_linears,
    time_linear_shape,
)

__all__ = ["Float8TrainingCallback"]

PRECISIONS = ("bf16-mixed", "bf16-true")


class Float8TrainingCallback(UndoOnExit):
    """Trains eligible ``nn.Linear`` layers in float8 with torchao, only where float8 is measured faster.

    In ``setup`` of a ``fit`` (after ``configure_model``, before the optimizers and DDP exist) the chosen layers are
    swapped for torchao's ``Float8Linear`` (:func:`torchao.float8.convert_to_float8_training`); in ``teardown``, and in
    ``on_exception`` when the run fails or is interrupted, the ``nn.Linear`` layers go back holding the trained
    weights. The float8 layers hold the original Parameters: ``state_dict`` keys and the weights' dtype do not change,
    so a checkpoint saved with the callback loads without it and the other way round.

    Which layers (:func:`~lightning_perf.functional.quantization.float8.plan_float8`): both dimensions divisible by 16;
    not the output layer when ``skip_last`` (the last ``nn.Linear`` registered, or one tied to an embedding); with
    ``filter="auto"`` each distinct shape (its rows: the tokens of the first training batch as the model sees them,
    found by a shape-only forward; else ``rows``) is timed once on the GPU, forward and backward, bf16 against float8,
    paired and interleaved, and converted only when the speed-up's 95% interval lies above 1. The figures are cached
    per GPU model and shape (``$LIGHTNING_PERF_CACHE/float8_shapes.json``) and each decision is logged once with its
    measured ratio (:attr:`plan`). ``filter="all"`` converts every eligible layer unmeasured; a callable
    ``filter(module, fqn) -> bool`` decides alone.

    Gates, checked in this order once ``configure_model`` has run, each said once on rank zero (a
    :class:`~lightning_perf.NoEffectWarning`) with training left unchanged: layers already sharded by FSDP2
    (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``: torchao converts before sharding, so call
    :func:`~lightning_perf.functional.quantization.float8.convert_to_float8` there, before ``fully_shard``; the message
    names the
    strategy), no CUDA GPU of compute capability 8.9+ (Ada, Hopper or newer), a precision other than ``"bf16-mixed"`` /
    ``"bf16-true"``, no layer chosen. ``validate``/``test``/``predict`` runs are left alone (float8 here is a training
    speed-up). Without a :class:`~lightning_perf.callbacks.CompileCallback` (or a module compiled in place) it warns
    once that float8 is slow uncompiled.

    When it helps: large matrix products (transformers of roughly 1B parameters and up, hidden sizes of 2048+) on H100,
    H200, L40S, RTX 4090 and newer, with ``torch.compile``. When it hurts: small layers (casting costs more than the
    faster product saves: the auto filter keeps those in bf16) and uncompiled models. Figures on a GPU: unverified.

    Args:
        recipe: torchao's scaling recipe: ``"tensorwise"`` (fastest), ``"rowwise"`` (more accurate) or
            ``"rowwise_with_gw_hp"``.
        filter: ``"auto"``, ``"all"`` or a callable ``filter(module, fqn) -> bool``.
        skip_last: keep the model's output layer in high precision.
        rows: rows of each timed product when the first training batch cannot tell (tokens per micro-batch).
        refresh: time the shapes again even when the cache knows them.

    Raises:
        ValueError: for an unknown ``recipe`` or ``filter``, or ``rows < 16``.
        TypeError: for a non-bool ``skip_last`` or ``refresh``.
        ModuleNotFoundError: if torchao is not installed (the ``qat`` extra).

    Example::

        trainer = Trainer(precision="bf16-mixed", callbacks=[Float8TrainingCallback(), CompileCallback()])
    """

    def __init__(
        self,
        recipe: str = "tensorwise",
        filter: str | Callable[[nn.Module, str], bool] = "auto",
        skip_last: bool = True,
        *,
        rows: int = DEFAULT_ROWS,
        refresh: bool = False,
    ) -> None:
        owner = type(self).__name__
        check_choice(owner, "recipe", recipe, RECIPES)
        if not callable(filter) and filter not in FILTERS:
            raise ValueError(
                f"`{owner}(filter={filter!r})` is not valid. Expected 'auto', 'all' or a callable "
                "`filter(module, fqn) -> bool`."
            )
        self.skip_last = check_bool(owner, "skip_last", skip_last)
        self.refresh = check_bool(owner, "refresh", refresh)
        self.rows = check_int(owner, "rows", rows, 16)
        require("torchao", owner)
        self.recipe = recipe
        self.filter = filter
        self.plan: Float8Plan | None = None
        """The decisions of the last ``fit`` setup (per layer, and per shape with its measured ratio)."""
        self._conversion = Float8Conversion()
        self._logged: set[LinearShape] = set()

    @property
    def converted(self) -> list[str]:
        """The layers training in float8 now."""
        return self._conversion.names

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            run_after_configure_model(pl_module, self._convert)

    def _convert(self, pl_module: pl.LightningModule) -> None:
        owner = type(self).__name__
        trainer = pl_module.trainer
        # The strategy first: a model that shards itself in configure_model is sharded now, whatever the device.
        sharded = sharded_linears(pl_module)
        if sharded:
            warn_once(
                f"{owner} leaves the model unchanged under {type(trainer.strategy).__name__}: {len(sharded)} "
                f"nn.Linear layers (e.g. {sharded[0]}) are already sharded by `fully_shard` when callbacks run, and "
                "torchao converts before sharding. Call "
                "`lightning_perf.functional.quantization.float8.convert_to_float8(module, names)` in `configure_model` "
                "before `fully_shard` instead.",
                NoEffectWarning,
            )
            return
        device = trainer.strategy.root_device
        if (reason := float8_unsupported_reason(device)) is not None:
            warn_once(f"{owner} leaves the model in its own precision: {reason}.", NoEffectWarning)
            return
        precision = str(trainer.precision)
        if precision not in PRECISIONS:
            warn_once(
                f"{owner} leaves the model unchanged under precision={precision!r}: torchao's float8 layers take "
                "bf16 inputs and return bf16 (their speed-up is against bf16). Use "
                "`Trainer(precision='bf16-mixed')` (or 'bf16-true').",
                NoEffectWarning,
            )
            return
        compiled = runs_compiled(trainer, pl_module)

        def timer(shape: LinearShape) -> tuple[Blocks, Blocks]:
            return time_linear_shape(shape, device=device, recipe=self.recipe, compiled=compiled)

        self.plan = plan_float8(
            pl_module,
            filter=self.filter,
            skip_last=self.skip_last,
            rows=self._rows(trainer, pl_module) if self.filter == "auto" else self.rows,
            timer=timer if self.filter == "auto" else None,
            cache_key=machine_key(device, self.recipe, compiled),
            refresh=self.refresh,
        )
        self._log(self.plan)
        if not self.plan.names:
            warn_once(f"{owner} converted no layer: {_why_none(self.plan)}.", NoEffectWarning)
            return
        # Off CUDA (reached only when a test lifts the hardware gate) the float8 products are emulated.
        self._conversion = convert_to_float8(pl_module, self.plan, recipe=self.recipe, emulate=device.type != "cuda")
        if not compiled:
            warn_once(
                f"{owner}: float8 layers are slow without torch.compile (the casts to float8 are separate kernels "
                "until inductor fuses them). Add `CompileCallback()` to the Trainer's callbacks.",
                LightningPerfWarning,
            )

    def _rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int | dict[str, int]:
        """Each layer's rows in the first training batch (a shape-only forward), else ``self.rows``."""
        from lightning_perf.callbacks._trainer_data import first_batch
        from lightning_perf.functional.inputs import split_inputs

        try:
            batch = first_batch(trainer, pl_module, "train")
            if batch is not None:
                found = linear_rows(pl_module, split_inputs(batch))
                if found:
                    names = [n for n, m in pl_module.named_modules() if n and isinstance(m, nn.Linear)]
                    return {name: found.get(name, self.rows) for name in names}
        except Exception as err:  # the user's data or forward: any failure means "use the given rows"
            rank_zero_info(f"{type(self).__name__}: timing at {self.rows} rows ({type(err).__name__}: {err}).")
        return self.rows

    def _log(self, plan: Float8Plan) -> None:
        new = [shape for shape in plan.measured if shape not in self._logged]
        self._logged.update(new)
        lines = [f"{type(self).__name__}: {len(plan.names)} of {len(plan.decisions)} nn.Linear layers in float8."]
        if new:
            lines.append("Per shape (rows x in x out), bf16 time over float8 time:")
            lines += [f"  {line}" for line in plan.shape_lines(new)]
        rank_zero_info("\n".join(lines))

    def _undo(self, pl_module: pl.LightningModule) -> None:
        discard_pending_surgery(pl_module)
        self._conversion.undo(pl_module)


def _why_none(plan: Float8Plan) -> str:
    reasons: dict[str, int] = {}
    for decision in plan.decisions.values():
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
    if not reasons:
        return "the model has no nn.Linear layer"
    return "; ".join(f"{count} {reason}" for reason, count in reasons.items())
