"""``torch.compile`` applied in place, to a whole model or to its repeated blocks, with a fallback to eager.

Entry points: :func:`compile_regions` and :func:`select_regions` (a :class:`CompiledModules`, undone by
:meth:`CompiledModules.remove`), :class:`CompileMonitor`. ``state_dict`` keys are unchanged. Regional compilation, and
what torch's ``nn.Module.compile()`` does not handle that this module does: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_perf._validation import check_bool, check_choice, check_optional_bool
from lightning_perf._warnings import FallbackWarning, warn_once
from lightning_perf.functional.compile.monitor import CompileMonitor, CompileStats
from lightning_perf.functional.compile.startup import startup_options
from lightning_perf.functional.sharding import is_fsdp_module
from lightning_perf.functional.surgery import (
    ForwardPatch,
    find_forward_patch,
    find_modules,
    find_repeated_blocks,
    import_module_class,
    unpatch_forward,
)

__all__ = [
    "COMPILE_MODES",
    "STAGES",
    "CompileMonitor",
    "CompileStats",
    "CompiledModules",
    "compile_options",
    "compile_regions",
    "inside_wrappers",
    "is_compiler_error",
    "select_regions",
    "top_level_blocks",
    "validate_regions",
]

#: The ``mode`` values ``torch.compile`` accepts (``None`` means ``"default"``).
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

#: Trainer entry points, as Lightning names them in ``Callback.setup(stage=...)``.
STAGES: tuple[str, ...] = ("fit", "validate", "test", "predict")

Regions = str | Sequence["type[nn.Module] | str"] | None


# ------------------------------------------------------------------------------------------------------ validation


def compile_options(
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: Mapping[str, Any] | None = None,
    owner: str = "compile_regions",
) -> dict[str, Any]:
    """Check ``torch.compile`` arguments and return them as keyword arguments for it.

    Args:
        mode: ``None`` or one of :data:`COMPILE_MODES`.
        fullgraph: ``True`` makes a graph break an error (which then falls back, or raises under ``strict``).
        dynamic: ``None`` (automatic), ``True`` or ``False``.
        backend: a registered backend name (``torch._dynamo.list_backends(exclude_tags=())``) or a callable
            ``backend(graph_module, example_inputs) -> callable``.
        options: inductor options (``torch._inductor.list_options()``); not together with ``mode``.
        owner: what to name in error messages.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if ``mode`` or a ``backend`` name is unknown, or ``mode`` and ``options`` are both given.
    """
    check_choice(owner, "mode", mode, (None, *COMPILE_MODES))
    check_bool(owner, "fullgraph", fullgraph)
    check_optional_bool(owner, "dynamic", dynamic)
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"`{owner}(backend={backend!r})` is not a registered torch.compile backend. Expected a callable or "
                f"one of: {', '.join(sorted(known))}."
            )
    elif not callable(backend):
        raise TypeError(
            f"`{owner}(backend={backend!r})` is not valid. Expected a backend name such as 'inductor' or a callable "
            "`backend(graph_module, example_inputs)`."
        )
    if options is not None:
        if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
            raise TypeError(f"`{owner}(options={options!r})` is not valid. Expected None or a dict with string keys.")
        if mode is not None:
            raise ValueError(
                f"`{owner}(mode={mode!r}, options=...)`: torch.compile takes a mode or options, not both. "
                "Pass the options only (e.g. {'triton.cudagraphs': True} for reduce-overhead)."
            )
        if backend == "inductor":
            _check_inductor_options(options, owner)
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend, "mode": mode}
    kwargs["options"] = None if options is None else dict(options)
    return kwargs


def _check_inductor_options(options: Mapping[str, Any], owner: str) -> None:
    """Refuse an option name ``torch._inductor`` does not have (torch would only fail at the first compiled call)."""
    import difflib

    from torch import _inductor

    known = [name for name in _inductor.list_options() if not name.startswith("_") and name != "TYPE_CHECKING"]
    for key in options:
        if key not in known:
            nearest = difflib.get_close_matches(key, known, n=3, cutoff=0.0)
            raise ValueError(
                f"`{owner}(options={dict(options)!r})`: {key!r} is not an inductor option. Nearest valid ones: "
                f"{', '.join(repr(n) for n in nearest)} (all of them: torch._inductor.list_options())."
            )


def validate_regions(regions: Any, owner: str = "compile_regions") -> str | tuple[type[nn.Module] | str, ...] | None:
    """Check and normalize ``regions``: ``None``, ``"auto"``, or a non-empty list of module classes or class names.

    A dotted string (``"torch.nn.TransformerEncoderLayer"``, ``"my_pkg.model.Block"``) is imported here, so a typo
    fails at once; a bare name (``"Block"``) matches modules whose class has that name, and must look like one (a
    Python identifier starting with an upper-case letter), so ``"all"`` or ``"layers"`` is refused rather than
    silently matching nothing.

    Raises:
        TypeError: if ``regions`` or one of its items has the wrong type.
        ValueError: if the list is empty, a string is neither ``"auto"``, a class path nor a class name, or a dotted
            path does not import to an ``nn.Module`` subclass.
    """
    if regions is None or regions == "auto":
        return regions  # type: ignore[no-any-return]
    expected = (
        "Expected None (the whole model), 'auto' (its largest group of repeated blocks) or a list of module classes, "
        "class paths ('torch.nn.TransformerEncoderLayer') or class names ('Block')."
    )
    if isinstance(regions, str) and not _is_class_reference(regions):
        raise ValueError(f"`{owner}(regions={regions!r})` is not valid: {regions!r} is not a class name. {expected}")
    if isinstance(regions, (str, type)):
        regions = [regions]  # one class, or one class name: as a one-item list
    if not isinstance(regions, (list, tuple)):
        raise TypeError(f"`{owner}(regions={regions!r})` is not valid. {expected}")
    if not regions:
        raise ValueError(f"`{owner}(regions=[])` selects nothing. {expected}")
    resolved: list[type[nn.Module] | str] = []
    for item in regions:
        if isinstance(item, type) and issubclass(item, nn.Module):
            resolved.append(item)
        elif isinstance(item, str) and _is_class_reference(item.strip()):
            resolved.append(_module_class(item.strip(), owner) if "." in item else item.strip())
        else:
            raise (ValueError if isinstance(item, str) else TypeError)(
                f"`{owner}(regions={list(regions)!r})`: item {item!r} is not an nn.Module class or class name. "
                + expected
            )
    return tuple(resolved)


def _is_class_reference(text: str) -> bool:
    """A dotted path (``"pkg.module.Class"``) or a plausible class name (an identifier starting upper-case)."""
    parts = text.split(".")
    if len(parts) > 1:
        return all(part.isidentifier() for part in parts)
    return text.isidentifier() and text[0].isupper()


# ------------------------------------------------------------------------------------------------ choosing regions


def _module_class(path: str, owner: str) -> type[nn.Module]:
    try:
        return import_module_class(path)
    except ValueError as error:
        raise ValueError(
            f"`{owner}(regions=[{path!r}])`: {error} Expected the class path of an nn.Module subclass, e.g. "
            "'torch.nn.TransformerEncoderLayer'."
        ) from error


def top_level_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost sub-modules of ``model`` that hold parameters, looking through plain containers."""
    return find_modules(model, _is_top_level_block, outermost=True)


