"""Float8 training with torchao, layer by layer where it pays: eligibility, a measured shape filter, convert and undo.

Entry points: :func:`plan_float8` (a :class:`Float8Plan`, one :class:`LayerDecision` per ``nn.Linear``),
:func:`convert_to_float8` (undone by :meth:`Float8Conversion.undo`), :func:`sharded_linears`. When float8 pays, the
rules per layer and the order under FSDP2: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_perf._device import as_device, cuda_capability, is_sm_at_least
from lightning_perf._imports import require
from lightning_perf._io import DecisionCache
from lightning_perf._validation import check_choice
from lightning_perf.functional.surgery import restore_modules
from lightning_perf.profiling.intervals import RatioEstimate
from lightning_perf.profiling.latency import Blocks, paired_blocks, speedup_estimate
from lightning_perf.profiling.machine import decision_key

__all__ = [
    "CACHE_FILE",
    "DEFAULT_ROWS",
    "FILTERS",
    "MIN_CAPABILITY",
    "RECIPES",
    "Blocks",
    "Float8Conversion",
    "Float8Plan",
    "LayerDecision",
    "LinearShape",
    "ShapeTimer",
    "convert_to_float8",
    "float8_unsupported_reason",
    "is_sm_at_least_89",
    "linear_rows",
    "machine_key",
    "output_layer_names",
    "plan_float8",
    "sharded_linears",
    "time_linear_shape",
]

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's float8 recipe names (``Float8LinearConfig.from_recipe_name``)."""
FILTERS = ("auto", "all")
"""``"auto"``: convert the shapes measured faster in float8; ``"all"``: every eligible layer, unmeasured."""
MIN_CAPABILITY = (8, 9)
"""Float8 tensor cores: Ada (sm 89), Hopper (sm 90) and newer."""
DEFAULT_ROWS = 8192
"""Rows of the timed input (tokens per micro-batch) when the model's own cannot be found: 16 sequences of 512."""
CACHE_FILE = "float8_shapes.json"
_CACHE = DecisionCache(CACHE_FILE, "float8 shape cache")

# Decisions (LayerDecision.reason) that no measurement changes.
ELIGIBLE = "eligible"
FASTER = "measured faster in float8"
NOT_FASTER = "not measured faster in float8"


# ---------------------------------------------------------------------------------------------------------------------
# Hardware gates


