"""Activation checkpointing to a memory budget: measure what each block keeps for backward, then checkpoint the least.

``memory_budget=0.5`` asks for at most half the activation memory that training without checkpointing keeps, at the
least recompute time. Three steps, each usable alone in a plain training loop:

1. :class:`ActivationRecorder` (or :func:`profile_activations`) watches one forward pass: saved-tensor hooks
   (``torch.autograd.graph.saved_tensors_hooks``) size every tensor autograd keeps for backward, deduplicated by
   storage and attributed to the candidate block it was first saved in; a ``TorchDispatchMode`` records each op a
   block runs, its output storages and its time. Parameters are not activations and are left out.
2. :func:`plan_checkpointing` chooses, per block, one of: no checkpointing; *selective* checkpointing that keeps the
   outputs of expensive ops (matmuls, convolutions, attention kernels, the CPU one
   ``aten._scaled_dot_product_flash_attention_for_cpu`` included) and recomputes the cheap elementwise and
   normalization ops (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, charged what its per-op
   Python dispatch costs); selective checkpointing that keeps attention outputs only; checkpointing some of the
   block's *parts* (its children of two layers or more: attention, MLP), each fully; or full checkpointing (only the
   block's inputs are kept). The choice is a multiple-choice knapsack solved exactly: the least recompute time whose
   kept memory is within the budget, so the plan lands just under the budget, not far below it.
3. :func:`apply_plan` patches the chosen blocks with
   :class:`~lightning_perf.functional.grad_checkpoint.CheckpointedForward` (names, ``state_dict`` keys and gradients
   unchanged); :func:`~lightning_perf.functional.grad_checkpoint.remove_activation_checkpointing` undoes it.

The expected figures are a model: a selective block keeps its inputs plus the outputs of the kept ops; a fully
checkpointed one its inputs; recompute time is the time of the ops not kept. Check them against the allocator (CUDA
``memory_allocated``, CPU glibc ``mallinfo2`` through :class:`~lightning_perf.profiling.memory.MemoryProbe`): the
recorder samples it around the forward, and :class:`CheckpointPlan` carries both.

Under ``torch.compile`` the compiler has its own budget (``torch._functorch.config.activation_memory_budget``, a
knapsack over the compiled graph's saved tensors): :func:`set_compiler_memory_budget` sets it and returns the old
value to restore. That setting is read when a graph compiles, so a class compiled earlier in the process keeps
its old graph: :func:`apply_compiler_budget` patches the modules so that the budget is part of what dynamo guards, and
a new budget compiles them again.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_perf.functional.checkpoint_blocks import count_layers
from lightning_perf.functional.grad_checkpoint import CheckpointedForward
from lightning_perf.functional.surgery import patch_forward
from lightning_perf.profiling.memory import MemoryProbe

__all__ = [
    "SAVE_OP_CLASSES",
    "ActivationProfile",
    "ActivationRecorder",
    "BlockChoice",
    "BlockProfile",
    "CheckpointPlan",
    "apply_plan",
    "plan_checkpointing",
    "profile_activations",
    "selective_context_fn",
    "validate_memory_budget",
]

SAVE_OP_CLASSES: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_scaled_mm", "_int_mm"),
    "conv": (
        "convolution",
        "_convolution",
        "convolution_overrideable",
        "cudnn_convolution",
        "mkldnn_convolution",
        "miopen_convolution",
    ),
    "attention": (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
}
"""The expensive ops whose outputs selective checkpointing keeps, by class (``aten`` op names, every overload)."""

# The selective policies tried per block, by name: which op classes they keep.
_POLICIES: dict[str, tuple[str, ...]] = {
    "matmul+conv+attention": ("matmul", "conv", "attention"),
    "attention": ("attention",),
}


def _op_class(func: Any) -> str | None:
    """The class in :data:`SAVE_OP_CLASSES` of an ``OpOverload`` (``aten.mm.default`` -> ``"matmul"``), or None."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", None)
    namespace = getattr(func, "namespace", None)
    if namespace != "aten" or name is None:
        return None
    for cls, names in SAVE_OP_CLASSES.items():
        if name in names:
            return cls
    return None


