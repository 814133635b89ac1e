"""The registry of named benchmark configurations that ``lightning-perf bench`` and the auto-tuner run.

A configuration says what to add to a plain Trainer: callbacks, a strategy, Trainer keyword arguments. Factories
build fresh objects inside the benchmark's worker process, so nothing but the configuration's name crosses a process
boundary. Names joined with ``+`` form a stack (``channels_last+compile``): callbacks in the order given, Trainer
arguments merged (a conflict is an error).

The configurations are derived from the one list of optimizations, :mod:`lightning_perf.optimizations`, plus
``baseline``: a new configuration is an entry there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

import lightning_perf.optimizations as optimizations
from lightning_perf.optimizations import BASELINE, DEVICE_CAPABILITIES, Optimization

if TYPE_CHECKING:
    from lightning_perf.benchmark.structure import ModelStructure

CallbackFactory = Callable[[], list[Any]]
# A callback as LightningCLI writes it: its import path and its keyword arguments.
CallbackSpec = tuple[str, Mapping[str, Any]]
StrategyFactory = Callable[[], Any]
# Returns why the configuration cannot run on ``device`` (e.g. "needs CUDA"), or None when it can.
Applicability = Callable[[torch.device], "str | None"]


def _no_callbacks() -> list[Any]:
    return []


def instantiate_callbacks(specs: Iterable[CallbackSpec]) -> list[Any]:
    """Build callbacks from ``(class_path, init_args)`` pairs, importing each class."""
    from lightning_perf.benchmark.sources import import_object

    return [import_object(class_path, "callback")(**dict(init_args)) for class_path, init_args in specs]


@dataclass(frozen=True)
class BenchConfig:
    """A named way to train: what it adds to a plain fp32 Trainer.

    Args:
        name: registry name, lower case, no ``+`` or ``,``.
        description: one line for ``lightning-perf bench --list``.
        callbacks: builds the callbacks, called once per run inside the worker process.
        trainer_kwargs: extra ``Trainer`` arguments (e.g. ``{"precision": "bf16-mixed"}``).
        strategy: builds the strategy, or ``None`` for Lightning's default.
        applies_to: says why the configuration cannot run on a device, or ``None`` when it can.
        parts: the names a stack was built from (just ``(name,)`` for a single configuration).
        callback_specs: the callbacks as ``(class_path, init_args)`` pairs; given instead of ``callbacks``, they let
            the auto-tuner write the configuration as a LightningCLI file.
        stages: the Trainer stages it applies to (``fit``, ``predict``, ``validate``, ``test``).
    """

    name: str
    description: str
    callbacks: CallbackFactory = _no_callbacks
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    strategy: StrategyFactory | None = None
    applies_to: Applicability | None = None
    parts: tuple[str, ...] = ()
    callback_specs: tuple[CallbackSpec, ...] | None = None
    stages: tuple[str, ...] = optimizations.STAGES

    def __post_init__(self) -> None:
        if self.callback_specs is not None:
            if self.callbacks is not _no_callbacks:
                raise ValueError(f"`BenchConfig(name={self.name!r})`: give `callbacks` or `callback_specs`, not both.")
            specs = tuple((path, MappingProxyType(dict(args))) for path, args in self.callback_specs)
            object.__setattr__(self, "callback_specs", specs)
            object.__setattr__(self, "callbacks", lambda: instantiate_callbacks(specs))
        elif self.callbacks is _no_callbacks:
            object.__setattr__(self, "callback_specs", ())
        if not self.parts:
            object.__setattr__(self, "parts", (self.name,))
        # A stack is named after its parts ("a+b"); every part is a plain word.
        if "+".join(self.parts) != self.name or any(not p or any(c in p for c in "+, ") for p in self.parts):
            raise ValueError(f"`BenchConfig(name={self.name!r})` is not a valid name: expected a non-empty word.")
        object.__setattr__(self, "trainer_kwargs", MappingProxyType(dict(self.trainer_kwargs)))

    def why_not(self, device: torch.device) -> str | None:
        """Why this configuration cannot run on ``device``, or ``None``."""
        return self.applies_to(device) if self.applies_to is not None else None

    def why_not_stage(self, stage: str) -> str | None:
        """Why this configuration does not apply to a ``stage`` run (``"fit"``, ``"predict"``...), or ``None``."""
        if stage in self.stages:
            return None
        if not self.stages:
            return "its parts apply to no stage in common"
        only = "training" if self.stages == ("fit",) else "/".join(self.stages)
        return f"applies to {only} only, not to {stage}"


BASELINE_CONFIG = BenchConfig(BASELINE, "plain Lightning, fp32 (the reference every ratio is taken against)")
AA_CONTROL = "aa_control"
"""Baseline under another name, measured as any configuration (its own processes, interleaved): ``--configs
baseline,aa_control`` checks the bench itself, whose answer should be "no clear difference" (never in the default set).
"""
# Configurations only the bench knows (tests, experiments); the optimizations' own are derived on lookup.
_BENCH_ONLY: dict[str, BenchConfig] = {
    AA_CONTROL: BenchConfig(AA_CONTROL, "baseline under another name: an A/A check of the bench (expect no difference)")
}
# name -> (the entry it was built from, the configuration): rebuilt when the list holds another entry by that name.
_DERIVED: dict[str, tuple[Optimization, BenchConfig]] = {}


def _lookup(name: str) -> BenchConfig | None:
    """The single configuration called ``name``, or ``None``."""
    if name == BASELINE:
        return BASELINE_CONFIG
    if name in _BENCH_ONLY:
        return _BENCH_ONLY[name]
    optimization = optimizations.find(name)
    if optimization is None:
        return None
    known = _DERIVED.get(name)
    if known is None or known[0] is not optimization:
        known = _DERIVED[name] = (optimization, config_from_optimization(optimization))
    return known[1]


def available_configs() -> list[str]:
    """The registered configuration names, ``baseline`` first."""
    return [BASELINE, *sorted({*optimizations.names(), *_BENCH_ONLY} - {BASELINE})]


def get_config(name: str) -> BenchConfig:
    """The configuration called ``name``, or the stack ``a+b+...`` of registered ones.

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    parts = [p.strip() for p in name.split("+")]
    found = [_lookup(p) for p in parts]
    unknown = [p for p, config in zip(parts, found) if config is None]
    if unknown or not parts:
        raise ValueError(
            f"Unknown benchmark configuration {unknown[0] if unknown else name!r} in {name!r}. "
            f"Valid names: {', '.join(available_configs())}; join several with '+' to stack them."
        )
    configs = [config for config in found if config is not None]
    return configs[0] if len(configs) == 1 else stack_configs(configs)


