"""Quantization-aware training (QAT) and post-training quantization (PTQ) of a plain ``nn.Module`` with torchao.

Two backends:

- ``"x86"``, for CNNs and general models deployed on CPUs: PT2E. The module is captured with ``torch.export``
  (batch dimension dynamic), prepared with torchao's ``X86InductorQuantizer`` (``prepare_qat_pt2e``, or
  ``prepare_pt2e`` for PTQ), trained or calibrated, and converted with ``convert_pt2e``. The converted model is an
  int8 q/dq graph that is fast only once lowered by inductor with weight freezing (``torch.compile`` under
  ``torch._inductor.config.patch(freezing=True)``); run as is, it is slower than the float model.
- ``"torchao"``, for Linear-heavy models (transformers): ``quantize_(model, QATConfig(base_config, step="prepare"))``
  swaps ``nn.Linear`` for fake-quantized linears in place (parameter names unchanged), and
  ``QATConfig(base_config, step="convert")`` produces the quantized model. ``base_config`` is a torchao PTQ config
  object or its YAML-able spec (:func:`resolve_base_config`).

A :class:`QuantizationRecipe` records what was done (backend, mode, base config, per-sample input shapes and dtypes)
as plain data, so a checkpoint can carry it and the same preparation can be repeated before weights are loaded.

Exported modules refuse ``.train()`` / ``.eval()``; the x86 prepared model is a :class:`PreparedGraphModule`, whose
graph follows its ``training`` flag (set by ``train()`` / ``eval()`` or assigned directly, as Lightning does after
validation): batch-norm and dropout nodes switch between training and inference behaviour (batch norm stays in
inference behaviour once :func:`freeze_batchnorm_stats` was called) and observers pause in eval mode. Its
``state_dict`` keys are the float module's plus the observer and fake-quantize state
(``activation_post_process_<i>.*``), which :func:`quantization_state_keys` names.

:func:`export_quantized` is the end-of-training step: convert a copy, validate it against the fake-quantized (or
calibrated) model on real batches, save it atomically with ``torch.export.save``, time it against the float model
(both compiled, batch 1 and 32 by default) and write a JSON report beside it.

torchao is imported only inside the functions that need it; a missing torchao raises ``ModuleNotFoundError`` naming
the ``qat`` extra.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import itertools
import math
import os
import shutil
import tempfile
import time
import typing
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import module_device
from lightning_perf._imports import require
from lightning_perf._io import atomic_path
from lightning_perf._warnings import FallbackWarning
from lightning_perf.functional.export import _flat_outputs, _latency, as_input_tuple, split_inputs
from lightning_perf.profiling import write_json

__all__ = [
    "BACKENDS",
    "MODES",
    "SUPPORTED_BASE_CONFIGS",
    "LatencyRow",
    "NothingToQuantizeError",
    "PreparedGraphModule",
    "QuantizationError",
    "QuantizationRecipe",
    "QuantizationReport",
    "ValidationSummary",
    "base_config_spec",
    "batchnorm_modules",
    "calibrate",
    "compare_models",
    "compiled_latency",
    "convert",
    "export_quantized",
    "float_copy",
    "freeze_batchnorm_stats",
    "is_prepared",
    "make_recipe",
    "prepare",
    "quantization_state_keys",
    "recipe_of",
    "resolve_base_config",
    "save_quantized",
    "set_fake_quant",
    "set_observers",
]

BACKENDS: tuple[str, ...] = ("x86", "torchao")
MODES: tuple[str, ...] = ("qat", "ptq")

#: torchao PTQ configs that ``QATConfig`` can derive fake quantization from (torchao 0.18). The first is the default
#: of the ``torchao`` backend: int8 per-token dynamic activations, int8 weights in groups of 32.
SUPPORTED_BASE_CONFIGS: tuple[str, ...] = (
    "Int8DynamicActivationIntxWeightConfig",
    "IntxWeightOnlyConfig",
    "Int4WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8DynamicActivationInt4WeightConfig",
)

_RECIPE_VERSION = 1
_INFO_KEY = "lightning_perf_quantization"  # where a prepared module keeps its recipe and float state keys
_OWNER = "QATCallback"


class QuantizationError(RuntimeError):
    """Capturing, preparing, converting or saving a model for quantization failed (the cause is chained)."""


class NothingToQuantizeError(QuantizationError):
    """The backend found no layer it quantizes in the model (e.g. ``x86`` in a network of 3D convolutions)."""


# ----------------------------------------------------------------------------------------------- base configs


def _torchao_namespace() -> dict[str, Any]:
    """Classes a spec may name: torchao.quantization's configs and granularities."""
    quantization = require("torchao", f"{_OWNER}(backend='torchao')").quantization
    return {name: getattr(quantization, name) for name in dir(quantization) if name[:1].isupper()}


def _type_options(hint: Any) -> list[Any]:
    """The alternatives of a type hint (``Optional[X]`` -> ``[X, NoneType]``)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return [option for arg in typing.get_args(hint) for option in _type_options(arg)]
    return [hint]


def _construct(name: str, args: Any, namespace: Mapping[str, Any], where: str) -> Any:
    cls = namespace.get(name)
    if not isinstance(cls, type):
        raise ValueError(f"{where}: {name!r} is not a class of torchao.quantization.")
    if isinstance(args, Mapping):
        return cls(**_coerce_kwargs(cls, args, namespace, where))
    if isinstance(args, (list, tuple)):
        return cls(*args)
    return cls() if args is None else cls(args)


def _coerce_kwargs(cls: type, kwargs: Mapping[str, Any], namespace: Mapping[str, Any], where: str) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: pass the values through unconverted
        hints = {}
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    out = {}
    for key, value in kwargs.items():
        if fields is not None and key not in fields:
            raise ValueError(f"{where}: {cls.__name__} has no field {key!r}. Its fields: {', '.join(sorted(fields))}.")
        out[key] = _coerce(value, hints.get(key), namespace, f"{where}.{key}")
    return out


def _coerce(value: Any, hint: Any, namespace: Mapping[str, Any], where: str) -> Any:
    """Turn a YAML value into what the field's type hint wants: dtype names, enum names, ``{Class: args}``."""
    options = _type_options(hint) if hint is not None else []
    classes = [o for o in options if isinstance(o, type)]
    if isinstance(value, Mapping) and len(value) == 1:
        ((name, args),) = value.items()
        if isinstance(name, str) and name in namespace:
            return _construct(name, args, namespace, where)
    if not isinstance(value, str):
        return value
    if torch.dtype in classes:
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
        raise ValueError(f"{where}={value!r} is not a torch dtype. Expected a name such as 'int8', 'int4', 'bfloat16'.")
    for option in classes:
        if issubclass(option, enum.Enum):
            for member in option:
                if value.lower() in (member.name.lower(), str(member.value).lower()):
                    return member
            raise ValueError(
                f"{where}={value!r} is not a {option.__name__}. Expected one of: {', '.join(m.name for m in option)}."
            )
    if value in namespace and any(
        isinstance(namespace[value], type) and issubclass(namespace[value], c) for c in classes
    ):
        return namespace[value]()
    return value


