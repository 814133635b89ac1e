"""Quantization-aware training (or post-training / dynamic quantization) that ends in a real, validated int8 model.

The callback only schedules: each mode is a recipe object carried out by the quantizer registered for its type
(:mod:`lightning_perf.deploy.quantize.quantizer`, :mod:`~lightning_perf.deploy.quantize.qat_quantizer`,
:mod:`~lightning_perf.deploy.quantize.recipes`); the hooks hand it the model and what only the Trainer knows.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._io import load_checkpoint
from lightning_perf._warnings import FallbackWarning
from lightning_perf.callbacks._model_hooks import (
    add_before_weights_load,
    check_pruning_order,
    discard_pending_surgery,
    refuse_sharded,
    remove_before_weights_load,
    run_after_configure_model,
)
from lightning_perf.callbacks._trainer_data import default_dirpath, loop_data, step_call
from lightning_perf.deploy.inputs import submodule_inputs
from lightning_perf.deploy.quantize.quantizer import SCHEDULE_UNITS, LoopData, check_options, quantizer_for
from lightning_perf.deploy.quantize.recipes import load_qat_checkpoint, recipe_for
from lightning_perf.functional.inputs import CallRecorder
from lightning_perf.functional.quantization.qat import QuantizationError, QuantizationRecipe

__all__ = ["SCHEDULE_UNITS", "QATCallback"]

RUN_STAGES = ("predict", "test", "validate")


class QATCallback(Callback):
    """Quantization-aware training that yields a real int8 model: prepared before training, converted after it.

    Each ``mode`` is a recipe carried out by the quantizer registered for its type
    (:mod:`lightning_perf.deploy.quantize.quantizer`); this callback schedules it on the Trainer's hooks.

    - ``"qat"``: in ``setup`` (after ``configure_model``, before optimizers and DDP) the submodule is replaced by its
      prepared version, whose fake-quantize and observer state trains, checkpoints and synchronizes like any other.
      ``backend="x86"`` (CNNs and general models for CPU deployment): torchao's PT2E ``X86InductorQuantizer`` on a
      ``torch.export`` graph captured from a CPU copy; it trains where the model lives (CPU or CUDA) and ends as a CPU
      int8 model. ``backend="torchao"`` (Linear-heavy models): ``quantize_(submodule, QATConfig(base_config))``.
      Schedules in epochs or steps: fake quantization from ``fake_quant_after``, observers until
      ``disable_observers_after``, batch-norm statistics until ``freeze_bn_after``.
    - ``"ptq"``: at the end of ``fit`` (or ``Trainer.validate``) a copy is calibrated on ``calibration_batches``.
    - ``"dynamic"`` (``backend`` ``"auto"``/``"eager"``/``"onnxruntime"``/``"torchao"``): training untouched; every
      eligible Linear of ``submodule`` (default: the only child holding parameters, else the whole LightningModule,
      whose ``forward`` the int8 copy stands in for) goes int8 with the fastest back-end that agrees with fp32;
      ``predict``/``test``/``validate`` runs go through it (CPU). The choice, and the onnxruntime back-end's int8
      model with a hash of the weights, are cached (``$LIGHTNING_PERF_CACHE``): a run in a new process with the same
      weights loads them, timing and converting nothing (``refresh=True`` measures and converts again).

    At the end of ``fit`` (rank zero) the int8 model is validated on ``validation_batches`` validation batches, saved
    with its JSON report as one atomic artifact set ``<dirpath>/<filename>/`` (``.pt2``; ``onnx=True`` adds ONNX) and
    timed against the float model on the CPU. A failure there, a full disk included, warns with a
    :class:`~lightning_perf.FallbackWarning` and leaves model and checkpoints untouched (``strict=True`` raises).
    Under ``ModelParallelStrategy`` or ``FSDPStrategy``, or with modules sharded by ``fully_shard``, it warns once at
    ``setup`` (a :class:`~lightning_perf.NoEffectWarning` naming the strategy) and leaves the run unchanged: quantizing
    needs the whole model in one process (QAT: train with DDP or on one device).
    Every run ends with the plain float model (``teardown`` and ``on_exception``); the callback keeps the quantization
    state (:attr:`quantization_state`) for later runs, checkpoints (its own entry: the model's ``state_dict`` keeps
    its keys), :meth:`prepared` and :meth:`load_checkpoint`.

    Args:
        backend: ``"x86"`` (default) or ``"torchao"``; for ``mode="dynamic"`` see above (default ``"auto"``).
        mode: ``"qat"``, ``"ptq"`` or ``"dynamic"``.
        submodule: dotted name of the submodule to quantize.
        base_config: ``torchao``: the config to train for: an object, a class name or ``{class name: {field: value}}``.
        disable_observers_after, freeze_bn_after, fake_quant_after, schedule_unit: the QAT schedules.
        eval_converted_every_n_epochs: compare a converted copy with the model (logged under ``qat/``).
        calibration_batches: validation batches to calibrate on (PTQ).
        validation_batches: validation batches to validate the int8 model on (``None``: all).
        min_cosine, min_agreement: what the int8 outputs must reach (cosine; dynamic: top-1 agreement with fp32).
        export: quantize, save and time at the end of ``fit`` (``False``: QAT only).
        benchmark, benchmark_batch_sizes, latency_iterations, latency_warmup: the timing at the end.
        dirpath: where to write; default the ``ModelCheckpoint``'s directory, else ``<default_root_dir>/quantized``.
        filename: name of the artifact set and stem of its files.
        onnx: also export the int8 model to ONNX.
        input_key: the model input's key when batches are dicts.
        strict: raise instead of warning when the end-of-fit quantization fails.
        refresh: ``mode="dynamic"``: measure the back-ends and convert again instead of using the cached choice and
            int8 model (:func:`~lightning_perf.deploy.quantize.dynamic.quantize_dynamic`).

    Raises:
        ValueError: for an invalid option, naming it, its value and what is expected.
        ModuleNotFoundError: if torchao (the ``qat`` extra) is missing for QAT or PTQ.

    Example::

        trainer = Trainer(callbacks=[QATCallback(backend="x86", disable_observers_after=3, freeze_bn_after=2)])
        trainer.fit(model, datamodule=data)  # then <checkpoint dir>/model_int8/model_int8.pt2 + .json
    """

    def __init__(
        self,
        backend: str | None = None,
        mode: str = "qat",
        *,
        submodule: str | None = None,
        base_config: Any = None,
        disable_observers_after: int | None = None,
        freeze_bn_after: int | None = None,
        fake_quant_after: int = 0,
        schedule_unit: str = "epoch",
        eval_converted_every_n_epochs: int | None = None,
        calibration_batches: int = 8,
        validation_batches: int | None = 4,
        min_cosine: float = 0.99,
        min_agreement: float = 0.95,
        export: bool = True,
        benchmark: bool = True,
        benchmark_batch_sizes: Sequence[int] = (1, 32),
        latency_iterations: int = 20,
        latency_warmup: int = 3,
        dirpath: str | Path | None = None,
        filename: str = "model_int8",
        onnx: bool = False,
        input_key: str | None = None,
        strict: bool = False,
        refresh: bool = False,
    ) -> None:
        owner = type(self).__name__
        recipe = recipe_for(mode, backend, base_config, owner)
        options = check_options(owner, mode, dict(locals()))
        self.refresh = refresh
        self.backend, self.mode, self.base_config = recipe.backend, mode, recipe.base_config
        self.submodule, self.schedule_unit = submodule, schedule_unit
        self.eval_converted_every_n_epochs = eval_converted_every_n_epochs
        self.export, self.strict, self.input_key = export, strict, input_key
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.disable_observers_after, self.freeze_bn_after = disable_observers_after, freeze_bn_after
        self.fake_quant_after, self.calibration_batches = fake_quant_after, calibration_batches
        self.validation_batches, self.min_cosine = validation_batches, float(min_cosine)
        self.min_agreement = min_agreement
        self.benchmark, self.benchmark_batch_sizes = benchmark, options.benchmark_batch_sizes
        self.latency_iterations, self.latency_warmup = latency_iterations, latency_warmup
        self.filename, self.onnx = filename, onnx
        self._quantizer = quantizer_for(recipe, options)
        self.report: Any = None
        """What the last end-of-training quantization produced (rank zero); ``None`` before one ran."""
        self.history: list[dict[str, Any]] = []
        """The periodic comparisons of a converted copy with the model (``eval_converted_every_n_epochs``)."""
        self._refused = False  # this run trains sharded (FSDP2): the callback stands aside until it ends
        self._recorder: CallRecorder | None = None  # the first call training makes: the example input

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(submodule=self.submodule)

    @property
    def recipe(self) -> QuantizationRecipe | None:
        """The recipe of the prepared (QAT) or last quantized (PTQ) model."""
        return self._quantizer.recipe_used  # type: ignore[no-any-return]

    @property
    def quantization_state(self) -> dict[str, torch.Tensor]:
        """The observer and fake-quantize state of the QAT model (keys relative to the submodule)."""
        return self._quantizer.quantization_state

    def prepared(self, pl_module: pl.LightningModule) -> contextlib.AbstractContextManager[nn.Module]:
        """Put the QAT-prepared submodule into ``pl_module`` for use outside a Trainer; the plain one on exit::

            with callback.prepared(model) as prepared:
                report = export_quantized(prepared, float_model=copy.deepcopy(model.net), dirpath="out")

        Raises:
            ValueError: if the callback holds no QAT state (no fit, no checkpoint loaded with it).
        """
        return self._quantizer.prepared(pl_module)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------------------------------- what the loop has

    def _data(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LoopData:
        dirpath = self.dirpath or default_dirpath(trainer, "quantized")
        call = None if self._recorder is None else self._recorder.call
        return loop_data(type(self).__name__, trainer, pl_module, dirpath, self.input_key, call)

    def _fallback(self, exc: Exception, consequence: str) -> None:
        if self.strict:
            if isinstance(exc, QuantizationError):
                raise exc
            raise QuantizationError(
                f"{type(self).__name__} could not quantize the model: {type(exc).__name__}: {exc}"
            ) from exc
        warnings.warn(
            f"{type(self).__name__} could not quantize the model ({type(exc).__name__}: {exc}); {consequence}.",
            FallbackWarning,
            stacklevel=3,
        )

    # ----------------------------------------------------------------------------------------------------- hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._refuse(trainer, None):
            return
        if stage == "fit" and self._quantizer.trains:
            owner = f"{type(self).__name__}(backend={self.backend!r})"
            check_pruning_order(self, owner, trainer, self._quantizer.recipe.pruning_refusal)
        if stage == "fit":
            self._recorder = CallRecorder(pl_module)
        begin = self._quantizer.begin_run if stage != "fit" else lambda module: self._begin_fit(trainer, module)
        run_after_configure_model(pl_module, lambda module: self._begin(trainer, module, begin))

    def _refuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule | None) -> bool:
        self._refused = refuse_sharded(
            f"{type(self).__name__}(mode={self.mode!r})",
            trainer,
            pl_module,
            "the model's parameters are sharded across processes (FSDP2 DTensors), and quantization needs the whole "
            "model in one process (torch.export cannot capture DTensor parameters, the fake-quantized and int8 layers "
            "take plain tensors)",
            "train with DDP or on one device for QAT; for PTQ or dynamic int8, load the consolidated checkpoint into "
            "the float model after training and quantize it (`lightning_perf.deploy.quantize`)",
        )
        return self._refused

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, begin: Callable[[nn.Module], Any]) -> None:
        if self._refuse(trainer, pl_module):  # a model that shards itself in configure_model
            return
        add_before_weights_load(pl_module, self)  # a checkpoint's QAT state goes in before its weights
        begin(pl_module)

    def _begin_fit(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        line = self._quantizer.begin_fit(pl_module, self._data(trainer, pl_module))
        if line:
            rank_zero_info(line)

    def _schedule(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._refused:
            return
        progress = trainer.current_epoch if self.schedule_unit == "epoch" else trainer.global_step
        line = self._quantizer.schedule(pl_module, progress)
        if line:
            rank_zero_info(line)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._quantizer.schedules_per_step():
            self._schedule(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = self.eval_converted_every_n_epochs
        if every is None or (trainer.current_epoch + 1) % every or not trainer.is_global_zero or self._refused:
            return
        try:
            summary = self._quantizer.check_converted(pl_module, self._data(trainer, pl_module))
        except Exception as exc:
            warnings.warn(
                f"{type(self).__name__} could not check the converted model at epoch {trainer.current_epoch}: "
                f"{type(exc).__name__}: {exc}",
                FallbackWarning,
                stacklevel=2,
            )
            return
        if summary is None:
            return
        self.history.append({"epoch": trainer.current_epoch, "global_step": trainer.global_step, **summary.to_dict()})
        for logger in trainer.loggers:
            logger.log_metrics(summary.metrics("qat/"), step=trainer.global_step)
        rank_zero_info(f"{type(self).__name__}: converted model at epoch {trainer.current_epoch}: {summary.describe()}")

    def _run_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        stage = trainer.state.fn
        if stage not in RUN_STAGES or trainer.sanity_checking or self._refused:
            return
        call = None if self._recorder is None else self._recorder.call
        inputs = step_call(pl_module, batch, call, self.input_key)
        owner = type(self).__name__
        try:
            line = self._quantizer.run_batch(
                pl_module, lambda m: submodule_inputs(pl_module, m, inputs, "the first batch", owner=owner), str(stage)
            )
        except Exception as exc:
            self._fallback(exc, f"the {stage} run goes on in float")
            return
        if line:
            rank_zero_info(line)

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._run_batch(trainer, pl_module, batch)

    on_test_batch_start = on_validation_batch_start = on_predict_batch_start

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "fit")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            self._finish(trainer, pl_module, "validate")  # PTQ of a model that is not trained here

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, run: str) -> None:
        if run not in self._quantizer.finishes_after or not (trainer.is_global_zero and self.export) or self._refused:
            return
        try:
            report = self._quantizer.finish(pl_module, self._data(trainer, pl_module))
        except Exception as exc:
            self._fallback(exc, "the trained model and its checkpoints are unchanged")
            return
        if report is None:
            rank_zero_info(f"{type(self).__name__}: nothing to quantize.")
            return
        self.report = report
        rank_zero_info(report.summary(type(self).__name__))

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted run does not reach `teardown`: put the plain model back as it would. A failed fit
        # also gives back the quantization state it started from, so that a second fit starts as the first did.
        self._quantizer.end_run(pl_module, failed_fit=trainer.state.fn == "fit")
        self.teardown(trainer, pl_module, trainer.state.stage.value if trainer.state.stage else "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recorder is not None:
            self._recorder.remove()  # a fit that never called forward
        self._quantizer.end_run(pl_module)
        discard_pending_surgery(pl_module)
        remove_before_weights_load(pl_module, self)

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._quantizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._quantizer.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._quantizer.save_checkpoint(pl_module, checkpoint["callbacks"][self.state_key], checkpoint["state_dict"])

    def before_weights_load(self, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Prepare ``pl_module`` as the checkpoint's recipe says and complete ``checkpoint["state_dict"]`` with the
        quantization state, so that a strict ``load_state_dict`` succeeds (Lightning runs this right before it loads
        the weights, through the module's ``on_load_checkpoint``)."""
        entry = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        checkpoint["state_dict"] = self._quantizer.before_weights_load(pl_module, entry, checkpoint["state_dict"])

    @staticmethod
    def load_checkpoint(
        pl_module: pl.LightningModule, checkpoint_path: str | Path, map_location: Any = "cpu"
    ) -> QuantizationRecipe:
        """Load a checkpoint written with this callback into a fresh (float) ``pl_module``, outside a Trainer: the
        submodule is prepared as its recipe says, then weights and quantization state load strictly (the file read
        with ``torch.load(weights_only=True)``). Returns the recipe.

        Raises:
            ValueError: if the checkpoint holds no ``QATCallback`` state with a QAT recipe, or several.
            UnsafeCheckpointError: if the file needs a global torch does not allow by default.
        """
        checkpoint = load_checkpoint(checkpoint_path, map_location, what="QATCallback.load_checkpoint:")
        return load_qat_checkpoint(pl_module, checkpoint, "QATCallback")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("log", None)  # the logging functions Lightning attaches belong to this process
        state.pop("log_dict", None)
        state["_recorder"] = None  # a hook on this process's model
        return state