def stack_configs(configs: list[BenchConfig]) -> BenchConfig:
    """Combine configurations into one: callbacks in order, Trainer arguments merged, at most one strategy."""
    if any(len(c.parts) > 1 for c in configs):  # a stack of stacks: flatten to registered single configurations
        configs = [get_config(p) for c in configs for p in c.parts]
    trainer_kwargs: dict[str, Any] = {}
    for config in configs:
        for key, value in config.trainer_kwargs.items():
            if key in trainer_kwargs and trainer_kwargs[key] != value:
                raise ValueError(
                    f"Cannot stack {'+'.join(c.name for c in configs)!r}: both set Trainer({key}=...) "
                    f"to different values ({trainer_kwargs[key]!r} and {value!r})."
                )
            trainer_kwargs[key] = value
    strategies = [c for c in configs if c.strategy is not None]
    if len(strategies) > 1:
        raise ValueError(f"Cannot stack {', '.join(c.name for c in strategies)}: each sets a strategy.")
    factories = [c.callbacks for c in configs]
    specs = None
    if all(c.callback_specs is not None for c in configs):
        specs = tuple(spec for c in configs for spec in c.callback_specs)  # type: ignore[union-attr]

    def callbacks() -> list[Any]:
        return [cb for factory in factories for cb in factory()]

    def applies_to(device: torch.device) -> str | None:
        reasons = [f"{c.name}: {r}" for c in configs if (r := c.why_not(device)) is not None]
        return "; ".join(reasons) or None

    stages = tuple(stage for stage in optimizations.STAGES if all(stage in c.stages for c in configs))
    return BenchConfig(
        name="+".join(c.name for c in configs),
        description=" + ".join(c.description for c in configs),
        callbacks=callbacks if specs is None else _no_callbacks,
        callback_specs=specs,
        trainer_kwargs=trainer_kwargs,
        strategy=strategies[0].strategy if strategies else None,
        applies_to=applies_to,
        parts=tuple(c.name for c in configs),
        stages=stages,
    )


def config_from_optimization(optimization: Optimization) -> BenchConfig:
    """The bench configuration of one entry of :mod:`lightning_perf.optimizations`: it runs where the device offers
    every capability the entry ``requires`` and every package it needs imports."""

    def applies_to(device: torch.device) -> str | None:
        return _missing(optimization, device)

    from lightning_perf.benchmark.stack import callbacks_of

    return BenchConfig(
        optimization.name,
        optimization.description,
        callback_specs=tuple(callbacks_of(optimization)),
        trainer_kwargs=optimization.trainer_kwargs,
        applies_to=applies_to if optimization.requires or optimization.packages else None,
        stages=optimization.stages,
    )


