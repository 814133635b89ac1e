"""Module surgery: find submodules, replace them or wrap their ``forward`` in place, keeping ``state_dict`` keys.

Entry points: :func:`find_modules`, :func:`replace_modules`, :func:`restore_modules`, :func:`patch_forward`,
:func:`unpatch_forward` (:class:`ForwardPatch`), :func:`find_repeated_blocks`. The rules every model-changing
optimization follows through this file: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import importlib
import types
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn

from lightning_perf._validation import check_int

FilterFn = Callable[[nn.Module, str], bool]
ModuleFactory = Callable[[nn.Module, str], "nn.Module | None"]

# Plain containers (these exact classes, not subclasses): a place where blocks are listed, never a block themselves.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def find_modules(model: nn.Module, filter_fn: FilterFn, *, outermost: bool = False) -> list[tuple[str, nn.Module]]:
    """The submodules of ``model`` for which ``filter_fn(module, name)`` is true, in ``named_modules`` order.

    Args:
        model: the module to search; it is never returned itself.
        filter_fn: called with each submodule and its fully qualified name.
        outermost: drop a match that lies inside another match (wrapping both would nest the work).

    A module registered under several names is returned once, under its first name.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or not filter_fn(module, name):
            continue
        if outermost and any(_is_inside(name, outer) for outer, _ in found):
            continue
        found.append((name, module))
    return found


def _is_inside(name: str, outer: str) -> bool:
    return name.startswith(outer + ".")


def _named_filter(targets: FilterFn | Iterable[str]) -> FilterFn:
    if callable(targets):
        return targets
    wanted = set(targets)
    return lambda module, name: name in wanted


def replace_modules(
    model: nn.Module,
    targets: FilterFn | Iterable[str],
    factory: ModuleFactory,
    *,
    check_state_dict: bool = True,
) -> dict[str, tuple[nn.Module, nn.Module]]:
    """Replace submodules in place: each target is swapped for ``factory(module, name)`` on its parent.

    The new module is set as an attribute of the parent, which covers plain attributes as well as the string indices of
    ``nn.ModuleList``, ``nn.Sequential`` and ``nn.ModuleDict``. It takes over the ``training`` flag of the module it
    replaces, and of each submodule under the same name (:func:`take_over_modes`): a replacement built while the
    original was in eval mode still trains, and as a registered child it follows every later ``train()`` / ``eval()``
    (Lightning's switches around validation and sanity checking included). A module registered under several names
    (shared) is replaced everywhere by one new module. Matches inside a replaced module are left alone.

    Args:
        model: the module to change in place.
        targets: a ``filter_fn(module, name) -> bool`` or the fully qualified names to replace.
        factory: builds the replacement; returning ``None`` or the module itself leaves it as it is.
        check_state_dict: raise if a replacement's ``state_dict`` keys differ from the module it replaces (before
            anything is changed for that module).

    Returns:
        ``{name: (old, new)}`` for every name under which a module was replaced; undo with :func:`restore_modules`.

    Raises:
        ValueError: if a replacement would change the ``state_dict`` keys, or a name in ``targets`` does not exist.
    """
    if not callable(targets):
        targets = list(targets)
        existing = {name for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in existing or not t]
        if missing:
            raise ValueError(f"`replace_modules` got names that are not submodules of the model: {missing}.")
    chosen = find_modules(model, _named_filter(targets), outermost=True)
    new_for: dict[int, nn.Module] = {}
    for name, module in chosen:
        new = factory(module, name)
        if new is None or new is module:
            continue
        if check_state_dict:
            _check_same_keys(name, module, new)
        take_over_modes(new, module)
        new_for[id(module)] = new
    replaced: dict[str, tuple[nn.Module, nn.Module]] = {}
    if not new_for:
        return replaced
    # Every place the module is registered, shared ones included (``remove_duplicate=False``).
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if name and id(module) in new_for:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            if parent._modules.get(child) is module:  # not already redirected through a shared parent
                setattr(parent, child, new_for[id(module)])
            replaced[name] = (module, new_for[id(module)])
    return replaced


def _check_same_keys(name: str, old: nn.Module, new: nn.Module) -> None:
    before, after = set(old.state_dict().keys()), set(new.state_dict().keys())
    if before != after:
        raise ValueError(
            f"Replacing `{name}` ({type(old).__name__} -> {type(new).__name__}) would change its state_dict keys: "
            f"missing {sorted(before - after)}, unexpected {sorted(after - before)}. A replacement must hold the same "
            "parameters and buffers under the same names."
        )


