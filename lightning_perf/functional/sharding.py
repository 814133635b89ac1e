"""Recognising FSDP2-sharded models (``fully_shard``): their wrapped blocks and their DTensor parameters.

Entry points: :func:`is_sharded`, :func:`is_fsdp_module`, :func:`is_sharded_parameter`, :func:`plain_parameters`.
Detection by capability; no-ops without ``torch.distributed``. What a transform must do around sharded modules:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "is_fsdp_module",
    "is_sharded",
    "is_sharded_parameter",
    "plain_parameters",
    "rebind_parameters",
]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor  # type: ignore[no-any-return]


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FSDPModule  # type: ignore[no-any-return]


def is_sharded_parameter(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 or tensor-parallel shard)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (it is an ``FSDPModule``)."""
    fsdp = _fsdp_module_type()
    return fsdp is not None and isinstance(module, fsdp)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor, or any of its modules an ``FSDPModule``."""
    return any(is_sharded_parameter(p) for p in model.parameters()) or any(is_fsdp_module(m) for m in model.modules())


def _stand_in(param: torch.Tensor, generator: torch.Generator) -> nn.Parameter:
    """A plain tensor of ``param``'s full shape and dtype, on the device of its local shard (CPU for meta shards).

    The values are drawn from ``generator`` (the same on every rank), uniform in ``+-1/sqrt(fan_in)`` like torch's own
    ``Linear`` initialisation, so a probe makes the same decision on every rank without a collective call.
    """
    local = param.to_local() if hasattr(param, "to_local") else param
    device = torch.device("cpu") if local.device.type == "meta" else local.device
    fan_in = math.prod(param.shape[1:]) if param.dim() > 1 else param.numel()
    bound = 1.0 / math.sqrt(max(fan_in, 1))
    values = torch.rand(tuple(param.shape), generator=generator, dtype=torch.float64) * 2 - 1
    return nn.Parameter((values * bound).to(device=device, dtype=param.dtype), requires_grad=param.requires_grad)


@contextlib.contextmanager
def plain_parameters(module: nn.Module, seed: int = 0) -> Iterator[dict[int, nn.Parameter]]:
    """Inside the block, every DTensor parameter of ``module`` is replaced by a plain stand-in of its full shape.

    For calls that only need the module's *behaviour* (which layout an attention module uses, whether a swapped version
    computes the same): the stand-ins hold seeded random values, not the trained ones, and no collective call is made,
    so every rank can probe on its own. The original parameters are back in their modules when the block ends, also on
    an error. Yields ``{id(stand_in): original}`` for :func:`rebind_parameters`.
    """
    generator = torch.Generator().manual_seed(seed)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    mapping: dict[int, nn.Parameter] = {}
    try:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and is_sharded_parameter(param):
                    stand_in = _stand_in(param, generator)
                    owner._parameters[name] = stand_in
                    swapped.append((owner, name, param))
                    mapping[id(stand_in)] = param
        yield mapping
    finally:
        for owner, name, param in reversed(swapped):
            owner._parameters[name] = param


def rebind_parameters(module: nn.Module, mapping: dict[int, nn.Parameter]) -> int:
    """Put the original parameters back wherever ``module`` still holds a stand-in of :func:`plain_parameters`."""
    count = 0
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and id(param) in mapping:
                owner._parameters[name] = mapping[id(param)]
                count += 1
    return count
