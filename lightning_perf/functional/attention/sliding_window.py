"""Sliding-window inference over inputs larger than a network's patch, through MONAI's ``sliding_window_inference``.

Entry points: :func:`validate_sliding_window`, :func:`apply_sliding_window` / :func:`remove_sliding_window` (a
:class:`SlidingWindowForward`), :func:`choose_sw_batch_size` (``sw_batch_size="auto"``, measured). No Lightning; MONAI
is imported only when a window runs. Which inputs go through the window: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._imports import require
from lightning_perf._validation import check_device, is_int, is_number
from lightning_perf.functional.surgery import ForwardPatch, find_forward_patch, patch_forward, unpatch_forward
from lightning_perf.profiling.latency import LatencyRow, paired_blocks
from lightning_perf.profiling.machine import installed_version
from lightning_perf.profiling.memory import MemoryProbe

__all__ = [
    "BLEND_MODES",
    "PADDING_MODES",
    "SLIDING_WINDOW_STAGES",
    "SlidingWindowForward",
    "SlidingWindowSettings",
    "SwBatchSizeChoice",
    "apply_sliding_window",
    "choose_sw_batch_size",
    "memory_headroom_bytes",
    "needs_window",
    "remove_sliding_window",
    "require_monai",
    "resolve_roi_size",
    "sliding_window_patch",
    "sliding_window_predict",
    "validate_sliding_window",
]

BLEND_MODES: tuple[str, ...] = ("constant", "gaussian")
PADDING_MODES: tuple[str, ...] = ("constant", "reflect", "replicate", "circular")
SLIDING_WINDOW_STAGES: tuple[str, ...] = ("predict", "test", "validate")
ROI_FROM_MODEL = "model"
"""``roi_size="model"``: read the patch size from the model's ``roi_size`` attribute, else ``hparams["roi_size"]``."""

AUTO_MAX_SW_BATCH_SIZE = 64
"""The largest size ``sw_batch_size="auto"`` tries."""
AUTO_ITERATIONS = 4
"""Timed calls per size and comparison (two per ABBA block) in ``sw_batch_size="auto"``; one untimed call per block."""
AUTO_MEMORY_FRACTION = 0.8
"""Share of the free memory a candidate size may be expected to use."""


def require_monai() -> ModuleType:
    """Import ``monai.inferers``, or raise a ``ModuleNotFoundError`` naming the ``monai`` extra."""
    require("monai", "SlidingWindowInferenceCallback")
    return importlib.import_module("monai.inferers")


@dataclass(frozen=True)
class SlidingWindowSettings:
    """The validated arguments of MONAI's ``sliding_window_inference`` (see :func:`validate_sliding_window`)."""

    roi_size: int | tuple[int, ...] | str
    sw_batch_size: int | str = 1
    overlap: float | tuple[float, ...] = 0.25
    mode: str = "gaussian"
    sigma_scale: float | tuple[float, ...] = 0.125
    padding_mode: str = "constant"
    cval: float = 0.0
    sw_device: torch.device | None = None
    device: torch.device | None = None
    progress: bool = False
    roi_weight_map: Tensor | None = field(default=None, compare=False)
    process_fn: Callable[..., Any] | None = None
    buffer_steps: int | None = None
    buffer_dim: int = -1

    def with_roi(self, roi_size: int | tuple[int, ...]) -> SlidingWindowSettings:
        return dataclasses.replace(self, roi_size=roi_size)


