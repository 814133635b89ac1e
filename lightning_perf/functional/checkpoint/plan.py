"""Planning eager activation checkpointing to a memory budget: the profile a plan is made from, and the plan.

:func:`plan_checkpointing` turns an :class:`ActivationProfile` (what
:class:`~lightning_perf.functional.checkpoint.budget.ActivationRecorder` measured) into a :class:`CheckpointPlan`: per
block one option of none / recomputing its norm and activation outputs / selective / some parts / full, the least
recompute time within the budget (an exact multiple-choice knapsack). See
:mod:`lightning_perf.functional.checkpoint.budget` for the whole method.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from lightning_perf._validation import check_number

# The selective policies tried per block, by name: which op classes they keep.
_POLICIES: dict[str, tuple[str, ...]] = {
    "matmul+conv+attention": ("matmul", "conv", "attention"),
    "attention": ("attention",),
}


def validate_memory_budget(owner: str, budget: Any) -> float:
    """Return ``budget`` as a float if it is a number in ``(0, 1]``: the fraction of the activation memory of training
    without checkpointing to keep (1.0 means no checkpointing).

    Raises:
        ValueError: for anything else (a bool, NaN, infinities, zero, negatives, numbers above 1).
    """
    return check_number(owner, "memory_budget", budget, 0, 1, exclusive=True)


@dataclass(frozen=True)
class BlockProfile:
    """What one candidate block keeps for backward and what recomputing it costs, from one profiled forward.

    Attributes:
        name: the block's qualified name in the model.
        saved_bytes: activation bytes first saved for backward inside the block (unique storages), no checkpointing.
        input_bytes: bytes a fully checkpointed block still keeps: its inputs (that nothing before it saves) and the
            outputs it saves itself.
        forward_s: time of the block's ops in the profiled forward.
        kept_bytes: per selective policy name, the bytes kept under it (inputs plus the kept ops' outputs).
        recompute_s: per selective policy name, the time of the ops it recomputes.
        op_counts: how many ops of each class in :data:`SAVE_OP_CLASSES` the block ran (``"other"`` for the rest).
        parts: the block's children that can be checkpointed alone (attention, MLP: two layers or more), by qualified
            name: ``(saved_bytes, kept_bytes, recompute_s)``, what the part saves, keeps checkpointed, and the time of
            the ops it runs again (those before the one that packs its last saved tensor: torch's early stop).
        cheap: the norms and activations whose output can be dropped and recomputed from an input kept anyway (see
            :mod:`~lightning_perf.functional.checkpoint.cheap`), by qualified name: ``(part, bytes, seconds)``, the
            part the output is first saved in (None: outside the parts), the bytes dropping it frees, the time of
            making it again.
        full_recompute_s: the time of the ops a fully checkpointed block runs again (those before the one that packs
            its last saved tensor: the MLP's second linear is not among them); None: ``forward_s``.
        fingerprint: a hash of the block's ops and their output shapes, in order (None: unknown): blocks with the same
            fingerprint and memory figures run the same computation, and are planned with their median times.
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_s: float
    kept_bytes: dict[str, int] = field(default_factory=dict)
    recompute_s: dict[str, float] = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    parts: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    cheap: dict[str, tuple[str | None, int, float]] = field(default_factory=dict)
    full_recompute_s: float | None = None
    fingerprint: int | None = None


@dataclass(frozen=True)
class ActivationProfile:
    """One forward pass, as :class:`ActivationRecorder` saw it.

    Attributes:
        total_saved_bytes: activation bytes saved for backward in the whole forward (unique storages, no parameters).
        outside_bytes: the part saved outside the candidate blocks (checkpointing them cannot remove it).
        blocks: one :class:`BlockProfile` per candidate block, in model order.
        measured_bytes: the allocator's growth over the forward (activations kept plus the output), or None.
        memory_source: where ``measured_bytes`` comes from (``"cuda"``, ``"cpu-mallinfo2"``, ``"cpu-rss"``).
    """

    total_saved_bytes: int
    outside_bytes: int
    blocks: tuple[BlockProfile, ...]
    measured_bytes: int | None = None
    memory_source: str | None = None


# ------------------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class BlockChoice:
    """How one block runs under a :class:`CheckpointPlan`.

    Attributes:
        name: the block's qualified name.
        mode: ``"none"``, ``"cheap"`` (only norm and activation outputs recomputed), ``"selective"``, ``"parts"``
            (some of its children checkpointed, fully; norm and activation outputs outside them maybe recomputed) or
            ``"full"``.
        kept_ops: for ``"selective"``, the op classes whose outputs are kept (``("matmul", "conv", "attention")``).
        expected_kept_bytes: activation bytes the block is expected to keep for backward.
        expected_recompute_s: expected recompute time per step.
        parts: for ``"parts"``, the qualified names of the children checkpointed.
        recomputed: for ``"cheap"`` and ``"parts"``, the norms and activations whose outputs are dropped and
            recomputed (the block runs under
            :class:`~lightning_perf.functional.checkpoint.cheap.RecomputeCheapForward`).
    """

    name: str
    mode: str
    kept_ops: tuple[str, ...]
    expected_kept_bytes: int
    expected_recompute_s: float
    parts: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()

    @property
    def regions(self) -> tuple[str, ...]:
        """The modules patched for this choice, in module order: the block, its chosen parts (after the block when it
        recomputes norm and activation outputs), or none."""
        if self.mode == "parts":
            return ((self.name,) if self.recomputed else ()) + self.parts  # in module order
        return () if self.mode == "none" else (self.name,)


@dataclass(frozen=True)
class CheckpointPlan:
    """Which blocks to checkpoint, how, and what it is expected (and, once run, measured) to keep and cost.

    Attributes:
        budget: the fraction of the no-checkpointing activation memory asked for.
        choices: one :class:`BlockChoice` per candidate block.
        baseline_bytes: activation bytes kept without checkpointing (saved-tensor sizes).
        expected_bytes: activation bytes expected under the plan.
        expected_recompute_s: expected recompute time per step.
        forward_s: time of the profiled forward's ops inside the candidate blocks.
        reachable: False when even full checkpointing of every candidate cannot meet the budget.
        measured_bytes: allocator growth over a forward under the plan (activations kept plus the output), once
            measured; compared with ``baseline_bytes``, which the allocator matches without checkpointing (the
            profiled step's own allocator growth also holds first-call allocations, so it is not the baseline).
    """

    budget: float
    choices: tuple[BlockChoice, ...]
    baseline_bytes: int
    expected_bytes: int
    expected_recompute_s: float
    forward_s: float
    reachable: bool = True
    measured_bytes: int | None = None

    @property
    def checkpointed(self) -> list[BlockChoice]:
        """The blocks the plan checkpoints (selective, parts of them, or full)."""
        return [c for c in self.choices if c.mode != "none"]

    @property
    def regions(self) -> list[str]:
        """The qualified names of the modules the plan checkpoints (blocks, or their parts)."""
        return [name for c in self.choices for name in c.regions]

    @property
    def expected_ratio(self) -> float:
        """Expected activation memory as a fraction of no checkpointing."""
        return self.expected_bytes / self.baseline_bytes if self.baseline_bytes else 1.0

    @property
    def measured_ratio(self) -> float | None:
        """Measured (allocator) activation memory as a fraction of no checkpointing, once both are measured."""
        if self.measured_bytes is None or not self.baseline_bytes:
            return None
        return self.measured_bytes / self.baseline_bytes

    def with_measurement(self, measured_bytes: int) -> CheckpointPlan:
        """This plan with the allocator's figure for a forward under it."""
        return replace(self, measured_bytes=measured_bytes)

    def describe(self) -> str:
        """The plan in a few lines: blocks, kept ops, expected (and measured) memory and recompute time."""
        full = [c.name for c in self.choices if c.mode == "full"]
        selective: dict[tuple[str, ...], list[str]] = {}
        for c in self.choices:
            if c.mode == "selective":
                selective.setdefault(c.kept_ops, []).append(c.name)
        lines = [
            f"memory_budget={self.budget:g}: checkpointing in {len(self.checkpointed)} of {len(self.choices)} blocks "
            f"(least recompute within the budget)"
        ]
        if full:
            lines.append(f"  full ({len(full)}): {_abbreviate(full)}")
        for ops, names in selective.items():
            lines.append(f"  selective, keeping {'/'.join(ops)} outputs ({len(names)}): {_abbreviate(names)}")
        parts = [p for c in self.choices if c.mode == "parts" for p in c.parts]
        if parts:
            lines.append(f"  parts of blocks ({len(parts)}): {_abbreviate(parts)}")
        recomputed = [c for c in self.choices if c.recomputed]
        if recomputed:
            lines.append(
                f"  norm/activation outputs recomputed from kept inputs ({sum(len(c.recomputed) for c in recomputed)} "
                f"in {len(recomputed)} blocks): {_abbreviate([c.name for c in recomputed])}"
            )
        if not self.checkpointed:
            lines.append("  none: the budget is met without checkpointing")
        recompute = (
            f"{self.expected_recompute_s * 1e3:.1f} ms recompute per step"
            f" ({self.expected_recompute_s / self.forward_s:.0%} of the blocks' forward)"
            if self.forward_s > 0
            else "no recompute"
        )
        lines.append(
            f"  expected: activation memory {_mib(self.expected_bytes)} of {_mib(self.baseline_bytes)} "
            f"({self.expected_ratio:.2f}x of no checkpointing, saved-tensor sizes), {recompute}"
        )
        if self.measured_ratio is not None:
            lines.append(
                f"  measured: {_mib(self.measured_bytes or 0)} ({self.measured_ratio:.2f}x; allocator growth over "
                "the first checkpointed forward, one step)"
            )
        if not self.reachable:
            lines.append(
                f"  the budget is out of reach: checkpointing every candidate block fully keeps "
                f"{self.expected_ratio:.2f}x (activations saved outside the blocks, or the blocks' inputs, remain)"
            )
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _abbreviate(names: list[str], keep: int = 6) -> str:
    if len(names) <= keep:
        return ", ".join(names)
    return ", ".join(names[: keep - 2]) + f", ... ({len(names) - keep + 2} more), " + ", ".join(names[-2:])


# (recompute s, kept bytes, mode, kept op classes or part names, norms/activations recomputed)
_Option = tuple[float, int, str, tuple[str, ...], tuple[str, ...]]


def _cheap_outside(block: BlockProfile, parts: Sequence[str]) -> tuple[float, int, tuple[str, ...]]:
    """Recomputing the norm and activation outputs first saved outside ``parts``: (seconds, bytes freed, modules)."""
    chosen = [(name, v) for name, v in block.cheap.items() if v[0] not in parts]
    return sum(v[2] for _, v in chosen), sum(v[1] for _, v in chosen), tuple(name for name, _ in chosen)


def _part_options(block: BlockProfile) -> list[_Option]:
    """Checkpointing some of a block's parts (every subset of up to three parts; else each alone, and all), each
    alone and with the norm and activation outputs outside them recomputed."""
    names = list(block.parts)  # in the order of the block's children, as `named_modules` lists them
    if len(names) <= 3:
        subsets = [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    else:
        subsets = [(n,) for n in names] + [tuple(names)]
    options: list[_Option] = []
    for subset in subsets:
        freed = sum(block.parts[p][0] - block.parts[p][1] for p in subset)
        seconds = sum(block.parts[p][2] for p in subset)
        options.append((seconds, block.saved_bytes - freed, "parts", subset, ()))
        cheap_s, cheap_freed, cheap = _cheap_outside(block, subset)
        if cheap:
            options.append((seconds + cheap_s, block.saved_bytes - freed - cheap_freed, "parts", subset, cheap))
    return options


def _block_options(block: BlockProfile) -> list[_Option]:
    """A block's options: none, its norm and activation outputs recomputed, each selective policy, some of its parts
    (with or without those recomputes), full."""
    options: list[_Option] = [(0.0, block.saved_bytes, "none", (), ())]
    cheap_s, cheap_freed, cheap = _cheap_outside(block, ())
    if cheap:
        options.append((cheap_s, block.saved_bytes - cheap_freed, "cheap", (), cheap))
    for policy, classes in _POLICIES.items():
        present = tuple(c for c in classes if block.op_counts.get(c))
        if present and policy in block.kept_bytes and block.kept_bytes[policy] < block.saved_bytes:
            options.append((max(block.recompute_s[policy], 0.0), block.kept_bytes[policy], "selective", present, ()))
    options.extend(_part_options(block))
    full_s = block.forward_s if block.full_recompute_s is None else block.full_recompute_s
    options.append((full_s, min(block.input_bytes, block.saved_bytes), "full", (), ()))
    return options


def _knapsack(options: list[list[_Option]], unit: float, cap: int) -> list[_Option] | None:
    """One option per block, the least total time with at most ``cap`` units of memory (None when nothing fits)."""
    import numpy as np

    best = np.zeros(cap + 1)  # least recompute time with at most j units kept, over the blocks so far
    picks = []
    for block_options in options:
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1)
        for index, (seconds, kept, *_) in enumerate(block_options):
            weight = math.ceil(kept / unit - 1e-9)
            if weight > cap:
                continue
            candidate = best[: cap + 1 - weight] + seconds
            better = candidate < new[weight:]
            new[weight:][better] = candidate[better]
            pick[weight:][better] = index
        best = new
        picks.append(pick)
    if not math.isfinite(best[cap]):
        return None
    chosen, j = [], cap
    for block_options, pick in zip(reversed(options), reversed(picks)):
        option = block_options[int(pick[j])]
        chosen.append(option)
        j -= math.ceil(option[1] / unit - 1e-9)
    return chosen[::-1]


def _signature(block: BlockProfile) -> tuple[Any, ...]:
    """What makes two blocks the same for planning: their memory figures and op counts, names relative to the block."""

    def local(name: str | None) -> str | None:
        return name[len(block.name) + 1 :] if name is not None and name.startswith(block.name + ".") else name

    if block.fingerprint is None:
        return (block.name,)  # unknown ops: alone in its group
    return (
        block.fingerprint,
        block.saved_bytes,
        block.input_bytes,
        tuple(sorted(block.kept_bytes.items())),
        tuple(sorted(block.recompute_s)),
        tuple(sorted(block.op_counts.items())),
        tuple((local(p), v[0], v[1]) for p, v in block.parts.items()),
        tuple((local(m), local(v[0]), v[1]) for m, v in block.cheap.items()),
    )


def pool_identical_blocks(blocks: Sequence[BlockProfile]) -> list[BlockProfile]:
    """``blocks`` with the times of identical blocks (same ops and output shapes, memory figures, parts and recomputable
    modules, by names relative to the block: the repeated layers of a transformer) replaced by their medians.

    One profiled forward times each op once, and a shared machine or a cache miss makes one block's op look several
    times slower than the same op in its twin. The knapsack would then pick, among identical blocks, the ones whose
    options happened to be timed fast: plans that change from run to run, and an expected recompute time below the
    real one. The median over the identical blocks is the better estimate for each of them.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, block in enumerate(blocks):
        groups.setdefault(_signature(block), []).append(index)
    pooled = list(blocks)
    for members in groups.values():
        if len(members) < 2:
            continue
        twins = [blocks[i] for i in members]
        full = [b.forward_s if b.full_recompute_s is None else b.full_recompute_s for b in twins]
        parts = [list(b.parts.values()) for b in twins]
        cheap = [list(b.cheap.values()) for b in twins]
        for i in members:
            block = blocks[i]
            pooled[i] = replace(
                block,
                forward_s=median([b.forward_s for b in twins]),
                recompute_s={k: median([b.recompute_s[k] for b in twins]) for k in block.recompute_s},
                parts={
                    p: (v[0], v[1], median([t[j][2] for t in parts])) for j, (p, v) in enumerate(block.parts.items())
                },
                cheap={
                    m: (v[0], v[1], median([t[j][2] for t in cheap])) for j, (m, v) in enumerate(block.cheap.items())
                },
                full_recompute_s=median(full),
            )
    return pooled


def plan_checkpointing(profile: ActivationProfile, budget: float, resolution: int = 2000) -> CheckpointPlan:
    """Choose per block none / selective / parts / full checkpointing: the least recompute time that keeps at most
    ``budget`` x the activations of no checkpointing.

    A multiple-choice knapsack, solved exactly by dynamic programming over the memory left (in ``resolution`` steps,
    each option's memory rounded up, so the plan never exceeds the budget): one option per block, the least total
    recompute time within the budget. It keeps as much as the budget allows where keeping saves time, so the plan
    lands just under the budget rather than far below it. When even full checkpointing of every block exceeds the
    budget, every block is checkpointed fully and the plan says it is out of reach. Identical blocks are planned with
    their median times (:func:`pool_identical_blocks`).
    """
    budget = validate_memory_budget("plan_checkpointing", budget)
    target = budget * profile.total_saved_bytes
    options = [_block_options(block) for block in pool_identical_blocks(profile.blocks)]
    room = target - profile.outside_bytes
    least = sum(min(o[1] for o in block_options) for block_options in options)
    current = [min(block_options, key=lambda o: (o[1], o[0])) for block_options in options]  # the least memory
    if room >= least and options:
        unit = max(room / resolution, 1.0)
        # Each option's memory rounded up to whole units: with len(options) units of slack first (the exact plan,
        # checked), then without (never over the budget).
        for cap in (int(room // unit) + len(options), int(room // unit)):
            chosen = _knapsack(options, unit, cap)
            if chosen is not None and sum(o[1] for o in chosen) <= room:
                current = chosen
                break
    total = profile.outside_bytes + sum(o[1] for o in current)
    choices = tuple(
        BlockChoice(
            block.name, mode, () if mode == "parts" else ops, kept, recompute, ops if mode == "parts" else (), cheap
        )
        for block, (recompute, kept, mode, ops, cheap) in zip(profile.blocks, current)
    )
    return CheckpointPlan(
        budget=budget,
        choices=choices,
        baseline_bytes=profile.total_saved_bytes,
        expected_bytes=total,
        expected_recompute_s=sum(c.expected_recompute_s for c in choices),
        forward_s=sum(b.forward_s for b in profile.blocks),
        reachable=total <= target,
    )
