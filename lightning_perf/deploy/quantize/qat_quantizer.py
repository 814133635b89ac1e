"""Quantization-aware training of one submodule: prepared before training, converted after it.

Entry point: :class:`QATQuantizer`, which carries out the x86 and torchao QAT recipes for
:class:`~lightning_perf.callbacks.QATCallback`. What it does across a run, and why the x86 graph is captured on the CPU:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.deploy.quantize import save
from lightning_perf.deploy.quantize.convert import convert, float_copy, restore_float
from lightning_perf.deploy.quantize.quantizer import (
    LoopData,
    QuantizeOptions,
    Quantizer,
    TorchaoQATRecipe,
    X86QATRecipe,
    register_quantizer,
    resolve_submodule,
)
from lightning_perf.deploy.validate import ValidationSummary, compare_models
from lightning_perf.functional.quantization.qat import (
    NothingToQuantizeError,
    QuantizationRecipe,
    batchnorm_modules,
    freeze_batchnorm_stats,
    is_prepared,
    make_recipe,
    prepare,
    quantization_state_keys,
    recipe_of,
    set_fake_quant,
    set_observers,
    with_state_versions,
)
from lightning_perf.functional.surgery import replace_modules

__all__ = ["QATQuantizer", "holds_tensors_of"]


def holds_tensors_of(prepared: nn.Module, module: nn.Module) -> bool:
    """Whether ``prepared`` (an x86 graph) holds ``module``'s own parameters and buffers, so putting it back in
    ``module``'s place trains and reads the same tensors."""
    held = prepared.state_dict(keep_vars=True)
    return all(held.get(key) is value for key, value in module.state_dict(keep_vars=True).items())


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    replace_modules(root, [name], lambda module, _: new, check_state_dict=False)


