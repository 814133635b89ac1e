"""Activation (gradient) checkpointing: drop a block's intermediate activations in forward, recompute them in backward.

Entry points: :func:`apply_activation_checkpointing`, :func:`remove_activation_checkpointing`,
:func:`checkpointed_modules`, :class:`CheckpointedForward` (names and ``state_dict`` keys unchanged; BatchNorm
statistics and key/value caches kept right in the recompute). What the checkpoint keeps right, what it costs (measured):
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_perf._validation import check_instance, check_int, check_number
from lightning_perf.functional.checkpoint.blocks import find_checkpoint_blocks
from lightning_perf.functional.surgery import (
    FilterFn,
    ForwardPatch,
    find_forward_patch,
    find_modules,
    import_module_class,
    patch_forward,
    unpatch_forward,
)


class _RestoreBuffers(contextlib.AbstractContextManager):
    """Put the given modules' buffers back as they were when the context was entered (the recompute's context)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> _RestoreBuffers:
        self.saved = [[(b, b.clone()) for b in m.buffers(recurse=False)] for m in self.modules if m.training]
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for pairs in self.saved:
                for buffer, value in pairs:
                    buffer.copy_(value)
        self.saved = []


def _combined_contexts(
    context_fn: Any, stat_modules: Sequence[nn.Module]
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The user's ``(forward, recompute)`` contexts, with the BatchNorm restore added to the recompute one."""
    forward_context, recompute_context = context_fn()

    @contextlib.contextmanager
    def recompute() -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_RestoreBuffers(stat_modules))
            stack.enter_context(recompute_context)
            yield

    return forward_context, recompute()


def is_cache(value: Any) -> bool:
    """Whether ``value`` looks like a key/value cache that a block writes into (duck-typed Hugging Face ``Cache``)."""
    return (
        not isinstance(value, torch.Tensor)
        and callable(getattr(value, "update", None))
        and callable(getattr(value, "get_seq_length", None))
    )


def _caches_in(values: Any) -> list[Any]:
    """The caches among ``values`` and, one level down, inside them (an encoder-decoder cache holds two)."""
    found: dict[int, Any] = {}
    for value in values:
        if is_cache(value) and hasattr(value, "__dict__"):  # patched through its instance dict
            found[id(value)] = value
            for inner in getattr(value, "__dict__", {}).values():
                if is_cache(inner) and hasattr(inner, "__dict__"):
                    found[id(inner)] = inner
    return list(found.values())


class _CacheReplay:
    """Keep the recompute from writing into a key/value cache a second time.

    In the forward, each cache's ``update`` runs as usual and what it returns (the keys and values the attention then
    reads: the past ones and this step's) is recorded. In the recompute, ``update`` writes nothing and returns the
    recorded tensors in the same order, so the attention sees exactly what it saw in the forward. The patch is an
    instance attribute put in place around each call and removed after it. Only the gradient graph of the forward is
    used by backward (the non-reentrant recompute only refills saved tensors), so returning the forward's tensors
    computes the same gradients. Reads inside the block (``get_seq_length()``) see the cache after the forward's write.
    """

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches
        self.recorded: dict[int, list[Any]] = {id(c): [] for c in caches}
        self.forward_done = False

    @contextlib.contextmanager
    def patched(self) -> Any:
        replaying = self.forward_done
        saved = []
        for cache in self.caches:
            had = "update" in cache.__dict__
            saved.append((cache, had, cache.__dict__.get("update")))
            cache.__dict__["update"] = self._replay(cache) if replaying else self._record(cache)
        try:
            yield
        finally:
            for cache, had, previous in saved:
                if had:
                    cache.__dict__["update"] = previous
                else:
                    cache.__dict__.pop("update", None)
            self.forward_done = True

    def _record(self, cache: Any) -> Any:
        update, log = cache.update, self.recorded[id(cache)]

        def record(*args: Any, **kwargs: Any) -> Any:
            result = update(*args, **kwargs)
            log.append(result)
            return result

        return record

    def _replay(self, cache: Any) -> Any:
        log, position = self.recorded[id(cache)], iter(range(len(self.recorded[id(cache)])))

        def replay(*args: Any, **kwargs: Any) -> Any:
            index = next(position, None)
            if index is None:
                raise RuntimeError(
                    f"The recompute of a checkpointed block called {type(cache).__name__}.update() more often than "
                    "its forward did; the block's calls to the cache differ between the two runs."
                )
            return log[index]

        return replay


