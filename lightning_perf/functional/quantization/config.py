"""torchao base configs for quantization-aware training: from a YAML-able spec to a config object and back.

:func:`resolve_base_config` builds (and checks) the torchao PTQ config a ``QATConfig`` derives its fake quantization
from; :func:`base_config_spec` writes a config back as plain data, so a recipe and a checkpoint can carry it. torchao
is imported only inside these functions.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Mapping
from typing import Any

import torch

from lightning_perf._imports import require

__all__ = ["SUPPORTED_BASE_CONFIGS", "base_config_spec", "resolve_base_config"]

#: torchao PTQ configs that ``QATConfig`` can derive fake quantization from (torchao 0.18). The first is the default
#: of the ``torchao`` backend: int8 per-token dynamic activations, int8 weights in groups of 32.
SUPPORTED_BASE_CONFIGS: tuple[str, ...] = (
    "Int8DynamicActivationIntxWeightConfig",
    "IntxWeightOnlyConfig",
    "Int4WeightOnlyConfig",
    "Float8DynamicActivationFloat8WeightConfig",
    "Float8DynamicActivationInt4WeightConfig",
)


def _torchao_namespace(owner: str) -> dict[str, Any]:
    """Classes a spec may name: torchao.quantization's configs and granularities."""
    quantization = require("torchao", f"{owner}(backend='torchao')").quantization
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


def resolve_base_config(spec: Any, owner: str = "resolve_base_config") -> Any:
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
    namespace = _torchao_namespace(owner)
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