def is_sm_at_least_89(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` is a CUDA GPU with float8 tensor cores (compute capability 8.9 or newer)."""
    return is_sm_at_least(*MIN_CAPABILITY, device=device)


def float8_unsupported_reason(device: torch.device | str | None = None) -> str | None:
    """Why float8 matmuls cannot run fast on ``device``, or ``None`` when they can."""
    dev = as_device(device)
    if dev.type != "cuda":
        return f"the device is {dev.type!r}, and float8 matrix products need a CUDA GPU of compute capability 8.9+"
    capability = cuda_capability(dev)
    if capability is None:
        return "CUDA is not available, and float8 matrix products need a CUDA GPU of compute capability 8.9+"
    if not is_sm_at_least_89(dev):
        name = torch.cuda.get_device_name(dev)
        return (
            f"{name} has compute capability {capability[0]}.{capability[1]}; float8 tensor cores need 8.9+ "
            "(Ada, Hopper or newer)"
        )
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Eligibility


@dataclass(frozen=True, order=True)
class LinearShape:
    """One distinct matrix product: ``rows`` x ``in_features`` input, ``out_features`` outputs, with or without bias."""

    rows: int
    in_features: int
    out_features: int
    bias: bool

    @property
    def key(self) -> str:
        """``"8192x768x3072+bias"``: rows x in x out, the cache's key."""
        return f"{self.rows}x{self.in_features}x{self.out_features}{'+bias' if self.bias else ''}"


@dataclass
class LayerDecision:
    """What :func:`plan_float8` decided for one ``nn.Linear``: ``convert`` or not, and why.

    ``estimate`` is the measured speed-up of its shape (bf16 time over float8 time, with its 95% interval) under
    ``filter="auto"``; ``cached`` says it came from the cache file.
    """

    name: str
    shape: LinearShape
    convert: bool
    reason: str
    estimate: RatioEstimate | None = None
    cached: bool = False


@dataclass
class Float8Plan:
    """Per-layer decisions (in ``named_modules`` order) and the per-shape measurements behind them."""

    decisions: dict[str, LayerDecision] = field(default_factory=dict)
    measured: dict[LinearShape, RatioEstimate] = field(default_factory=dict)
    cached: set[LinearShape] = field(default_factory=set)

    @property
    def names(self) -> list[str]:
        """The layers to convert."""
        return [name for name, d in self.decisions.items() if d.convert]

    def shape_lines(self, shapes: Iterable[LinearShape] | None = None) -> list[str]:
        """One line per measured shape (or per one of ``shapes``):
        ``"8192x768x3072+bias: 1.31x [1.25-1.37], faster -> float8 (cached)"``."""
        lines = []
        for shape in sorted(self.measured if shapes is None else shapes):
            est = self.measured[shape]
            verdict = "float8" if est.low > 1.0 else "bf16"
            cached = " (cached)" if shape in self.cached else ""
            lines.append(f"{shape.key}: {est.format()}, {est.verdict} -> {verdict}{cached}")
        return lines


FilterFn = Callable[[nn.Module, str], bool]


def _forward_is_linear(module: nn.Module) -> bool:
    return type(module).forward is nn.Linear.forward


def output_layer_names(model: nn.Module) -> set[str]:
    """The model's output layer(s): the last ``nn.Linear`` registered, and any ``nn.Linear`` whose weight another
    module also holds (a head tied to the embedding)."""
    linears = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    names = {linears[-1][0]} if linears else set()
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    names.update(n for n, m in linears if holders.get(id(m.weight), 0) > 1)
    return names


def sharded_linears(model: nn.Module) -> list[str]:
    """The ``nn.Linear`` layers whose parameters FSDP2 (``fully_shard``) or tensor parallelism sharded (DTensors)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support shards nothing
        return []
    return [
        name
        for name, module in model.named_modules()
        if name and isinstance(module, nn.Linear) and isinstance(module.weight, DTensor)
    ]


def _static_reason(name: str, module: nn.Linear, parent: nn.Module | None, outputs: set[str]) -> str | None:
    """Why ``module`` can never be converted, or ``None``."""
    if type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao"):
        return "already a torchao Float8Linear"
    if not _forward_is_linear(module):
        return f"{type(module).__name__} has its own forward"
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention uses its weight directly, not its forward"
    if not module.weight.is_floating_point():
        return f"weight dtype {module.weight.dtype} is not floating point"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features}x{module.out_features}: both dimensions must be divisible by 16"
    if name in outputs:
        return "the output layer (skip_last)"
    return None


def plan_float8(
    model: nn.Module,
    *,
    filter: str | FilterFn = "auto",
    skip_last: bool = True,
    rows: int | Mapping[str, int] = DEFAULT_ROWS,
    timer: ShapeTimer | None = None,
    cache_path: str | os.PathLike[str] | None = None,
    cache_key: str | None = None,
    refresh: bool = False,
) -> Float8Plan:
    """Decide, per ``nn.Linear`` of ``model``, whether it trains in float8.

    Args:
        model: the model (its layers are only read).
        filter: ``"auto"`` (measure each distinct shape with ``timer``), ``"all"`` (every eligible layer) or
            ``filter_fn(module, fqn) -> bool``, which overrides every other rule (dimensions and ``skip_last``
            included) for the ``nn.Linear`` layers it is called on.
        skip_last: keep the output layer (:func:`output_layer_names`) in high precision.
        rows: rows of each layer's input (tokens per micro-batch), one figure or ``{name: rows}``
            (:func:`linear_rows`); a name missing from the mapping takes :data:`DEFAULT_ROWS`.
        timer: ``timer(shape) -> (bf16 blocks, float8 blocks)``, per-call seconds in paired blocks; needed for
            ``"auto"`` (:func:`time_linear_shape` bound to a device, or a scripted one in tests).
        cache_path: the JSON cache of measured shapes (default: ``float8_shapes.json`` in the user's cache folder).
        cache_key: the machine the figures hold for (default :func:`machine_key` of the current CUDA device).
        refresh: measure again even when the cache holds a shape.

    Raises:
        ValueError: for an unknown ``filter`` string, or ``"auto"`` without a ``timer``.
    """
    if isinstance(filter, str) and filter not in FILTERS:
        raise ValueError(f"`plan_float8(filter={filter!r})` is not valid. Expected one of {FILTERS} or a callable.")
    if filter == "auto" and timer is None:
        raise ValueError("`plan_float8(filter='auto')` needs a `timer` to measure each shape with.")
    outputs = output_layer_names(model) if skip_last else set()
    plan = Float8Plan()
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.Linear):
            continue
        layer_rows = rows.get(name, DEFAULT_ROWS) if isinstance(rows, Mapping) else rows
        shape = LinearShape(int(layer_rows), module.in_features, module.out_features, module.bias is not None)
        if callable(filter):
            keep = bool(filter(module, name))
            static = None if _forward_is_linear(module) else f"{type(module).__name__} has its own forward"
            reason = "chosen by filter_fn" if keep else "left out by filter_fn"
            plan.decisions[name] = LayerDecision(name, shape, keep and static is None, static or reason)
            continue
        why_not = _static_reason(name, module, parents.get(id(module)), outputs)
        plan.decisions[name] = LayerDecision(name, shape, why_not is None, why_not or ELIGIBLE)
    if filter == "auto":
        assert timer is not None
        _measure(plan, timer, _CACHE.path(cache_path or None), cache_key, refresh)
    return plan


# ---------------------------------------------------------------------------------------------------------------------
# The measured filter

ShapeTimer = Callable[[LinearShape], tuple[Blocks, Blocks]]


def machine_key(device: torch.device | str | None = None, recipe: str = "tensorwise", compiled: bool = True) -> str:
    """The cache key of shape timings: GPU model and compute capability, torch and torchao versions, recipe, compile."""
    return decision_key(as_device(device), ("torchao",), recipe=recipe, compiled="yes" if compiled else "no")


def _estimate_from(entry: Any) -> RatioEstimate | None:
    try:
        return RatioEstimate(
            float(entry["ratio"]),
            float(entry["low"]),
            float(entry["high"]),
            str(entry["method"]),
            str(entry["verdict"]),
            int(entry["n"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def _measure(plan: Float8Plan, timer: ShapeTimer, path: Path, cache_key: str | None, refresh: bool) -> None:
    key = cache_key if cache_key is not None else machine_key()
    known = _CACHE.entry(path, key)
    shapes = sorted({d.shape for d in plan.decisions.values() if d.convert})
    fresh = False
    for shape in shapes:
        estimate = None if refresh else _estimate_from(known.get(shape.key))
        if estimate is not None:
            plan.cached.add(shape)
        else:
            baseline, candidate = timer(shape)
            estimate = speedup_estimate(baseline, candidate)
            known[shape.key] = dataclasses.asdict(estimate)
            fresh = True
        plan.measured[shape] = estimate
        log.info("float8 %s: %s, %s", shape.key, estimate.format(), estimate.verdict)
    for decision in plan.decisions.values():
        if decision.convert:
            est = plan.measured[decision.shape]
            decision.estimate, decision.cached = est, decision.shape in plan.cached
            # Kept only when the whole interval clears 1: a shape inside its own noise stays in bf16.
            decision.convert = est.low > 1.0
            decision.reason = FASTER if decision.convert else NOT_FASTER
    if fresh:
        _CACHE.store(path, key, known)


def float8_config(recipe: str = "tensorwise", *, emulate: bool = False, fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``emulate=True`` runs the float8 products in high precision
    (any device: for tests), ``fsdp_float8_all_gather`` all-gathers weights in float8 under FSDP2 (tensorwise only).

    Raises:
        ValueError: for an unknown recipe, or float8 all-gather with a recipe other than ``"tensorwise"``.
        ModuleNotFoundError: if torchao is not installed (the ``qat`` extra).
    """
    check_choice("float8_config", "recipe", recipe, RECIPES)
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"float8 all-gather under FSDP2 needs recipe='tensorwise', not {recipe!r}.")
    float8 = require("torchao", "Float8 training").float8
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def time_linear_shape(
    shape: LinearShape,
    *,
    device: torch.device | str,
    recipe: str = "tensorwise",
    compiled: bool = True,
    iterations: int = 20,
    warmup: int = 3,
    repeats: int = 3,
    emulate: bool = False,
) -> tuple[Blocks, Blocks]:
    """Time one training step of a lone ``nn.Linear`` of ``shape`` (forward, backward to its input and weights) in
    bf16 against its float8 version, paired and interleaved (ABBA blocks, ``repeats`` times): ``(bf16 blocks, float8
    blocks)`` of per-call seconds. ``compiled`` compiles both, as a float8 model must be to be fast.
    """
    require("torchao", "Float8 training")
    from torchao.float8.float8_linear import Float8Linear

    dev = as_device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    base = nn.Linear(shape.in_features, shape.out_features, bias=shape.bias).to(device=dev, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_float(copy.deepcopy(base), config=float8_config(recipe, emulate=emulate))
    x = torch.randn(shape.rows, shape.in_features, generator=generator).to(device=dev, dtype=torch.bfloat16)
    grad = torch.randn(shape.rows, shape.out_features, generator=generator).to(device=dev, dtype=torch.bfloat16)
    x.requires_grad_(True)

    def step_of(module: nn.Module) -> Callable[[], None]:
        forward = torch.compile(module) if compiled else module

        def step() -> None:
            module.zero_grad(set_to_none=True)
            x.grad = None
            forward(x).backward(grad)

        return step

    base_step, fp8_step = step_of(base), step_of(fp8)
    baseline: Blocks = []
    candidate: Blocks = []
    # Every timed shape compiles the same forward code again: without room for them, dynamo's recompile limit (8)
    # would silently leave the later shapes uncompiled, and float8 uncompiled is slow. Restored on return.
    with _dynamo_room(compiled):
        for _ in range(repeats):
            b, c = paired_blocks(base_step, fp8_step, iterations=iterations, warmup=warmup, device=dev)
            baseline += b
            candidate += c
    return baseline, candidate


@contextlib.contextmanager
def _dynamo_room(compiled: bool, extra: int = 64) -> Iterator[None]:
    if not compiled:
        yield
        return
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, name)
    setattr(dynamo_config, name, before + extra)
    try:
        yield
    finally:
        setattr(dynamo_config, name, before)


def linear_rows(model: nn.Module, inputs: Any) -> dict[str, int]:
    """The rows each ``nn.Linear`` of ``model`` multiplies (its input's elements over ``in_features``: tokens per
    micro-batch in a transformer) when ``model`` runs on ``inputs`` (a tensor, a tuple of them, or a dict of keyword
    arguments).

    The forward runs on fake tensors (``FakeTensorMode``): shapes only, no arithmetic and no memory, whatever the
    model's size. Layers not called are missing from the result.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if name and isinstance(module, nn.Linear):

            def record(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
                    rows.setdefault(name, int(args[0].numel() // max(int(args[0].shape[-1]), 1)))

            handles.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            if isinstance(inputs, Mapping):
                model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Convert and undo


@dataclass
class Float8Conversion:
    """What :func:`convert_to_float8` changed; :meth:`undo` puts it all back."""

    replaced: dict[str, tuple[nn.Module, nn.Module]] = field(default_factory=dict)
    _inductor_patch: tuple[Any, dict[str, Any], Any] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.replaced)

    def undo(self, model: nn.Module) -> None:
        """Put every ``nn.Linear`` back, holding the weights trained meanwhile (the same Parameters; a float8
        all-gather weight wrapper is unwrapped), and torch's inductor code generation as it was. Idempotent."""
        for _, new in self.replaced.values():
            weight = new._parameters.get("weight")
            inner = getattr(weight, "_tensor", None) if weight is not None else None
            if isinstance(inner, nn.Parameter):  # torchao's float8 all-gather wrapper holds the original Parameter
                new._parameters["weight"] = inner
            elif isinstance(inner, torch.Tensor):
                new._parameters["weight"] = nn.Parameter(inner, requires_grad=inner.requires_grad)
        restore_modules(model, self.replaced)
        self.replaced = {}
        if self._inductor_patch is not None:
            overrides, saved, patch_module = self._inductor_patch
            for attr, value in saved.items():
                setattr(overrides, attr, value)
            patch_module._PATCHED = False
            self._inductor_patch = None


def _inductor_state() -> tuple[Any, dict[str, Any], Any] | None:
    """torch's Triton min/max code generation, which torchao's conversion patches process-wide (a workaround for
    triton-lang/triton#11111): saved so that :meth:`Float8Conversion.undo` can put it back."""
    try:
        patch_module = importlib.import_module("torchao.float8._inductor_patch")
        from torch._inductor.codegen.triton import TritonOverrides
    except Exception:  # inductor or torchao internals moved: nothing we know how to restore
        return None
    if getattr(patch_module, "_PATCHED", True):
        return None  # patched before us: not ours to undo
    saved = {
        attr: TritonOverrides.__dict__[attr] for attr in ("minimum", "maximum") if attr in TritonOverrides.__dict__
    }
    return TritonOverrides, saved, patch_module


def convert_to_float8(
    model: nn.Module,
    names: Iterable[str] | Float8Plan,
    *,
    recipe: str = "tensorwise",
    emulate: bool = False,
    fsdp_float8_all_gather: bool = False,
) -> Float8Conversion:
    """Swap the named ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear``, in place.

    Each new layer holds the original ``weight`` and ``bias`` Parameters (same objects, dtypes and ``state_dict``
    keys), so an optimizer built before stays valid and a checkpoint loads with or without the conversion. Call it
    before ``fully_shard`` (torchao's order); it refuses layers already sharded.

    Args:
        model: the model to change in place.
        names: the layers to convert (fully qualified names) or a :class:`Float8Plan`.
        recipe: one of :data:`RECIPES`.
        emulate: compute the float8 products in high precision (runs anywhere: tests, CPU).
        fsdp_float8_all_gather: under FSDP2, all-gather the weights in float8 (tensorwise only).

    Returns:
        The :class:`Float8Conversion`; ``conversion.undo(model)`` swaps back.

    Raises:
        ValueError: for a name that is not an ``nn.Linear`` of ``model``, or a layer already sharded.
        ModuleNotFoundError: if torchao is not installed (the ``qat`` extra).
    """
    wanted = names.names if isinstance(names, Float8Plan) else list(names)
    config = float8_config(recipe, emulate=emulate, fsdp_float8_all_gather=fsdp_float8_all_gather)
    modules = dict(model.named_modules())
    bad = [n for n in wanted if not n or not isinstance(modules.get(n), nn.Linear)]
    if bad:
        raise ValueError(f"`convert_to_float8` got names that are not nn.Linear layers of the model: {bad}.")
    sharded = sorted(set(wanted) & set(sharded_linears(model)))
    if sharded:
        raise ValueError(
            f"`convert_to_float8`: {sharded} are already sharded (DTensor parameters). torchao converts before "
            "sharding: call it in `configure_model` before `fully_shard`."
        )
    conversion = Float8Conversion()
    if not wanted:
        return conversion
    float8 = require("torchao", "Float8 training").float8
    conversion._inductor_patch = _inductor_state()
    before = dict(model.named_modules(remove_duplicate=False))
    chosen = {id(modules[n]) for n in wanted}  # a layer registered under several names is converted everywhere
    # torchao's own entry point, so its process-wide set-up (the inductor workaround) happens as it intends.
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: id(m) in chosen, config=config)
    after = dict(model.named_modules(remove_duplicate=False))
    new_for = {id(old): after[name] for name, old in before.items() if id(old) in chosen and after.get(name) is not old}
    for name, old in before.items():
        if id(old) not in new_for:
            continue
        new = new_for[id(old)]
        if after.get(name) is old:  # another name of a shared layer (torchao swaps the first): the same new layer
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        new.training = old.training
        conversion.replaced[name] = (old, new)
    return conversion