def _is_top_level_block(module: nn.Module, name: str) -> bool:
    plain_container = type(module) in (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return not plain_container and next(module.parameters(), None) is not None


def select_regions(model: nn.Module, regions: Regions) -> list[tuple[str, nn.Module]]:
    """The modules that :func:`compile_regions` compiles, as ``[(qualified_name, module), ...]``.

    Args:
        model: the model.
        regions: ``None`` for ``model`` itself (name ``""``); ``"auto"`` for its main repeated blocks
            (:func:`lightning_perf.functional.surgery.find_repeated_blocks`, as activation checkpointing picks them);
            or module classes / class names (see :func:`validate_regions`), of which the outermost matching modules
            are taken (a match inside another match is compiled as part of it), never ``model`` itself.
    """
    normalized = validate_regions(regions, "select_regions")
    if normalized is None:
        return [("", model)]
    if normalized == "auto":
        return find_repeated_blocks(model)
    classes = tuple(item for item in normalized if isinstance(item, type))
    names = {item for item in normalized if isinstance(item, str)}
    return find_modules(
        model, lambda module, _: isinstance(module, classes) or type(module).__name__ in names, outermost=True
    )


def inside_wrappers(model: nn.Module, selected: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``selected`` moved inside FSDP2's wrappers: never compile around an ``FSDPModule`` (its hooks, collectives).

    A selected module that holds ``fully_shard``-ed modules is replaced by the innermost of them (the blocks, each then
    compiled in its forward, inside its wrapper: per-block compilation after wrapping); a selected ``FSDPModule`` with
    none inside is compiled in its forward. Without FSDP2, ``selected`` is returned as it is.
    """
    sharded = find_modules(model, lambda m, n: is_fsdp_module(m))
    if not sharded:
        return selected
    innermost = [
        (name, module)
        for name, module in sharded
        if not any(other is not module and is_fsdp_module(other) for other in module.modules())
    ]
    kept: dict[str, nn.Module] = {}
    for name, module in selected:
        inside = [(n, m) for n, m in innermost if m is not module and any(m is sub for sub in module.modules())]
        kept.update(inside or [(name, module)])
    return list(kept.items())


# ------------------------------------------------------------------------------------------------------- compiling


def is_compiler_error(error: BaseException) -> bool:
    """Whether ``error`` was raised by torch's compiler (dynamo, AOT autograd, inductor) rather than by the model."""
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(error, TorchDynamoException):
        return True
    try:
        from torch._inductor.exc import CppCompileError, InvalidCxxCompiler, OperatorIssue
    except ImportError:  # pragma: no cover - torch without inductor
        return False
    return isinstance(error, (CppCompileError, InvalidCxxCompiler, OperatorIssue))


def _with_recompile_limit(
    compile_kwargs: Mapping[str, Any], modules: Sequence[tuple[str, nn.Module]]
) -> dict[str, Any]:
    """Raise torch's recompile limit in proportion to the distinct configurations among blocks sharing code.

    Torch caches compiled graphs per code object (a class's ``forward``) and stops compiling one after
    ``torch._dynamo.config.recompile_limit`` (8) variants, running it eagerly from then on. Blocks of one class with
    different shapes or settings (the first block of each ResNet stage, say) each need their own graphs, times the
    training/evaluation/inference variants, so give every distinct configuration the default budget.
    """
    kwargs = dict(compile_kwargs)
    configurations = len({repr(module) for _, module in modules}) if len(modules) > 1 else 1
    if configurations > 1 and "recompile_limit" in inspect.signature(torch.compile).parameters:
        kwargs["recompile_limit"] = torch._dynamo.config.recompile_limit * configurations
    return kwargs


def _compiled(call: Callable[..., Any], module: nn.Module, compile_kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    try:
        from torch._dynamo import external_utils, trace_rules

        if trace_rules.check(module.forward):
            # A built-in layer: no frame of its call is traced, so give torch one (what torch.compile(module) does).
            call = external_utils.wrap_inline(call)
    except (ImportError, AttributeError):  # pragma: no cover - private helpers moved in a later torch
        pass
    kwargs = dict(compile_kwargs)
    if kwargs.get("options") is not None:
        kwargs["options"] = dict(kwargs["options"])  # torch.compile pops keys from it
    return torch.compile(call, **kwargs)


class _CompiledCall:
    """What a compiled module's ``__call__`` runs: the compiled call, with the fallback on a compiler failure."""

    __slots__ = ("calls", "compiled", "forward", "module", "name", "owner")

    def __init__(self, owner: CompiledModules, name: str, module: nn.Module, compile_kwargs: Mapping[str, Any]) -> None:
        self.owner = owner
        self.name = name
        self.module = module
        self.compiled = _compiled(module._call_impl, module, compile_kwargs)
        self.forward = _function_of(module.forward)
        self.calls = 0
        module._compiled_call_impl = self

    @property
    def installed(self) -> bool:
        return self.module._compiled_call_impl is self

    def uninstall(self) -> None:
        if self.installed:
            self.module._compiled_call_impl = None

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        return self.module._call_impl(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _function_of(self.module.forward) is not self.forward:
            # `forward` was swapped for this call: Lightning's forward redirection (DDP, FSDP) sends `training_step`
            # through the module's `__call__`. Compiling that would compile the whole step (logging included); run
            # it eagerly instead, and the step's own `self(x)` runs compiled.
            return self.module._call_impl(*args, **kwargs)
        return _run_compiled(self, args, kwargs)


class _CompiledForward(ForwardPatch):
    """A sharded (FSDP2) block's ``forward`` compiled inside its wrapper: FSDP2's hooks stay eager around it.

    Patching ``forward`` rather than ``__call__`` keeps the all-gather before and the reshard after the compiled region,
    as compiling each block before ``fully_shard`` does (torchtitan's order); a forward patch already there (activation
    checkpointing) is compiled with the block, so checkpointing runs inside the compiled region.
    """

    def __init__(self, owner: CompiledModules, name: str, module: nn.Module, compile_kwargs: Mapping[str, Any]) -> None:
        super().__init__(module)
        self.owner = owner
        self.name = name
        self.calls = 0
        self.compiled = _compiled(self.call_original, module, compile_kwargs)
        module.__dict__["forward"] = self.__call__

    @property
    def installed(self) -> bool:
        return find_forward_patch(self.module, _CompiledForward) is self

    def uninstall(self) -> None:
        if self.installed:
            unpatch_forward(self.module, _CompiledForward)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_original(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.installed:  # a fallback took it out while an outer caller still held this bound method
            return self.call_original(*args, **kwargs)
        return _run_compiled(self, args, kwargs)


_Compiled = _CompiledCall | _CompiledForward


def _run_compiled(entry: _Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    entry.calls += 1
    try:
        return entry.compiled(*args, **kwargs)
    except Exception as error:
        if not is_compiler_error(error):
            raise
        return entry.owner._fall_back(entry, error, args, kwargs)


def _function_of(method: Any) -> Any:
    return getattr(method, "__func__", method)


class CompiledModules:
    """Modules compiled in place by :func:`compile_regions`; :meth:`remove` makes them plain modules again.

    Attributes:
        names: qualified names of the compiled modules, in order (``""`` is the model itself).
        failures: per module class name, the compiler error that turned compilation off for that class.
        strict: whether a compiler failure raises instead of falling back.
    """

    def __init__(
        self,
        modules: Iterable[tuple[str, nn.Module]],
        compile_kwargs: Mapping[str, Any],
        strict: bool = False,
    ) -> None:
        self.strict = strict
        self.failures: dict[str, str] = {}
        self._calls: list[_Compiled] = []
        modules = list(modules)
        compile_kwargs = _with_recompile_limit(compile_kwargs, modules)
        for name, module in modules:
            # An FSDP2 block is compiled inside its wrapper (its forward); any other module in place of its __call__.
            kind = _CompiledForward if is_fsdp_module(module) else _CompiledCall
            self._calls.append(kind(self, name, module, compile_kwargs))
        self.names: list[str] = [call.name for call in self._calls]

    @property
    def calls(self) -> int:
        """How many times a compiled module was called (compiled or, after a fallback, not)."""
        return sum(call.calls for call in self._calls)

    @property
    def active(self) -> list[str]:
        """Names of the modules that still run compiled."""
        return [call.name for call in self._calls if call.installed]

    def remove(self) -> None:
        """Make every module plain again (a module compiled by someone else since is left alone). Idempotent."""
        for call in self._calls:
            call.uninstall()

    def _fall_back(self, failed: _Compiled, error: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The eager call decides whose error it is: if it fails too, that error (the model's) propagates unchanged.
        result = failed.eager(*args, **kwargs)
        if self.strict:
            raise error
        cls = type(failed.module)
        siblings = [call for call in self._calls if type(call.module) is cls]
        for call in siblings:  # the same code would fail the same way: do not pay for it once per block
            call.uninstall()
        cause = f"{type(error).__name__}: {_summary(error)}"
        self.failures[cls.__name__] = cause
        warn_once(
            f"torch.compile failed for {cls.__name__}: the {len(siblings)} compiled module(s) of that class now run "
            f"eagerly, and nothing else changes. Cause: {cause}. Pass strict=True to raise instead.",
            FallbackWarning,
        )
        return result


def _summary(error: BaseException) -> str:
    """The first line of an error's message, and the next when the first only leads into it ("backend raised:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def compile_regions(
    model: nn.Module,
    regions: Regions = None,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str | Callable[..., Any] = "inductor",
    options: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> CompiledModules:
    """Compile ``model`` (or its repeated blocks) in place; ``state_dict`` keys do not change.

    Args:
        model: the model.
        regions: what to compile: ``None`` the model's own ``forward``; ``"auto"`` its main repeated blocks
            (:func:`~lightning_perf.functional.surgery.find_repeated_blocks`); or a list of module classes, class paths
            or class names, whose outermost instances are compiled (the model itself never is).
        mode, fullgraph, dynamic, backend, options: passed to ``torch.compile`` (see :func:`compile_options`). Regions
            on a CPU with ``inductor`` and neither ``mode`` nor ``options`` get ``options={"cpp_wrapper": True}``
            (:func:`~lightning_perf.functional.compile.startup.startup_options`).
        strict: raise a compiler failure instead of falling back to eager with a ``FallbackWarning``.

    Returns:
        The handle: ``.names`` of what was compiled (empty if ``regions`` matched nothing), ``.remove()`` to undo.

    Example::

        compiled = compile_regions(model, "auto", backend="inductor")
        loss = model(x).sum()  # the first call compiles
        compiled.remove()      # plain model again
    """
    kwargs = compile_options(
        mode=mode, fullgraph=fullgraph, dynamic=dynamic, backend=backend, options=options, owner="compile_regions"
    )
    check_bool("compile_regions", "strict", strict)
    regions = validate_regions(regions)
    selected = inside_wrappers(model, select_regions(model, regions))
    kwargs = startup_options(model, selected, kwargs)  # on a CPU: a quicker cold start (compile_startup)
    return CompiledModules(selected, kwargs, strict=strict)