def resolve_base_config(spec: Any, owner: str = _OWNER) -> Any:
    """A torchao PTQ config object from ``spec``, checked to be usable as a ``QATConfig`` base config.

    ``spec`` is one of:

    - a torchao config object, e.g. ``Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4)``;
    - a class name of :mod:`torchao.quantization`, e.g. ``"Int8DynamicActivationIntxWeightConfig"`` (its defaults);
    - ``{class name: {field: value}}``, the YAML form. Values are converted by the field's type: a dtype by name
      (``"int4"``), an enum member by name (``"SYMMETRIC"``), an object as ``{class name: args}`` where args is a
      dict of keyword arguments, a list of positional ones or a single value, e.g.
      ``{"Int8DynamicActivationIntxWeightConfig": {"weight_dtype": "int4", "weight_granularity": {"PerGroup": 32}}}``.

    ``None`` means the default, ``Int8DynamicActivationIntxWeightConfig()``.

    Raises:
        ValueError: for an unknown class or field, a value that does not convert, or a config that torchao cannot
            derive fake quantization from (its message is included).
        ModuleNotFoundError: if torchao is not installed.
    """
    namespace = _torchao_namespace()
    where = f"`{owner}(base_config={spec!r})`"
    if spec is None:
        spec = SUPPORTED_BASE_CONFIGS[0]
    if isinstance(spec, str):
        spec = {spec: {}}
    if isinstance(spec, Mapping):
        if len(spec) != 1 or not isinstance(next(iter(spec)), str):
            raise ValueError(
                f"{where} is not valid. Expected a class name, or {{class name: {{field: value}}}} with one class."
            )
        ((name, kwargs),) = spec.items()
        if name not in namespace or not isinstance(namespace[name], type):
            raise ValueError(
                f"{where}: {name!r} is not a torchao.quantization config. Expected one of: "
                f"{', '.join(SUPPORTED_BASE_CONFIGS)}."
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"{where}: the arguments of {name} must be a dict of field values, got {kwargs!r}.")
        try:
            config = namespace[name](**_coerce_kwargs(namespace[name], kwargs or {}, namespace, where))
        except (TypeError, AssertionError) as exc:
            raise ValueError(f"{where} is not a valid {name}: {exc}") from None
    else:
        config = spec
    core = require("torchao", f"{owner}(backend='torchao')").core.config
    if not isinstance(config, core.AOBaseConfig):
        raise ValueError(f"{where} is not a torchao config. Expected e.g. {SUPPORTED_BASE_CONFIGS[0]!r}.")
    from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs

    try:
        _infer_fake_quantize_configs(config)
    except (ValueError, AssertionError) as exc:
        raise ValueError(
            f"{where}: torchao cannot train {type(config).__name__} with QAT ({exc or 'unsupported settings'}). "
            f"Supported base configs: {', '.join(SUPPORTED_BASE_CONFIGS)}."
        ) from None
    return config