class CheckpointedForward(ForwardPatch):
    """A block's forward run under non-reentrant activation checkpointing; see :func:`apply_activation_checkpointing`.

    Args:
        module: the block.
        preserve_rng_state: restore the RNG state for the recompute, so dropout draws the same masks (torch's default;
            ``False`` is a little faster for blocks without randomness).
        context_fn: torch's checkpoint ``context_fn``: a zero-argument callable returning
            ``(forward_context, recompute_context)``, e.g. from
            ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (selective checkpointing). Entered together
            with the BatchNorm-statistics restore.
    """

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True, context_fn: Any = None) -> None:
        super().__init__(module)
        expected = "None or a zero-argument callable returning (forward_context, recompute_context)"
        check_instance(type(self).__name__, "context_fn", context_fn, (type(None), Callable), expected)
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.call_original(*args, **kwargs)
        options: dict[str, Any] = {}
        # Looked up per call, not at patching: Lightning's sync_batchnorm=True replaces BatchNorm modules afterwards.
        stat_modules = [
            m for m in self.module.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        ]
        restore = bool(stat_modules) and not torch.compiler.is_compiling()
        if restore and self.context_fn is not None:
            options["context_fn"] = lambda: _combined_contexts(self.context_fn, stat_modules)
        elif restore:
            options["context_fn"] = lambda: (contextlib.nullcontext(), _RestoreBuffers(stat_modules))
        elif self.context_fn is not None:
            options["context_fn"] = self.context_fn
        caches = [] if torch.compiler.is_compiling() else _caches_in([*args, *kwargs.values()])
        function = self._with_cache_replay(_CacheReplay(caches)) if caches else self.call_original
        return checkpoint(
            function,
            *args,
            use_reentrant=False,
            preserve_rng_state=self.preserve_rng_state,
            **options,
            **kwargs,
        )

    def _with_cache_replay(self, replay: _CacheReplay) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with replay.patched():
                return self.call_original(*args, **kwargs)

        return run


def resolve_module_classes(modules: Any) -> tuple[list[type[nn.Module]], list[str]]:
    """Split a ``modules=`` argument into classes (dotted paths imported now) and bare class names (matched later).

    Raises:
        ValueError: for a dotted path that does not import or is not a module class.
        TypeError: for anything else than classes and strings.
    """
    if isinstance(modules, (str, type)):
        items = [modules]
    elif isinstance(modules, (list, tuple)):
        items = list(modules)
    else:
        items = [modules]  # rejected below with the expected forms
    classes: list[type[nn.Module]] = []
    names: list[str] = []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            classes.append(item)
        elif isinstance(item, str) and "." in item:
            classes.append(import_module_class(item))
        elif isinstance(item, str) and item.isidentifier():
            names.append(item)
        else:
            raise TypeError(
                f"`modules` got {item!r}. Expected 'auto', nn.Module subclasses, class paths such as "
                "'torch.nn.TransformerEncoderLayer', or class names such as 'Block'."
            )
    if not items:
        raise ValueError("`modules` is empty. Expected 'auto' or at least one module class.")
    return classes, names


def select_blocks(
    model: nn.Module,
    modules: Any = "auto",
    filter_fn: FilterFn | None = None,
) -> list[tuple[str, nn.Module]]:
    """The blocks to checkpoint, outermost only, in ``named_modules`` order.

    Args:
        model: the model.
        modules: ``"auto"`` (the repeated blocks that hold real work: transformer layers, Swin blocks, residual
            blocks, U-Net stages; never conv-norm-activation sub-blocks, see
            :func:`~lightning_perf.functional.checkpoint.blocks.find_checkpoint_blocks`), or module classes: classes,
            dotted class paths, or bare class names matched against the class names in ``model``.
        filter_fn: ``filter_fn(module, name) -> bool`` instead of ``modules``.

    Raises:
        ValueError: for a bare class name that no module of ``model`` has (with the names it does have).
    """
    if filter_fn is not None:
        return find_modules(model, filter_fn, outermost=True)
    if modules == "auto":
        return find_checkpoint_blocks(model)
    classes, names = resolve_module_classes(modules)
    if names:
        present = {type(m).__name__ for m in model.modules()}
        unknown = [n for n in names if n not in present]
        if unknown:
            import difflib

            hints = [
                f"{n!r} (did you mean {', '.join(repr(h) for h in close)}?)" if close else repr(n)
                for n in unknown
                for close in [difflib.get_close_matches(n, present, n=2)]
            ]
            raise ValueError(
                f"`modules` names classes that no module of {type(model).__name__} has: {', '.join(hints)}. "
                "Give a class, a dotted class path, or the name of a class used in the model."
            )
    wanted_classes, wanted_names = tuple(classes), set(names)
    return find_modules(
        model,
        lambda m, _: isinstance(m, wanted_classes) or type(m).__name__ in wanted_names,
        outermost=True,
    )


