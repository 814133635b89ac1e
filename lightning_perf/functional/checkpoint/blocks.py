"""Which blocks activation checkpointing wraps when asked for ``"auto"``: repeated blocks that hold real work.

Entry points: :func:`find_checkpoint_blocks` (by structure alone, no forward), :func:`unet_level_blocks` (U-Nets built
by nesting), :func:`count_layers`. The scoring rules, the thresholds and what they choose on real models:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import itertools

from torch import nn

from lightning_perf.functional.surgery import _CONTAINERS, find_modules, repeated_block_groups

MIN_LAYERS = 4
"""Fewest layers a repeated block must hold to be worth checkpointing (conv + norm + activation hold three)."""

MIN_LEVEL_LAYERS = 2
"""Fewest layers a part of a nested U-Net level must hold (conv + norm: checkpointing it drops at least one tensor)."""

_FINER_SHARE = 0.75  # a group of finer blocks wins when it covers at least this share of the best group's layers
_JOIN_SHARE = 0.25  # another disjoint group joins when it covers at least this share of the winner's layers


def _is_layer(module: nn.Module) -> bool:
    if module._parameters and any(p is not None for p in module._parameters.values()):
        return True
    if module._modules or isinstance(module, nn.Identity):
        return False
    return not (isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0)


def count_layers(module: nn.Module) -> int:
    """The layers of ``module`` (itself included): modules that compute and keep activations, see the module notes."""
    return sum(1 for m in module.modules() if _is_layer(m))


def find_checkpoint_blocks(model: nn.Module, *, min_repeats: int = 2) -> list[tuple[str, nn.Module]]:
    """The blocks worth checkpointing in ``model``, outermost only, in ``named_modules`` order (see the module notes).

    Args:
        model: the model to search.
        min_repeats: how many same-class siblings make a group.

    Returns:
        ``[(name, block), ...]``; empty when no repeated block holds :data:`MIN_LAYERS` layers.

    Example::

        >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> [name for name, _ in find_checkpoint_blocks(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))]
        ['layers.0', 'layers.1']
    """
    chosen = _repeated_blocks(model, min_repeats)
    levels = unet_level_blocks(model)
    if levels:
        first, second = (levels, chosen)
        if sum(map(count_layers, chosen)) > sum(map(count_layers, levels)):
            first, second = chosen, levels
        chosen = first + [m for m in second if not any(_nested(m, b) for b in first)]
    ids = {id(m) for m in chosen}
    return find_modules(model, lambda m, _: id(m) in ids, outermost=True)


def _repeated_blocks(model: nn.Module, min_repeats: int) -> list[nn.Module]:
    """Steps 1 to 3 of the module notes: the chosen groups of repeated sibling blocks."""
    groups = []
    for members in repeated_block_groups(model, min_repeats=min_repeats).values():
        sizes = [count_layers(m) for m in members]
        if min(sizes) >= MIN_LAYERS:
            groups.append((sum(sizes), members))
    if not groups:
        return []
    groups.sort(key=lambda g: -g[0])
    best_cover = groups[0][0]
    contenders = [g for g in groups if g[0] >= _FINER_SHARE * best_cover]
    winner = max(contenders, key=lambda g: (len(g[1]), g[0]))
    chosen: list[nn.Module] = list(winner[1])
    for cover, members in groups:
        if members is winner[1] or cover < _JOIN_SHARE * winner[0]:
            continue
        if any(_nested(a, b) for a in members for b in chosen):
            continue
        chosen.extend(members)
    return chosen


def _level_classes(model: nn.Module) -> set[type]:
    """Classes (plain containers aside) with an instance nested inside another instance of the same class."""
    found: set[type] = set()
    for module in model.modules():
        cls = type(module)
        if cls in _CONTAINERS or cls in found:
            continue
        if any(type(inner) is cls for inner in itertools.islice(module.modules(), 1, None)):
            found.add(cls)
    return found


def _spine_split(host: nn.Module, on_spine: set[int]) -> tuple[list[nn.Module], nn.Module | None, list[nn.Module]]:
    """``host``'s children before the one on the spine (through plain containers), that child, and those after it."""
    children = list(host.children())
    for index, child in enumerate(children):
        if id(child) not in on_spine:
            continue
        if type(child) in _CONTAINERS:
            before, nested, after = _spine_split(child, on_spine)
            return children[:index] + before, nested, after + children[index + 1 :]
        return children[:index], child, children[index + 1 :]
    return children, None, []


def unet_level_blocks(model: nn.Module) -> list[nn.Module]:
    """The encoder and decoder parts of the levels of a U-Net built by nesting, and its bottleneck (see the module
    doc), in ``model.modules()`` order; empty for a model without nested levels.

    Example::

        from monai.networks.nets import UNet

        net = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2))
        unet_level_blocks(net)  # 2 encoder parts, the bottleneck, 1 decoder part (the top decoder is a lone conv)
    """
    classes = _level_classes(model)
    if not classes:
        return []
    levels = [m for m in model.modules() if type(m) in classes]
    # The spine: every level and every module holding one; a level's host is the level itself, or for the outermost
    # levels the module that holds them (through plain containers).
    holding: dict[int, bool] = {}
    for module in model.modules():
        holding[id(module)] = any(type(m) in classes for m in module.modules())
    on_spine = {key for key, holds in holding.items() if holds}
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    hosts: dict[int, nn.Module] = {}
    for level in levels:
        hosts[id(level)] = level
        parent = parents.get(id(level))
        while parent is not None and type(parent) in _CONTAINERS and id(parent) in parents:
            parent = parents[id(parent)]
        if parent is not None and type(parent) not in classes:
            hosts.setdefault(id(parent), parent)
    parts: dict[int, nn.Module] = {}
    for host in hosts.values():
        before, _nested, after = _spine_split(host, on_spine)
        # The innermost level holds no further level: its children (all in `before`) are the bottleneck.
        for part in before + after:
            if count_layers(part) >= MIN_LEVEL_LAYERS:
                parts[id(part)] = part
    return [m for m in model.modules() if id(m) in parts]


def _nested(a: nn.Module, b: nn.Module) -> bool:
    """Whether one of ``a`` and ``b`` lies inside the other (or they are the same module)."""
    return a is b or any(m is b for m in a.modules()) or any(m is a for m in b.modules())


__all__: list[str] = ["MIN_LAYERS", "MIN_LEVEL_LAYERS", "count_layers", "find_checkpoint_blocks", "unet_level_blocks"]