def _plain(value: Any) -> Any:
    """A config value as YAML-able data (the inverse of :func:`_coerce`)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__name__: {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"The config value {value!r} has no YAML form.")


def base_config_spec(config: Any) -> dict[str, Any]:
    """The YAML-able spec of a torchao config: ``{class name: {field: value}}`` with the fields that differ from
    the class defaults (so specs written by different torchao versions compare equal when they mean the same)."""
    fields = {}
    defaults = type(config)()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _plain(value) != _plain(getattr(defaults, f.name)):
            fields[f.name] = _plain(value)
    return {type(config).__name__: fields}


# ----------------------------------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class QuantizationRecipe:
    """What a quantization did, as plain data: enough to prepare a fresh copy of the model identically.

    Attributes:
        backend: ``"x86"`` (PT2E) or ``"torchao"`` (``quantize_`` + ``QATConfig``).
        mode: ``"qat"`` or ``"ptq"``.
        base_config: the torchao base config's spec (``torchao`` backend), else ``None``.
        input_shapes: per-sample shape of each positional model input (without the batch dimension).
        input_dtypes: dtype name of each input.
    """

    backend: str
    mode: str
    base_config: Mapping[str, Any] | None
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]

    def example_inputs(self, batch_size: int = 2) -> tuple[Tensor, ...]:
        """Zero tensors of the recorded shapes and dtypes (values do not matter for capture)."""
        return tuple(
            torch.zeros((batch_size, *shape), dtype=getattr(torch, dtype))
            for shape, dtype in zip(self.input_shapes, self.input_dtypes)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": _RECIPE_VERSION,
            "backend": self.backend,
            "mode": self.mode,
            "base_config": None if self.base_config is None else copy.deepcopy(dict(self.base_config)),
            "input_shapes": [list(s) for s in self.input_shapes],
            "input_dtypes": list(self.input_dtypes),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationRecipe:
        """Rebuild from :meth:`to_dict` output (as stored in a checkpoint).

        Raises:
            ValueError: if the data is not a recipe this version understands.
        """
        try:
            version = int(data.get("version", 0))
            if version > _RECIPE_VERSION:
                raise ValueError(f"recipe version {version} is newer than this lightning_perf's ({_RECIPE_VERSION})")
            return make_recipe(
                backend=data["backend"],
                mode=data["mode"],
                base_config=data.get("base_config"),
                input_shapes=data["input_shapes"],
                input_dtypes=data["input_dtypes"],
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"Not a quantization recipe: {dict(data)!r} ({type(exc).__name__}: {exc}).") from None


def _check_choice(name: str, value: Any, choices: Sequence[str], owner: str) -> None:
    if value not in choices:
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected one of: {', '.join(map(repr, choices))}.")


def make_recipe(
    backend: str = "x86",
    mode: str = "qat",
    base_config: Any = None,
    example_inputs: Any = None,
    *,
    input_shapes: Sequence[Sequence[int]] | None = None,
    input_dtypes: Sequence[str] | None = None,
    owner: str = "make_recipe",
) -> QuantizationRecipe:
    """Check the options and record them with the inputs' per-sample shapes and dtypes.

    Args:
        backend: ``"x86"`` or ``"torchao"``.
        mode: ``"qat"`` or ``"ptq"``.
        base_config: for ``torchao``, see :func:`resolve_base_config` (``None``: its default); must be ``None`` for
            ``x86``.
        example_inputs: a tensor or tuple of tensors with a batch dimension; or give ``input_shapes`` (and
            ``input_dtypes``, default float32).

    Raises:
        ValueError: for an unknown backend or mode, a base config given to ``x86`` or invalid for ``torchao``, or
            missing/invalid inputs.
    """
    _check_choice("backend", backend, BACKENDS, owner)
    _check_choice("mode", mode, MODES, owner)
    spec: dict[str, Any] | None = None
    if backend == "torchao":
        spec = base_config_spec(resolve_base_config(base_config, owner))
    elif base_config is not None:
        raise ValueError(
            f"`{owner}(backend='x86', base_config={base_config!r})`: the x86 backend uses torchao's "
            "X86InductorQuantizer (int8 activations and per-channel int8 weights) and takes no base config. Use "
            "backend='torchao' to choose a torchao config."
        )
    if example_inputs is not None:
        inputs = as_input_tuple(example_inputs, f"`{owner}(example_inputs)`")
        shapes = tuple(tuple(int(s) for s in t.shape[1:]) for t in inputs)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in inputs)
    elif input_shapes is not None:
        shapes = tuple(tuple(int(s) for s in shape) for shape in input_shapes)
        dtypes = tuple(input_dtypes) if input_dtypes is not None else ("float32",) * len(shapes)
    else:
        raise ValueError(f"`{owner}()` needs example_inputs or input_shapes.")
    if not shapes or len(dtypes) != len(shapes) or any(any(s < 1 for s in shape) for shape in shapes):
        raise ValueError(f"`{owner}`: input shapes {shapes!r} / dtypes {dtypes!r} are not valid.")
    for dtype in dtypes:
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"`{owner}`: {dtype!r} is not a torch dtype name.")
    return QuantizationRecipe(backend, mode, spec, shapes, tuple(str(d) for d in dtypes))


# ------------------------------------------------------------------------------------ prepared-module bookkeeping


def _info(module: nn.Module) -> dict[str, Any] | None:
    # Graph modules rebuild themselves on deepcopy from their graph and `meta`; other modules copy their __dict__.
    holder = module.meta if isinstance(module, torch.fx.GraphModule) else module.__dict__
    return holder.get(_INFO_KEY)


def _set_info(module: nn.Module, **info: Any) -> None:
    holder = module.meta if isinstance(module, torch.fx.GraphModule) else module.__dict__
    holder.setdefault(_INFO_KEY, {}).update(info)


def recipe_of(module: nn.Module) -> QuantizationRecipe | None:
    """The recipe a module was prepared (or converted) with by this module, or ``None``."""
    info = _info(module)
    return None if info is None else info["recipe"]


def is_prepared(module: nn.Module) -> bool:
    """Whether ``module`` was prepared for QAT/PTQ by :func:`prepare` and not converted."""
    info = _info(module)
    return info is not None and not info.get("converted", False)


def quantization_state_keys(module: nn.Module) -> list[str]:
    """The ``state_dict`` keys of a prepared module that its float module did not have (observer, fake-quantize
    state); empty for a module that is not prepared."""
    info = _info(module)
    if info is None:
        return []
    float_keys = set(info["float_keys"])
    return [k for k in module.state_dict() if k not in float_keys]


# -------------------------------------------------------------------------------- exported train / eval switching

_aten = torch.ops.aten
# Index of the `training`/`train` flag in the schema of each op whose behaviour depends on it.
_BATCH_NORM_FLAG = {_aten.batch_norm.default: 5}
_DROPOUT_FLAG = {
    op: 2
    for op in (
        _aten.dropout.default,
        _aten.dropout_.default,
        _aten.feature_dropout.default,
        _aten.feature_dropout_.default,
        _aten.alpha_dropout.default,
        _aten.alpha_dropout_.default,
        _aten.feature_alpha_dropout.default,
        _aten.feature_alpha_dropout_.default,
    )
}
# Batch norm in other IR forms; the flag rewrite does not know these and leaves it to torchao's pattern rewrite.
_OTHER_BATCH_NORMS = {
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit_no_training.default,
    _aten._native_batch_norm_legit_functional.default,
    _aten.native_batch_norm.default,
    _aten.cudnn_batch_norm.default,
}


def _set_exported_mode(gm: torch.fx.GraphModule, training: bool, freeze_bn: bool) -> None:
    """Switch batch norm and dropout nodes of an exported graph between training and inference behaviour.

    torchao's ``move_exported_model_to_train/_eval`` do this by matching patterns, which exports six small
    programs per switch (seconds; Lightning switches around every validation) and would undo frozen batch-norm
    statistics. Here each op's ``training`` flag is set directly: batch norm trains only when ``training`` and not
    ``freeze_bn`` (frozen statistics: normalize with the running estimates, the PT2E recipe for freezing BN in QAT).
    """
    if any(node.target in _OTHER_BATCH_NORMS for node in gm.graph.nodes):
        pt2e = require("torchao", "PreparedGraphModule.train").quantization.pt2e
        (pt2e.move_exported_model_to_train if training else pt2e.move_exported_model_to_eval)(gm)
        return
    changed = False
    bn_training = training and not freeze_bn
    wanted: bool | int
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _BATCH_NORM_FLAG:
            index, wanted = _BATCH_NORM_FLAG[node.target], bn_training
        elif node.target in _DROPOUT_FLAG:
            index, wanted = _DROPOUT_FLAG[node.target], training
        elif _counts_batches(node):
            index, wanted = 1, int(bn_training)  # `num_batches_tracked += 1` is a node of its own: add 0 instead
        else:
            continue
        if len(node.args) > index and (node.args[index] != wanted or type(node.args[index]) is not type(wanted)):
            node.args = (*node.args[:index], wanted, *node.args[index + 1 :])
            changed = True
    gm.__dict__["_exported_training"] = training  # torchao's own record of the mode
    if changed:
        gm.recompile()


def _counts_batches(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a batch norm's ``num_batches_tracked.add_(1)`` (or ``add_(0)`` once switched)."""
    if node.target is not _aten.add_.Tensor or len(node.args) < 2 or node.args[1] not in (0, 1):
        return False
    target = node.args[0]
    return (
        isinstance(target, torch.fx.Node)
        and target.op == "get_attr"
        and str(target.target).endswith("num_batches_tracked")
    )


class PreparedGraphModule(torch.fx.GraphModule):
    """An exported, PT2E-prepared model whose graph follows its ``training`` flag like an eager module.

    The graph's batch-norm and dropout nodes take their training or inference behaviour (batch norm stays in
    inference behaviour while its statistics are frozen, see :func:`freeze_batchnorm_stats`), and the fake-quantize
    observers pause in eval mode (evaluation never moves the quantization ranges; in train mode they follow
    :func:`set_observers`). The switch happens in ``train()`` / ``eval()`` and, should the flag have been set
    directly (Lightning restores the mode of every submodule after validation by assigning ``module.training``), at
    the next call. Python branches on ``self.training`` inside the original model were fixed when it was captured.
    Not created directly: :func:`prepare` returns it.
    """

    def train(self, mode: bool = True) -> PreparedGraphModule:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        super().train(mode)
        _sync_mode(self)
        return self

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_lightning_perf_mode") != _wanted_mode(self):
            _sync_mode(self)
        return super()._call_impl(*args, **kwargs)


