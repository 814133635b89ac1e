"""Quantization-aware training (or post-training quantization) that ends in a real, validated, faster int8 model.

The logic is :mod:`lightning_perf.functional.qat` (training time) and :mod:`lightning_perf.deploy.quantize` (after
training); this callback picks the submodule and its example input, prepares it before the optimizers and DDP exist,
runs the observer / batch-norm / fake-quant schedule, keeps checkpoints loadable both ways, converts, validates, saves
and times the quantized model once training ends, and puts the plain model back when any run ends or fails.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._io import load_checkpoint
from lightning_perf._warnings import FallbackWarning, NoEffectWarning, warn_once
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from lightning_perf.callbacks._qat_dynamic import DynamicInt8, DynamicReport, check_mode_and_backend
from lightning_perf.callbacks._qat_support import (  # noqa: F401  (SCHEDULE_UNITS: public here before)
    SCHEDULE_UNITS,
    RestoreBeforeWeights,
    check_options,
    check_pruning,
    default_dirpath,
    example_inputs,
    holds_tensors_of,
    resolve_submodule,
    submodule_batches,
)
from lightning_perf.callbacks.tensorrt_export import _val_dataloader
from lightning_perf.deploy.quantize import (
    QuantizationReport,
    calibrate,
    compare_models,
    convert,
    export_quantized,
    float_copy,
)
from lightning_perf.deploy.quantize.convert import restore_float
from lightning_perf.functional.qat import (
    NothingToQuantizeError,
    QuantizationError,
    QuantizationRecipe,
    base_config_spec,
    batchnorm_modules,
    freeze_batchnorm_stats,
    is_prepared,
    make_recipe,
    prepare,
    quantization_state_keys,
    recipe_of,
    resolve_base_config,
    set_fake_quant,
    set_observers,
    with_state_versions,
)
from lightning_perf.functional.surgery import replace_modules

__all__ = ["QATCallback"]


class QATCallback(Callback):
    """Quantization-aware training that yields a real int8 model: prepared before training, converted after it.

    **QAT** (``mode="qat"``). In ``setup`` (after ``configure_model``, before the optimizers and DDP exist) the chosen
    submodule is replaced by its prepared version, so the fake-quantize and observer state is trained, checkpointed
    and synchronized across ranks like any other:

    - ``backend="x86"`` (CNNs and general models for CPU deployment): captured with ``torch.export`` and prepared by
      torchao's PT2E ``X86InductorQuantizer`` (int8 activations, per-channel int8 weights, conv-BN folded). Lightning's
      ``model.train()`` / ``model.eval()`` work on it (batch norm and dropout switch behaviour); Python branches on
      ``self.training`` inside the submodule are fixed at capture.
    - ``backend="torchao"`` (Linear-heavy models such as transformers): ``quantize_(submodule, QATConfig(base_config,
      step="prepare"))`` swaps its ``nn.Linear`` layers in place for fake-quantized ones.

    The submodule is ``submodule`` (a dotted name) or, by default, the LightningModule's only child holding
    parameters (the LightningModule itself cannot be exported). Its example input is what it receives when the
    LightningModule runs ``example_input_array`` (else the inputs of the first training batch); the batch dimension
    stays dynamic.

    Schedules, in epochs or steps (``schedule_unit``): fake quantization starts after ``fake_quant_after``
    (observers collect ranges from the start), observers stop after ``disable_observers_after`` (the ranges freeze),
    batch-norm statistics freeze after ``freeze_bn_after``. Every ``eval_converted_every_n_epochs`` epochs a converted
    copy is compared with the fake-quantized model on validation batches and the figures are logged under ``qat/``
    (cosine, top-1 agreement, and with ``(inputs, labels)`` batches the accuracy gap in percentage points).

    At the end of ``fit``, on rank zero, a converted copy of the trained model is validated against it on validation
    batches (cosine similarity, max abs difference, accuracies), saved as ``<dirpath>/<filename>/<filename>.pt2``
    (``torch.export.save``; ``onnx=True`` adds an ONNX file; files and report are one artifact set, committed
    atomically: :mod:`lightning_perf.deploy.artifacts`), timed against the float model with both compiled by inductor
    with weight freezing at ``benchmark_batch_sizes`` (``benchmark=False`` skips it: compiling takes tens of seconds;
    each ratio comes with its 95% interval and verdict), and described in ``<filename>.json``. A failure there warns
    with a :class:`~lightning_perf.FallbackWarning` and leaves the trained model and the checkpoints untouched
    (``strict=True`` raises).

    **Every run ends with the plain model.** In ``teardown``, and in ``on_exception`` when a run fails or is
    interrupted, the plain float submodule goes back in place (the same parameters, with the QAT-trained weights and
    batch-norm statistics), so the model's ``state_dict`` keys are its own again. The callback keeps the quantization
    state (recipe, observer and fake-quantize state; :attr:`quantization_state`): ``validate``/``test``/``predict``
    and a later ``fit`` with the same callback put the prepared submodule back for their run (a later fit goes on from
    the state the last one reached), ``trainer.save_checkpoint`` writes it, and :meth:`prepared` puts it back outside
    a Trainer. A fit that fails also gives back the quantization state it started from, so a second fit starts as the
    first did.

    **PTQ** (``mode="ptq"``): training is not touched; at the end of ``fit``, or of a ``Trainer.validate`` run, a
    copy of the submodule is calibrated on ``calibration_batches`` validation batches (x86; the torchao configs
    quantize activations dynamically and need none), converted, validated on the following batches, saved and timed
    as above.

    **Dynamic int8** (``mode="dynamic"``, ``backend="auto"`` by default; ``"eager"``, ``"onnxruntime"``,
    ``"torchao"``): training is not touched and nothing is calibrated. At the end of ``fit`` an int8 copy of the
    submodule (int8 weights, activations quantized per batch: Linear and recurrent layers) is built by the fastest
    back-end whose outputs agree with fp32 (measured on the module: :mod:`lightning_perf.deploy.quantize.dynamic`),
    validated (cosine, top-1 agreement at least ``min_agreement``, accuracy gap), timed against fp32 and saved with
    its report as one artifact set. A ``predict``/``test``/``validate`` run of its own builds it on its first batch
    and runs through it; the float submodule goes back at the run's end or failure (CPU only; the model keeps its
    float weights and ``state_dict`` keys).

    **Checkpoints.** The recipe (backend, config, example input shapes) is in this callback's ``state_dict``. A
    checkpoint's ``state_dict`` keeps the plain model's keys (QAT-trained float weights: it loads into the model
    without the callback); the observer and fake-quantize state travels in this callback's entry. With the callback,
    a Trainer that loads the checkpoint (resuming ``fit``, ``test``/``validate``/``predict`` with ``ckpt_path``)
    first prepares the model as the recipe says, so resuming, testing a checkpoint, fitting twice and loading into a
    fresh model all work; outside a Trainer use :meth:`load_checkpoint`. A checkpoint saved with
    ``save_weights_only=True`` has no callback state: its quantization state stays under the model's keys. A pickled
    callback keeps its quantization state but not the ``x86`` prepared graph (``torch.export``'s guard module holds a
    local function): it prepares the float module again and loads that state.

    Args:
        backend: ``"x86"`` (default) or ``"torchao"``; for ``mode="dynamic"``: ``"auto"`` (default), ``"eager"``,
            ``"onnxruntime"`` or ``"torchao"``.
        mode: ``"qat"``, ``"ptq"`` or ``"dynamic"``.
        submodule: dotted name of the submodule to quantize; default the only child holding parameters.
        base_config: ``torchao`` backend: the torchao PTQ config to train for (default
            ``"Int8DynamicActivationIntxWeightConfig"``): a config object, a class name, or for YAML
            ``{class name: {field: value}}`` (see :func:`~lightning_perf.functional.qat_config.resolve_base_config`).
        disable_observers_after: stop the observers after this many epochs/steps (``x86``).
        freeze_bn_after: freeze batch-norm statistics after this many epochs/steps.
        fake_quant_after: start fake quantization after this many epochs/steps (0: from the start).
        schedule_unit: ``"epoch"`` or ``"step"``, the unit of the three schedules.
        eval_converted_every_n_epochs: compare a converted copy with the model every this many epochs.
        calibration_batches: validation batches to calibrate on (PTQ).
        validation_batches: validation batches to validate the converted model on (``None``: all).
        min_cosine: the converted model's outputs must have at least this cosine similarity to the reference's.
        min_agreement: ``mode="dynamic"``: the int8 model's top-1 agreement with fp32 must be at least this.
        export: convert, validate, save and time the quantized model at the end of ``fit`` (``False``: QAT only; the
            trained checkpoint converts later with :meth:`load_checkpoint` and
            :func:`~lightning_perf.deploy.quantize.export_quantized`).
        benchmark: time the quantized against the float model, both compiled, at the end.
        benchmark_batch_sizes: batch sizes to time at.
        latency_iterations: timed calls per batch size and model.
        latency_warmup: untimed calls first (they include compilation).
        dirpath: where to write; default the ``ModelCheckpoint``'s directory, else ``<default_root_dir>/quantized``.
        filename: name of the artifact set and stem of its files (``<filename>.pt2``, ``.json``, ``.onnx``).
        onnx: also export the quantized model to ONNX.
        input_key: the model input's key when batches are dicts.
        strict: raise instead of warning when converting, validating or saving at the end fails.

    Raises:
        ValueError: for an invalid option (unknown backend or mode, a base config torchao cannot train, negative
            schedule...).
        ModuleNotFoundError: if torchao is not installed (the ``qat`` extra).

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
    ) -> None:
        owner = type(self).__name__
        backend = check_mode_and_backend(owner, mode, backend)
        self._dynamic = DynamicInt8(self) if mode == "dynamic" else None
        if self._dynamic:
            self.base_config = None
        elif backend == "torchao":
            self.base_config: dict[str, Any] | None = base_config_spec(resolve_base_config(base_config, owner))
        elif base_config is not None:
            make_recipe(backend, mode, base_config, input_shapes=[(1,)], owner=owner)  # raises with the reason
        else:
            self.base_config = None
        sizes = check_options(owner, dict(locals()))
        self.backend = backend
        self.mode = mode
        self.submodule = submodule
        self.disable_observers_after = disable_observers_after
        self.freeze_bn_after = freeze_bn_after
        self.fake_quant_after = fake_quant_after
        self.schedule_unit = schedule_unit
        self.eval_converted_every_n_epochs = eval_converted_every_n_epochs
        self.calibration_batches = calibration_batches
        self.validation_batches = validation_batches
        self.min_cosine = float(min_cosine)
        self.min_agreement = float(min_agreement)
        self.export = bool(export)
        self.benchmark = bool(benchmark)
        self.benchmark_batch_sizes = tuple(sizes)
        self.latency_iterations = latency_iterations
        self.latency_warmup = latency_warmup
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.onnx = bool(onnx)
        self.input_key = input_key
        self.strict = bool(strict)
        self.report: QuantizationReport | DynamicReport | None = None
        """What the last end-of-training quantization produced (rank zero); ``None`` before one ran."""
        self.history: list[dict[str, Any]] = []
        """The periodic comparisons of a converted copy with the model (``eval_converted_every_n_epochs``)."""
        self._recipe: QuantizationRecipe | None = None
        self._submodule_name: str | None = None
        self._float_module: nn.Module | None = None  # x86: what the prepared graph was captured from (shared params)
        self._applied: tuple[bool, bool, bool] | None = None
        self._eager_batchnorms: list[nn.Module] = []
        self._prepared_here = False  # this callback put the prepared module in place in this run (undone at its end)
        self._prepared_module: nn.Module | None = None  # what it put there
        # Kept between runs while the model is plain: the x86 prepared graph (it holds the float module's own
        # parameters and buffers, so putting it back is instant) and the observer / fake-quantize state.
        self._kept_graph: nn.Module | None = None
        self._quantization_state: dict[str, torch.Tensor] = {}
        self._before_fit: tuple[Any, ...] | None = None  # what a failed fit gives back (see `on_exception`)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(submodule=self.submodule)

    @property
    def recipe(self) -> QuantizationRecipe | None:
        """The recipe of the prepared (QAT) or last quantized (PTQ) model."""
        return self._recipe

    @property
    def quantization_state(self) -> dict[str, torch.Tensor]:
        """The observer and fake-quantize state of the QAT model (keys relative to the submodule): read from the
        prepared submodule while it is in the model, else the state kept since the last run ended."""
        module = self._prepared_module
        if self._prepared_here and module is not None and is_prepared(module):
            current = module.state_dict()
            return {key: current[key] for key in quantization_state_keys(module)}
        return dict(self._quantization_state)

    @contextlib.contextmanager
    def prepared(self, pl_module: pl.LightningModule) -> Iterator[nn.Module]:
        """Put the QAT-prepared submodule into ``pl_module`` for use outside a Trainer; the plain one on exit.

        After ``fit`` the model holds its plain float submodule with the QAT-trained weights; this puts back what the
        callback kept (the prepared graph, or a new preparation loaded with the kept quantization state), e.g. to run
        the fake-quantized model or to convert it with :func:`~lightning_perf.deploy.quantize.export_quantized`::

            with callback.prepared(model) as prepared:
                report = export_quantized(prepared, float_model=copy.deepcopy(model.net), dirpath="out")

        Raises:
            ValueError: if the callback holds no QAT state (no fit, no checkpoint loaded with it).
        """
        if self.mode != "qat" or self._recipe is None or self._submodule_name is None:
            raise ValueError(
                f"`{type(self).__name__}.prepared()` has no quantization-aware training to put back: fit with the "
                "callback first, or load a checkpoint written with it (`QATCallback.load_checkpoint`)."
            )
        ours = not self._prepared_here and not is_prepared(pl_module.get_submodule(self._submodule_name))
        if ours:
            self._reinstall(pl_module)
        try:
            yield pl_module.get_submodule(self._submodule_name)
        finally:
            if ours:
                self._restore(pl_module)

    # --------------------------------------------------------------------------------------------- the submodule

    def _resolve(self, pl_module: pl.LightningModule, name: str | None = None) -> tuple[str, nn.Module]:
        return resolve_submodule(type(self).__name__, pl_module, name or self.submodule)

    def _replace(self, pl_module: pl.LightningModule, name: str, new: nn.Module) -> None:
        replace_modules(pl_module, [name], lambda module, _: new, check_state_dict=False)

    def _submodule_batches(self, pl_module: pl.LightningModule, module: nn.Module, loader: Any) -> Iterator[Any]:
        return submodule_batches(type(self).__name__, pl_module, module, loader, self.input_key)

    # ------------------------------------------------------------------------------------------------- preparing

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        restorer = pl_module.__dict__.get("on_load_checkpoint")
        if not isinstance(restorer, RestoreBeforeWeights):
            restorer = RestoreBeforeWeights(pl_module)
            object.__setattr__(pl_module, "on_load_checkpoint", restorer)
        if self not in restorer.callbacks and not self._dynamic:
            restorer.callbacks.append(self)
        if self.mode != "qat":
            return
        if stage == "fit":
            check_pruning(self, self.backend, trainer)
            state = {k: v.clone() for k, v in self._quantization_state.items()}
            self._before_fit = (self._recipe, self._submodule_name, self._float_module, self._kept_graph, state)
            run_after_configure_model(pl_module, self._prepare_for_fit)
        elif self._recipe is not None and self._submodule_name is not None:
            run_after_configure_model(pl_module, self._reinstall)  # validate/test/predict the QAT model

    def _check_same_settings(self, name: str, recipe: QuantizationRecipe) -> None:
        if (recipe.backend, recipe.mode, recipe.base_config) != (self.backend, "qat", self.base_config):
            raise ValueError(
                f"`{type(self).__name__}(backend={self.backend!r})`: {name!r} was already prepared with "
                f"{recipe.to_dict()}. Quantize a fresh model, or use the same settings."
            )

    def _prepare_for_fit(self, pl_module: pl.LightningModule) -> None:
        name, module = self._resolve(pl_module)
        if is_prepared(module):  # prepared outside a Trainer (`load_checkpoint`): it goes on training as it is
            recipe = recipe_of(module)
            assert recipe is not None
            self._check_same_settings(name, recipe)
            self._recipe, self._submodule_name = recipe, name
            self._collect_batchnorms(module)
            return
        if self._recipe is not None and self._recipe.mode == "qat" and self._submodule_name == name:
            self._check_same_settings(name, self._recipe)  # a later fit goes on from the state the last one reached
            self._reinstall(pl_module)
            return
        self._submodule_name = name
        example = example_inputs(type(self).__name__, pl_module.trainer, pl_module, module, "train", self.input_key)
        recipe = make_recipe(self.backend, "qat", self.base_config, example, owner=type(self).__name__)
        try:
            self._install(pl_module, name, module, recipe, example)
        except NothingToQuantizeError as exc:
            self._submodule_name = None
            warn_once(f"{type(self).__name__}: {exc} Training goes on in float, unchanged.", NoEffectWarning)
            return
        rank_zero_info(
            f"{type(self).__name__}: prepared {name!r} ({type(module).__name__}) for quantization-aware training with "
            f"backend {self.backend!r}; example input shapes {[list(s) for s in recipe.input_shapes]}."
        )

    def _install(
        self, pl_module: pl.LightningModule, name: str, module: nn.Module, recipe: QuantizationRecipe, example: Any
    ) -> None:
        prepared = prepare(module, recipe, example, owner=type(self).__name__)
        if prepared is not module:
            self._replace(pl_module, name, prepared)
        self._float_module = module if recipe.backend == "x86" else None
        self._recipe = recipe
        self._submodule_name = name
        self._mark_installed(prepared)
        if recipe.backend == "torchao" and self.disable_observers_after is not None:
            warn_once(
                f"`{type(self).__name__}(backend='torchao', disable_observers_after=...)` has no effect: torchao's QAT "
                "configs quantize activations dynamically and have no observers.",
                NoEffectWarning,
            )

    def _mark_installed(self, prepared: nn.Module) -> None:
        self._applied = None
        self._prepared_here = True
        self._prepared_module = prepared
        self._collect_batchnorms(prepared)

    def _reinstall(self, pl_module: pl.LightningModule, recipe: QuantizationRecipe | None = None) -> None:
        """Put the prepared submodule back into the plain model: the kept graph when it still holds the float
        module's own tensors, else a new preparation of the float module loaded with the kept quantization state."""
        recipe = recipe or self._recipe
        assert recipe is not None and self._submodule_name is not None
        name, module = self._resolve(pl_module, self._submodule_name)
        if is_prepared(module):
            return
        graph = self._kept_graph
        if graph is not None and recipe_of(graph) == recipe and holds_tensors_of(graph, module):
            graph.train(module.training)
            self._replace(pl_module, name, graph)
            self._float_module, self._recipe = module, recipe
            self._mark_installed(graph)
            return
        self._install(pl_module, name, module, recipe, None)
        prepared = pl_module.get_submodule(name)
        state = self._quantization_state
        expected = quantization_state_keys(prepared)
        if state and set(state) != set(expected):
            kept = self._kept_graph, self._quantization_state
            self._restore(pl_module)
            self._kept_graph, self._quantization_state = kept
            raise ValueError(
                f"`{type(self).__name__}`: the quantization state kept from the last run ({len(state)} tensors) does "
                f"not fit {name!r} as prepared now ({len(expected)} tensors): the submodule was replaced by another "
                "kind of model. Use a new QATCallback for it."
            )
        if state:
            prepared.load_state_dict(with_state_versions(prepared, state), strict=False)

    def _restore(self, pl_module: pl.LightningModule) -> None:
        """Put the plain float submodule (same parameters, trained) back and keep the quantization state."""
        name, module = self._submodule_name, self._prepared_module
        if self._prepared_here and name is not None and module is not None and is_prepared(module):
            current = module.state_dict()
            self._quantization_state = {k: current[k].detach().clone() for k in quantization_state_keys(module)}
            self._kept_graph = module if isinstance(module, torch.fx.GraphModule) else None
            plain = restore_float(module, self._float_module)
            if pl_module.get_submodule(name) is module and plain is not module:
                self._replace(pl_module, name, plain)
            self._float_module = plain if self._kept_graph is not None else None
        self._prepared_here, self._prepared_module, self._eager_batchnorms = False, None, []

    def _collect_batchnorms(self, prepared: nn.Module) -> None:
        eager = self.freeze_bn_after is not None and not isinstance(prepared, torch.fx.GraphModule)
        self._eager_batchnorms = batchnorm_modules(prepared) if eager else []

    # ------------------------------------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": None if self._recipe is None else self._recipe.to_dict(),
            "submodule": self._submodule_name,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The model was prepared from this state before its weights were loaded (`before_weights_load`).
        if state_dict.get("recipe") is not None and self._recipe is None:
            self._recipe = QuantizationRecipe.from_dict(state_dict["recipe"])
        self._submodule_name = state_dict.get("submodule") or self._submodule_name

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.mode != "qat" or self._submodule_name is None:
            return
        name = self._submodule_name
        module = pl_module.get_submodule(name)
        weights = checkpoint["state_dict"]
        if is_prepared(module):
            # The plain model's keys stay in `state_dict`; the observer / fake-quantize state rides in this entry.
            keys = [f"{name}.{key}" for key in quantization_state_keys(module)]
            quantization_state = {k: weights.pop(k) for k in keys if k in weights}
        else:  # saved after a run, the model plain again: the state this callback kept
            quantization_state = {f"{name}.{k}": v.clone() for k, v in self._quantization_state.items()}
        checkpoint["callbacks"][self.state_key]["quantization_state"] = quantization_state

    def before_weights_load(self, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Prepare ``pl_module`` as the checkpoint's recipe says and put its quantization state back into
        ``checkpoint["state_dict"]``, so that a strict ``load_state_dict`` of the checkpoint succeeds.

        Lightning runs this (through the module's ``on_load_checkpoint``) right before it loads the weights; without a
        recipe in the checkpoint (written without the callback, or weights only) a prepared model keeps its current
        quantization state for the keys the checkpoint lacks.
        """
        state = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        weights = checkpoint["state_dict"]
        recipe_data = state.get("recipe")
        name, module = self._resolve(pl_module, state.get("submodule") or self._submodule_name)
        if recipe_data is not None and recipe_data.get("mode") == "qat":
            recipe = QuantizationRecipe.from_dict(recipe_data)
            graph = self._kept_graph
            reuse = graph is not None and recipe_of(graph) == recipe and not is_prepared(module)
            if reuse and holds_tensors_of(graph, module):  # type: ignore[arg-type]
                self._submodule_name = name
                self._reinstall(pl_module, recipe)  # the checkpoint's quantization state is loaded next
                module = pl_module.get_submodule(name)
            if recipe_of(module) != recipe:
                float_module = module if not is_prepared(module) else self._float_source(module)
                self._install(pl_module, name, float_module, recipe, None)
                module = pl_module.get_submodule(name)
                rank_zero_info(
                    f"{type(self).__name__}: prepared {name!r} with the checkpoint's recipe (backend "
                    f"{recipe.backend!r}, input shapes {[list(s) for s in recipe.input_shapes]}) before loading it."
                )
            self._recipe, self._submodule_name = recipe, name
            for key, value in (state.get("quantization_state") or {}).items():
                weights.setdefault(key, value)
        if is_prepared(module):
            current = module.state_dict()
            for key in quantization_state_keys(module):
                weights.setdefault(f"{name}.{key}", current[key])
            # A checkpoint saved from the plain model lacks the observers' state versions: give them, or loading
            # resets their `eps` (see `with_state_versions`).
            checkpoint["state_dict"] = with_state_versions(module, weights, prefix=name)

    def _float_source(self, module: nn.Module) -> nn.Module:
        recipe = recipe_of(module)
        if recipe is not None and recipe.backend == "torchao":
            return float_copy(module)
        if self._float_module is None:
            raise ValueError(
                f"`{type(self).__name__}`: the model was prepared with {recipe.to_dict() if recipe else None} but the "
                "checkpoint needs another recipe, and the float module it came from is unknown. Load the checkpoint "
                "into a fresh model."
            )
        return self._float_module

    @staticmethod
    def load_checkpoint(
        pl_module: pl.LightningModule, checkpoint_path: str | Path, map_location: Any = "cpu"
    ) -> QuantizationRecipe:
        """Load a checkpoint written with this callback into a fresh (float) ``pl_module``, outside a Trainer.

        The submodule is prepared as the checkpoint's recipe says and the checkpoint's weights and quantization
        state are loaded (strictly). Returns the recipe.

        The file is read with ``torch.load(weights_only=True)`` only: a checkpoint whose hyperparameters need other
        classes fails with an error naming the class and ``torch.serialization.add_safe_globals``.

        Raises:
            ValueError: if the checkpoint holds no ``QATCallback`` state.
            UnsafeCheckpointError: if the file needs a global torch does not allow by default.
        """
        checkpoint = load_checkpoint(checkpoint_path, map_location, what="QATCallback.load_checkpoint:")
        entries = {k: v for k, v in (checkpoint.get("callbacks") or {}).items() if k.startswith("QATCallback")}
        states = [v for v in entries.values() if (v.get("recipe") or {}).get("mode") == "qat"]
        if len(states) != 1:
            raise ValueError(
                f"{checkpoint_path} holds {len(states)} QATCallback states with a QAT recipe; expected exactly one."
            )
        state = states[0]
        recipe = QuantizationRecipe.from_dict(state["recipe"])
        callback = QATCallback(recipe.backend, base_config=recipe.base_config, benchmark=False)
        callback.before_weights_load(pl_module, {**checkpoint, "callbacks": {callback.state_key: state}})
        pl_module.load_state_dict(checkpoint["state_dict"])
        return recipe

    # ------------------------------------------------------------------------------------------------- schedules

    def _wanted(self, progress: int) -> tuple[bool, bool, bool]:
        observers = self.disable_observers_after is None or progress < self.disable_observers_after
        bn_frozen = self.freeze_bn_after is not None and progress >= self.freeze_bn_after
        return observers, bn_frozen, progress >= self.fake_quant_after

    def _apply_schedule(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode != "qat" or self._submodule_name is None:
            return
        progress = trainer.current_epoch if self.schedule_unit == "epoch" else trainer.global_step
        wanted = self._wanted(progress)
        if wanted != self._applied:
            module = pl_module.get_submodule(self._submodule_name)
            observers, bn_frozen, fake_quant = wanted
            if self._recipe is not None and self._recipe.backend == "x86":
                set_observers(module, observers)
            if isinstance(module, torch.fx.GraphModule):
                freeze_batchnorm_stats(module, bn_frozen)
            set_fake_quant(module, fake_quant)
            if self._applied is not None:
                rank_zero_info(
                    f"{type(self).__name__}: at {self.schedule_unit} {progress}: observers "
                    f"{'on' if observers else 'off'}, batch-norm statistics {'frozen' if bn_frozen else 'updating'}, "
                    f"fake quantization {'on' if fake_quant else 'off'}."
                )
            self._applied = wanted
        if wanted[1]:
            for layer in self._eager_batchnorms:  # `model.train()` puts them back in training mode each epoch
                if layer.training:
                    layer.eval()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply_schedule(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.schedule_unit == "step" or self._eager_batchnorms:
            self._apply_schedule(trainer, pl_module)

    # ------------------------------------------------------------------------------------------ converted checks

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        every = self.eval_converted_every_n_epochs
        if self.mode != "qat" or every is None or (trainer.current_epoch + 1) % every or not trainer.is_global_zero:
            return
        if self._submodule_name is None:
            return
        loader = _val_dataloader(trainer, pl_module)
        if loader is None:
            warn_once(f"`{type(self).__name__}(eval_converted_every_n_epochs=...)` needs validation data.")
            return
        module = pl_module.get_submodule(self._submodule_name)
        try:
            summary = compare_models(
                module,  # in eval mode nothing moves: observers pause, batch norm uses its running statistics
                convert(module),
                self._submodule_batches(pl_module, module, loader),
                max_batches=self.validation_batches,
                min_cosine=self.min_cosine,
            )
        except Exception as exc:
            warnings.warn(
                f"{type(self).__name__} could not check the converted model at epoch {trainer.current_epoch}: "
                f"{type(exc).__name__}: {exc}",
                FallbackWarning,
                stacklevel=2,
            )
            return
        entry = {"epoch": trainer.current_epoch, "global_step": trainer.global_step, **summary.to_dict()}
        self.history.append(entry)
        metrics = {
            f"qat/{key}": float(value)
            for key, value in (
                ("int8_cosine", summary.cosine),
                ("int8_top1_agreement", summary.top1_agreement),
                ("fake_quant_accuracy", summary.reference_accuracy),
                ("int8_accuracy", summary.quantized_accuracy),
                ("accuracy_gap_pp", summary.accuracy_gap),
            )
            if value is not None
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(f"{type(self).__name__}: converted model at epoch {trainer.current_epoch}: {summary.describe()}")

    # ------------------------------------------------------------------------------------------- end of training

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._dynamic:
            self.report = self._dynamic.fit_end(trainer, pl_module) or self.report
        elif trainer.is_global_zero and self.export:
            self._finish(trainer, pl_module)

    @override
    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if self._dynamic:
            self._dynamic.batch_start(trainer, pl_module, batch)

    on_test_batch_start = on_validation_batch_start = on_predict_batch_start  # dynamic: swap in on the first

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # PTQ of a model that is not trained here: `Trainer.validate` with the callback quantizes it.
        if (
            self.mode == "ptq"
            and trainer.state.fn == "validate"
            and trainer.is_global_zero
            and not trainer.sanity_checking
        ):
            self._finish(trainer, pl_module)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self.report = self._quantize(trainer, pl_module)
        except Exception as exc:
            if self.strict:
                if isinstance(exc, QuantizationError):
                    raise
                raise QuantizationError(
                    f"{type(self).__name__} could not quantize the model: {type(exc).__name__}: {exc}"
                ) from exc
            warnings.warn(
                f"{type(self).__name__} could not quantize the model ({type(exc).__name__}: {exc}); the trained model "
                "and its checkpoints are unchanged.",
                FallbackWarning,
                stacklevel=2,
            )
            return
        rank_zero_info(
            self.report.summary(type(self).__name__) if self.report else f"{type(self).__name__}: nothing to quantize."
        )

    def _quantize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> QuantizationReport | None:
        if self.mode == "qat" and self._submodule_name is None:
            return None  # nothing was prepared in this run
        name, module = self._resolve(pl_module, self._submodule_name if self.mode == "qat" else None)
        loader = _val_dataloader(trainer, pl_module)
        batches = (
            list(itertools.islice(self._submodule_batches(pl_module, module, loader), self._batches_needed()))
            if loader is not None
            else []
        )
        common: dict[str, Any] = {
            "validation_batches": self.validation_batches,
            "min_cosine": self.min_cosine,
            "dirpath": self.dirpath or default_dirpath(trainer),
            "filename": self.filename,
            "benchmark": self.benchmark,
            "batch_sizes": self.benchmark_batch_sizes,
            "latency_iterations": self.latency_iterations,
            "latency_warmup": self.latency_warmup,
            "onnx": self.onnx,
            "strict": self.strict,
            "metadata": {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "model_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            },
        }
        common["metadata"]["submodule"] = name
        if self.mode == "qat":
            if not is_prepared(module):
                return None
            return export_quantized(module, float_model=self._float_module, validation_data=batches, **common)
        if is_prepared(module):
            raise ValueError(f"{name!r} is prepared for QAT; post-training quantization needs the float model.")
        example = example_inputs(type(self).__name__, trainer, pl_module, module, "val", self.input_key)
        float_module = module if self.backend == "torchao" else copy.deepcopy(module).cpu()
        recipe = make_recipe(self.backend, "ptq", self.base_config, example, owner=type(self).__name__)
        prepared = prepare(float_module, recipe, example, owner=type(self).__name__)
        calibration, held_out = batches[: self.calibration_batches], batches[self.calibration_batches :]
        common["metadata"]["calibration_samples"] = calibrate(prepared, calibration)
        self._recipe, self._submodule_name = recipe, name
        return export_quantized(
            prepared,
            float_model=float_module,
            validation_data=held_out or calibration,
            example_inputs=example,
            **common,
        )

    def _batches_needed(self) -> int | None:
        if self.validation_batches is None:
            return None
        return self.validation_batches + (self.calibration_batches if self.mode == "ptq" else 0)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A failed or interrupted run does not reach `teardown`: put the plain model back as it would. A failed fit
        # also gives back the quantization state it started from, so that a second fit starts as the first did.
        self._restore(pl_module)
        if self._dynamic:
            self._dynamic.restore(pl_module)
        if trainer.state.fn == "fit" and self._before_fit is not None:
            self._recipe, self._submodule_name, self._float_module, self._kept_graph, state = self._before_fit
            self._quantization_state = state
            if self._kept_graph is not None and state:
                self._kept_graph.load_state_dict(with_state_versions(self._kept_graph, state), strict=False)
        self.teardown(trainer, pl_module, trainer.state.stage.value if trainer.state.stage else "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The plain float submodule goes back with the trained weights; the quantization state stays here, for the
        # next validate/test/predict/fit with this callback and for `trainer.save_checkpoint`.
        self._restore(pl_module)
        if self._dynamic:
            self._dynamic.restore(pl_module)
        self._before_fit = None
        discard_pending_surgery(pl_module)
        restorer = pl_module.__dict__.get("on_load_checkpoint")
        if isinstance(restorer, RestoreBeforeWeights):
            if self in restorer.callbacks:
                restorer.callbacks.remove(self)
            if not restorer.callbacks:
                del pl_module.__dict__["on_load_checkpoint"]
        self._applied = None

    def __getstate__(self) -> dict[str, Any]:
        # The float module, the layer list and the logging functions Lightning attaches belong to this process's
        # model (an exported model does not pickle: torch.export's guard module holds a local function).
        state = {
            **self.__dict__,
            "_float_module": None,
            "_eager_batchnorms": [],
            "_prepared_module": None,
            "_kept_graph": None,
            "_before_fit": None,
        }
        state.pop("log", None)
        state.pop("log_dict", None)
        return state
