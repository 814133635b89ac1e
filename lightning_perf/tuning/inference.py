"""Tuning for inference: what ``AutoTuner(stage="predict")`` (or ``"validate"``, ``"test"``) searches, and how.

Entry points: :func:`search_plan` (a :class:`SearchPlan` derived from :mod:`lightning_perf.optimizations`),
:func:`trial_skip_reason`, :func:`inference_notes`. The search stages and why candidates are
compared on speed only: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_perf.optimizations import COMPILE, COMPILE_REGIONAL, INFERENCE_STAGES, optimizations, tuner_search_list

if TYPE_CHECKING:
    from lightning_perf.benchmark.structure import ModelStructure

__all__ = [
    "MIN_TIMED_BATCHES",
    "NO_DATA_STAGE",
    "SearchPlan",
    "inference_notes",
    "precision_names",
    "search_plan",
    "too_few_batches",
    "trial_skip_reason",
]

NO_DATA_STAGE = (
    "the data wait is not measured in inference runs (the latency is timed per batch, fetch excluded): "
    "loader workers are not tried"
)
"""Why an inference search has no data-loading stage."""


def precision_names(stage: str = "fit") -> tuple[str, ...]:
    """The precisions the tuner searches for ``stage``, in order (``fit``: the registry's precision stage)."""
    if stage not in INFERENCE_STAGES:
        return tuner_search_list("precision")
    found = [
        ("fit" in o.stages, o.tuner_order, i, o.name)
        for i, o in enumerate(optimizations())
        if "precision" in o.trainer_kwargs
        and stage in o.stages
        and (o.tuner_stage == "precision" or "fit" not in o.stages)
    ]
    return tuple(name for *_, name in sorted(found))


@dataclass(frozen=True)
class SearchPlan:
    """The search for one Trainer stage: every name in order, and those left out because they do not apply to the
    stage (name -> why; the tuner lists them as skipped trials with that reason)."""

    stage: str
    precisions: tuple[str, ...]
    optimizations: tuple[str, ...]
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def searched_precisions(self) -> tuple[str, ...]:
        return tuple(p for p in self.precisions if p not in self.left_out)

    @property
    def searched_optimizations(self) -> tuple[str, ...]:
        return tuple(o for o in self.optimizations if o not in self.left_out)


def search_plan(
    stage: str,
    precisions: Any = None,
    optimization_names: Any = None,
    *,
    device: Any = None,
    structure: ModelStructure | None = None,
) -> SearchPlan:
    """The precisions and optimizations to try for ``stage``; the ones that do not apply to it are left out with the
    reason (e.g. ``fused_optimizer``: "applies to training only, not to predict").

    Args:
        stage: the Trainer stage tuned for.
        precisions: the user's list (None: :func:`precision_names`; on a CPU ``device`` the fp16 autocast of
            ``16-mixed``, whose entry requires CUDA, is left out, as the fit search does).
        optimization_names: the user's list (None: the registry's optimization stage, decided by ``structure`` as the
            bench's default set is: see below).
        device: the device (``"cpu"``, ``"cuda:0"``, a ``torch.device``), to choose the default precisions.
        structure: the model's structure (:func:`~lightning_perf.benchmark.structure.structure_of`). With the
            default optimizations, what the structure rules out is left out with the model's fact
            (:func:`~lightning_perf.benchmark.configs.structural_verdict`: channels-last without convolutions carrying
            5% of the FLOPs, the attention swap where attention is already fused, compile on a CPU for a model with
            neither repeated blocks nor convolutions), and off CUDA ``compile`` is searched as ``compile_regional``
            where the model has repeated blocks (on CUDA, ``compile_reduce_overhead`` is tried in place of
            ``compile``, so the whole-model compile stays).
    """
    from lightning_perf.benchmark.configs import get_config

    if precisions is None:
        cuda = str(device).startswith("cuda")
        # Left out by default where the entry needs CUDA and the device is not one (fp16 autocast with a scaler).
        precisions = tuple(p for p in precision_names(stage) if cuda or "cuda" not in _requires(p))
    left_out: dict[str, str] = {}
    if optimization_names is None:
        optimization_names = tuner_search_list("optimization")
        if structure is not None:
            optimization_names, left_out = _by_structure(optimization_names, device, structure)
    for name in (*precisions, *optimization_names):
        why = get_config(name).why_not_stage(stage)
        if why is not None:
            left_out[name] = why
    return SearchPlan(stage, tuple(precisions), tuple(optimization_names), left_out)


def _by_structure(names: tuple[str, ...], device: Any, structure: ModelStructure) -> tuple[tuple[str, ...], dict]:
    """The default search list for this model: ``compile`` as ``compile_regional`` off CUDA where the model has
    repeated blocks, and ``{name: why}`` for what its structure rules out."""
    import torch

    from lightning_perf.benchmark.configs import COMPILE_VARIANTS, structural_verdict
    from lightning_perf.optimizations import get

    where = torch.device(device if device is not None else "cpu")
    cuda = where.type == "cuda"
    if not cuda and structure.repeated_blocks:
        names = tuple(COMPILE_REGIONAL if n == COMPILE else n for n in names)
    left_out = {}
    for name in names:
        if cuda and name in COMPILE_VARIANTS:
            continue
        verdict = structural_verdict(get(name), where, structure)
        if verdict is not None and not verdict[0]:
            left_out[name] = verdict[1]
    return names, left_out


def _requires(name: str) -> tuple[str, ...]:
    from lightning_perf.optimizations import find

    optimization = find(name)
    return optimization.requires if optimization is not None else ()


def trial_skip_reason(name: str, structure: ModelStructure, device: Any, *, explicit: bool = False) -> str | None:
    """Why the trial of ``name`` (a precision or an optimization) cannot apply to this model on ``device``, or None.

    A trial that cannot change anything (an entry's ``model_needs`` the model lacks) or that would measure an
    emulation is skipped with its reason instead of costing a trial and a chance for noise to look like a win.

    Args:
        name: the precision or optimization (bench configuration) name.
        structure: the model's (:func:`~lightning_perf.benchmark.structure.probe_structure`).
        device: where the trials run.
        explicit: the user named it: an emulated bf16 is measured anyway (what it costs is then the question).
    """
    import torch

    from lightning_perf._device import supports_bf16
    from lightning_perf.benchmark.configs import device_capabilities, get_config
    from lightning_perf.optimizations import MODEL_FEATURES, find

    device = torch.device(device)
    optimization = find(name)
    for need in optimization.model_needs if optimization is not None else ():
        if not getattr(structure, need):
            return f"the model has no {MODEL_FEATURES[need]}: {name} changes nothing"
    emulated = device.type == "cpu" and "bf16" in _requires(name) and not device_capabilities(device)["fast_bf16"]
    if emulated and not explicit:
        return "this CPU has no bf16 instructions (avx512_bf16, AMX): bf16 would be emulated, slower than fp32"
    precision = str(get_config(name).trainer_kwargs.get("precision", ""))
    if precision.startswith("bf16") and not supports_bf16(device):
        return f"{device} does not support bfloat16"
    if precision == "16-mixed" and device.type != "cuda":
        return "fp16 autocast with a gradient scaler is for CUDA devices"
    return get_config(name).why_not(device)


MIN_TIMED_BATCHES = 3
"""Fewest steady batches an inference trial must time for its latency to be compared (an interval needs a spread)."""


def too_few_batches(stage: str, result: Any) -> str | None:
    """Why an inference run timed too few batches to compare (its data ran out after the warm-up), or None."""
    timed = len(result.step_times_s)
    if stage not in INFERENCE_STAGES or not result.ok or timed >= MIN_TIMED_BATCHES:
        return None
    return (
        f"the {stage} data ran out: {timed} batch(es) timed after the warm-up at batch size {result.batch_size}, "
        f"at least {MIN_TIMED_BATCHES} are needed to compare (give the data module more {stage} samples, or lower "
        "the warm-up steps)"
    )


def inference_notes(stage: str, configs: tuple[str, ...]) -> list[str]:
    """The recommendation's notes for an inference stage: how to run it, and what was not checked."""
    if stage not in INFERENCE_STAGES:
        return []
    from lightning_perf.optimizations import get, names

    known = set(names())
    numeric = [c for c in configs if c in known and get(c).changes_numerics]
    notes = [
        f"tuned for {stage}: `python train.py {stage} --config <this file>` with LightningCLI; these settings are "
        "for inference, not for training"
    ]
    if numeric:
        notes.append(
            f"{', '.join(numeric)} change the outputs' numerics; inference runs have no loss, so the tuner compared "
            "speed only: check the outputs or accuracy against the model as given before deploying"
        )
    return notes