def validate_portion(every_n: Any, fraction: Any, owner: str = "apply_activation_checkpointing") -> None:
    """Check ``every_n`` (an int >= 1) / ``fraction`` (a number in ``(0, 1]``), at most one of them given.

    Raises:
        ValueError: naming ``owner``, for a bad value or both given.
    """
    if every_n is not None and fraction is not None:
        raise ValueError(f"`{owner}(every_n={every_n!r}, fraction={fraction!r})`: give one of them, not both.")
    check_int(owner, "every_n", every_n, 1, allow_none=True)
    if fraction is not None:
        check_number(owner, "fraction", fraction, 0, 1, exclusive=True)


def take_portion(blocks: list[Any], every_n: int | None = None, fraction: float | None = None) -> list[Any]:
    """The part of ``blocks`` to checkpoint: every ``every_n``-th (from the first), or the first ``fraction`` of them.

    The first blocks are taken for a fraction because in networks that downsample (ResNets, U-Nets) they hold the
    largest activations; in a transformer every block's activations are the same size, so which does not matter.
    """
    validate_portion(every_n, fraction)
    if every_n is not None:
        return blocks[::every_n]
    if fraction is not None:
        return blocks[: math.ceil(fraction * len(blocks) - 1e-9)]
    return list(blocks)


def apply_activation_checkpointing(
    model: nn.Module,
    modules: Any = "auto",
    *,
    filter_fn: FilterFn | None = None,
    every_n: int | None = None,
    fraction: float | None = None,
    preserve_rng_state: bool = True,
    context_fn: Any = None,
) -> list[str]:
    """Turn on activation checkpointing for blocks of ``model``, in place; returns the names of the blocks wrapped.

    Call it before building the optimizer (it does not change parameters, so an existing optimizer also stays valid).
    Blocks already checkpointed are left as they are, and are not in the returned list.

    Args:
        model: the model.
        modules: which blocks, see :func:`select_blocks` (``"auto"``: the repeated blocks that hold real work).
        filter_fn: ``filter_fn(module, name) -> bool`` instead of ``modules``.
        every_n: checkpoint only every ``every_n``-th of the selected blocks (less recompute, less memory saved).
        fraction: checkpoint only the first ``fraction`` of the selected blocks, in ``(0, 1]``.
        preserve_rng_state: see :class:`CheckpointedForward`.
        context_fn: see :class:`CheckpointedForward` (called anew for each block call).

    Example::

        >>> layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        >>> apply_activation_checkpointing(model, fraction=0.5)
        ['layers.0', 'layers.1']
    """
    blocks = take_portion(select_blocks(model, modules, filter_fn), every_n, fraction)
    wrapped = []
    for name, block in blocks:
        if patch_forward(block, lambda m: CheckpointedForward(m, preserve_rng_state, context_fn)) is not None:
            wrapped.append(name)
    return wrapped


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the submodules of ``model`` that run under activation checkpointing."""
    return [name for name, m in model.named_modules() if find_forward_patch(m, CheckpointedForward) is not None]


def remove_activation_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_activation_checkpointing` in all of ``model``; returns the names of the blocks unpatched."""
    return [name for name, m in model.named_modules() if unpatch_forward(m, CheckpointedForward)]


__all__: list[str] = [
    "CheckpointedForward",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "remove_activation_checkpointing",
    "resolve_module_classes",
    "select_blocks",
    "take_portion",
    "validate_portion",
]