def restore_modules(model: nn.Module, replaced: dict[str, tuple[nn.Module, nn.Module]]) -> None:
    """Undo :func:`replace_modules`: put each old module back where its replacement is.

    Before an old module goes back it takes over its replacement's current tensors and train/eval mode, so nothing
    learned or moved (``.to(device)``, dtype casts) since the replacement is lost. A name whose module was changed
    again since is left alone.
    """
    adopted: set[int] = set()
    for name, (old, new) in replaced.items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            continue
        if parent._modules.get(child) is not new:
            continue
        if id(old) not in adopted:
            adopt_tensors(old, new)
            adopted.add(id(old))
        setattr(parent, child, old)


def take_over_modes(target: nn.Module, source: nn.Module) -> None:
    """Give ``target`` and each of its submodules the ``training`` flag of ``source``'s submodule of the same name.

    A submodule ``source`` does not have keeps its flag. Flags are copied one by one, not set with ``train()``, so a
    submodule the user froze in eval mode inside a training model stays in eval mode.
    """
    for prefix, sub in target.named_modules(remove_duplicate=False):
        try:
            sub.training = source.get_submodule(prefix).training
        except AttributeError:
            continue


def adopt_tensors(target: nn.Module, source: nn.Module) -> None:
    """Make ``target`` hold ``source``'s parameters and buffers (the same objects) under the same names.

    Used when a module that shares its tensors with a replacement goes back into the model: anything that replaced a
    tensor object in the replacement (``.to()`` of a direct buffer, loading with ``assign=True``) is carried over.
    """
    for attr in ("_parameters", "_buffers"):
        for prefix, sub in source.named_modules(remove_duplicate=False):
            try:
                dest = target.get_submodule(prefix)
            except AttributeError:
                continue
            dest_tensors, src_tensors = getattr(dest, attr), getattr(sub, attr)
            for key, tensor in src_tensors.items():
                if key in dest_tensors and dest_tensors[key] is not tensor:
                    dest_tensors[key] = tensor
    take_over_modes(target, source)


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_block(module: nn.Module) -> bool:
    """A module worth wrapping on its own: not a plain container, holds parameters, and has submodules."""
    return type(module) not in _CONTAINERS and bool(module._modules) and _holds_parameters(module)


def _children_through_containers(parent: nn.Module) -> list[nn.Module]:
    """``parent``'s children, with each plain container replaced by its own children (recursively)."""
    children = []
    for child in parent.children():
        if type(child) in _CONTAINERS:
            children.extend(_children_through_containers(child))
        else:
            children.append(child)
    return children


def repeated_block_groups(model: nn.Module, min_repeats: int = 2) -> dict[type, list[nn.Module]]:
    """Groups of repeated blocks by class: ``{cls: [block, ...]}``, the candidates of :func:`find_repeated_blocks`.

    A group holds every block of class ``cls`` that has at least ``min_repeats - 1`` same-class siblings (children of
    one module, seen through plain containers), pooled across parents, in ``model.modules()`` order, each block once.

    Raises:
        ValueError: if ``min_repeats`` is not an int >= 2.
    """
    check_int("repeated_block_groups", "min_repeats", min_repeats, 2)
    pooled: dict[type, dict[int, nn.Module]] = defaultdict(dict)
    for parent in model.modules():
        if type(parent) in _CONTAINERS and parent is not model:
            continue  # its children were counted with its owner's
        siblings: dict[type, list[nn.Module]] = defaultdict(list)
        for child in _children_through_containers(parent):
            if _is_block(child):
                siblings[type(child)].append(child)
        for cls, members in siblings.items():
            if len(members) >= min_repeats:
                pooled[cls].update((id(m), m) for m in members)
    return {cls: list(members.values()) for cls, members in pooled.items()}