def _one_of(options: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in options


def _per_dim(owner: str, name: str, value: Any, check: Callable[[Any], bool], expected: str) -> Any:
    """``value`` as a number or a tuple of numbers, each passing ``check``; else ``ValueError``."""
    items = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not items or not all(check(v) for v in items):
        raise ValueError(
            f"`{owner}({name}={value!r})` is not valid. Expected {expected}, or a non-empty sequence of them "
            "(one per spatial dimension)."
        )
    return items if isinstance(value, (list, tuple)) else value


def validate_sliding_window(owner: str = "sliding_window_inference", **kwargs: Any) -> SlidingWindowSettings:
    """Check the arguments of :class:`SlidingWindowSettings` and return them normalized (sequences as tuples).

    Args:
        owner: the name shown in error messages.
        kwargs: ``roi_size`` and any other field of :class:`SlidingWindowSettings`.

    Raises:
        ValueError: for an empty, zero, negative or non-integer ``roi_size`` (other than ``"model"``), an ``overlap``
            outside ``[0, 1)``, a ``sw_batch_size`` below 1 (other than ``"auto"``), an unknown ``mode`` or
            ``padding_mode``, a ``sigma_scale`` <= 0, a non-finite ``cval``, a ``buffer_steps`` below 1, a bad device
            string.
        TypeError: for a non-bool ``progress``, a ``roi_weight_map`` that is not a tensor, a ``process_fn`` that is
            not callable, a ``buffer_dim`` that is not an int, a device of the wrong type.
    """
    unknown = set(kwargs) - set(SlidingWindowSettings.__dataclass_fields__)
    if unknown:
        raise TypeError(f"`{owner}` got unknown arguments {sorted(unknown)}.")
    if "roi_size" not in kwargs:
        raise TypeError(f"`{owner}` needs `roi_size`.")
    args = {**vars(SlidingWindowSettings(roi_size=ROI_FROM_MODEL)), **kwargs}
    if not (isinstance(args["roi_size"], str) and args["roi_size"] == ROI_FROM_MODEL):
        expected = f"a positive integer or {ROI_FROM_MODEL!r}"
        args["roi_size"] = _per_dim(owner, "roi_size", args["roi_size"], lambda v: is_int(v, 1), expected)
    for name, check, error, expected in _ARGUMENT_CHECKS:
        if name in _PER_DIM_ARGUMENTS:
            args[name] = _per_dim(owner, name, args[name], check, expected)
        elif not check(args[name]):
            raise error(f"`{owner}({name}={args[name]!r})` is not valid. Expected {expected}.")
    weight_map = args["roi_weight_map"]
    if weight_map is not None and (weight_map.numel() == 0 or bool((weight_map < 0).any())):
        raise ValueError(
            f"`{owner}(roi_weight_map=<tensor {tuple(weight_map.shape)}>)` is not valid. Expected a non-empty, "
            "non-negative tensor."
        )
    devices = {name: check_device(owner, name, args[name], allow_none=True) for name in ("sw_device", "device")}
    return SlidingWindowSettings(**{**args, **devices, "cval": float(args["cval"])})


_PER_DIM_ARGUMENTS = ("overlap", "sigma_scale")
_ARGUMENT_CHECKS: tuple[tuple[str, Callable[[Any], bool], type[Exception], str], ...] = (
    ("sw_batch_size", lambda v: v == "auto" or is_int(v, 1), ValueError, "an integer >= 1 or 'auto'"),
    ("overlap", lambda v: is_number(v) and 0 <= v < 1, ValueError, "a number in [0, 1)"),
    ("mode", _one_of(BLEND_MODES), ValueError, f"one of {', '.join(map(repr, BLEND_MODES))}"),
    ("sigma_scale", lambda v: is_number(v) and v > 0, ValueError, "a number > 0"),
    ("padding_mode", _one_of(PADDING_MODES), ValueError, f"one of {', '.join(map(repr, PADDING_MODES))}"),
    ("cval", is_number, ValueError, "a finite number"),
    ("progress", lambda v: isinstance(v, bool), TypeError, "True or False"),
    (
        "roi_weight_map",
        lambda v: v is None or isinstance(v, Tensor),
        TypeError,
        "None or a non-negative tensor of the window's spatial shape",
    ),
    (
        "process_fn",
        lambda v: v is None or callable(v),
        TypeError,
        "None or a function `process_fn(outputs, window, importance_map) -> (outputs, importance_map)`",
    ),
    ("buffer_steps", lambda v: v is None or is_int(v, 1), ValueError, "None or an integer >= 1"),
    ("buffer_dim", is_int, TypeError, "an integer (a spatial dimension)"),
)
"""Each argument after ``roi_size``: its name, the check it must pass, the error otherwise, and what is expected."""


def resolve_roi_size(model: nn.Module, owner: str = "sliding_window_inference") -> tuple[int, ...] | int:
    """The patch size a model declares: its ``roi_size`` attribute, else ``hparams["roi_size"]``.

    Raises:
        ValueError: if the model declares none, or one that is not a positive integer or a sequence of them.
    """
    roi = getattr(model, "roi_size", None)
    if roi is None:
        hparams: Any = getattr(model, "hparams", None)
        roi = hparams.get("roi_size") if hparams is not None and hasattr(hparams, "get") else None
    if roi is None:
        raise ValueError(
            f"`{owner}(roi_size='model')`: {type(model).__name__} declares no patch size. Expected a `roi_size` "
            "attribute or a `roi_size` hyperparameter (an int or one int per spatial dimension), or pass "
            "`roi_size=` explicitly."
        )
    return _per_dim(
        owner,
        f"roi_size={ROI_FROM_MODEL!r} -> model.roi_size",
        roi,
        lambda v: is_int(v, 1),
        "a positive integer",
    )


def _spatial_roi(roi_size: int | tuple[int, ...], spatial_dims: int) -> tuple[int, ...] | None:
    if isinstance(roi_size, int):
        return (roi_size,) * spatial_dims
    return tuple(roi_size) if len(roi_size) == spatial_dims else None


def needs_window(inputs: Any, roi_size: int | tuple[int, ...]) -> bool:
    """Whether ``inputs`` goes through the sliding window: a tensor ``(N, C, *spatial)`` of the rank ``roi_size``
    implies whose spatial shape differs from ``roi_size`` (see the module notes)."""
    if not isinstance(inputs, Tensor) or inputs.dim() < 3:
        return False
    roi = _spatial_roi(roi_size, inputs.dim() - 2)
    return roi is not None and tuple(inputs.shape[2:]) != roi


def _monai_kwargs(settings: SlidingWindowSettings, sliding_window_inference: Callable[..., Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "overlap": settings.overlap,
        "mode": settings.mode,
        "sigma_scale": settings.sigma_scale,
        "padding_mode": settings.padding_mode,
        "cval": settings.cval,
        "sw_device": settings.sw_device,
        "device": settings.device,
        "progress": settings.progress,
        "roi_weight_map": settings.roi_weight_map,
        "process_fn": settings.process_fn,
    }
    parameters = inspect.signature(sliding_window_inference).parameters
    for name, default in (("buffer_steps", None), ("buffer_dim", -1)):
        value = getattr(settings, name)
        if name in parameters:
            kwargs[name] = value
        elif value != default:
            raise ValueError(
                f"`{name}={value!r}` needs a MONAI whose `sliding_window_inference` has `{name}` (1.3 or later); the "
                f"installed one ({installed_version('monai') or 'unknown'}) has not. Upgrade MONAI or leave `{name}` "
                "at its default."
            )
    return kwargs


def sliding_window_predict(
    inputs: Tensor, predictor: Callable[..., Any], settings: SlidingWindowSettings, sw_batch_size: int | None = None
) -> Any:
    """``monai.inferers.sliding_window_inference(inputs, roi_size, sw_batch_size, predictor, **the other settings)``.

    Args:
        inputs: ``(N, C, *spatial)``.
        predictor: called on batches of windows ``(sw_batch_size, C, *roi_size)``.
        settings: validated settings with a resolved ``roi_size`` (not ``"model"``).
        sw_batch_size: overrides ``settings.sw_batch_size`` (needed when that is ``"auto"``).
    """
    inferers = require_monai()
    size = settings.sw_batch_size if sw_batch_size is None else sw_batch_size
    if not isinstance(size, int) or isinstance(settings.roi_size, str):
        raise ValueError(
            f"sliding_window_predict needs a resolved roi_size and an integer sw_batch_size; got "
            f"roi_size={settings.roi_size!r}, sw_batch_size={size!r}."
        )
    function = inferers.sliding_window_inference
    return function(inputs, settings.roi_size, size, predictor, **_monai_kwargs(settings, function))


def memory_headroom_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes that new tensors on ``device`` can still take: on CUDA the driver's free memory plus what the caching
    allocator holds unused; on CPU the system's available memory (psutil). ``None`` when unknown."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil comes with lightning
            return None
        return int(psutil.virtual_memory().available)
    return None


@dataclass
class SwBatchSizeChoice:
    """What ``sw_batch_size="auto"`` measured and chose.

    Attributes:
        chosen: the size kept.
        candidates: the sizes allowed by the window count and the memory headroom, in the order tried.
        comparisons: one :class:`~lightning_perf.profiling.latency.LatencyRow` per size tried after the first: the best
            size so far (``baseline``) against the new one (``candidate``), seconds per sliding-window call, with the
            speed-up, its 95% interval and verdict.
        memory_limit: the largest size the memory headroom allowed (``None``: not limited by memory).
        memory_per_window_bytes: the memory estimate one window needs, from the size-1 call.
        headroom_bytes: the free memory at the start (``None``: unknown).
    """

    chosen: int
    candidates: list[int]
    comparisons: list[LatencyRow] = field(default_factory=list)
    memory_limit: int | None = None
    memory_per_window_bytes: int | None = None
    headroom_bytes: int | None = None

    def summary(self) -> str:
        """One paragraph for a log: the choice, each comparison with its interval and verdict, the memory limit."""
        parts = [f"sw_batch_size={self.chosen} chosen among {self.candidates}"]
        for row in self.comparisons:
            parts.append(
                f"{row.candidate} vs {row.baseline}: {row.candidate_median_s * 1e3:.1f} ms vs "
                f"{row.baseline_median_s * 1e3:.1f} ms per call, speed-up {row.format_speedup()}"
            )
        if self.memory_limit is not None and self.memory_per_window_bytes and self.headroom_bytes is not None:
            parts.append(
                f"memory allows up to {self.memory_limit} (about {self.memory_per_window_bytes / 2**20:.0f} MiB per "
                f"window, {self.headroom_bytes / 2**20:.0f} MiB free)"
            )
        return "; ".join(parts)


def _window_count(inputs: Tensor, settings: SlidingWindowSettings) -> int:
    """How many windows MONAI places over one ``(N, C, *spatial)`` batch."""
    spatial = inputs.shape[2:]
    roi = _spatial_roi(settings.roi_size, len(spatial))  # type: ignore[arg-type]
    assert roi is not None
    overlap = settings.overlap if isinstance(settings.overlap, tuple) else (settings.overlap,) * len(spatial)
    count = int(inputs.shape[0])
    for size, window, share in zip(spatial, roi, overlap):
        if size > window:  # MONAI's scan interval: int(window * (1 - overlap)), at least 1
            count *= math.ceil((size - window) / max(int(window * (1 - share)), 1)) + 1
    return count


def choose_sw_batch_size(
    inputs: Tensor,
    predictor: Callable[..., Any],
    settings: SlidingWindowSettings,
    *,
    max_size: int = AUTO_MAX_SW_BATCH_SIZE,
    iterations: int = AUTO_ITERATIONS,
    measure: Callable[..., tuple[list[list[float]], list[list[float]]]] = paired_blocks,
) -> SwBatchSizeChoice:
    """Pick the fastest ``sw_batch_size`` by timing sliding-window calls on one volume (sizes 1, 2, 4, 8, ...).

    Each size is timed against the best size so far with :func:`~lightning_perf.profiling.latency.paired_blocks`
    (ABBA blocks of ``iterations`` calls); it becomes the best only when it is faster with its whole 95% interval above
    1, so a difference inside the noise keeps the smaller size, and the search stops at the first size that is not
    faster. Sizes beyond the number of windows change nothing and are not tried; sizes whose memory estimate
    (``size`` times the peak memory of the size-1 call, or of its window and output when the peak is not measurable)
    exceeds :data:`AUTO_MEMORY_FRACTION` of the free memory are not tried either.

    Args:
        inputs: the batch whose first volume the sizes are timed on (the first batch that needs the window).
        predictor: the network's forward.
        settings: validated settings with a resolved ``roi_size``.
        max_size: the largest size tried.
        iterations: timed calls per size and comparison.
        measure: the timer (``paired_blocks``'s signature); tests pass a fake one.
    """
    inputs = inputs[:1]  # one volume: the window count per call, and the measurement stays a small share of the run
    windows = _window_count(inputs, settings)
    sizes = [1]
    while sizes[-1] * 2 <= min(windows, max_size):
        sizes.append(sizes[-1] * 2)
    device = settings.sw_device or inputs.device
    headroom = memory_headroom_bytes(device)
    per_window: int | None = None
    memory_limit: int | None = None
    if len(sizes) > 1 and device.type in ("cpu", "cuda"):
        probe = MemoryProbe(device)
        probe.reset_peak()
        before = probe.sample()
        with torch.no_grad():
            output = sliding_window_predict(inputs, predictor, settings, 1)
        after = probe.sample()
        probe.close()
        measured = after.peak_above(before) if after.peak_since_reset else 0  # a lifetime peak says nothing here
        window_bytes = inputs.element_size() * inputs[:1].numel() * _roi_share(inputs, settings)
        output_bytes = sum(t.element_size() * t.numel() for t in _tensors(output))
        per_window = max(measured, int(window_bytes) + output_bytes, 1)
        del output
        if headroom is not None:
            memory_limit = max(1, int(AUTO_MEMORY_FRACTION * headroom // per_window))
            sizes = [s for s in sizes if s <= memory_limit]
    choice = SwBatchSizeChoice(
        chosen=1,
        candidates=list(sizes),
        memory_limit=memory_limit,
        memory_per_window_bytes=per_window,
        headroom_bytes=headroom,
    )

    def run(size: int) -> Callable[[], Any]:
        return functools.partial(_no_grad_predict, inputs, predictor, settings, sw_batch_size=size)

    for size in sizes[1:]:
        best = choice.chosen
        base, cand = measure(run(best), run(size), iterations=iterations, warmup=1, device=device)
        row = LatencyRow.from_blocks(
            inputs.shape[0], base, cand, names=(f"sw_batch_size={best}", f"sw_batch_size={size}")
        )
        choice.comparisons.append(row)
        if row.speedup_verdict != "faster":
            break
        choice.chosen = size
    return choice


def _no_grad_predict(
    inputs: Tensor, predictor: Callable[..., Any], settings: SlidingWindowSettings, sw_batch_size: int
) -> Any:
    with torch.no_grad():
        return sliding_window_predict(inputs, predictor, settings, sw_batch_size)


def _roi_share(inputs: Tensor, settings: SlidingWindowSettings) -> float:
    roi = _spatial_roi(settings.roi_size, inputs.dim() - 2)  # type: ignore[arg-type]
    assert roi is not None
    return math.prod(roi) / max(1, math.prod(inputs.shape[2:]))


def _tensors(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, Tensor)]
    if isinstance(output, (list, tuple)):
        return [t for t in output if isinstance(t, Tensor)]
    return []


class SlidingWindowForward(ForwardPatch):
    """A module's forward that runs MONAI's sliding window over inputs unlike its patch (see the module notes).

    Extra positional and keyword arguments of ``forward`` go to every window's call of the plain forward.

    Attributes:
        settings: the validated settings (resolved ``roi_size``).
        choice: after the first windowed call with ``sw_batch_size="auto"``, what was measured and chosen.
        windowed_calls: how many calls went through the window.
    """

    def __init__(
        self,
        module: nn.Module,
        settings: SlidingWindowSettings,
        on_choice: Callable[[SwBatchSizeChoice], None] | None = None,
        choice: SwBatchSizeChoice | None = None,
    ) -> None:
        super().__init__(module)
        self.settings = settings
        self.on_choice = on_choice
        self.choice = choice
        self.windowed_calls = 0

    @property
    def sw_batch_size(self) -> int | None:
        """The size in use (``None`` while ``"auto"`` has not measured yet)."""
        if isinstance(self.settings.sw_batch_size, int):
            return self.settings.sw_batch_size
        return self.choice.chosen if self.choice is not None else None

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Disabled for the compiler: the window loop runs eagerly, the plain forward inside it is what compiles
        # (compile the network's blocks; see SlidingWindowInferenceCallback).
        if not args or not needs_window(args[0], self.settings.roi_size):  # type: ignore[arg-type]
            return self.call_original(*args, **kwargs)
        inputs, rest = args[0], args[1:]

        def predictor(window: Tensor) -> Any:
            return self.call_original(window, *rest, **kwargs)

        size = self.sw_batch_size
        if size is None:
            self.choice = choose_sw_batch_size(inputs, predictor, self.settings)
            size = self.choice.chosen
            if self.on_choice is not None:
                self.on_choice(self.choice)
        self.windowed_calls += 1
        return sliding_window_predict(inputs, predictor, self.settings, size)


def apply_sliding_window(
    module: nn.Module,
    settings: SlidingWindowSettings,
    *,
    on_choice: Callable[[SwBatchSizeChoice], None] | None = None,
    choice: SwBatchSizeChoice | None = None,
    owner: str = "apply_sliding_window",
) -> SlidingWindowForward | None:
    """Route ``module``'s forward through the sliding window, in place (the module keeps its class and keys).

    Args:
        module: the network (or LightningModule) whose ``forward(x)`` takes ``(N, C, *spatial)`` inputs.
        settings: from :func:`validate_sliding_window`; ``roi_size="model"`` is resolved here from ``module``.
        on_choice: called once with the :class:`SwBatchSizeChoice` when ``sw_batch_size="auto"`` has measured.
        choice: an earlier choice to reuse (``"auto"`` then measures nothing).
        owner: the name error messages give the caller.

    Returns:
        The patch, or ``None`` if the module's forward already goes through a sliding window.

    Example::

        settings = validate_sliding_window(roi_size=(32, 32, 32), sw_batch_size=4, mode="gaussian")
        apply_sliding_window(net, settings)
        logits = net(volume)  # (1, 1, 96, 96, 96) predicted in 32^3 windows
        remove_sliding_window(net)
    """
    require_monai()
    if isinstance(settings.roi_size, str):
        settings = settings.with_roi(resolve_roi_size(module, owner))
    return patch_forward(module, lambda m: SlidingWindowForward(m, settings, on_choice, choice))


def remove_sliding_window(module: nn.Module) -> bool:
    """Put back the forward :func:`apply_sliding_window` replaced; ``False`` if there was none."""
    return unpatch_forward(module, SlidingWindowForward)


def sliding_window_patch(module: nn.Module) -> SlidingWindowForward | None:
    """The sliding-window patch on ``module``'s forward, or ``None``."""
    return find_forward_patch(module, SlidingWindowForward)
