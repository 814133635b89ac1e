"""Where a quantized model is captured and where it trains: device-neutral capture for the PT2E recipes.

torchao's ``X86InductorQuantizer`` annotates the graph of a CPU model, and a model trained on a GPU is deployed in int8
on a CPU: :func:`cpu_copy` gives the capture a CPU copy, :func:`take_tensors_of` gives the prepared graph the module's
own parameters and buffers back, on their device, so the fake-quantized model fine-tunes where the model lives.
:func:`cache_off` turns off Hugging Face key/value caches while a model is captured or validated.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["cache_off", "cpu_copy", "disable_cache", "retarget_graph", "take_tensors_of"]


def cpu_copy(module: nn.Module) -> nn.Module:
    """A CPU copy of ``module`` for capture (values matter only where the graph depends on them: meta tensors get
    uninitialized storage)."""
    copied = copy.deepcopy(module)
    if any(t.is_meta for t in itertools.chain(copied.parameters(), copied.buffers())):
        return copied.to_empty(device="cpu")
    return copied.cpu()


def take_tensors_of(prepared: torch.fx.GraphModule, module: nn.Module, device: torch.device) -> None:
    """Give ``prepared`` (captured from a CPU copy of ``module``) ``module``'s own parameters and buffers, and move its
    observers, fake quantizers and constants to ``device``: it then trains ``module``'s tensors where they are."""
    for key, value in module.state_dict(keep_vars=True).items():
        owner_name, _, attr = key.rpartition(".")
        try:
            owner = prepared.get_submodule(owner_name)
        except AttributeError:
            continue  # folded away by the quantizer (not read by the graph)
        if attr in owner._parameters:
            owner._parameters[attr] = value  # type: ignore[assignment]
        elif attr in owner._buffers:
            owner._buffers[attr] = value
    own = {id(t) for t in module.state_dict(keep_vars=True).values()}

    def moved(t: Tensor) -> Tensor:
        return torch.empty_like(t, device=device) if device.type == "meta" else t.to(device)

    for sub in prepared.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if t is not None and id(t) not in own and t.device != device:
                    new = moved(t)
                    store[name] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new  # type: ignore[assignment]
        for name, value in list(vars(sub).items()):
            if isinstance(value, Tensor) and value.device != device:  # constants the graph reads by name
                sub.__dict__[name] = moved(value)
    retarget_graph(prepared, device)


def retarget_graph(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Make the tensors a captured graph creates itself (``device=`` arguments fixed at capture) land on ``device``."""
    changed = False
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
    if changed:
        gm.recompile()


def disable_cache(module: nn.Module) -> list[Any]:
    """Set ``config.use_cache = False`` on every Hugging Face model inside ``module``; returns the configs changed."""
    changed: list[Any] = []
    for sub in module.modules():
        config: Any = getattr(sub, "config", None)
        if getattr(config, "use_cache", None) is True:
            changed.append(config)
            config.use_cache = False
    return changed


@contextlib.contextmanager
def cache_off(*modules: nn.Module | None) -> Iterator[None]:
    """Turn off the key/value cache of Hugging Face models inside ``modules`` (``config.use_cache``) for the block:
    ``torch.export`` cannot take a ``DynamicCache`` output, and a deployed model called once per input needs none."""
    changed = [config for module in modules if module is not None for config in disable_cache(module)]
    try:
        yield
    finally:
        for config in changed:
            config.use_cache = True
