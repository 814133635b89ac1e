"""``QATCallback(mode="dynamic")``: what the callback does for dynamic int8, kept out of ``qat.py``.

Training is not touched. At the end of ``fit`` (rank zero, ``export=True``) an int8 copy of the submodule is built
(:func:`lightning_perf.deploy.quantize.dynamic.quantize_dynamic`), validated, timed and saved with its report
(:func:`lightning_perf.deploy.quantize.dynamic_save.export_dynamic`). In a ``predict`` / ``test`` / ``validate`` run of
its own, the int8 copy is built on the run's first batch and swapped in for the float submodule
(:func:`lightning_perf.functional.surgery.replace_modules`: it takes over the training flag) and the float submodule
goes back at ``teardown`` and in ``on_exception``. The LightningModule keeps its float weights and ``state_dict`` keys
throughout; the int8 copy is reused while the float weights and the input shapes stay the same.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_perf._imports import require
from lightning_perf._warnings import FallbackWarning, NoEffectWarning, warn_once
from lightning_perf.callbacks._qat_support import default_dirpath, example_inputs, resolve_submodule, submodule_batches
from lightning_perf.callbacks.tensorrt_export import _val_dataloader
from lightning_perf.deploy.inputs import split_inputs, submodule_inputs
from lightning_perf.deploy.quantize.dynamic import DynamicQuantization, check_dynamic_backend, quantize_dynamic
from lightning_perf.deploy.quantize.dynamic_save import DynamicReport, export_dynamic
from lightning_perf.functional.qat import BACKENDS, MODES, QuantizationError
from lightning_perf.functional.surgery import replace_modules

__all__ = ["DynamicInt8", "DynamicReport", "check_mode_and_backend"]

RUN_STAGES = ("predict", "test", "validate")


def check_mode_and_backend(owner: str, mode: Any, backend: Any) -> str:
    """The back-end for ``mode`` (``None``: ``"x86"``, or ``"auto"`` for ``"dynamic"``), checked; torchao required
    by the QAT/PTQ back-ends.

    Raises:
        ValueError: for an unknown mode, or a back-end the mode does not have.
        ModuleNotFoundError: if torchao is missing for QAT or PTQ.
    """
    if mode not in (*MODES, "dynamic"):
        choices = ", ".join((*MODES, "dynamic"))
        raise ValueError(f"`{owner}(mode={mode!r})` is not valid. Expected one of: {choices}.")
    if mode == "dynamic":
        return check_dynamic_backend(owner, "auto" if backend is None else backend)
    backend = "x86" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"`{owner}(backend={backend!r})` is not valid. Expected one of: {', '.join(BACKENDS)}.")
    require("torchao", f"{owner}(backend={backend!r})")
    return backend  # type: ignore[no-any-return]


def _signature(module: nn.Module, example: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """Changes when the float weights (their storage or any in-place update) or the input shapes change."""
    tensors = tuple((n, t.data_ptr(), t._version) for n, t in module.state_dict(keep_vars=True).items())
    return tensors, tuple((tuple(t.shape[1:]), t.dtype) for t in example)


class DynamicInt8:
    """The dynamic-int8 half of a :class:`~lightning_perf.callbacks.QATCallback` (``callback``: its options)."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self.owner = type(callback).__name__
        self.choice: DynamicQuantization | None = None
        """The last back-end choice (candidates, figures); ``None`` before one was made."""
        self.report: DynamicReport | None = None
        self._built: tuple[tuple[Any, ...], DynamicQuantization] | None = None
        self._swapped: tuple[str, nn.Module, nn.Module] | None = None  # (name, float module, int8 module)
        self._declined: nn.Module | None = None  # the module a run could not quantize (tried once per run)

    # ------------------------------------------------------------------------------------------------- building

    def _quantize(self, module: nn.Module, example: tuple[torch.Tensor, ...]) -> DynamicQuantization:
        signature = _signature(module, example)
        if self._built is not None and self._built[0] == signature:
            return self._built[1]
        cb = self.callback
        choice = quantize_dynamic(
            module,
            example,
            cb.backend,
            min_cosine=cb.min_cosine,
            min_agreement=cb.min_agreement,
            iterations=cb.latency_iterations,
            warmup=cb.latency_warmup,
        )
        self.choice = choice
        self._built = (signature, choice)
        rank_zero_info(f"{self.owner}: {choice.describe()}")
        return choice

    # --------------------------------------------------------------------------------------------- run of its own

    def batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        """On a predict/test/validate run's batches: on the first, build the int8 submodule and swap it in."""
        if self._swapped is not None or trainer.state.fn not in RUN_STAGES or trainer.sanity_checking:
            return
        name, module = resolve_submodule(self.owner, pl_module, self.callback.submodule)
        if self._declined is module:
            return
        self._declined = module
        if pl_module.device.type != "cpu":
            warn_once(
                f"`{self.owner}(mode='dynamic')` runs int8 on the CPU only; the model is on {pl_module.device}: "
                "it runs in float, unchanged.",
                NoEffectWarning,
            )
            return
        inputs = split_inputs(batch, self.callback.input_key)
        example = submodule_inputs(pl_module, module, inputs, "the first batch", owner=self.owner)
        try:
            choice = self._quantize(module, example)
        except Exception as exc:
            self._fallback(exc, f"the {trainer.state.fn.value} run goes on in float")
            return
        if choice.module is None:
            warn_once(
                f"`{self.owner}(mode='dynamic')`: no int8 back-end was correct and faster than fp32 for {name!r} "
                f"on this CPU; the {trainer.state.fn.value} run goes on in float.\n{choice.describe()}",
                NoEffectWarning,
            )
            return
        int8 = choice.module
        replace_modules(pl_module, [name], lambda m, _: int8, check_state_dict=False)
        self._swapped = (name, module, int8)

    def _fallback(self, exc: Exception, consequence: str) -> None:
        if self.callback.strict:
            if isinstance(exc, QuantizationError):
                raise exc
            raise QuantizationError(f"{self.owner}: dynamic int8 failed: {type(exc).__name__}: {exc}") from exc
        warnings.warn(
            f"{self.owner}: dynamic int8 failed ({type(exc).__name__}: {exc}); {consequence}.",
            FallbackWarning,
            stacklevel=3,
        )

    def restore(self, pl_module: pl.LightningModule) -> None:
        """Put the float submodule back (teardown, on_exception); nothing when none was swapped."""
        self._declined = None
        if self._swapped is None:
            return
        name, module, int8 = self._swapped
        self._swapped = None
        try:
            current = pl_module.get_submodule(name)
        except AttributeError:
            return
        if current is int8:
            replace_modules(pl_module, [name], lambda m, _: module, check_state_dict=False)

    # ----------------------------------------------------------------------------------------------- end of fit

    def fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> DynamicReport | None:
        """Build, validate, time and save the int8 copy of the trained submodule (rank zero)."""
        cb = self.callback
        if not (trainer.is_global_zero and cb.export):
            return None
        name, module = resolve_submodule(self.owner, pl_module, cb.submodule)
        if pl_module.device.type != "cpu":
            module = copy.deepcopy(module).cpu()
        loader = _val_dataloader(trainer, pl_module)
        batches = []
        if loader is not None:
            found = submodule_batches(self.owner, pl_module, module, loader, cb.input_key)
            batches = list(itertools.islice(found, cb.validation_batches))
        was_training = module.training
        module.eval()
        try:
            example = (
                batches[0][0]
                if batches
                else example_inputs(self.owner, trainer, pl_module, module, "train", cb.input_key)
            )
            choice = self._quantize(module, example)
            self.report = export_dynamic(
                module,
                choice,
                example_inputs=example,
                validation_data=batches or None,
                validation_batches=cb.validation_batches,
                min_cosine=cb.min_cosine,
                min_agreement=cb.min_agreement,
                dirpath=cb.dirpath or default_dirpath(trainer),
                filename=cb.filename,
                benchmark=cb.benchmark,
                batch_sizes=cb.benchmark_batch_sizes,
                latency_iterations=cb.latency_iterations,
                latency_warmup=cb.latency_warmup,
                strict=cb.strict,
                metadata={
                    "global_step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                    "submodule": name,
                    "model_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                },
            )
        except Exception as exc:
            self._fallback(exc, "the trained model and its checkpoints are unchanged")
            return None
        finally:
            module.train(was_training)
        rank_zero_info(self.report.summary(self.owner))
        return self.report

    def __getstate__(self) -> dict[str, Any]:
        # The int8 copies and the swapped modules belong to this process's model.
        return {**self.__dict__, "_built": None, "_swapped": None, "_declined": None}