def _wanted_mode(gm: torch.fx.GraphModule) -> tuple[bool, bool, bool]:
    info = _info(gm) or {}
    return gm.training, bool(info.get("bn_frozen", False)), bool(info.get("observers", True))


@torch.compiler.disable
def _sync_mode(gm: torch.fx.GraphModule) -> None:
    """Make the graph and the observers match the module's training flag and settings (a no-op when they do)."""
    training, bn_frozen, observers = wanted = _wanted_mode(gm)
    _set_exported_mode(gm, training, freeze_bn=bn_frozen)
    _switch_observers(gm, training and observers)
    gm.__dict__["_lightning_perf_mode"] = wanted


def _as_prepared_graph_module(gm: torch.fx.GraphModule) -> PreparedGraphModule:
    """Make ``gm`` (in place) a :class:`PreparedGraphModule`.

    Every GraphModule has a class of its own named ``GraphModuleImpl`` (``GraphModule.__new__``) that carries its
    generated ``forward``; the new one derives from :class:`PreparedGraphModule` instead, so ``deepcopy`` (which
    re-creates the first class in the MRO not named ``GraphModuleImpl``) keeps it.
    """
    gm.__class__ = type("GraphModuleImpl", (PreparedGraphModule,), {})
    _allow_train_eval(gm)
    gm.recompile()
    return gm  # type: ignore[return-value]


def _allow_train_eval(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove the instance-level ``train``/``eval`` that torchao installs to refuse them (``nn.Module``'s apply)."""
    gm.__dict__.pop("train", None)
    gm.__dict__.pop("eval", None)
    return gm


# ---------------------------------------------------------------------------------------- torchao speed-ups


_PATTERN_CACHE: dict[Any, torch.fx.GraphModule] = {}


def _tensor_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    return value


def _pattern_key(pattern: Any, example_inputs: Sequence[Any], is_cuda: bool, kwargs: Mapping[str, Any]) -> Any:
    fn = getattr(pattern, "fn", pattern)  # torchao wraps some patterns in a WrapperModule(fn)
    closure = tuple(cell.cell_contents for cell in (fn.__closure__ or ()))
    if any(isinstance(value, Tensor) for value in closure):
        raise TypeError("a pattern closing over a tensor depends on its values: not cached")
    key = (
        type(pattern),
        fn.__code__,
        closure,
        fn.__defaults__,
        tuple(_tensor_meta(x) for x in example_inputs),
        is_cuda,
        tuple(sorted((k, _tensor_meta(v)) for k, v in kwargs.items())),
    )
    hash(key)
    return key


_CONV_OPS = {name: getattr(_aten, name) for name in ("conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d")}


@contextlib.contextmanager
def _fast_pattern_matching() -> Iterator[None]:
    """Make torchao's PT2E prepare and convert steps fast, without changing what they compute.

    Conv-BN fusion (``prepare_qat_pt2e``) and folding (``convert_pt2e``) build their match and replacement patterns
    by ``torch.export``-ing small functions: for every kind of convolution (1d, 2d, transposed 1d/2d) whether the
    model has one or not: 12 exports in prepare and 96 in convert (a convert takes 12 s on a quiet 2-core CPU). Within
    this context (1) each pattern is exported once per process and reused (a pattern is a pure function of its code, its
    closure and the shapes and dtypes of its example inputs; a deep copy is handed out each time) and (2) the
    per-kind passes skip convolution kinds the graph does not contain, which cannot match: the same convert then
    takes about 4 s the first time in a process and 0.3 s after. Should torchao's internals move, the context does
    nothing and the steps run as they are.
    """
    try:
        from torchao.quantization.pt2e import qat_utils, utils
    except ImportError:
        yield
        return
    patches: list[tuple[Any, str, Any]] = []
    original_export = getattr(utils, "_get_aten_graph_module_for_pattern", None)
    if original_export is not None:

        def cached_export(pattern: Any, example_inputs: Any, is_cuda: bool = False, **kwargs: Any) -> Any:
            try:
                key = _pattern_key(pattern, example_inputs, is_cuda, kwargs)
            except (AttributeError, TypeError):
                return original_export(pattern, example_inputs, is_cuda, **kwargs)
            if key not in _PATTERN_CACHE:
                _PATTERN_CACHE[key] = original_export(pattern, example_inputs, is_cuda, **kwargs)
            return _quiet_deepcopy(_PATTERN_CACHE[key])

        patches += [(utils, "_get_aten_graph_module_for_pattern", cached_export)]
        if getattr(qat_utils, "_get_aten_graph_module_for_pattern", None) is original_export:
            patches += [(qat_utils, "_get_aten_graph_module_for_pattern", cached_export)]

    def skip_absent_kinds(helper: Any) -> Any:
        def run(m: torch.fx.GraphModule, conv_fn: Any, *args: Any, **kwargs: Any) -> Any:
            ops = {getattr(node.target, "overloadpacket", None) for node in m.graph.nodes if node.op == "call_function"}
            present = {name for name, op in _CONV_OPS.items() if op in ops}
            generic = _aten.convolution in ops
            if present and not generic and getattr(conv_fn, "__name__", None) not in present:
                return m
            return helper(m, conv_fn, *args, **kwargs)

        return run

    for name in ("_fuse_conv_bn_qat_helper", "_fold_conv_bn_qat_helper"):
        helper = getattr(qat_utils, name, None)
        if helper is not None:
            patches.append((qat_utils, name, skip_absent_kinds(helper)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _quiet_deepcopy(obj: Any) -> Any:
    # Copying an exported graph module trips a deprecation warning inside torch's pytree code; it is not actionable.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        return copy.deepcopy(obj)


def _distinguish_repeated_module_calls(gm: torch.fx.GraphModule) -> int:
    """Give every call of a module used more than once its own name in the nodes' ``nn_module_stack``.

    ``torch.export`` records the ``n``-th further call of a module under the key ``<path>@<n>`` but with the module's
    own path, and torchao's partitioner groups nodes by that path: a ReLU module applied twice (torchvision's and
    most ResNet blocks do it) becomes one partition with two outputs, which ``X86InductorQuantizer`` rejects ("Input
    partition has more than one output node"). Naming the call ``<path>@<n>`` keeps the calls apart. Returns the
    number of nodes renamed.
    """
    renamed = 0
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        key, (path, cls) = next(reversed(stack.items()))
        _, sep, call = key.rpartition("@")
        if sep and call.isdigit() and not path.endswith(f"@{call}"):
            stack = dict(stack)
            stack[key] = (f"{path}@{call}", cls)
            node.meta["nn_module_stack"] = stack
            renamed += 1
    return renamed


# ------------------------------------------------------------------------------------------ prepare / convert


def _with_batch(inputs: Sequence[Tensor], batch_size: int) -> tuple[Tensor, ...]:
    """The inputs with exactly ``batch_size`` samples (repeating them cyclically when there are fewer)."""
    index = torch.arange(batch_size) % inputs[0].shape[0]
    return tuple(t.detach()[index.to(t.device)] for t in inputs)


def _capture(module: nn.Module, example: tuple[Tensor, ...], training: bool) -> torch.fx.GraphModule:
    """``torch.export`` the module in training or inference behaviour, with a dynamic batch dimension.

    The example gets two samples: ``torch.export`` specializes a dimension whose example size is 1.
    """
    from torch.export import Dim

    was_training = module.training
    module.train(training)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation chatter
            program = torch.export.export(
                module,
                _with_batch(example, 2),
                dynamic_shapes=tuple({0: Dim.DYNAMIC} for _ in example),
                strict=False,
            )
    except Exception as exc:
        raise QuantizationError(
            f"torch.export could not capture {type(module).__name__} for quantization: {_reason(exc)}. The model "
            "must be exportable (no data-dependent Python control flow, positional tensor inputs); see "
            "https://pytorch.org/docs/stable/export.html."
        ) from exc
    finally:
        module.train(was_training)
    gm = program.module()
    _distinguish_repeated_module_calls(gm)
    return gm


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:500] if text else ''}"


def _count_quantizers(module: nn.Module) -> int:
    from torchao.quantization.pt2e import FakeQuantizeBase, ObserverBase

    return sum(isinstance(m, (FakeQuantizeBase, ObserverBase)) for m in module.modules())


def _torchao_fake_quantizers(module: nn.Module) -> list[nn.Module]:
    from torchao.quantization.qat import FakeQuantizerBase

    return [m for m in module.modules() if isinstance(m, FakeQuantizerBase)]


def prepare(module: nn.Module, recipe: QuantizationRecipe, example_inputs: Any = None) -> nn.Module:
    """Prepare ``module`` for QAT (fake quantization) or PTQ (observers) as ``recipe`` says; returns the module to
    train or calibrate in its place.

    - ``x86``: a new :class:`PreparedGraphModule`, captured from ``module`` in training (QAT) or inference (PTQ)
      behaviour, in that mode; ``module`` itself is not changed and its parameters are shared.
    - ``torchao``, QAT: ``module`` itself, its ``nn.Linear`` layers swapped for fake-quantized ones in place
      (parameters and ``state_dict`` keys unchanged). PTQ: a float copy in eval mode (dynamic activation
      quantization needs no calibration).

    Args:
        module: the float model; its ``forward`` takes positional tensors.
        recipe: from :func:`make_recipe` (or a checkpoint).
        example_inputs: inputs to capture with (``x86``); default zeros of the recipe's shapes.

    Raises:
        QuantizationError: if the module cannot be captured with ``torch.export`` (with its reason) or prepared, or
            nothing in it can be quantized.
        ModuleNotFoundError: if torchao is not installed.
    """
    torchao = require("torchao", f"{_OWNER}(backend={recipe.backend!r})")
    float_keys = list(module.state_dict())
    example = as_input_tuple(example_inputs) if example_inputs is not None else recipe.example_inputs()
    prepared: nn.Module
    if recipe.backend == "x86":
        from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        qat = recipe.mode == "qat"
        captured = _capture(module, example, training=qat)
        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=qat))
        try:
            with _fast_pattern_matching():
                prepared = (prepare_qat_pt2e if qat else prepare_pt2e)(captured, quantizer)
        except Exception as exc:
            raise QuantizationError(
                f"torchao's X86InductorQuantizer could not prepare {type(module).__name__}: {_reason(exc)}"
            ) from exc
        if _count_quantizers(prepared) == 0:
            raise NothingToQuantizeError(
                f"X86InductorQuantizer found nothing to quantize in {type(module).__name__} (it quantizes "
                "convolutions, linear layers and the ops around them)."
            )
        prepared = _as_prepared_graph_module(prepared)  # type: ignore[arg-type]
        _set_info(prepared, recipe=recipe, float_keys=float_keys, bn_frozen=False)
        prepared.train(qat)
        return prepared
    base = resolve_base_config(recipe.base_config)
    if recipe.mode == "ptq":
        prepared = _quiet_deepcopy(module).eval()
        _set_info(prepared, recipe=recipe, float_keys=float_keys)
        return prepared
    if isinstance(module, (nn.Linear, nn.Embedding)):
        raise QuantizationError(
            f"torchao's QAT swaps the Linear layers inside a model; {type(module).__name__} is one itself. Quantize "
            "the module that contains it."
        )
    try:
        torchao.quantization.quantize_(module, torchao.quantization.qat.QATConfig(base, step="prepare"))
    except Exception as exc:
        raise QuantizationError(f"torchao could not prepare {type(module).__name__} for QAT: {_reason(exc)}") from exc
    if not _torchao_fake_quantizers(module):
        raise NothingToQuantizeError(
            f"torchao found nothing to quantize in {type(module).__name__}: {type(base).__name__} applies to "
            "nn.Linear layers."
        )
    _set_info(module, recipe=recipe, float_keys=float_keys)
    return module