def find_repeated_blocks(model: nn.Module, *, min_repeats: int = 2) -> list[tuple[str, nn.Module]]:
    """The model's main repeated blocks: the layers of a transformer, the residual blocks of a ResNet's stages.

    Detection is by structure only, never by class name:

    - A *block* is a submodule that holds parameters and has submodules of its own (a lone ``Linear`` is no block),
      and is not a plain ``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict`` (subclasses count as blocks).
    - *Siblings* are the children of one module, seen through plain containers: the layers in a ``ModuleList``, the
      residual blocks in the ``nn.Sequential`` stages of a ResNet are siblings of each other.
    - At least ``min_repeats`` sibling blocks of one class form a group; groups of the same class are pooled across
      parents (the blocks of every stage, whatever the stages' class; both stacks of an encoder-decoder built from one
      block class).
    - Of the pooled groups, those holding at least 90% of the parameters that the biggest one holds compete, and the
      one with the most blocks wins: the residual blocks over custom stage modules that contain them, the layers of a
      decoder over the two attention modules inside each layer (which hold fewer parameters). A block inside another
      block of the winning group is dropped.

    Args:
        model: the model to search.
        min_repeats: how many same-class siblings make a group.

    Returns:
        ``[(name, block), ...]`` in ``named_modules`` order; empty when the model has no repeated blocks.

    Example::

        >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> [name for name, _ in find_repeated_blocks(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False))]
        ['layers.0', 'layers.1', 'layers.2']
    """
    pooled = {cls: {id(m): m for m in members} for cls, members in repeated_block_groups(model, min_repeats).items()}
    if not pooled:
        return []

    def parameter_count(members: dict[int, nn.Module]) -> int:
        return sum({id(p): p.numel() for m in members.values() for p in m.parameters()}.values())

    coverage = {cls: parameter_count(members) for cls, members in pooled.items()}
    biggest = max(coverage.values())
    contenders = [cls for cls in pooled if coverage[cls] >= 0.9 * biggest]
    best = pooled[max(contenders, key=lambda cls: (len(pooled[cls]), coverage[cls]))]
    return find_modules(model, lambda m, _: id(m) in best, outermost=True)


def import_module_class(path: str) -> type[nn.Module]:
    """The ``nn.Module`` subclass at the dotted ``path`` (``"torch.nn.TransformerEncoderLayer"``).

    Raises:
        ValueError: if ``path`` cannot be imported or does not name an ``nn.Module`` subclass.
    """
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ValueError(f"{path!r} is not a class path. Expected a dotted path such as 'torch.nn.Linear'.")
    try:
        obj = getattr(importlib.import_module(module_path), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"Cannot import the module class {path!r}: {err}.") from err
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"{path!r} is {obj!r}, not a subclass of torch.nn.Module.")
    return obj


class ForwardPatch:
    """A replacement for one module instance's ``forward``, installed by :func:`patch_forward`.

    The patch's bound ``__call__`` lives in the module's ``__dict__`` under ``forward``, so the module keeps its
    class, its submodules and its ``state_dict`` keys exactly (unlike a wrapper module, which adds a prefix to every
    key). Subclass it and override ``__call__``; call :meth:`call_original` for what the module did before. A bound
    method of a plain object of a module-level class is what torch's compiler and ``inspect`` expect of a ``forward``,
    and it pickles and deep-copies with the model. Patches of different kinds stack.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # An instance-level forward already in place (another patch, or the user's own), called in turn.
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")

    def call_original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_original(*args, **kwargs)


P = TypeVar("P", bound=ForwardPatch)


def _patch_of(forward: Any) -> ForwardPatch | None:
    """The patch whose bound ``__call__`` ``forward`` is, else ``None``."""
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(forward, types.MethodType) and isinstance(owner, ForwardPatch) else None


def find_forward_patch(module: nn.Module, kind: type[P]) -> P | None:
    """The patch of type ``kind`` on ``module``'s forward, or ``None``."""
    patch = _patch_of(module.__dict__.get("forward"))
    while patch is not None:
        if isinstance(patch, kind):
            return patch
        patch = _patch_of(patch.inner)
    return None


def patch_forward(module: nn.Module, make_patch: Callable[[nn.Module], P]) -> P | None:
    """Install ``make_patch(module)`` as ``module.forward``; ``None`` if a patch of that type is already there."""
    patch = make_patch(module)
    if find_forward_patch(module, type(patch)) is not None:
        return None
    module.__dict__["forward"] = patch.__call__
    return patch


def unpatch_forward(module: nn.Module, kind: type[ForwardPatch]) -> bool:
    """Remove the patch of type ``kind`` from ``module.forward``, keeping any other patches; ``False`` if none."""
    outer: ForwardPatch | None = None
    patch = _patch_of(module.__dict__.get("forward"))
    while patch is not None:
        if isinstance(patch, kind):
            if outer is not None:
                outer.inner = patch.inner
            elif patch.inner is not None:
                module.__dict__["forward"] = patch.inner
            else:
                del module.__dict__["forward"]
            return True
        outer, patch = patch, _patch_of(patch.inner)
    return False