def validate_memory_budget(owner: str, budget: Any) -> float:
    """Return ``budget`` as a float if it is a number in ``(0, 1]``.

    Raises:
        TypeError: for a bool or anything not a number.
        ValueError: for NaN, infinities, zero, negatives and numbers above 1.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"`{owner}(memory_budget={budget!r})` is not valid. Expected a number in (0, 1]: the fraction of the "
            "activation memory of training without checkpointing to keep (1.0 means no checkpointing)."
        )
    if not math.isfinite(budget) or not 0 < budget <= 1:
        raise ValueError(
            f"`{owner}(memory_budget={budget!r})` is not valid. Expected a finite number in (0, 1]: the fraction of "
            "the activation memory of training without checkpointing to keep (1.0 means no checkpointing)."
        )
    return float(budget)


# ----------------------------------------------------------------------------------------------------- measuring


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
            name: ``(saved_bytes, kept_bytes, forward_s)``, what the part saves, keeps checkpointed, and its ops' time.
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_s: float
    kept_bytes: dict[str, int] = field(default_factory=dict)
    recompute_s: dict[str, float] = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    parts: dict[str, tuple[int, int, float]] = field(default_factory=dict)


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


def _storage_of(t: torch.Tensor) -> Any | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta-like tensors: not sized here
        return None


class _StorageIds:
    """A distinct id per storage, alive or dead: a pointer freed and reused later gets a new id."""

    def __init__(self) -> None:
        self._by_pointer: dict[int, tuple[int, Any]] = {}
        self.sizes: dict[int, int] = {}

    def key(self, t: torch.Tensor) -> int | None:
        storage = _storage_of(t)
        if storage is None or storage.nbytes() == 0:
            return None
        pointer = storage.data_ptr()
        known = self._by_pointer.get(pointer)
        if known is not None and not known[1].expired():
            return known[0]
        from torch.multiprocessing.reductions import StorageWeakRef

        new = len(self.sizes)
        self._by_pointer[pointer] = (new, StorageWeakRef(storage))
        self.sizes[new] = storage.nbytes()
        return new


class _OpRecorder(TorchDispatchMode):
    """Records, while a candidate block runs, each op's class, output storages and time."""

    def __init__(self, recorder: ActivationRecorder, synchronize: bool) -> None:
        super().__init__()
        self.recorder = recorder
        self.synchronize = synchronize

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        block = self.recorder._current
        if block is None:
            return func(*args, **(kwargs or {}))
        if self.synchronize:
            torch.cuda.synchronize()
        start = time.perf_counter_ns()
        out = func(*args, **(kwargs or {}))
        if self.synchronize:
            torch.cuda.synchronize()
        elapsed = time.perf_counter_ns() - start
        ids = self.recorder._ids
        keys = [k for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) for k in [ids.key(t)] if k is not None]
        self.recorder._ops[block].append((_op_class(func) or "other", elapsed, keys))
        part = self.recorder._part
        if part is not None:
            self.recorder._part_ns[part] += elapsed
        return out