@torch.no_grad()
def calibrate(prepared: nn.Module, batches: Iterable[Any], input_key: str | None = None) -> int:
    """Run ``batches`` through a PTQ-prepared model in eval mode so its observers see real data; returns the
    number of samples seen. The model inputs of each batch are found with
    :func:`~lightning_perf.functional.export.split_inputs`.
    """
    device = module_device(prepared)
    prepared.eval()
    seen = 0
    for batch in batches:
        inputs = split_inputs(batch, input_key)
        prepared(*(t.to(device) for t in inputs))
        seen += int(inputs[0].shape[0])
    return seen


def convert(prepared: nn.Module, recipe: QuantizationRecipe | None = None) -> nn.Module:
    """The quantized model of a prepared (trained or calibrated) one, in eval mode; ``prepared`` is not changed.

    ``x86``: ``convert_pt2e`` of a copy, an int8 q/dq graph to be lowered with ``torch.compile`` and
    ``torch._inductor.config.patch(freezing=True)`` (:func:`compiled_latency` does) or saved (:func:`save_quantized`).
    ``torchao``: ``QATConfig(base_config, step="convert")`` (QAT) or ``base_config`` itself (PTQ) applied to a copy.

    Raises:
        ValueError: if ``prepared`` was not made by :func:`prepare` and no recipe is given.
        QuantizationError: if torchao's conversion fails.
    """
    recipe = recipe or recipe_of(prepared)
    if recipe is None:
        raise ValueError("convert() needs a module returned by prepare(), or its recipe.")
    torchao = require("torchao", f"{_OWNER}(backend={recipe.backend!r})")
    model = _quiet_deepcopy(prepared)
    if recipe.backend == "x86":
        model = model.cpu()  # X86InductorQuantizer's int8 kernels are CPU kernels
    model.eval()
    try:
        if recipe.backend == "x86":
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

            # Inference does not count batches; the counter's `add_` would stay in the int8 graph otherwise.
            for node in [n for n in model.graph.nodes if _counts_batches(n) and not n.users]:
                model.graph.erase_node(node)
            with _fast_pattern_matching():
                model = _allow_train_eval(convert_pt2e(model))
        else:
            base = resolve_base_config(recipe.base_config)
            config = torchao.quantization.qat.QATConfig(base, step="convert") if recipe.mode == "qat" else base
            torchao.quantization.quantize_(model, config)
    except Exception as exc:
        raise QuantizationError(f"torchao could not convert the model: {_reason(exc)}") from exc
    _set_info(model, recipe=recipe, float_keys=list(model.state_dict()), converted=True)
    return model.eval()


