"""Turn a measured step-time breakdown into recommendations, each with the evidence behind it.

Entry points: :class:`StepBreakdown` (what was measured), :func:`recommend` (the rules, most important first) and
:class:`Recommendation` (the figures that triggered it and the callbacks that would help). Plain data, no Lightning; the
optimizations offered come from :mod:`lightning_perf.optimizations`. The rules and their thresholds:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning_perf.optimizations as optimizations
from lightning_perf._validation import check_mapping
from lightning_perf.profiling.report import format_seconds
from lightning_perf.profiling.syncs import SyncSite

__all__ = [
    "DEFAULT_THRESHOLDS",
    "PHASES",
    "LoaderSettings",
    "Recommendation",
    "StepBreakdown",
    "recommend",
    "validate_thresholds",
]

PHASES: tuple[str, ...] = ("data", "transfer", "forward", "backward", "optimizer", "other")
"""The phases a training step is split into, in the order they happen (``other``: time in none of the rest)."""

COMPUTE_PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")

DEFAULT_THRESHOLDS: Mapping[str, float] = {"data": 0.2, "transfer": 0.1, "optimizer": 0.2, "other": 0.3}
"""Share of the step above which a phase is flagged."""

SEVERITIES: tuple[str, ...] = ("high", "medium", "low")


def validate_thresholds(thresholds: Mapping[str, float] | None, owner: str) -> dict[str, float]:
    """:data:`DEFAULT_THRESHOLDS` updated with ``thresholds``, checked.

    Raises:
        ValueError: for a phase not in :data:`DEFAULT_THRESHOLDS` or a share outside (0, 1).
        TypeError: if ``thresholds`` is not a mapping.
    """
    if thresholds is None:
        return dict(DEFAULT_THRESHOLDS)

    def problem(name: Any, value: Any) -> str | None:
        if name not in DEFAULT_THRESHOLDS:
            return f"{name!r} not a phase with a threshold"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
            return f"{name!r}: {value!r} is not a share of the step strictly between 0 and 1"
        return None

    expected = f"a dict from phase name ({', '.join(DEFAULT_THRESHOLDS)}) to a share of the step, e.g. {{'data': 0.2}}"
    check_mapping(owner, "thresholds", thresholds, problem, expected)
    return {**DEFAULT_THRESHOLDS, **{name: float(value) for name, value in thresholds.items()}}


@dataclass(frozen=True)
class LoaderSettings:
    """The settings of a ``torch.utils.data.DataLoader`` that decide how fast batches arrive.

    Attributes:
        num_workers: worker processes (0: batches are made in the training process).
        pin_memory: whether batches are copied to page-locked memory.
        persistent_workers: whether workers survive from one epoch to the next.
        batch_size: samples per batch (None with a custom batch sampler).
        prefetch_factor: batches loaded ahead by each worker (None without workers).
    """

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    batch_size: int | None
    prefetch_factor: int | None

    @classmethod
    def from_dataloader(cls, loader: Any) -> LoaderSettings | None:
        """Read the settings of a DataLoader (anything with its attributes); None for other iterables."""
        if not hasattr(loader, "num_workers"):
            return None
        return cls(
            num_workers=int(loader.num_workers),
            pin_memory=bool(getattr(loader, "pin_memory", False)),
            persistent_workers=bool(getattr(loader, "persistent_workers", False)),
            batch_size=getattr(loader, "batch_size", None),
            prefetch_factor=getattr(loader, "prefetch_factor", None),
        )

    def describe(self) -> str:
        """``"DataLoader(num_workers=0, pin_memory=False, ...)"``."""
        return f"DataLoader({', '.join(f'{name}={value}' for name, value in asdict(self).items())})"


@dataclass(frozen=True)
class StepBreakdown:
    """What was measured about the training steps, the input of :func:`recommend`.

    Attributes:
        shares: phase -> share of the total steady-state step time (see :data:`PHASES`).
        medians: phase -> median seconds over the steps in which the phase ran.
        step_median_s: median step time in seconds.
        steps: number of steady-state steps measured.
        device_type: ``"cuda"``, ``"cpu"``...
        loader: the training DataLoader's settings, if it is one.
        cpu_count: CPUs this process may use.
        processes_per_node: training processes sharing those CPUs (devices per node).
        steps_per_epoch: batches per epoch, if known.
        epoch_restart_s: median extra wait of the first batch of an epoch (epochs after the first) over the median
            data wait, if more than one epoch ran.
        precision: Lightning's precision string, e.g. ``"32-true"``, ``"bf16-mixed"``.
        has_convolutions: whether the model has 2D/3D convolutions (channels-last applies).
        optimizers_fused: whether every optimizer already runs a fused or foreach implementation (None: unknown).
        fast_bf16: whether the device runs bf16 fast (tensor cores, AMX/avx512-bf16).
        tf32_capable: whether the device has TF32 tensor cores (CUDA sm 80+).
        tf32_enabled: whether float32 matmuls already use TF32 (``torch.get_float32_matmul_precision() != "highest"``).
        active_callbacks: class names of the callbacks in the run (their advice is not repeated).
        host_syncs: synchronization sites found in the checked steps.
        sync_steps_checked: how many steps were checked for synchronizations (0: not checked).
        sync_method: how they were found (see :class:`~lightning_perf.profiling.syncs.HostSyncRecorder`).
        thresholds: phase -> share above which it is flagged (:data:`DEFAULT_THRESHOLDS`).
    """

    shares: Mapping[str, float]
    medians: Mapping[str, float]
    step_median_s: float
    steps: int
    device_type: str = "cpu"
    loader: LoaderSettings | None = None
    cpu_count: int = 1
    processes_per_node: int = 1
    steps_per_epoch: float | None = None
    epoch_restart_s: float | None = None
    precision: str = "32-true"
    has_convolutions: bool = False
    optimizers_fused: bool | None = None
    fast_bf16: bool = False
    tf32_capable: bool = False
    tf32_enabled: bool = False
    active_callbacks: frozenset[str] = frozenset()
    host_syncs: Sequence[SyncSite] = ()
    sync_steps_checked: int = 0
    sync_method: str = ""
    thresholds: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))

    def share(self, phase: str) -> float:
        value = self.shares.get(phase, 0.0)
        return 0.0 if value is None or math.isnan(value) else float(value)

    def median(self, phase: str) -> float:
        value = self.medians.get(phase)
        return math.nan if value is None else float(value)

    def facts(self) -> dict[str, bool | None]:
        """The facts an advice rule of the optimization list can name (:data:`~lightning_perf.optimizations.
        ADVICE_FACTS`), and what the model holds (:data:`~lightning_perf.optimizations.MODEL_FEATURES`; None:
        unknown)."""
        return {
            "cuda": self.device_type == "cuda",
            "full_precision": self.precision in ("32", "32-true", "64", "64-true"),
            "fast_bf16": self.fast_bf16,
            "tf32_off": self.tf32_capable and not self.tf32_enabled,
            "optimizers_fused": self.optimizers_fused is True,
            "convolutions": self.has_convolutions,
            "attention": None,
        }


@dataclass(frozen=True)
class Recommendation:
    """One thing to change, why, and what in this library helps.

    Attributes:
        rule: which rule fired (``"data_wait"``, ``"host_syncs"``...), stable across versions.
        severity: ``"high"``, ``"medium"`` or ``"low"``.
        title: the finding, in one sentence.
        evidence: the measurements behind it.
        actions: what to change, most effective first.
        callbacks: this library's callbacks that would help.
    """

    rule: str
    severity: str
    title: str
    evidence: str
    actions: tuple[str, ...] = ()
    callbacks: tuple[str, ...] = ()

    def format(self) -> str:
        """The recommendation as a few lines of text."""
        lines = [f"[{self.severity}] {self.title}", f"    evidence: {self.evidence}"]
        lines += [f"    - {action}" for action in self.actions]
        if self.callbacks:
            lines.append("    lightning_perf: " + ", ".join(self.callbacks))
        return "\n".join(lines)


def _pct(share: float) -> str:
    return f"{100.0 * share:.0f}%"


def _phase_evidence(b: StepBreakdown, phase: str) -> str:
    return (
        f"{phase} is {_pct(b.share(phase))} of step time (median {format_seconds(b.median(phase))} of a "
        f"{format_seconds(b.step_median_s)} step, {b.steps} steady steps)"
    )


def _cpus_per_process(b: StepBreakdown) -> int:
    return max(1, b.cpu_count // max(1, b.processes_per_node))


def _data_wait(b: StepBreakdown) -> Recommendation | None:
    if b.share("data") <= b.thresholds["data"]:
        return None
    loader, cpus = b.loader, _cpus_per_process(b)
    evidence = _phase_evidence(b, "data") + f"; {cpus} CPUs per training process"
    if loader is None:
        return Recommendation(
            "data_wait",
            "high",
            "Training waits for data.",
            evidence + "; the training data is not a DataLoader",
            ("make each batch cheaper to produce, or load it in background workers",),
        )
    evidence += f"; {loader.describe()}"
    actions: list[str] = []
    if loader.num_workers == 0:
        suggested = max(1, min(8, cpus - 1))
        actions.append(
            f"set DataLoader(num_workers={suggested}): with num_workers=0 every batch is made in the training "
            f"process while the model waits ({cpus} CPUs available per process)"
        )
    elif loader.num_workers < cpus:
        actions.append(
            f"raise num_workers from {loader.num_workers} towards {cpus} (the CPUs per process), or prefetch deeper "
            f"(prefetch_factor={loader.prefetch_factor})"
        )
    else:
        actions.append(
            f"the {loader.num_workers} workers already use every CPU: make per-sample work cheaper (decode or "
            "pre-process once and cache, move augmentation to the device)"
        )
    if b.device_type == "cuda" and not loader.pin_memory:
        actions.append("set pin_memory=True so copies to the GPU overlap with compute")
    if loader.num_workers > 0 and not loader.persistent_workers:
        actions.append("set persistent_workers=True so workers are not restarted at each epoch")
    return Recommendation("data_wait", "high", "Training waits for data.", evidence, tuple(actions))


def _oversubscribed(b: StepBreakdown) -> Recommendation | None:
    loader = b.loader
    if loader is None or loader.num_workers * b.processes_per_node <= b.cpu_count:
        return None
    per_node = f"num_workers={loader.num_workers}"
    if b.processes_per_node > 1:
        per_node = f"{loader.num_workers} workers x {b.processes_per_node} processes"
    return Recommendation(
        "num_workers_above_cpus",
        "medium",
        "More DataLoader workers than CPUs.",
        f"{per_node} on {b.cpu_count} usable CPUs",
        (f"lower num_workers to at most {_cpus_per_process(b)}: extra workers only compete for the same cores",),
    )


def _pin_memory(b: StepBreakdown) -> Recommendation | None:
    if b.device_type != "cuda" or b.loader is None or b.loader.pin_memory:
        return None
    return Recommendation(
        "pin_memory",
        "medium" if b.share("transfer") > b.thresholds["transfer"] else "low",
        "Batches are not pinned before the copy to the GPU.",
        f"pin_memory=False on CUDA; host-to-device transfer is {_pct(b.share('transfer'))} of step time",
        ("set DataLoader(pin_memory=True): copies from page-locked memory run asynchronously",),
    )


def _persistent_workers(b: StepBreakdown) -> Recommendation | None:
    loader = b.loader
    if loader is None or loader.num_workers == 0 or loader.persistent_workers:
        return None
    if b.epoch_restart_s is None or b.steps_per_epoch is None or not b.step_median_s > 0:
        return None
    epoch_s = b.steps_per_epoch * b.step_median_s
    if b.epoch_restart_s <= 0.05 * epoch_s:
        return None
    return Recommendation(
        "persistent_workers",
        "medium",
        "DataLoader workers restart at every epoch.",
        f"the first batch of each epoch waits {format_seconds(b.epoch_restart_s)} longer than the others, "
        f"{_pct(b.epoch_restart_s / epoch_s)} of a {format_seconds(epoch_s)} epoch of {b.steps_per_epoch:.0f} steps; "
        f"persistent_workers=False with num_workers={loader.num_workers}",
        ("set DataLoader(persistent_workers=True)",),
    )


def _transfer(b: StepBreakdown) -> Recommendation | None:
    if b.share("transfer") <= b.thresholds["transfer"]:
        return None
    actions = []
    if b.loader is not None and not b.loader.pin_memory and b.device_type == "cuda":
        actions.append("set DataLoader(pin_memory=True)")
    actions.append("send compact dtypes (uint8 images, int32 token ids) and convert on the device")
    return Recommendation(
        "transfer",
        "medium",
        "Copying batches to the device takes long.",
        _phase_evidence(b, "transfer"),
        tuple(actions),
    )


def _optimizer(b: StepBreakdown) -> Recommendation | None:
    if b.share("optimizer") <= b.thresholds["optimizer"]:
        return None
    actions, callbacks = _registered_advice(b, "optimizer_step")
    actions.append("fewer parameter groups or tensors help too (each costs a kernel launch per step)")
    evidence = _phase_evidence(b, "optimizer") + " (zero_grad and the optimizer step, once per accumulation window)"
    if b.optimizers_fused is True:
        evidence += "; the optimizers already run fused/foreach"
    return Recommendation(
        "optimizer_step",
        "medium",
        "The optimizer step is a large part of the step.",
        evidence,
        tuple(actions),
        tuple(callbacks),
    )


def _other(b: StepBreakdown) -> Recommendation | None:
    if b.share("other") <= b.thresholds["other"]:
        return None
    return Recommendation(
        "other_overhead",
        "medium",
        "Much of the step is spent outside data loading and compute.",
        _phase_evidence(b, "other") + " (callbacks, logging, Lightning's own bookkeeping, user code in hooks)",
        (
            "log less often (Trainer(log_every_n_steps=...)) and avoid per-step work in callbacks",
            "raise the progress bar's refresh_rate",
        ),
    )


def _host_syncs(b: StepBreakdown) -> Recommendation | None:
    if not b.host_syncs or b.sync_steps_checked <= 0:
        return None
    total = sum(site.count for site in b.host_syncs)
    top = "; ".join(f"{site.count}x {site.kind} at {site.where}" for site in b.host_syncs[:5])
    more = f" and {len(b.host_syncs) - 5} more sites" if len(b.host_syncs) > 5 else ""
    on_gpu = b.device_type == "cuda"
    title = (
        "The training step synchronizes the host with the GPU."
        if on_gpu
        else "The training step makes calls that would synchronize with a GPU."
    )
    return Recommendation(
        "host_syncs",
        "high" if on_gpu else "low",
        title,
        f"{total / b.sync_steps_checked:.1f} per step over {b.sync_steps_checked} checked steps ({b.sync_method}): "
        f"{top}{more}",
        (
            "keep values as tensors inside the step: self.log() takes tensors, and reads them only when it logs",
            "move .item()/.cpu()/.tolist() and data-dependent `if tensor:` out of the step, or do them every N steps",
        ),
    )


def _device_idle(b: StepBreakdown) -> Recommendation | None:
    compute = sum(b.share(p) for p in COMPUTE_PHASES)
    if b.device_type != "cuda" or compute >= 0.5:
        return None
    batch = b.loader.batch_size if b.loader is not None else None
    actions = [
        f"use a larger batch{f' than {batch}' if batch else ''} so fixed per-step costs are spread over more samples"
    ]
    more_actions, callbacks = _registered_advice(b, "device_idle")
    actions += more_actions
    return Recommendation(
        "device_idle",
        "high",
        "The GPU is idle for much of each step.",
        f"forward, backward and optimizer together are {_pct(compute)} of step time on the GPU timeline",
        tuple(actions),
        tuple(callbacks),
    )


def _compute_bound(b: StepBreakdown) -> Recommendation | None:
    compute = sum(b.share(p) for p in COMPUTE_PHASES)
    if compute < 0.5:
        return None
    actions, callbacks = _registered_advice(b, "compute_bound")
    if not actions:
        return None
    return Recommendation(
        "compute_bound",
        "low",
        "Compute dominates the step: make it cheaper.",
        f"forward {_pct(b.share('forward'))}, backward {_pct(b.share('backward'))}, optimizer "
        f"{_pct(b.share('optimizer'))} of step time; precision={b.precision!r}",
        tuple(actions),
        tuple(callbacks),
    )


def _registered_advice(b: StepBreakdown, symptom: str) -> tuple[list[str], list[str]]:
    """The actions and callbacks that the list of optimizations offers for ``symptom`` and that apply to ``b``;
    a callback already in use is not suggested again."""
    actions: list[str] = []
    callbacks: list[str] = []
    facts = b.facts()
    for optimization, rule in optimizations.advice_for(symptom):
        name = optimization.callback_name
        if name is not None and (name in b.active_callbacks or name in callbacks):
            continue
        needs = {need: True for need in optimization.model_needs}  # an unknown feature (None) is not assumed
        if not optimizations.holds(rule.when, facts) or not optimizations.holds(needs, facts):
            continue
        actions.append(rule.action)
        if name is not None:
            callbacks.append(name)
    return actions, callbacks


# In the order their findings are listed within one severity.
_RULES = (_data_wait, _host_syncs, _device_idle, _oversubscribed, _persistent_workers, _transfer, _pin_memory,
          _optimizer, _other, _compute_bound)  # fmt: skip


def recommend(breakdown: StepBreakdown) -> list[Recommendation]:
    """Apply every rule (see the module notes) to ``breakdown``; the most severe recommendations come first.

    Returns:
        The recommendations, empty when nothing stands out or no steady-state step was measured.
    """
    if breakdown.steps <= 0 or not breakdown.step_median_s > 0:
        return []
    found = [rec for rule in _RULES if (rec := rule(breakdown)) is not None]
    return sorted(found, key=lambda rec: SEVERITIES.index(rec.severity))