class ActivationRecorder:
    """Watch one forward pass: what each candidate block saves for backward, which ops it runs and their times.

    Start it right before the forward, stop it right after (before ``backward``): :meth:`stop` returns the
    :class:`ActivationProfile`. As a context manager it does both. The forward is the training's own: nothing it
    computes changes (the hooks return every tensor as it is), it only runs slower (each op goes through Python once).

    Args:
        model: the model (its parameters and buffers are not counted as activations).
        blocks: the candidate blocks, ``(name, module)``, none inside another.
        device: the device the forward runs on (CUDA: ops are synchronized for timing, memory from the allocator).
    """

    def __init__(
        self, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], device: torch.device | str | None = None
    ) -> None:
        self.model = model
        self.blocks = list(blocks)
        self.device = torch.device(device) if device is not None else _model_device(model)
        self._current: str | None = None
        self._ops: dict[str, list[tuple[str, int, list[int]]]] = {}  # block -> [(op class, ns, output storage ids)]
        self._inputs: dict[str, set[int]] = {}
        self._outputs: dict[str, set[int]] = {}
        self._saved: dict[int, str | None] = {}  # storage id -> block it was first saved in (None: outside)
        # The parts of each block (children holding 2+ layers: attention, MLP), checkpointed alone as finer options.
        self.parts = {name: _parts_of(name, block) for name, block in self.blocks}
        self._part: str | None = None
        self._saved_part: dict[int, str | None] = {}  # storage id -> part it was first saved in (None: no part)
        self._part_ns: dict[str, int] = {}
        self._wall_ns: dict[str, int] = {}  # block -> wall time of its forward, the recorder's own cost included
        self._entered_ns = 0
        self._ids = _StorageIds()
        self._excluded: set[int] = set()
        self._handles: list[Any] = []
        self._saved_hooks: Any = None
        self._mode: _OpRecorder | None = None
        self._probe: MemoryProbe | None = None
        self._before: int | None = None

    @property
    def active(self) -> bool:
        """Whether the recorder is watching (between :meth:`start` and :meth:`stop`)."""
        return self._saved_hooks is not None

    def start(self) -> None:
        """Install the hooks; call right before the forward."""
        if self.active:
            return
        regions = [name for name, _ in self.blocks] + [n for parts in self.parts.values() for n, _ in parts]
        self._ops = {name: [] for name, _ in self.blocks}
        self._inputs = {name: set() for name in regions}
        self._outputs = {name: set() for name in regions}
        self._saved, self._saved_part, self._part = {}, {}, None
        self._part_ns = {n: 0 for parts in self.parts.values() for n, _ in parts}
        self._wall_ns = {name: 0 for name, _ in self.blocks}
        self._ids = _StorageIds()
        keys = (self._ids.key(t) for t in (*self.model.parameters(), *self.model.buffers()))
        self._excluded = {key for key in keys if key is not None}
        for name, block in self.blocks:
            enter = functools.partial(self._enter, name)
            self._handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leave, always_call=True))
            for part, module in self.parts[name]:
                enter_part = functools.partial(self._enter_part, name, part)
                self._handles.append(module.register_forward_pre_hook(enter_part, with_kwargs=True))
                self._handles.append(module.register_forward_hook(functools.partial(self._leave_part, part)))
        try:
            self._probe = MemoryProbe(self.device)
            self._before = self._probe.allocated()
        except (ValueError, RuntimeError):
            self._probe, self._before = None, None
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        self._mode = _OpRecorder(self, synchronize=self.device.type == "cuda" and torch.cuda.is_available())
        self._mode.__enter__()

    def stop(self) -> ActivationProfile:
        """Remove the hooks (call before ``backward``, while the forward's output is alive) and return the profile."""
        if not self.active:
            raise RuntimeError("`ActivationRecorder.stop()` called without `start()`.")
        after = None
        if self._probe is not None:
            after = self._probe.allocated()
        self.close()
        return self._profile(None if after is None or self._before is None else after - self._before)

    def close(self) -> None:
        """Remove the hooks without building a profile (on an exception); does nothing when not started."""
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._current = self._part = None
        if self._probe is not None:
            self._probe.close()

    def __enter__(self) -> ActivationRecorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # hooks
    def _enter(self, name: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled() and self._current is None:
            self._current = name
            self._note(self._inputs[name], (args, kwargs))
            self._entered_ns = time.perf_counter_ns()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._current
        if name is not None and self.blocks[[n for n, _ in self.blocks].index(name)][1] is module:
            self._wall_ns[name] += time.perf_counter_ns() - self._entered_ns
            self._current = self._part = None
            self._note(self._outputs[name], output)

    def _enter_part(self, block: str, part: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._current == block and self._part is None:
            self._part = part
            self._note(self._inputs[part], (args, kwargs))

    def _leave_part(self, part: str, module: nn.Module, args: Any, output: Any) -> None:
        if self._part == part:
            self._part = None
            self._note(self._outputs[part], output)

    def _note(self, keys: set[int], tensors: Any) -> None:
        for t in tree_flatten(tensors)[0]:
            key = self._ids.key(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in self._excluded:
                keys.add(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self._ids.key(t)
        if key is not None and key not in self._excluded and key not in self._saved:
            self._saved[key] = self._current
            self._saved_part[key] = self._part
        return t

    # accounting
    def _profile(self, measured: int | None) -> ActivationProfile:
        size = self._ids.sizes
        total = sum(size[k] for k in self._saved)
        profiles = []
        for name, _ in self.blocks:
            saved = sum(size[k] for k, block in self._saved.items() if block == name)
            inputs = self._kept_when_checkpointed(name, self._saved)
            ops = self._ops[name]
            forward_ns = sum(elapsed for _, elapsed, _ in ops)
            # Selective checkpointing runs every op of the block through a Python dispatch mode twice (forward and
            # recompute): charge it what the recorder's own mode cost per op, measured on this forward.
            per_op_ns = max(0, self._wall_ns[name] - forward_ns) / max(len(ops), 1)
            kept, recompute = {}, {}
            for policy, classes in _POLICIES.items():
                keys = set(inputs)
                kept_ns = 0
                for cls, elapsed, outs in ops:
                    if cls in classes:
                        keys.update(k for k in outs if k not in self._excluded)
                        kept_ns += elapsed
                kept[policy] = sum(size[k] for k in keys)
                recompute[policy] = (forward_ns - kept_ns + 2 * len(ops) * per_op_ns) / 1e9
            counts: dict[str, int] = {}
            for cls, _, _ in ops:
                counts[cls] = counts.get(cls, 0) + 1
            parts = {
                part: (
                    sum(size[k] for k, p in self._saved_part.items() if p == part),
                    sum(size[k] for k in self._kept_when_checkpointed(part, self._saved_part)),
                    self._part_ns[part] / 1e9,
                )
                for part, _ in self.parts[name]
            }
            inputs_bytes = sum(size[k] for k in inputs)
            useful = {p: v for p, v in parts.items() if v[0] > v[1]}  # a part that frees nothing is no option
            profiles.append(
                BlockProfile(
                    name, saved, inputs_bytes, forward_ns / 1e9, kept, recompute, dict(sorted(counts.items())), useful
                )
            )
        inside = sum(p.saved_bytes for p in profiles)
        return ActivationProfile(
            total, total - inside, tuple(profiles), measured, self._probe.sample().source if self._probe else None
        )

    def _kept_when_checkpointed(self, region: str, owner: dict[int, str | None]) -> set[int]:
        """The storages a checkpointed region still keeps: its inputs (the checkpoint holds them; those it saved first
        or nobody saved count here) and those of its outputs it saved itself (a ReLU saves its result), which stay
        alive as the next region's input."""
        inputs = {k for k in self._inputs[region] if owner.get(k, region) == region}
        return inputs | {k for k in self._outputs[region] if owner.get(k) == region}


def _parts_of(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of ``block`` holding two layers or more (attention, MLP), by qualified name."""
    return [(f"{name}.{child}", module) for child, module in block.named_children() if count_layers(module) >= 2]


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def profile_activations(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], forward_fn: Callable[[], Any]
) -> tuple[ActivationProfile, Any]:
    """Run ``forward_fn()`` (one forward pass) under an :class:`ActivationRecorder`; return the profile and its output.

    The output is returned with its graph, so the caller's ``backward`` makes this a normal training step.
    """
    recorder = ActivationRecorder(model, blocks)
    recorder.start()
    try:
        output = forward_fn()
    except BaseException:
        recorder.close()
        raise
    return recorder.stop(), output


# ------------------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class BlockChoice:
    """How one block runs under a :class:`CheckpointPlan`.

    Attributes:
        name: the block's qualified name.
        mode: ``"none"``, ``"selective"``, ``"parts"`` (some of its children checkpointed, fully) or ``"full"``.
        kept_ops: for ``"selective"``, the op classes whose outputs are kept (``("matmul", "conv", "attention")``).
        expected_kept_bytes: activation bytes the block is expected to keep for backward.
        expected_recompute_s: expected recompute time per step.
        parts: for ``"parts"``, the qualified names of the children checkpointed.
    """

    name: str
    mode: str
    kept_ops: tuple[str, ...]
    expected_kept_bytes: int
    expected_recompute_s: float
    parts: tuple[str, ...] = ()

    @property
    def regions(self) -> tuple[str, ...]:
        """The modules checkpointed for this choice: the block, its chosen parts, or none."""
        return () if self.mode == "none" else self.parts if self.mode == "parts" else (self.name,)


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


_Option = tuple[float, int, str, tuple[str, ...]]  # (recompute s, kept bytes, mode, kept op classes or part names)


def _part_options(block: BlockProfile) -> list[tuple[float, int, str, tuple[str, ...]]]:
    """Checkpointing some of a block's parts (every subset of up to three parts; else each alone, and all)."""
    names = list(block.parts)  # in the order of the block's children, as `named_modules` lists them
    if len(names) <= 3:
        subsets = [c for r in range(1, len(names) + 1) for c in itertools.combinations(names, r)]
    else:
        subsets = [(n,) for n in names] + [tuple(names)]
    options = []
    for subset in subsets:
        freed = sum(block.parts[p][0] - block.parts[p][1] for p in subset)
        options.append((sum(block.parts[p][2] for p in subset), block.saved_bytes - freed, "parts", subset))
    return options


def _block_options(block: BlockProfile) -> list[_Option]:
    """A block's options: none, each selective policy, some of its parts, full."""
    options: list[_Option] = [(0.0, block.saved_bytes, "none", ())]
    for policy, classes in _POLICIES.items():
        present = tuple(c for c in classes if block.op_counts.get(c))
        if present and policy in block.kept_bytes and block.kept_bytes[policy] < block.saved_bytes:
            options.append((max(block.recompute_s[policy], 0.0), block.kept_bytes[policy], "selective", present))
    options.extend(_part_options(block))
    options.append((block.forward_s, min(block.input_bytes, block.saved_bytes), "full", ()))
    return options


def _knapsack(options: list[list[_Option]], unit: float, cap: int) -> list[_Option] | None:
    """One option per block, the least total time with at most ``cap`` units of memory (None when nothing fits)."""
    import numpy as np

    best = np.zeros(cap + 1)  # least recompute time with at most j units kept, over the blocks so far
    picks = []
    for block_options in options:
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1)
        for index, (seconds, kept, _, _) in enumerate(block_options):
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


def plan_checkpointing(profile: ActivationProfile, budget: float, resolution: int = 2000) -> CheckpointPlan:
    """Choose per block none / selective / parts / full checkpointing: the least recompute time that keeps at most
    ``budget`` x the activations of no checkpointing.

    A multiple-choice knapsack, solved exactly by dynamic programming over the memory left (in ``resolution`` steps,
    each option's memory rounded up, so the plan never exceeds the budget): one option per block, the least total
    recompute time within the budget. It keeps as much as the budget allows where keeping saves time, so the plan
    lands just under the budget rather than far below it. When even full checkpointing of every block exceeds the
    budget, every block is checkpointed fully and the plan says it is out of reach.
    """
    budget = validate_memory_budget("plan_checkpointing", budget)
    target = budget * profile.total_saved_bytes
    options = [_block_options(block) for block in profile.blocks]
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
        BlockChoice(block.name, mode, () if mode == "parts" else ops, kept, recompute, ops if mode == "parts" else ())
        for block, (recompute, kept, mode, ops) in zip(profile.blocks, current)
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


# ------------------------------------------------------------------------------------------------------ applying


def _ops_of(classes: Sequence[str]) -> frozenset[Any]:
    ops: set[Any] = set()
    for cls in classes:
        for name in SAVE_OP_CLASSES[cls]:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


def selective_context_fn(kept_ops: Sequence[str]) -> Callable[[], tuple[Any, Any]]:
    """A checkpoint ``context_fn`` that keeps the outputs of the given op classes and recomputes every other op.

    Args:
        kept_ops: classes from :data:`SAVE_OP_CLASSES` (``"matmul"``, ``"conv"``, ``"attention"``).

    Raises:
        ValueError: for an unknown class.
    """
    unknown = [c for c in kept_ops if c not in SAVE_OP_CLASSES]
    if unknown:
        raise ValueError(f"`kept_ops` names unknown op classes {unknown}. Expected some of {list(SAVE_OP_CLASSES)}.")
    keep = _ops_of(kept_ops)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def apply_plan(model: nn.Module, plan: CheckpointPlan, preserve_rng_state: bool = True) -> list[str]:
    """Checkpoint the blocks ``plan`` chooses, in place; returns the names patched (already checkpointed ones are left).

    Undo with :func:`~lightning_perf.functional.grad_checkpoint.remove_activation_checkpointing`.
    """
    wrapped = []
    for choice in plan.checkpointed:
        context_fn = selective_context_fn(choice.kept_ops) if choice.mode == "selective" else None
        for name in choice.regions:
            module = model.get_submodule(name)
            if patch_forward(module, functools.partial(_checkpointed, preserve_rng_state, context_fn)) is not None:
                wrapped.append(name)
    return wrapped


def _checkpointed(
    preserve_rng_state: bool, context_fn: Callable[[], tuple[Any, Any]] | None, module: nn.Module
) -> CheckpointedForward:
    return CheckpointedForward(module, preserve_rng_state, context_fn)
