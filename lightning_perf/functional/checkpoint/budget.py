"""Activation checkpointing to a memory budget: measure what each block keeps for backward, then checkpoint the least.

Three steps, each usable alone: :class:`ActivationRecorder` / :func:`profile_activations` (what each block keeps),
:func:`plan_checkpointing` (a :class:`CheckpointPlan`: the least recompute within the budget) and :func:`apply_plan`.
The choices per block, the model behind the figures and the compiler's own budget: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_perf.functional.checkpoint.apply import CheckpointedForward
from lightning_perf.functional.checkpoint.blocks import count_layers
from lightning_perf.functional.checkpoint.cheap import RecomputeCheapForward, cheap_modules
from lightning_perf.functional.checkpoint.plan import (
    _POLICIES,
    ActivationProfile,
    BlockChoice,
    BlockProfile,
    CheckpointPlan,
    plan_checkpointing,
    validate_memory_budget,
)
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


# ----------------------------------------------------------------------------------------------------- measuring


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
        now = self.recorder._now
        start = now()
        out = func(*args, **(kwargs or {}))
        if self.synchronize:
            torch.cuda.synchronize()
        elapsed = now() - start
        ids = self.recorder._ids
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        keys = [k for t in tensors for k in [ids.key(t)] if k is not None]
        self.recorder._ops[block].append((_op_class(func) or "other", elapsed, keys))
        self.recorder._shapes[block].append((str(func), tuple(tuple(t.shape) for t in tensors)))
        self.recorder._clock_ns += elapsed
        part = self.recorder._part
        self.recorder._op_parts[block].append(part)
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
        # The clock of op times: on CPU the process's CPU time, which a busy machine does not inflate (an op's wall
        # time there includes the time the thread waited for a core: a random few times the op's cost); on CUDA wall
        # time around synchronized ops.
        self._now = time.perf_counter_ns if self.device.type == "cuda" else time.process_time_ns
        self._current: str | None = None
        self._ops: dict[str, list[tuple[str, int, list[int]]]] = {}  # block -> [(op class, ns, output storage ids)]
        self._shapes: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}  # block -> [(op, output shapes)]
        self._inputs: dict[str, set[int]] = {}
        self._outputs: dict[str, set[int]] = {}
        self._saved: dict[int, str | None] = {}  # storage id -> block it was first saved in (None: outside)
        # The parts of each block (children holding 2+ layers: attention, MLP), checkpointed alone as finer options.
        self.parts = {name: _parts_of(name, block) for name, block in self.blocks}
        self._part: str | None = None
        self._saved_part: dict[int, str | None] = {}  # storage id -> part it was first saved in (None: no part)
        self._part_ns: dict[str, int] = {}
        self._op_parts: dict[str, list[str | None]] = {}  # block -> the part each of its ops ran in
        # Block or part -> how many of the block's ops ran before its last saved tensor was packed. A checkpoint's
        # recompute stops there (torch's early stop; inputs are packed before the op's kernel runs): the ops after
        # it (the MLP's second linear, whose input is saved but whose output is not) are not run again.
        self._last_pack: dict[str, int] = {}
        # The norms and activations of each block, whose outputs may be recomputed from their inputs alone.
        self.cheap = {name: cheap_modules(name, block) for name, block in self.blocks}
        self._cheap_calls: dict[str, list[tuple[str, int, int, int]]] = {}  # block -> [(module, in, out, op ns)]
        self._cheap_began: dict[str, int] = {}
        self._clock_ns = 0  # the ops' time so far
        self._wall_ns: dict[str, int] = {}  # block -> time of its forward (op clock), the recorder's cost included
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
        self._shapes = {name: [] for name, _ in self.blocks}
        self._inputs = {name: set() for name in regions}
        self._outputs = {name: set() for name in regions}
        self._saved, self._saved_part, self._part = {}, {}, None
        self._part_ns = {n: 0 for parts in self.parts.values() for n, _ in parts}
        self._op_parts, self._last_pack = {name: [] for name, _ in self.blocks}, {}
        self._wall_ns = {name: 0 for name, _ in self.blocks}
        self._cheap_calls, self._cheap_began, self._clock_ns = {name: [] for name, _ in self.blocks}, {}, 0
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
            for qualname, module in self.cheap[name]:
                enter_cheap = functools.partial(self._enter_cheap, qualname)
                self._handles.append(module.register_forward_pre_hook(enter_cheap, with_kwargs=True))
                leave = functools.partial(self._leave_cheap, name, qualname)
                self._handles.append(module.register_forward_hook(leave))
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
            self._entered_ns = self._now()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._current
        if name is not None and self.blocks[[n for n, _ in self.blocks].index(name)][1] is module:
            self._wall_ns[name] += self._now() - self._entered_ns
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

    def _enter_cheap(self, qualname: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._current is not None and not kwargs:  # called as the recompute calls it: one positional input
            self._cheap_began[qualname] = self._clock_ns

    def _leave_cheap(self, block: str, qualname: str, module: nn.Module, args: Any, output: Any) -> None:
        began = self._cheap_began.pop(qualname, None)
        if began is None or self._current != block or len(args) != 1 or not isinstance(output, torch.Tensor):
            return
        key, out = (self._ids.key(args[0]) if isinstance(args[0], torch.Tensor) else None), self._ids.key(output)
        if key is not None and out is not None:
            self._cheap_calls[block].append((qualname, key, out, self._clock_ns - began))

    def _note(self, keys: set[int], tensors: Any) -> None:
        for t in tree_flatten(tensors)[0]:
            key = self._ids.key(t) if isinstance(t, torch.Tensor) else None
            if key is not None and key not in self._excluded:
                keys.add(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None:
            self._last_pack[self._current] = len(self._ops[self._current])
            if self._part is not None:
                self._last_pack[self._part] = len(self._ops[self._current])
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
                    self._recompute_ns(name, part) / 1e9,
                )
                for part, _ in self.parts[name]
            }
            inputs_bytes = sum(size[k] for k in inputs)
            useful = {p: v for p, v in parts.items() if v[0] > v[1]}  # a part that frees nothing is no option
            profiles.append(
                BlockProfile(
                    name,
                    saved,
                    inputs_bytes,
                    forward_ns / 1e9,
                    kept,
                    recompute,
                    dict(sorted(counts.items())),
                    useful,
                    self._recomputable(name),
                    self._recompute_ns(name, name) / 1e9,
                    hash(tuple(self._shapes[name])),
                )
            )
        inside = sum(p.saved_bytes for p in profiles)
        return ActivationProfile(
            total, total - inside, tuple(profiles), measured, self._probe.sample().source if self._probe else None
        )

    def _recompute_ns(self, block: str, region: str) -> int:
        """Time of the ops a checkpointed ``region`` (the block or one of its parts) runs again: its ops before
        the one that packed its last saved tensor (see ``_last_pack``)."""
        last = self._last_pack.get(region, 0)
        ops, parts = self._ops[block], self._op_parts[block]
        return sum(ops[i][1] for i in range(min(last, len(ops))) if region == block or parts[i] == region)

    def _recomputable(self, name: str) -> dict[str, tuple[str | None, int, float]]:
        """The norms and activations of block ``name`` whose output can be dropped and made again from an input that
        stays saved anyway: ``{module: (part its output is first saved in or None, bytes freed, recompute s)}``.

        The output must be saved for backward first inside the block (not its input or output, which live on), and the
        input saved inside the block too (or be the block's input, saved by an earlier block or by this one), outside
        the parts or in the output's part: then dropping the output frees its bytes and keeps nothing new alive.
        """
        order = {block: index for index, (block, _) in enumerate(self.blocks)}
        found: dict[str, tuple[str | None, int, float]] = {}
        for qualname, key, out, ns in self._cheap_calls[name]:
            if qualname in found or self._saved.get(out, "") != name:
                continue
            if out in self._outputs[name] or out in self._inputs[name]:
                continue
            region = self._saved_part.get(out)
            owner = self._saved.get(key, "")
            inside = owner == name and self._saved_part.get(key) in (None, region)
            before = key in self._inputs[name] and owner in order and order[owner] <= order[name]
            if inside or before:
                found[qualname] = (region, self._ids.sizes[out], ns / 1e9 + _RECIPE_S)
        return found

    def _kept_when_checkpointed(self, region: str, owner: dict[int, str | None]) -> set[int]:
        """The storages a checkpointed region still keeps: its inputs (the checkpoint holds them; those it saved first
        or nobody saved count here) and those of its outputs it saved itself (a ReLU saves its result), which stay
        alive as the next region's input."""
        inputs = {k for k in self._inputs[region] if owner.get(k, region) == region}
        return inputs | {k for k in self._outputs[region] if owner.get(k) == region}


_RECIPE_S = 20e-6  # the saved-tensor hooks' own cost per recomputed output (pack, unpack, a module call in Python)


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

    Undo with :func:`~lightning_perf.functional.checkpoint.apply.remove_activation_checkpointing`.
    """
    wrapped = []
    for choice in plan.checkpointed:
        context_fn = selective_context_fn(choice.kept_ops) if choice.mode == "selective" else None
        for name in choice.regions:
            module = model.get_submodule(name)
            if name == choice.name and choice.recomputed:
                recomputed = [model.get_submodule(n) for n in choice.recomputed]
                patch: Any = patch_forward(module, functools.partial(RecomputeCheapForward, modules=recomputed))
            else:
                patch = patch_forward(module, functools.partial(_checkpointed, preserve_rng_state, context_fn))
            if patch is not None:
                wrapped.append(name)
    return wrapped


def _checkpointed(
    preserve_rng_state: bool, context_fn: Callable[[], tuple[Any, Any]] | None, module: nn.Module
) -> CheckpointedForward:
    return CheckpointedForward(module, preserve_rng_state, context_fn)
