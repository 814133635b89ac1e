"""Quantization as data: one recipe object per mode, one :class:`Quantizer` per recipe type, picked by a registry.

A recipe (:class:`X86QATRecipe`, :class:`TorchaoQATRecipe`, :class:`StaticPTQRecipe`, :class:`DynamicInt8Recipe`) is
plain, frozen data. :func:`register_quantizer` maps a recipe type to the :class:`Quantizer` class that carries it out
(as torchao's ``quantize_`` dispatches on its config's type), and
:func:`quantizer_for` builds one. A quantizer has the same methods whatever its
mode (prepare before training, schedules, runs of their own, finish with the artifact set, undo, checkpoint state), so
the training-loop adapter (:class:`~lightning_perf.callbacks.QATCallback`) only calls them from its hooks; what it
cannot know without a trainer (example inputs, validation batches) it hands over as a :class:`LoopData`.
No Lightning here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_perf._validation import (
    check_bool,
    check_choice,
    check_file_stem,
    check_instance,
    check_int,
    check_int_sequence,
    check_number,
)

__all__ = [
    "SCHEDULE_UNITS",
    "DynamicInt8Recipe",
    "LoopData",
    "QuantizeOptions",
    "Quantizer",
    "StaticPTQRecipe",
    "TorchaoQATRecipe",
    "X86QATRecipe",
    "check_options",
    "quantizer_for",
    "register_quantizer",
    "resolve_submodule",
]

SCHEDULE_UNITS = ("epoch", "step")


# ------------------------------------------------------------------------------------------------------- recipes


@dataclass(frozen=True)
class X86QATRecipe:
    """QAT for CPU deployment: ``torch.export`` + torchao's PT2E ``X86InductorQuantizer`` (int8 activations, per-channel
    int8 weights, conv-BN folded)."""

    mode: ClassVar[str] = "qat"
    backend: ClassVar[str] = "x86"
    base_config: None = None
    pruning_refusal: ClassVar[str | None] = (
        "the exported graph reads the weights directly and never runs the pruning hooks, so nothing would be pruned. "
        "Use backend='torchao' (with QATCallback before ModelPruning in `callbacks`), or prune and make it permanent "
        "before QAT"
    )
    """Why Lightning's ``ModelPruning`` cannot train with this recipe (``None``: it can, after the QAT adapter)."""


@dataclass(frozen=True)
class TorchaoQATRecipe:
    """QAT of Linear-heavy models: ``quantize_(module, QATConfig(base_config, step="prepare"))``; ``base_config`` is
    the torchao config's spec (:func:`~lightning_perf.functional.quantization.config.base_config_spec`)."""

    mode: ClassVar[str] = "qat"
    backend: ClassVar[str] = "torchao"
    base_config: Mapping[str, Any] | None = None
    pruning_refusal: ClassVar[str | None] = None


@dataclass(frozen=True)
class StaticPTQRecipe:
    """Post-training quantization: calibrate a copy (``x86``: observers; ``torchao``: its config), convert, save."""

    mode: ClassVar[str] = "ptq"
    backend: str = "x86"
    base_config: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class DynamicInt8Recipe:
    """Dynamic int8 for CPU inference: int8 weights, activations quantized per batch; ``backend`` one of
    :data:`~lightning_perf.deploy.quantize.dynamic.DYNAMIC_BACKENDS`."""

    mode: ClassVar[str] = "dynamic"
    backend: str = "auto"
    base_config: None = None


@dataclass(frozen=True)
class QuantizeOptions:
    """The options every quantizer reads (checked by :func:`check_options`)."""

    submodule: str | None = None
    disable_observers_after: int | None = None
    freeze_bn_after: int | None = None
    fake_quant_after: int = 0
    schedule_unit: str = "epoch"
    calibration_batches: int = 8
    validation_batches: int | None = 4
    min_cosine: float = 0.99
    min_agreement: float = 0.95
    benchmark: bool = True
    benchmark_batch_sizes: tuple[int, ...] = (1, 32)
    latency_iterations: int = 20
    latency_warmup: int = 3
    filename: str = "model_int8"
    onnx: bool = False
    strict: bool = False
    refresh: bool = False
    owner: str = "QATCallback"

    def export_settings(self, data: LoopData, name: str | None) -> dict[str, Any]:
        """The keywords :func:`~lightning_perf.deploy.quantize.save.export_quantized` and ``export_dynamic`` share."""
        same = ("validation_batches", "min_cosine", "filename", "benchmark", "latency_iterations", "latency_warmup")
        settings = {key: getattr(self, key) for key in (*same, "strict")}
        metadata = {**data.metadata, "submodule": name}
        return {**settings, "batch_sizes": self.benchmark_batch_sizes, "dirpath": data.dirpath, "metadata": metadata}