def float_copy(prepared: nn.Module) -> nn.Module:
    """A plain float copy (eval mode) of a model prepared with the ``torchao`` backend: its fake-quantized layers
    swapped back for ``nn.Linear``, with the trained weights.

    Raises:
        ValueError: for an ``x86`` model (the float module it was captured from is the float model).
    """
    recipe = recipe_of(prepared)
    if recipe is None or recipe.backend != "torchao":
        raise ValueError("float_copy() applies to models prepared with backend='torchao'.")
    torchao = require("torchao", f"{_OWNER}(backend='torchao')")
    model = _quiet_deepcopy(prepared)
    if recipe.mode == "qat":
        torchao.quantization.quantize_(model, torchao.quantization.qat.QATConfig(step="convert"))
    model.__dict__.pop(_INFO_KEY, None)
    return model.eval()


# ---------------------------------------------------------------------------------------------------- schedules


def _fake_quantizers(module: nn.Module) -> Iterator[nn.Module]:
    from torchao.quantization.pt2e import FakeQuantizeBase

    return (m for m in module.modules() if isinstance(m, FakeQuantizeBase))


def _switch_observers(module: nn.Module, enabled: bool) -> int:
    count = 0
    for m in _fake_quantizers(module):
        m.enable_observer(enabled)  # type: ignore[operator]
        count += 1
    return count


def set_observers(module: nn.Module, enabled: bool) -> int:
    """Enable or disable the observers of a QAT-prepared model (the quantization ranges stop moving once disabled);
    returns how many fake-quantize modules it switched (0 for the dynamic ``torchao`` backend).

    On a :class:`PreparedGraphModule` the setting is remembered: observers run in train mode only.
    """
    if isinstance(module, PreparedGraphModule):
        _set_info(module, observers=enabled)
        _sync_mode(module)
        return sum(1 for _ in _fake_quantizers(module))
    return _switch_observers(module, enabled)


def set_fake_quant(module: nn.Module, enabled: bool) -> int:
    """Enable or disable fake quantization (disabled, the model trains in float while observers keep collecting
    ranges); returns how many fake quantizers it switched."""
    count = 0
    for m in _fake_quantizers(module):
        m.enable_fake_quant(enabled)  # type: ignore[operator]
        count += 1
    if is_prepared(module) and recipe_of(module).backend == "torchao":  # type: ignore[union-attr]
        for m in _torchao_fake_quantizers(module):
            m.enabled = enabled  # type: ignore[assignment]
            count += 1
    return count


def batchnorm_modules(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of an eager module (the ones :func:`freeze_batchnorm_stats` puts in eval mode)."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def freeze_batchnorm_stats(module: nn.Module, frozen: bool = True) -> int:
    """Freeze (or unfreeze) batch-norm statistics: normalize with the running estimates and stop updating them.

    On a :class:`PreparedGraphModule` the setting lasts through ``train()`` / ``eval()``. On an eager module the
    batch-norm layers are put in eval mode (``frozen``) or back in the module's mode: a later ``module.train()``
    unfreezes them, so call this again after it. Returns the number of batch-norm ops or layers affected.
    """
    if isinstance(module, PreparedGraphModule):
        _set_info(module, bn_frozen=frozen)
        _sync_mode(module)
        return sum(node.target in _BATCH_NORM_FLAG for node in module.graph.nodes)
    layers = batchnorm_modules(module)
    for layer in layers:
        layer.train(module.training and not frozen)
    return len(layers)


# --------------------------------------------------------------------------------------------------- validation


@dataclass
class ValidationSummary:
    """The quantized model against its reference (the fake-quantized or calibrated model) on real batches.

    ``cosine`` and ``max_abs_diff`` are over all outputs of all batches; ``top1_agreement`` is the share of samples
    whose argmax over the last output dimension agree. The accuracies are filled when batches carry integer labels
    matching the output (``(inputs, labels)`` with ``labels.shape == output.shape[:-1]``); ``accuracy_gap`` is the
    reference's accuracy minus the quantized model's, in percentage points.
    """

    batches: int
    samples: int
    cosine: float
    max_abs_diff: float
    non_finite: int
    top1_agreement: float | None = None
    reference_accuracy: float | None = None
    quantized_accuracy: float | None = None
    passed: bool = False
    problem: str | None = None

    @property
    def accuracy_gap(self) -> float | None:
        if self.reference_accuracy is None or self.quantized_accuracy is None:
            return None
        return 100.0 * (self.reference_accuracy - self.quantized_accuracy)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "accuracy_gap_pp": self.accuracy_gap}


def _labels(batch: Any) -> Tensor | None:
    if isinstance(batch, (tuple, list)) and len(batch) > 1 and isinstance(batch[1], Tensor):
        label = batch[1]
        if not label.is_floating_point() and not label.is_complex():
            return label
    return None