def _missing(optimization: Optimization, device: torch.device) -> str | None:
    """What ``device`` (or this installation) lacks for ``optimization``, in words, or ``None``."""
    from lightning_perf._imports import install_hint, is_available

    for capability in optimization.requires:
        if not device_offers(device, capability):
            return f"needs {DEVICE_CAPABILITIES[capability]}"
    for package in optimization.packages:
        if not is_available(package):
            return install_hint(package)
    return None


def split_by_stage(names: Iterable[str], stage: str) -> tuple[list[str], list[tuple[str, str]]]:
    """``(names that apply to stage, [(name, why)] for the others)``, order kept (``baseline`` applies to all)."""
    whys = [(name, get_config(name).why_not_stage(stage)) for name in names]
    return [name for name, why in whys if why is None], [(name, why) for name, why in whys if why is not None]


def device_capabilities(device: torch.device) -> dict[str, bool]:
    """Which of :data:`lightning_perf.optimizations.DEVICE_CAPABILITIES` ``device`` offers (see
    :func:`device_offers`)."""
    return {capability: device_offers(device, capability) for capability in DEVICE_CAPABILITIES}


def device_offers(device: torch.device, capability: str) -> bool:
    """Whether ``device`` offers ``capability``, probed alone (one probe per name of the vocabulary).

    ``bf16``: bfloat16 tensors work there (emulated or not); ``fast_bf16``: on a CPU, avx512_bf16 or AMX in
    ``/proc/cpuinfo`` (oneDNN's own probe where the flags are unknown), on a GPU Ampere (sm 80) or later;
    ``fp16``: any CUDA device, a CPU with avx512_fp16 or amx_fp16; ``fast_fp32_matmul``: a backend flag makes float32
    matmuls faster there (TF32 on a GPU, oneDNN's bf16 path on a CPU with bf16 instructions).

    Raises:
        KeyError: for a name outside the vocabulary.
    """
    from lightning_perf._device import has_fast_cpu_bf16, is_sm_at_least, supports_bf16
    from lightning_perf.profiling.machine import cpu_flags, has_cpu_bf16_instructions

    if capability not in DEVICE_CAPABILITIES:
        raise KeyError(f"{capability!r} is not a device capability. Expected one of: {', '.join(DEVICE_CAPABILITIES)}")
    cuda = device.type == "cuda"
    if capability in ("cpu", "cuda"):
        return device.type == capability
    if capability == "fp8":
        return cuda and bool(is_sm_at_least(8, 9, device))
    if capability == "bf16":
        return bool(supports_bf16(device))
    if capability == "fp16":
        flags = cpu_flags() or {}
        return cuda or bool(flags.get("avx512_fp16") or flags.get("amx_fp16"))
    if capability == "fast_fp32_matmul" and cuda:
        from lightning_perf.functional.backend_flags import fastest_flags

        return bool(fastest_flags(device).requested())
    # fast_bf16, and fast_fp32_matmul on a CPU (oneDNN runs float32 matmuls in bf16 where the CPU has bf16 instructions)
    if cuda:
        return bool(is_sm_at_least(8, 0, device))
    native = has_cpu_bf16_instructions(cpu_flags())
    return bool(has_fast_cpu_bf16() if native is None else native)


def _why_left_out(
    optimization: Optimization,
    device: torch.device,
    capabilities: Mapping[str, bool],
    structure: ModelStructure | None = None,
) -> str | None:
    """Why the no-argument bench leaves ``optimization`` out on ``device`` for this model, in words naming what in the
    model or the device decided it, with how to include it; ``None`` when it is in."""
    where = "CUDA" if device.type == "cuda" else "CPU"
    verdict = structural_verdict(optimization, device, structure) if structure is not None else None
    if verdict is not None:
        wanted, because = verdict
        if wanted:
            return get_config(optimization.name).why_not(device)
        return f"left out because {because}; `--configs ...,{optimization.name}` to include it"
    if any(capabilities.get(c, False) for c in optimization.bench_default_on):
        return get_config(optimization.name).why_not(device)
    because = optimization.left_out_because
    if not because:
        on = " or ".join(DEVICE_CAPABILITIES[c] for c in optimization.bench_default_on)
        because = f"it is in the default set only on {on}" if on else "it is not in the default set"
    return f"left out on {where} because {because}; `--configs ...,{optimization.name}` to include it"