@dataclass
class LoopData:
    """What the training loop's adapter hands a quantizer (Lightning stays out of this layer).

    Attributes:
        example: ``example(module, split)``: the inputs ``module`` receives for the loop's example input or first
            batch of ``split`` (``"train"``/``"val"``), on the CPU.
        validation: ``validation(module)``: the validation batches as ``(inputs of module, labels)``; ``None`` when
            there is no validation data.
        dirpath: where the artifact set goes.
        metadata: what the report records about the run (step, epoch, model class).
    """

    example: Callable[[nn.Module, str], Any]  # positional tensors, or a CapturedCall with keyword inputs
    validation: Callable[[nn.Module], Iterable[Any] | None]
    dirpath: str | os.PathLike[str] = "."
    metadata: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------------ registry

_QUANTIZERS: dict[type, type[Quantizer]] = {}


def register_quantizer(*recipe_types: type) -> Callable[[type[Quantizer]], type[Quantizer]]:
    """Class decorator: the quantizer carries out recipes of ``recipe_types``."""

    def register(cls: type[Quantizer]) -> type[Quantizer]:
        for recipe_type in recipe_types:
            _QUANTIZERS[recipe_type] = cls
        return cls

    return register


class Quantizer:
    """Carries out one recipe on a model. Every method has a neutral default, so an adapter calls each of them from
    its hook whatever the recipe: a recipe that does not train leaves the model alone during ``fit``, one that makes
    no int8 model of its own for inference leaves runs of their own alone.

    Attributes:
        finishes_after: the runs whose end produces the quantized artifact set (``"fit"``, ``"validate"``).
        trains: whether the recipe changes the model that trains (QAT).
    """

    finishes_after: ClassVar[frozenset[str]] = frozenset({"fit"})
    trains: ClassVar[bool] = False

    def __init__(self, recipe: Any, options: QuantizeOptions) -> None:
        self.recipe = recipe
        self.options = options
        self.owner = options.owner
        self.recipe_used: Any = None
        """The :class:`~lightning_perf.functional.quantization.qat.QuantizationRecipe` (with input shapes) of the
        prepared (QAT) or last quantized (PTQ) model."""
        self.name: str | None = None
        """The submodule it applies to."""

    @property
    def quantization_state(self) -> dict[str, torch.Tensor]:
        """The observer and fake-quantize state kept for the prepared submodule (QAT)."""
        return {}

    def prepared(self, root: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        """Put the prepared submodule into ``root`` while the context lasts (QAT)."""
        raise ValueError(
            f"`{self.owner}.prepared()` has no quantization-aware training to put back: fit with the "
            "callback first, or load a checkpoint written with it (`QATCallback.load_checkpoint`)."
        )

    # training ------------------------------------------------------------------------------------------------
    def begin_fit(self, root: nn.Module, data: LoopData) -> str | None:
        """Before the optimizers exist: prepare what trains; returns a line to log when it did."""
        return None

    def schedule(self, root: nn.Module, progress: int) -> str | None:
        """Apply the schedules at ``progress`` (epochs or steps); returns a line to log when something switched."""
        return None

    def schedules_per_step(self) -> bool:
        """Whether :meth:`schedule` must run at every training step."""
        return False

    def check_converted(self, root: nn.Module, data: LoopData) -> Any:
        """Compare a converted copy with the training model; ``None`` when there is nothing to compare."""
        return None

    # runs of their own (validate / test / predict) --------------------------------------------------------------
    def begin_run(self, root: nn.Module) -> None:
        """Put the model this recipe evaluates in place (the prepared one after QAT)."""

    def run_batch(self, root: nn.Module, inputs: Any, stage: str) -> str | None:
        """On each batch of a run of its own (``inputs``: the batch's model inputs); returns a line for the log."""
        return None

    # end ---------------------------------------------------------------------------------------------------------
    def finish(self, root: nn.Module, data: LoopData) -> Any:
        """Convert, validate, save and time the quantized model; returns its report (``None``: nothing to do)."""
        return None

    def end_run(self, root: nn.Module, *, failed_fit: bool = False) -> None:
        """Put the plain model back (end or failure of any run); ``failed_fit`` also gives back the state the fit
        started from."""

    # checkpoints -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        used = self.recipe_used
        return {"recipe": None if used is None else used.to_dict(), "submodule": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the state of :meth:`state_dict` (the model is prepared from it before its weights are loaded)."""

    def save_checkpoint(self, root: nn.Module, entry: dict[str, Any], weights: dict[str, Any]) -> None:
        """Move what this recipe adds to the model's weights into its own checkpoint ``entry``."""

    def before_weights_load(self, root: nn.Module, entry: Mapping[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
        """Prepare ``root`` as the checkpoint ``entry`` says; returns ``weights`` completed so that a strict load of
        them succeeds."""
        return weights


# ------------------------------------------------------------------------------------------------------ helpers


def quantizer_for(recipe: Any, options: QuantizeOptions) -> Quantizer:
    """The quantizer registered for ``type(recipe)`` (:mod:`~lightning_perf.deploy.quantize.recipes` registers them
    all), built for ``options``.

    Raises:
        TypeError: for a recipe type nothing is registered for.
    """
    cls = _QUANTIZERS.get(type(recipe))
    if cls is None:
        known = ", ".join(sorted(t.__name__ for t in _QUANTIZERS))
        raise TypeError(f"No quantizer is registered for {type(recipe).__name__}; registered: {known}.")
    return cls(recipe, options)


def resolve_submodule(owner: str, root: nn.Module, name: str | None) -> tuple[str, nn.Module]:
    """The submodule called ``name``, or by default the root's only child holding parameters."""
    if name is not None:
        try:
            return name, root.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in root.named_children()]
            raise ValueError(
                f"`{owner}(submodule={name!r})`: {type(root).__name__} has no submodule "
                f"{name!r}. Its children: {', '.join(children) or 'none'}."
            ) from None
    holders = [(n, c) for n, c in root.named_children() if next(c.parameters(), None) is not None]
    if len(holders) != 1:
        found = ", ".join(n for n, _ in holders) or "none"
        raise ValueError(
            f"`{owner}()` quantizes one submodule of the LightningModule (which itself cannot be "
            f"exported) and could not choose in {type(root).__name__}: children holding parameters: {found}. "
            'Pass `submodule="<name>"`.'
        )
    return holders[0]


def check_options(owner: str, mode: str, options: Mapping[str, Any]) -> QuantizeOptions:
    """Check the constructor arguments of a quantizing adapter (``options``: by name) and return them as one object.

    Raises:
        ValueError: for an invalid value or combination, naming the argument, the value and what is expected.
        TypeError: for a ``dirpath`` that is not a path.
    """
    o = dict(options)
    for name in ("submodule", "input_key"):  # a dotted module name; a key of dict batches
        if o[name] is not None and (not isinstance(o[name], str) or not o[name]):
            raise ValueError(f"`{owner}({name}={o[name]!r})` is not valid. Expected None or a non-empty string.")
    for name in ("disable_observers_after", "freeze_bn_after"):
        check_int(owner, name, o[name], 0, True)
    check_int(owner, "eval_converted_every_n_epochs", o["eval_converted_every_n_epochs"], 1, True)
    check_int(owner, "validation_batches", o["validation_batches"], 0, True)
    if o["validation_batches"] == 0:
        raise ValueError(
            f"`{owner}(validation_batches=0)` is not valid: the quantized model would be saved without being "
            "compared with the model. Expected None (all validation batches) or an int >= 1."
        )
    for name, minimum in (("fake_quant_after", 0), ("calibration_batches", 1), ("latency_iterations", 1)):
        check_int(owner, name, o[name], minimum, False)
    check_int(owner, "latency_warmup", o["latency_warmup"], 0, False)
    check_choice(owner, "schedule_unit", o["schedule_unit"], SCHEDULE_UNITS)
    for name in ("export", "benchmark", "onnx", "strict", "refresh"):
        check_bool(owner, name, o[name])
    if mode == "ptq" and not o["export"]:
        raise ValueError(f"`{owner}(mode='ptq', export=False)` would do nothing. PTQ exports the quantized model.")
    if o["onnx"] and not o["export"]:
        raise ValueError(
            f"`{owner}(export=False, onnx=True)` is not valid: the ONNX file is written with the quantized model at "
            "the end of fit, which export=False skips. Drop onnx=True, or keep export=True."
        )
    if mode != "qat" and (o["disable_observers_after"], o["freeze_bn_after"], o["fake_quant_after"]) != (None, None, 0):
        raise ValueError(
            f"`{owner}(mode={mode!r}, ...)`: the observer, batch-norm and fake-quant schedules apply to QAT only."
        )
    for name in ("min_cosine", "min_agreement"):
        check_number(owner, name, o[name], 0.0, 1.0)
    if o["refresh"] and mode != "dynamic":
        raise ValueError(
            f"`{owner}(mode={mode!r}, refresh=True)` is not valid: only mode 'dynamic' caches a measured choice. "
            "Leave refresh=False."
        )
    if mode == "dynamic":
        for name, default, why in (
            ("base_config", None, "the torchao back-end of mode 'dynamic' uses Int8DynamicActivationInt8WeightConfig"),
            ("eval_converted_every_n_epochs", None, "training is not touched: there is no converted copy to follow"),
            ("onnx", False, "backend='onnxruntime' is the ONNX int8 model (saved as <filename>.onnx)"),
        ):
            if o[name] != default:
                raise ValueError(
                    f"`{owner}(mode='dynamic', {name}={o[name]!r})` is not valid: {why}. Leave it at {default!r}."
                )
    sizes = check_int_sequence(owner, "benchmark_batch_sizes", o["benchmark_batch_sizes"])
    check_file_stem(owner, "filename", o["filename"])
    check_instance(owner, "dirpath", o["dirpath"], (type(None), str, os.PathLike), "None or a directory path")
    names = set(QuantizeOptions.__dataclass_fields__) - {"benchmark_batch_sizes", "owner", "min_cosine"}
    return QuantizeOptions(
        **{k: o[k] for k in names},
        min_cosine=float(o["min_cosine"]),
        benchmark_batch_sizes=sizes,
        owner=owner,
    )