@torch.no_grad()
def compare_models(
    reference: nn.Module,
    quantized: nn.Module,
    batches: Iterable[Any],
    *,
    input_key: str | None = None,
    max_batches: int | None = None,
    min_cosine: float = 0.99,
) -> ValidationSummary:
    """Run both models (in eval mode, each on its own device) on ``batches`` and compare their outputs.

    Passes when no output is NaN/Inf, every output has the reference's shape and the overall cosine similarity is at
    least ``min_cosine``. The models' train/eval modes are left as they were.

    Raises:
        ValueError: if there is no batch.
    """
    modes = [(m, m.training) for m in (reference, quantized)]
    reference.eval()
    quantized.eval()
    dot = ref_sq = out_sq = 0.0
    max_abs = 0.0
    non_finite = samples = count = agree = positions = 0
    correct = {"reference": 0, "quantized": 0}
    labelled = 0
    problem: str | None = None
    try:
        for batch in batches:
            if max_batches is not None and count >= max_batches:
                break
            inputs = split_inputs(batch, input_key)
            ref_out, _ = _flat_outputs(reference(*(t.to(module_device(reference)) for t in inputs)))
            q_out, _ = _flat_outputs(quantized(*(t.to(module_device(quantized)) for t in inputs)))
            count += 1
            samples += int(inputs[0].shape[0])
            if len(ref_out) != len(q_out) or any(r.shape != q.shape for r, q in zip(ref_out, q_out)):
                problem = "the quantized model's outputs differ in number or shape from the reference's"
                break
            for r, q in zip(ref_out, q_out):
                r64, q64 = r.detach().double().cpu(), q.detach().double().cpu()
                non_finite += int((~torch.isfinite(q64)).sum())
                if non_finite:
                    continue
                dot += float((r64 * q64).sum())
                ref_sq += float((r64 * r64).sum())
                out_sq += float((q64 * q64).sum())
                max_abs = max(max_abs, float((r64 - q64).abs().max()) if r64.numel() else 0.0)
            first_ref, first_q = ref_out[0].cpu(), q_out[0].cpu()
            if first_ref.dim() >= 2:
                ref_top, q_top = first_ref.argmax(-1), first_q.argmax(-1)
                agree += int((ref_top == q_top).sum())
                positions += ref_top.numel()
                labels = _labels(batch)
                if labels is not None and tuple(labels.shape) == tuple(ref_top.shape):
                    labels = labels.cpu()
                    correct["reference"] += int((ref_top == labels).sum())
                    correct["quantized"] += int((q_top == labels).sum())
                    labelled += labels.numel()
    finally:
        for module, mode in modes:
            module.train(mode)
    if count == 0:
        raise ValueError("compare_models() got no batch to compare on.")
    norms = math.sqrt(ref_sq * out_sq)
    cosine = dot / norms if norms > 0 else (1.0 if ref_sq == out_sq == 0 else 0.0)
    if problem is None and non_finite:
        problem = f"{non_finite} NaN/Inf value(s) in the quantized model's outputs"
    if problem is None and cosine < min_cosine:
        problem = f"cosine similarity {cosine:.5f} to the reference is below {min_cosine}"
    return ValidationSummary(
        batches=count,
        samples=samples,
        cosine=cosine,
        max_abs_diff=max_abs,
        non_finite=non_finite,
        top1_agreement=agree / positions if positions else None,
        reference_accuracy=correct["reference"] / labelled if labelled else None,
        quantized_accuracy=correct["quantized"] / labelled if labelled else None,
        passed=problem is None,
        problem=problem,
    )


# ------------------------------------------------------------------------------------------------------ latency


@dataclass
class LatencyRow:
    """Latency of the float and the quantized model at one batch size, both compiled (seconds per call)."""

    batch_size: int
    float_median_s: float
    float_p90_s: float
    quantized_median_s: float
    quantized_p90_s: float
    speedup: float
    iterations: int
    float_compile_s: float
    quantized_compile_s: float


def _lowered(model: nn.Module, example: tuple[Tensor, ...], device: torch.device) -> nn.Module:
    """A captured (``torch.export``) inference copy of ``model`` on ``device``: a graph module of its own, so
    compiling it never runs into the recompilation limit of a ``forward`` already compiled for another instance."""
    copied = _quiet_deepcopy(model).to(device).eval()
    if isinstance(copied, torch.fx.GraphModule):
        return copied
    return _capture(copied, tuple(t.to(device) for t in example), training=False)


@torch.no_grad()
def compiled_latency(
    float_model: nn.Module,
    quantized: nn.Module,
    inputs: Sequence[Tensor] | Tensor,
    batch_sizes: Sequence[int] = (1, 32),
    *,
    iterations: int = 20,
    warmup: int = 3,
) -> list[LatencyRow]:
    """Time the float and the quantized model, both lowered by inductor with weight freezing, at each batch size.

    Each model is captured and ``torch.compile``-d (``dynamic=False``) inside ``torch._inductor.config.patch(
    freezing=True)`` on the device of the quantized model, so the global inductor config is left as it was. Calls are
    timed in blocks float, quantized, quantized, float (a linear drift of the machine falls on both alike), after
    ``warmup`` untimed calls that include compilation (reported apart). Samples are reused cyclically to fill a batch.
    """
    example = as_input_tuple(inputs, "compiled_latency(inputs)")
    device = module_device(quantized)
    rows = []
    with torch._inductor.config.patch(freezing=True):
        models = {"float": _lowered(float_model, example, device), "quantized": _lowered(quantized, example, device)}
        compiled = {name: torch.compile(m, dynamic=False) for name, m in models.items()}
        for b in batch_sizes:
            batch = tuple(t.to(device) for t in _with_batch(example, b))
            compile_s = {}
            for name, fn in compiled.items():
                started = time.perf_counter()
                fn(*batch)
                compile_s[name] = time.perf_counter() - started
            float_stats, quantized_stats = _latency(
                functools.partial(compiled["float"], *batch),
                functools.partial(compiled["quantized"], *batch),
                device,
                warmup,
                iterations,
            )
            rows.append(
                LatencyRow(
                    batch_size=b,
                    float_median_s=float_stats.median,
                    float_p90_s=float_stats.p90,
                    quantized_median_s=quantized_stats.median,
                    quantized_p90_s=quantized_stats.p90,
                    speedup=float_stats.median / quantized_stats.median if quantized_stats.median > 0 else math.inf,
                    iterations=quantized_stats.count,
                    float_compile_s=compile_s["float"],
                    quantized_compile_s=compile_s["quantized"],
                )
            )
    return rows


# --------------------------------------------------------------------------------------------------------- saving


def save_quantized(quantized: nn.Module, example_inputs: Any, path: str | os.PathLike[str]) -> Path:
    """Capture the quantized model with ``torch.export`` (dynamic batch) and save it atomically with
    ``torch.export.save``; load with ``torch.export.load(path).module()`` and lower it with ``torch.compile`` under
    ``torch._inductor.config.patch(freezing=True)`` for int8 speed on CPUs.

    Raises:
        QuantizationError: if the model cannot be captured.
    """
    example = as_input_tuple(example_inputs, "save_quantized(example_inputs)")
    device = module_device(quantized)
    program_source = quantized
    if isinstance(quantized, torch.fx.GraphModule):
        program_source = _quiet_deepcopy(quantized)
    program = _capture_program(program_source, tuple(t.to(device) for t in example))
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        torch.export.save(program, handle)
    return Path(path)


def _capture_program(module: nn.Module, example: tuple[Tensor, ...]) -> torch.export.ExportedProgram:
    from torch.export import Dim

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.export.export(
                module,
                _with_batch(example, 2),
                dynamic_shapes=tuple({0: Dim.DYNAMIC} for _ in example),
                strict=False,
            )
    except Exception as exc:
        raise QuantizationError(f"torch.export could not capture the quantized model: {_reason(exc)}") from exc