MEASURED_TOGETHER_ON_CPU = ((optimizations.BF16_MIXED, optimizations.FLASH_ATTENTION),)
"""Pairs the default set on a CPU also measures as one configuration where it has both: under bf16 the attention swap
computes SDPA in float32 where that is faster (:mod:`lightning_perf.functional.attention.kernels`), which neither shows
alone, and the winners' stack is built from single winners (the default ``vit`` on a 2-core AVX-512 CPU: bf16-mixed
1.00x and flash_attention 1.00x alone in its default bench; together 131-135 ms a step against baseline's 201-205 ms,
1.52x, one process each). A pair that wins with a higher speed-up than the winners' stack is the recommendation
(:func:`lightning_perf.benchmark.answer.prefer_measured_stack`)."""

COMPILE_VARIANTS = (optimizations.COMPILE, optimizations.COMPILE_REGIONAL)
"""The compile configurations the default set picks one of by the model's structure: ``compile_regional`` where the
model has repeated blocks, else ``compile``."""


def structural_verdict(
    optimization: Optimization, device: torch.device, structure: ModelStructure
) -> tuple[bool, str] | None:
    """``(in the default set, why)`` for an optimization that acts on part of a model (convolutions, attention,
    compiled regions), decided by ``structure``; ``None`` for one the model's structure does not decide."""
    from lightning_perf.benchmark.structure import CONV_SHARE_MIN

    model = structure.model
    share = structure.conv_flop_share
    if "convolutions" in optimization.model_needs:
        if not structure.convolutions:
            return False, f"{model} has no 2D or 3D convolution"
        if share is not None and share < CONV_SHARE_MIN:
            count = len(structure.convolutions)
            return False, (
                f"{model}'s {count} convolution{'s' if count > 1 else ''} carry {share:.1%} of a training step's "
                f"FLOPs, under the {CONV_SHARE_MIN:.0%} where channels-last can pay"
            )
        return True, ""
    if "attention" in optimization.model_needs:
        if not structure.attention:
            return False, f"{model} has no attention module the swap knows (nn.MultiheadAttention or an adapter's)"
        if not structure.unfused_attention:
            return (
                False,
                f"{model}'s attention already runs on scaled_dot_product_attention ({_few(structure.attention)})",
            )
        return True, ""
    if optimization.name not in COMPILE_VARIANTS:
        return None
    blocks = structure.repeated_blocks
    regional = optimization.name == optimizations.COMPILE_REGIONAL
    if not (device.type == "cuda" or blocks or structure.conv_heavy):
        return False, (
            f"{model} has neither repeated blocks nor convolutions carrying {CONV_SHARE_MIN:.0%} of the FLOPs: a "
            "cold compile (~30 s per process on a CPU) has little to win back"
        )
    if regional and not blocks:
        return False, f"{model} has no repeated blocks to compile once (compile covers the whole model)"
    if not regional and blocks:
        return False, (
            f"{model} has {len(blocks)} repeated {structure.block_class} blocks: compile_regional compiles one and "
            "reuses it (a shorter cold compile)"
        )
    return True, ""


def _few(names: tuple[str, ...], at_most: int = 2) -> str:
    more = len(names) - at_most
    return ", ".join(names[:at_most]) + (f" and {more} more" if more > 0 else "")


def default_configs(
    device: torch.device,
    capabilities: Mapping[str, bool] | None = None,
    stage: str = "fit",
    structure: ModelStructure | None = None,
) -> tuple[list[str], list[tuple[str, str]]]:
    """The configurations of the no-argument ``lightning-perf bench`` (and the tuner's default search) on ``device``,
    chosen by the model's ``structure`` and the device's capabilities.

    Where the model's structure decides (:func:`structural_verdict`): channels-last only where convolutions carry a
    real share of the FLOPs, the attention swap where attention is not already on a fused kernel, a compile variant
    (``compile_regional`` where there are repeated blocks, else ``compile``) on a GPU, and on a CPU when the model has
    repeated blocks or convolutions. Elsewhere, and for every entry when ``structure`` is ``None``, the entry's
    ``bench_default_on`` capabilities decide. On a CPU a pair of :data:`MEASURED_TOGETHER_ON_CPU` that are both in is
    also measured as one configuration (``bf16-mixed+flash_attention``).

    Returns:
        ``(names, left_out)``: ``baseline`` and every optimization chosen that can run there and applies to
        ``stage``; and ``(name, why)`` for each optimization left out, naming what in the model or device decided it.
    """
    caps = device_capabilities(device) if capabilities is None else capabilities
    chosen, left_out = [BASELINE], []
    for optimization in optimizations.optimizations():
        why = get_config(optimization.name).why_not_stage(stage) or _why_left_out(optimization, device, caps, structure)
        if why is None:
            chosen.append(optimization.name)
        else:
            left_out.append((optimization.name, why))
    if device.type == "cpu":
        chosen += [f"{a}+{b}" for a, b in MEASURED_TOGETHER_ON_CPU if a in chosen and b in chosen]
    return chosen, left_out