@register_quantizer(X86QATRecipe, TorchaoQATRecipe)
class QATQuantizer(Quantizer):
    """Quantization-aware training of one submodule of ``root`` (see the module notes)."""

    trains = True

    def __init__(self, recipe: Any, options: Any) -> None:
        super().__init__(recipe, options)
        self._float_module: nn.Module | None = None  # x86: what the prepared graph was captured from (shared params)
        self._applied: tuple[bool, bool, bool] | None = None
        self._eager_batchnorms: list[nn.Module] = []
        self._prepared_here = False  # put the prepared module in place in this run (undone at its end)
        self._prepared_module: nn.Module | None = None
        self._kept_graph: nn.Module | None = None
        self._state: dict[str, torch.Tensor] = {}
        self._before_fit: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------------------------------------- state

    @property
    def quantization_state(self) -> dict[str, torch.Tensor]:
        """The observer and fake-quantize state (keys relative to the submodule): from the prepared submodule while
        it is in the model, else the state kept since the last run ended."""
        module = self._prepared_module
        if self._prepared_here and module is not None and is_prepared(module):
            current = module.state_dict()
            return {key: current[key] for key in quantization_state_keys(module)}
        return dict(self._state)

    def prepared(self, root: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
        if self.recipe_used is None or self.name is None:
            return super().prepared(root)
        return self._prepared(root)

    @contextlib.contextmanager
    def _prepared(self, root: nn.Module) -> Iterator[nn.Module]:
        """Put the prepared submodule into ``root``; the plain one back on exit (when it was not there already)."""
        assert self.name is not None
        ours = not self._prepared_here and not is_prepared(root.get_submodule(self.name))
        if ours:
            self._reinstall(root)
        try:
            yield root.get_submodule(self.name)
        finally:
            if ours:
                self._restore(root)

    # ---------------------------------------------------------------------------------------------- preparing

    def _check_same_settings(self, name: str, recipe: QuantizationRecipe) -> None:
        if (recipe.backend, recipe.mode, recipe.base_config) != (self.recipe.backend, "qat", self.recipe.base_config):
            raise ValueError(
                f"`{self.owner}(backend={self.recipe.backend!r})`: {name!r} was already prepared with "
                f"{recipe.to_dict()}. Quantize a fresh model, or use the same settings."
            )

    def begin_fit(self, root: nn.Module, data: LoopData) -> str | None:
        state = {k: v.clone() for k, v in self._state.items()}
        self._before_fit = (self.recipe_used, self.name, self._float_module, self._kept_graph, state)
        name, module = resolve_submodule(self.owner, root, self.options.submodule)
        if is_prepared(module):  # prepared outside a Trainer (`load_checkpoint`): it goes on training as it is
            recipe = recipe_of(module)
            assert recipe is not None
            self._check_same_settings(name, recipe)
            self.recipe_used, self.name = recipe, name
            self._collect_batchnorms(module)
            return None
        if self.recipe_used is not None and self.name == name:
            self._check_same_settings(name, self.recipe_used)  # a later fit goes on from the last one's state
            self._reinstall(root)
            return None
        example = data.example(module, "train")
        recipe = make_recipe(self.recipe.backend, "qat", self.recipe.base_config, example, owner=self.owner)
        try:
            self._install(root, name, module, recipe, example)
        except NothingToQuantizeError as exc:
            warn_once(f"{self.owner}: {exc} Training goes on in float, unchanged.", NoEffectWarning)
            return None
        return (
            f"{self.owner}: prepared {name!r} ({type(module).__name__}) for quantization-aware training with backend "
            f"{recipe.backend!r}; example input shapes {[list(s) for s in recipe.input_shapes]}."
        )

    def _install(self, root: nn.Module, name: str, module: nn.Module, recipe: QuantizationRecipe, example: Any) -> None:
        prepared = prepare(module, recipe, example, owner=self.owner)
        if prepared is not module:
            _replace(root, name, prepared)
        self.name = name
        self._in_place(prepared, module if recipe.backend == "x86" else None, recipe)
        if recipe.backend == "torchao" and self.options.disable_observers_after is not None:
            warn_once(
                f"`{self.owner}(backend='torchao', disable_observers_after=...)` has no effect: torchao's QAT "
                "configs quantize activations dynamically and have no observers.",
                NoEffectWarning,
            )

    def _reinstall(self, root: nn.Module, recipe: QuantizationRecipe | None = None) -> None:
        """Put the prepared submodule back into the plain model: the kept graph when it still holds the float
        module's own tensors, else a new preparation of the float module loaded with the kept quantization state."""
        recipe = recipe or self.recipe_used
        assert recipe is not None and self.name is not None
        name, module = resolve_submodule(self.owner, root, self.name)
        if is_prepared(module):
            return
        graph = self._kept_graph
        if graph is not None and recipe_of(graph) == recipe and holds_tensors_of(graph, module):
            graph.train(module.training)
            _replace(root, name, graph)
            self._in_place(graph, module, recipe)
            return
        self._install(root, name, module, recipe, None)
        prepared = root.get_submodule(name)
        state, expected = self._state, quantization_state_keys(prepared)
        if state and set(state) != set(expected):
            kept = self._kept_graph, self._state
            self._restore(root)
            self._kept_graph, self._state = kept
            raise ValueError(
                f"`{self.owner}`: the quantization state kept from the last run ({len(state)} tensors) does "
                f"not fit {name!r} as prepared now ({len(expected)} tensors): the submodule was replaced by another "
                "kind of model. Use a new QATCallback for it."
            )
        if state:
            prepared.load_state_dict(with_state_versions(prepared, state), strict=False)

    def _restore(self, root: nn.Module) -> None:
        """Put the plain float submodule (same parameters, trained) back and keep the quantization state."""
        name, module = self.name, self._prepared_module
        if self._prepared_here and name is not None and module is not None and is_prepared(module):
            current = module.state_dict()
            self._state = {k: current[k].detach().clone() for k in quantization_state_keys(module)}
            self._kept_graph = module if isinstance(module, torch.fx.GraphModule) else None
            plain = restore_float(module, self._float_module)
            if root.get_submodule(name) is module and plain is not module:
                _replace(root, name, plain)
            self._float_module = plain if self._kept_graph is not None else None
        self._prepared_here, self._prepared_module, self._eager_batchnorms = False, None, []

    def _in_place(self, prepared: nn.Module, float_module: nn.Module | None, recipe: QuantizationRecipe) -> None:
        """Record that ``prepared`` (made from ``float_module`` with ``recipe``) now stands in the model."""
        self._float_module, self.recipe_used = float_module, recipe
        self._applied = None
        self._prepared_here, self._prepared_module = True, prepared
        self._collect_batchnorms(prepared)

    def _collect_batchnorms(self, prepared: nn.Module) -> None:
        eager = self.options.freeze_bn_after is not None and not isinstance(prepared, torch.fx.GraphModule)
        self._eager_batchnorms = batchnorm_modules(prepared) if eager else []

    def begin_run(self, root: nn.Module) -> None:
        if self.recipe_used is not None and self.name is not None:
            self._reinstall(root)  # validate/test/predict the QAT model

    def end_run(self, root: nn.Module, *, failed_fit: bool = False) -> None:
        self._restore(root)
        if failed_fit and self._before_fit is not None:
            self.recipe_used, self.name, self._float_module, self._kept_graph, state = self._before_fit
            self._state = state
            if self._kept_graph is not None and state:
                self._kept_graph.load_state_dict(with_state_versions(self._kept_graph, state), strict=False)
        self._before_fit, self._applied = None, None

    # ---------------------------------------------------------------------------------------------- schedules

    def schedules_per_step(self) -> bool:
        return self.options.schedule_unit == "step" or bool(self._eager_batchnorms)

    def schedule(self, root: nn.Module, progress: int) -> str | None:
        if self.name is None:
            return None
        o = self.options
        observers = o.disable_observers_after is None or progress < o.disable_observers_after
        bn_frozen = o.freeze_bn_after is not None and progress >= o.freeze_bn_after
        wanted = (observers, bn_frozen, progress >= o.fake_quant_after)
        line = None
        if wanted != self._applied:
            module = root.get_submodule(self.name)
            if self.recipe.backend == "x86":
                set_observers(module, observers)
            if isinstance(module, torch.fx.GraphModule):
                freeze_batchnorm_stats(module, bn_frozen)
            set_fake_quant(module, wanted[2])
            if self._applied is not None:
                line = (
                    f"{self.owner}: at {o.schedule_unit} {progress}: observers {'on' if observers else 'off'}, "
                    f"batch-norm statistics {'frozen' if bn_frozen else 'updating'}, fake quantization "
                    f"{'on' if wanted[2] else 'off'}."
                )
            self._applied = wanted
        if bn_frozen:
            for layer in self._eager_batchnorms:  # `model.train()` puts them back in training mode each epoch
                if layer.training:
                    layer.eval()
        return line

    # ------------------------------------------------------------------------------------------- conversions

    def check_converted(self, root: nn.Module, data: LoopData) -> ValidationSummary | None:
        if self.name is None:
            return None
        module = root.get_submodule(self.name)
        batches = data.validation(module)
        if batches is None:
            warn_once(f"`{self.owner}(eval_converted_every_n_epochs=...)` needs validation data.")
            return None
        # In eval mode nothing moves: observers pause, batch norm uses its running statistics.
        return compare_models(
            module,
            convert(module),
            batches,
            max_batches=self.options.validation_batches,
            min_cosine=self.options.min_cosine,
        )

    def finish(self, root: nn.Module, data: LoopData) -> save.QuantizationReport | None:
        if self.name is None:
            return None  # nothing was prepared in this run
        module = root.get_submodule(self.name)
        if not is_prepared(module):
            return None
        found = data.validation(module)
        batches = list(itertools.islice(found, self.options.validation_batches)) if found is not None else []
        return export_with_options(module, self._float_module, batches, None, data, self.options, self.name)

    # -------------------------------------------------------------------------------------------- checkpoints

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("recipe") is not None and self.recipe_used is None:
            self.recipe_used = QuantizationRecipe.from_dict(state["recipe"])
        self.name = state.get("submodule") or self.name

    def save_checkpoint(self, root: nn.Module, entry: dict[str, Any], weights: dict[str, Any]) -> None:
        if self.name is None:
            return
        name = self.name
        module = root.get_submodule(name)
        if is_prepared(module):
            # The plain model's keys stay in `state_dict`; the observer / fake-quantize state rides in this entry.
            keys = [f"{name}.{key}" for key in quantization_state_keys(module)]
            state = {k: weights.pop(k) for k in keys if k in weights}
        else:  # saved after a run, the model plain again: the state kept here
            state = {f"{name}.{k}": v.clone() for k, v in self._state.items()}
        entry["quantization_state"] = state

    def before_weights_load(self, root: nn.Module, entry: Mapping[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
        recipe_data = entry.get("recipe")
        name, module = resolve_submodule(self.owner, root, entry.get("submodule") or self.name)
        if recipe_data is not None and recipe_data.get("mode") == "qat":
            recipe = QuantizationRecipe.from_dict(recipe_data)
            graph = self._kept_graph
            reuse = graph is not None and recipe_of(graph) == recipe and not is_prepared(module)
            if reuse and holds_tensors_of(graph, module):  # type: ignore[arg-type]
                self.name = name
                self._reinstall(root, recipe)  # the checkpoint's quantization state is loaded next
                module = root.get_submodule(name)
            if recipe_of(module) != recipe:
                float_module = module if not is_prepared(module) else self._float_source(module)
                self._install(root, name, float_module, recipe, None)
                module = root.get_submodule(name)
            self.recipe_used, self.name = recipe, name
            for key, value in (entry.get("quantization_state") or {}).items():
                weights.setdefault(key, value)
        if not is_prepared(module):
            return weights
        current = module.state_dict()
        for key in quantization_state_keys(module):
            weights.setdefault(f"{name}.{key}", current[key])
        # A checkpoint saved from the plain model lacks the observers' state versions: give them, or loading resets
        # their `eps` (see `with_state_versions`).
        return with_state_versions(module, weights, prefix=name)

    def _float_source(self, module: nn.Module) -> nn.Module:
        recipe = recipe_of(module)
        if recipe is not None and recipe.backend == "torchao":
            return float_copy(module)
        if self._float_module is None:
            raise ValueError(
                f"`{self.owner}`: the model was prepared with {recipe.to_dict() if recipe else None} but the "
                "checkpoint needs another recipe, and the float module it came from is unknown. Load the checkpoint "
                "into a fresh model."
            )
        return self._float_module

    def __getstate__(self) -> dict[str, Any]:
        # The float module, the layer list and the graphs belong to this process's model (an exported model does not
        # pickle: torch.export's guard module holds a local function).
        dropped = dict.fromkeys(("_float_module", "_prepared_module", "_kept_graph", "_before_fit"))
        return {**self.__dict__, **dropped, "_eager_batchnorms": []}


def export_with_options(
    prepared: nn.Module,
    float_module: nn.Module | None,
    validation: list[Any],
    example: Any,
    data: LoopData,
    options: QuantizeOptions,
    name: str,
) -> save.QuantizationReport:
    """:func:`~lightning_perf.deploy.quantize.save.export_quantized` with a quantizer's options."""
    return save.export_quantized(
        prepared,
        float_model=float_module,
        validation_data=validation,
        example_inputs=example,
        onnx=options.onnx,
        **options.export_settings(data, name),
    )
