"""The recipes after training (static PTQ, dynamic int8), and :func:`recipe_for`.

:func:`recipe_for` turns an adapter's ``mode`` / ``backend`` / ``base_config`` options into one recipe object
(:mod:`~lightning_perf.deploy.quantize.quantizer`, whose ``quantizer_for`` builds the quantizer registered for the
recipe's type): :class:`~lightning_perf.deploy.quantize.qat_quantizer.QATQuantizer` (QAT, ``x86`` and ``torchao``),
:class:`StaticPTQQuantizer`, :class:`DynamicInt8Quantizer`. No Lightning here.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

from lightning_perf._device import module_device
from lightning_perf._imports import require
from lightning_perf._validation import check_choice
from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.deploy.quantize.convert import calibrate
from lightning_perf.deploy.quantize.dynamic import DYNAMIC_BACKENDS, DynamicQuantization, quantize_dynamic
from lightning_perf.deploy.quantize.qat_quantizer import QATQuantizer, export_with_options
from lightning_perf.deploy.quantize.quantizer import (
    DynamicInt8Recipe,
    LoopData,
    QuantizeOptions,
    Quantizer,
    StaticPTQRecipe,
    TorchaoQATRecipe,
    X86QATRecipe,
    quantizer_for,
    register_quantizer,
    resolve_submodule,
)
from lightning_perf.deploy.quantize.save import DynamicReport, QuantizationReport, export_dynamic
from lightning_perf.deploy.validate import eval_mode
from lightning_perf.functional.inputs import CapturedCall, PositionalCall
from lightning_perf.functional.quantization.config import base_config_spec, resolve_base_config
from lightning_perf.functional.quantization.qat import (
    BACKENDS,
    MODES,
    QuantizationRecipe,
    is_prepared,
    make_recipe,
    prepare,
)
from lightning_perf.functional.surgery import replace_modules

__all__ = [
    "DynamicInt8Quantizer",
    "QATQuantizer",
    "StaticPTQQuantizer",
    "load_qat_checkpoint",
    "recipe_for",
]

ALL_MODES = (*MODES, "dynamic")


def recipe_for(mode: Any, backend: Any, base_config: Any, owner: str) -> Any:
    """The recipe object of an adapter's options (``backend=None``: ``"x86"``, or ``"auto"`` for dynamic int8).

    Raises:
        ValueError: for an unknown mode, a back-end the mode does not have, or a base config it cannot take.
        ModuleNotFoundError: if torchao is missing for QAT or PTQ.
    """
    check_choice(owner, "mode", mode, ALL_MODES)
    backend = ("auto" if mode == "dynamic" else "x86") if backend is None else backend
    if mode == "dynamic":
        return DynamicInt8Recipe(check_choice(owner, "backend", backend, DYNAMIC_BACKENDS))
    check_choice(owner, "backend", backend, BACKENDS)
    require("torchao", f"{owner}(backend={backend!r})")
    spec = base_config_spec(resolve_base_config(base_config, owner)) if backend == "torchao" else None
    if backend == "x86" and base_config is not None:
        make_recipe(backend, mode, base_config, input_shapes=[(1,)], owner=owner)  # raises with the reason
    if mode == "ptq":
        return StaticPTQRecipe(backend, spec)
    return X86QATRecipe() if backend == "x86" else TorchaoQATRecipe(spec)


def load_qat_checkpoint(root: nn.Module, checkpoint: dict[str, Any], owner: str = "QATCallback") -> QuantizationRecipe:
    """Prepare ``root`` as the one ``owner`` entry with a QAT recipe in ``checkpoint["callbacks"]`` says, then load the
    checkpoint's weights and quantization state into it (strictly). Returns the recipe.

    Raises:
        ValueError: if the checkpoint holds no such entry, or several.
    """
    entries = {k: v for k, v in (checkpoint.get("callbacks") or {}).items() if k.startswith(owner)}
    states = [v for v in entries.values() if (v.get("recipe") or {}).get("mode") == "qat"]
    if len(states) != 1:
        raise ValueError(f"The checkpoint holds {len(states)} {owner} states with a QAT recipe; expected exactly one.")
    recipe = QuantizationRecipe.from_dict(states[0]["recipe"])
    qat_recipe = recipe_for("qat", recipe.backend, recipe.base_config, owner)
    quantizer = quantizer_for(qat_recipe, QuantizeOptions(owner=owner))
    root.load_state_dict(quantizer.before_weights_load(root, states[0], checkpoint["state_dict"]))
    return recipe


@register_quantizer(StaticPTQRecipe)
class StaticPTQQuantizer(Quantizer):
    """Training is not touched; at the end of ``fit`` or of a ``validate`` run a copy of the submodule is calibrated
    on ``calibration_batches`` validation batches (``x86``), converted, validated on the following ones, saved and
    timed."""

    finishes_after = frozenset({"fit", "validate"})

    def finish(self, root: nn.Module, data: LoopData) -> QuantizationReport:
        o = self.options
        name, module = resolve_submodule(self.owner, root, o.submodule)
        if is_prepared(module):
            raise ValueError(f"{name!r} is prepared for QAT; post-training quantization needs the float model.")
        found = data.validation(module)
        needed = None if o.validation_batches is None else o.validation_batches + o.calibration_batches
        batches = list(itertools.islice(found, needed)) if found is not None else []
        example = data.example(module, "val")
        float_module = module if self.recipe.backend == "torchao" else copy.deepcopy(module).cpu()
        recipe = make_recipe(self.recipe.backend, "ptq", self.recipe.base_config, example, owner=self.owner)
        prepared = prepare(float_module, recipe, example, owner=self.owner)
        calibration, held_out = batches[: o.calibration_batches], batches[o.calibration_batches :]
        data.metadata["calibration_samples"] = calibrate(prepared, calibration)
        self.recipe_used, self.name = recipe, name
        return export_with_options(prepared, float_module, held_out or calibration, example, data, o, name)


def _signature(module: nn.Module, example: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """Changes when the float weights (their storage or any in-place update) or the input shapes change."""
    tensors = tuple((n, t.data_ptr(), t._version) for n, t in module.state_dict(keep_vars=True).items())
    return tensors, tuple((tuple(t.shape[1:]), t.dtype) for t in example)


@register_quantizer(DynamicInt8Recipe)
class DynamicInt8Quantizer(Quantizer):
    """Dynamic int8: training is not touched and nothing is calibrated.

    What is quantized: ``submodule`` when given; else the only child holding parameters; else, when several children
    hold them (an embedding, a stack of blocks and a head side by side), the whole module, whose ``forward`` the int8
    copy then stands in for during runs of their own. At the end of ``fit`` the int8 copy is built by the fastest
    correct back-end, validated, timed and saved; in a ``predict``/``test``/``validate`` run it is built on the first
    batch and swapped in until the run ends (CPU only).
    """

    def __init__(self, recipe: Any, options: QuantizeOptions) -> None:
        super().__init__(recipe, options)
        self.choice: DynamicQuantization | None = None
        self._built: tuple[tuple[Any, ...], DynamicQuantization] | None = None
        self._swapped: tuple[str, nn.Module, nn.Module] | None = None  # (name, float module, int8 module)
        self._declined: nn.Module | None = None  # the module a run could not quantize (tried once per run)

    def target(self, root: nn.Module) -> tuple[str, nn.Module]:
        """The name (``""``: the whole module) and module quantized."""
        if self.options.submodule is not None:
            return resolve_submodule(self.owner, root, self.options.submodule)
        holders = [(n, c) for n, c in root.named_children() if next(c.parameters(), None) is not None]
        return holders[0] if len(holders) == 1 else ("", root)

    def _quantize(self, module: nn.Module, example: Any) -> tuple[DynamicQuantization, bool]:
        """The int8 copy of ``module`` (called as ``example``, a :class:`CapturedCall`, was: through its adapter) and
        whether it was chosen now (``False``: this process's earlier copy)."""
        if isinstance(example, CapturedCall):
            module, example = example.adapter(module), example.tensors
        signature = _signature(module, example)
        if self._built is not None and self._built[0] == signature:
            return self._built[1], False
        o = self.options
        same: dict[str, Any] = {name: getattr(o, name) for name in ("min_cosine", "min_agreement", "refresh")}
        timing = {"iterations": o.latency_iterations, "warmup": o.latency_warmup}
        choice = quantize_dynamic(module, example, self.recipe.backend, **same | timing)
        self.choice, self._built = choice, (signature, choice)
        return choice, True

    def run_batch(self, root: nn.Module, inputs: Any, stage: str) -> str | None:
        if self._swapped is not None:
            return None
        name, module = self.target(root)
        if self._declined is module:
            return None
        self._declined = module
        device = module_device(module)
        if device.type != "cpu":
            warn_once(
                f"`{self.owner}(mode='dynamic')` runs int8 on the CPU only; the model is on {device}: "
                "it runs in float, unchanged.",
                NoEffectWarning,
            )
            return None
        example = inputs(module)
        choice, fresh = self._quantize(module, example)  # a failure: the adapter's fallback, the run goes on
        if choice.module is None:
            warn_once(
                f"`{self.owner}(mode='dynamic')`: no int8 back-end was correct and faster than fp32 for "
                f"{name or type(root).__name__!r} on this CPU; the {stage} run goes on in float.\n{choice.describe()}",
                NoEffectWarning,
            )
            return None
        int8 = choice.module
        if isinstance(example, CapturedCall):  # the int8 adapter, called as the module is
            int8 = PositionalCall(int8, example, reverse=True)
        if name:
            replace_modules(root, [name], lambda m, _: int8, check_state_dict=False)
        else:  # the whole module: the int8 copy stands in for its forward (steps calling `self(...)`)
            root.__dict__["forward"] = int8
        self._swapped = (name, module, int8)
        return f"{self.owner}: {choice.describe()}" if fresh else None  # said once per choice

    def end_run(self, root: nn.Module, *, failed_fit: bool = False) -> None:
        self._declined = None
        if self._swapped is None:
            return
        name, module, int8 = self._swapped
        self._swapped = None
        if not name:
            if root.__dict__.get("forward") is int8:
                del root.__dict__["forward"]
            return
        try:
            current = root.get_submodule(name)
        except AttributeError:
            return
        if current is int8:
            replace_modules(root, [name], lambda m, _: module, check_state_dict=False)

    def finish(self, root: nn.Module, data: LoopData) -> DynamicReport:
        o = self.options
        name, module = self.target(root)
        if module_device(module).type != "cpu":
            module = copy.deepcopy(module).cpu()
        found = data.validation(module)
        batches = list(itertools.islice(found, o.validation_batches)) if found is not None else []
        with eval_mode(module):
            example = batches[0][0] if batches else data.example(module, "train")
            choice, _ = self._quantize(module, example)
            if isinstance(example, CapturedCall):  # validated and timed as the int8 copy was built: positionally
                batches = [(example.inputs_of(i.args, i.kwargs), labels) for i, labels in batches]
                module, example = example.adapter(module), example.tensors
            return export_dynamic(
                module,
                choice,
                example_inputs=example,
                validation_data=batches or None,
                min_agreement=o.min_agreement,
                **o.export_settings(data, name or None),
            )

    def __getstate__(self) -> dict[str, Any]:
        # The int8 copies and the swapped modules belong to this process's model.
        return {**self.__dict__, "_built": None, "_swapped": None, "_declined": None}