def _save_onnx(quantized: nn.Module, example: tuple[Tensor, ...], path: Path) -> Path:
    """ONNX export of the quantized model (weights in ``<name>.data`` beside it), written whole, then moved."""
    for module in ("onnx", "onnxscript"):
        require(module, f"{_OWNER}(onnx=True)")
    program = _capture_program(_quiet_deepcopy(quantized), example)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".qat-onnx-", dir=path.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            onnx_program = torch.onnx.export(program, (), None, dynamo=True, verbose=False)
        if onnx_program is None:
            raise QuantizationError("torch.onnx.export returned no program")
        onnx_program.save(str(staging / path.name), external_data=True)
        for staged in sorted(staging.iterdir(), key=lambda p: p.name == path.name):  # the graph file last
            with atomic_path(path.parent / staged.name) as tmp:
                os.replace(staged, tmp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


# --------------------------------------------------------------------------------------------- end of training


@dataclass
class QuantizationReport:
    """What :func:`export_quantized` did: the artifact, its validation against the reference and its latency.

    Attributes:
        ok: whether the quantized model was converted, passed validation and was saved.
        artifact: the ``torch.export`` program (``.pt2``), or ``None``.
        onnx: the ONNX file, when asked for and successful.
        validation: the comparison with the fake-quantized (QAT) or calibrated (PTQ) model.
        latency: float vs quantized, both compiled, per batch size (empty when not timed or timing failed).
        problems: what failed, in order (conversion, validation, saving, ONNX, timing).
        report_path: the JSON report beside the artifact.
    """

    ok: bool
    recipe: QuantizationRecipe
    artifact: Path | None = None
    onnx: Path | None = None
    convert_s: float | None = None
    validation: ValidationSummary | None = None
    latency: list[LatencyRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    report_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "recipe": self.recipe.to_dict(),
            "artifact": None if self.artifact is None else str(self.artifact),
            "onnx": None if self.onnx is None else str(self.onnx),
            "convert_s": self.convert_s,
            "validation": None if self.validation is None else self.validation.to_dict(),
            "latency": [dataclasses.asdict(row) for row in self.latency],
            "problems": list(self.problems),
            "metadata": dict(self.metadata),
            "load_with": "torch.export.load(path).module(), then torch.compile under "
            "torch._inductor.config.patch(freezing=True)",
        }


def export_quantized(
    prepared: nn.Module,
    *,
    float_model: nn.Module | None = None,
    validation_data: Iterable[Any] | None = None,
    example_inputs: Any = None,
    input_key: str | None = None,
    validation_batches: int | None = 4,
    min_cosine: float = 0.99,
    dirpath: str | os.PathLike[str] = ".",
    filename: str = "model_int8",
    benchmark: bool = True,
    batch_sizes: Sequence[int] = (1, 32),
    latency_iterations: int = 20,
    latency_warmup: int = 3,
    onnx: bool = False,
    strict: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> QuantizationReport:
    """Convert a copy of a trained (QAT) or calibrated (PTQ) model, validate it, save it, time it, report.

    ``prepared`` is left as it is. The converted model is compared with ``prepared`` itself in eval mode (the
    fake-quantized model for QAT, the float model with observers for PTQ) on up to ``validation_batches`` batches
    of ``validation_data`` (else on the example inputs): cosine similarity (at least ``min_cosine`` to pass), max abs
    difference, top-1 agreement and, for ``(inputs, labels)`` batches, both accuracies. A model that passes is saved
    as ``<dirpath>/<filename>.pt2`` (atomically); one that fails as ``<filename>.failed.pt2``. With ``benchmark``, it
    is then timed against ``float_model`` (or the ``torchao`` model's float copy), both compiled with freezing, at
    each of ``batch_sizes``. The report goes to ``<filename>.json``.

    A failure (conversion, validation, saving) warns with a :class:`~lightning_perf.FallbackWarning` and is recorded
    in the report; ``strict=True`` raises :class:`QuantizationError` instead. A failure of the optional steps (ONNX,
    timing) only warns.

    Raises:
        ValueError: for an invalid option or a module that was not prepared.
        QuantizationError: with ``strict=True``, when conversion, validation or saving fails.
    """
    recipe = recipe_of(prepared)
    if recipe is None:
        raise ValueError("export_quantized() needs a module returned by prepare().")
    if not isinstance(filename, str) or not filename or os.sep in filename or filename.startswith("."):
        raise ValueError(f"`export_quantized(filename={filename!r})` is not valid. Expected a plain file stem.")
    dirpath = Path(dirpath)
    report = QuantizationReport(ok=False, recipe=recipe, metadata=dict(metadata or {}))
    example = as_input_tuple(example_inputs) if example_inputs is not None else None
    batches = list(itertools.islice(validation_data, validation_batches)) if validation_data is not None else []
    if example is None:
        example = split_inputs(batches[0], input_key) if batches else recipe.example_inputs()
    failure: BaseException | None = None

    def fail(step: str, exc: BaseException) -> None:
        nonlocal failure
        failure = exc
        report.problems.append(f"{step}: {_reason(exc) if not isinstance(exc, QuantizationError) else exc}")

    quantized: nn.Module | None = None
    started = time.perf_counter()
    try:
        quantized = convert(prepared, recipe)
        report.convert_s = time.perf_counter() - started
    except Exception as exc:
        fail("conversion", exc)
    if quantized is not None:
        try:
            # The trained model itself in eval mode: no state moves (observers pause, batch norm uses its statistics).
            report.validation = compare_models(
                prepared,
                quantized,
                batches or [example],
                input_key=input_key if batches else None,
                min_cosine=min_cosine,
            )
        except Exception as exc:
            fail("validation", exc)
        passed = report.validation is not None and report.validation.passed
        if report.validation is not None and not passed:
            report.problems.append(f"validation: {report.validation.problem}")
        name = f"{filename}.pt2" if passed else f"{filename}.failed.pt2"
        try:
            report.artifact = save_quantized(quantized, example, dirpath / name)
        except Exception as exc:
            fail("saving", exc)
        report.ok = passed and report.artifact is not None and not report.problems
    if report.ok and onnx:
        try:
            report.onnx = _save_onnx(quantized, example, dirpath / f"{filename}.onnx")  # type: ignore[arg-type]
        except Exception as exc:
            report.problems.append(f"onnx: {_reason(exc)}")
            warnings.warn(
                f"The ONNX export of the quantized model failed: {_reason(exc)}", FallbackWarning, stacklevel=2
            )
    if report.ok and benchmark and batch_sizes:
        try:
            reference_float = float_model if float_model is not None else float_copy(prepared)
            report.latency = compiled_latency(
                reference_float,
                quantized,  # type: ignore[arg-type]
                example,
                batch_sizes,
                iterations=latency_iterations,
                warmup=latency_warmup,
            )
        except Exception as exc:
            report.problems.append(f"timing: {_reason(exc)}")
            warnings.warn(f"Timing the quantized model failed: {_reason(exc)}", FallbackWarning, stacklevel=2)
    report.report_path = write_json(report.to_dict(), dirpath / f"{filename}.json")
    if not report.ok:
        message = (
            f"The quantized model was not exported: {'; '.join(report.problems)}. The trained model is unchanged. "
            f"Report: {report.report_path}"
        )
        if strict:
            raise QuantizationError(message) from failure
        warnings.warn(message, FallbackWarning, stacklevel=2)
    return report
