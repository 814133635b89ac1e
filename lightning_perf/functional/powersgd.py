"""PowerSGD gradient compression for ``DistributedDataParallel`` on any backend, with checkpointable state.

Entry points: :func:`register_powersgd_hook` (a :class:`PowerSGDHook` around torch's unmodified hooks),
:class:`CommunicationStats`, :func:`gather_state_dict`. Plain PyTorch;
:class:`lightning_perf.strategies.PowerSGDDDPStrategy` is the Lightning adapter. What it adds to torch's hooks, and why:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from lightning_perf._validation import (
    check_bool,
    check_choice,
    check_instance,
    check_int,
    check_number,
    check_optional_bool,
)

__all__ = [
    "HOOK_VARIANTS",
    "CommunicationStats",
    "PowerSGDHook",
    "gather_state_dict",
    "register_powersgd_hook",
    "ring_allreduce_seconds",
    "waits_each_bucket",
]

HookVariant = Literal["powersgd", "batched"]
#: ``"powersgd"``: layer-wise, each gradient matrix compressed on its own (the paper's algorithm, torch's
#: ``powerSGD_hook``). ``"batched"``: each bucket's flat gradient viewed as one square matrix
#: (``batched_powerSGD_hook``): less compute, usually much lower accuracy unless the rank is 1.
HOOK_VARIANTS: tuple[str, ...] = ("powersgd", "batched")
POWERSGD_OPTIONS: tuple[str, ...] = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
)
"""The arguments of :func:`register_powersgd_hook` passed on to torch's ``PowerSGDState``."""

STATE_FORMAT = 1
# A group is what one piece of saved state belongs to: one parameter ("powersgd") or one bucket's parameters
# ("batched", whose state is per bucket), as a tuple of parameter names. Saved under ",".join(names).
Group = tuple[str, ...]


@dataclass
class CommunicationStats:
    """What the buckets held and what was handed to all-reduce, summed over the buckets of one or more steps.

    ``bytes`` is the payload passed to all-reduce on each rank; a ring all-reduce moves ``2 (n - 1) / n`` times that
    over each worker's link (see :func:`ring_allreduce_seconds`).
    """

    numel_before: int = 0
    numel_after: int = 0
    bytes: int = 0
    bytes_uncompressed: int = 0

    @property
    def compression_rate(self) -> float:
        """Elements before over elements after (1.0 for plain all-reduce, ``nan`` when nothing was sent)."""
        return self.numel_before / self.numel_after if self.numel_after else math.nan


def validate_powersgd_options(owner: str, hook: Any, options: Mapping[str, Any]) -> None:
    """Check ``hook`` and the :data:`POWERSGD_OPTIONS` in ``options``; ``ValueError``/``TypeError`` naming ``owner``,
    the argument and the value.

    ``start_powerSGD_iter`` may be ``None`` (chosen later from the run's length).
    """
    check_choice(owner, "hook", hook, HOOK_VARIANTS)
    check_int(owner, "matrix_approximation_rank", options["matrix_approximation_rank"], 1)
    for name in ("use_error_feedback", "warm_start"):
        check_bool(owner, name, options[name])
    start = check_int(owner, "start_powerSGD_iter", options["start_powerSGD_iter"], 0, allow_none=True)
    if start is not None and start < 2 and (options["use_error_feedback"] or options["warm_start"]):
        raise ValueError(
            f"`{owner}(start_powerSGD_iter={start!r})` is not valid with error feedback or warm "
            "start: expected >= 2, because DDP rebuilds its buckets after the first iteration (torch's "
            "PowerSGDState refuses less). Use a larger value, or turn both off."
        )
    for name in ("min_compression_rate", "orthogonalization_epsilon"):
        check_number(owner, name, options[name])
    check_int(owner, "random_seed", options["random_seed"], 0)


def waits_each_bucket(backend: str, device_type: str) -> bool:
    """Whether :func:`register_powersgd_hook` finishes each bucket's collectives before its hook returns.

    torch's hook chains its P and Q all-reduces from future callbacks; on gloo a blocking wait inside such a callback
    can deadlock (the ranks enqueue their collectives in different orders), so everywhere but NCCL each bucket is
    finished first. On NCCL the asynchronous hook runs as torch ships it, overlapping communication with the rest of
    the backward pass.

    Args:
        backend: the process group's backend as ``torch.distributed.get_backend`` names it: ``"nccl"``, ``"gloo"``,
            or per device type, ``"cpu:gloo,cuda:nccl"``.
        device_type: where the gradients are (``"cuda"``, ``"cpu"``): picks the backend from a per-device string.
    """
    chosen = backend
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        chosen = per_device.get(device_type, "")
    return chosen.strip().lower() != "nccl"


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float) -> float:
    """Bandwidth term of a ring all-reduce of ``nbytes`` per worker: ``2 (n - 1) / n * nbytes / bandwidth``.

    Latency (``2 (n - 1)`` messages per all-reduce) and overlap with the backward pass are not modelled.
    """
    owner = "ring_allreduce_seconds"
    check_number(owner, "nbytes", nbytes)
    check_int(owner, "workers", workers, 1)
    check_number(owner, "bandwidth_bytes_per_s", bandwidth_bytes_per_s, exclusive=True)
    return 2.0 * (workers - 1) / workers * nbytes / bandwidth_bytes_per_s


# ------------------------------------------------------------------------------------------------ torch hook fixes
def _orthogonalize_matrix_or_batch(matrices: Tensor, epsilon: float = 0) -> None:
    if matrices.dim() == 2:  # a view: the in-place orthogonalization lands in ``matrices``
        matrices = matrices.unsqueeze(0)
    _torch_powersgd._orthogonalize(matrices, epsilon)


@functools.cache
def _batched_hook() -> Callable[..., Any]:
    """torch's ``batched_powerSGD_hook``, with an orthogonalization that accepts the 2-D matrices it passes.

    The function is rebuilt from torch's own code object with one global replaced (its nested callbacks share those
    globals), so nothing in torch is patched. If the installed torch accepts 2-D matrices, its hook is used as is.
    """
    hook = _torch_powersgd.batched_powerSGD_hook
    try:
        _torch_powersgd._orthogonalize(torch.ones(2, 1))
        return hook
    except AssertionError:
        pass
    namespace = {**vars(_torch_powersgd), "_orthogonalize": _orthogonalize_matrix_or_batch}
    fixed = types.FunctionType(hook.__code__, namespace, hook.__name__, hook.__defaults__, hook.__closure__)
    fixed.__kwdefaults__ = hook.__kwdefaults__
    return fixed


@contextlib.contextmanager
def _cuda_synchronize_skips_cpu() -> Iterator[None]:
    """While a CPU bucket is compressed, make ``torch.cuda.synchronize(cpu_device)`` a no-op instead of an error."""
    original = torch.cuda.synchronize

    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type == "cpu":
            return
        original(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _completed(value: Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


# ------------------------------------------------------------------------------------------------ bucket layouts
@dataclass
class _Layout:
    """Which parameters a bucket holds, where their gradients sit in its flat buffer, and their shapes."""

    params: list[Tensor]
    names: tuple[str, ...]
    offsets: list[int]
    shapes: list[torch.Size]

    def holds(self, params: list[Tensor]) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))


def _compressed_order(shapes: list[torch.Size], rank: int, min_compression_rate: float) -> list[tuple[int, int, int]]:
    """``(index, m, r)`` of each gradient ``powerSGD_hook`` compresses, in the order its Q memory holds them.

    Mirrors the hook: a gradient is viewed as ``(shape[0], -1)``, compressed when worth it (``_should_compress``),
    and the compressed ones are grouped by matrix shape in order of first appearance.
    """
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for index, shape in enumerate(shapes):
        if len(shape) == 0 or shape.numel() == 0:
            continue
        n = shape[0]
        m = shape.numel() // n
        r = min(n, m, rank)
        if _torch_powersgd._should_compress(n, m, r, min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((index, m, r))
    return [entry for entries in by_shape.values() for entry in entries]


class PowerSGDHook:
    """The state DDP hands to the communication hook: torch's ``PowerSGDState`` and what it lacks.

    Built by :func:`register_powersgd_hook`. ``state`` is the torch ``PowerSGDState`` (hyperparameters, iteration,
    RNG, per-bucket residuals and P/Q memories); the hook itself is torch's, unmodified.

    State is re-keyed from bucket indices to parameters whenever a bucket is seen with other parameters than before
    (and on :meth:`load_state_dict`): residuals are cut per parameter at the gradient offsets, Q matrices per
    compressed gradient ("powersgd") or kept per bucket ("batched"), and put back together for the new buckets as
    they arrive. Layer-wise PowerSGD works on each gradient independently and, with warm start, each initial Q is
    drawn per parameter (seeded by ``random_seed`` and the parameter's name; torch draws one seed per bucket), so a
    run does not depend on DDP's bucketing: training after a resume or a bucket rebuild is exactly the same as
    without it. For "batched", a bucket whose parameters match no saved bucket runs one plain all-reduce while saved
    state is waiting (the first iteration after a resume, before DDP rebuilds its buckets).

    Only Q is saved for warm start: P is recomputed from Q at every step (``P = M Q``).
    """

    def __init__(
        self,
        state: _torch_powersgd.PowerSGDState,
        variant: HookVariant,
        parameter_names: Mapping[int, str],
        synchronous: bool,
        guard_cpu_synchronize: bool,
        random_seed: int = 0,
    ) -> None:
        check_choice("PowerSGDHook", "hook", variant, HOOK_VARIANTS)
        self.state = state
        self.variant = variant
        self.synchronous = synchronous
        self.guard_cpu_synchronize = guard_cpu_synchronize
        self.random_seed = random_seed
        self._names = dict(parameter_names)
        self._hook_fn = _torch_powersgd.powerSGD_hook if variant == "powersgd" else _batched_hook()
        self._layouts: dict[int, _Layout] = {}
        self._pending: dict[Group, dict[str, Tensor]] = {}  # re-keyed state waiting for its bucket
        self._restoring = False  # from a load or a bucket rebuild until a whole step ran on unchanged buckets
        self._layout_changed = False
        self.relayouts = 0  # how often DDP's buckets changed under compression (expected: at most once per fit)
        self._stats = CommunicationStats()

    # -------------------------------------------------------------------------------- the hook
    def run(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Compress and all-reduce one bucket (what DDP calls through :func:`powersgd_comm_hook`)."""
        state = self.state
        buffer = bucket.buffer()
        numel, element_size = buffer.numel(), buffer.element_size()
        # Before start_powerSGD_iter torch's hook all-reduces plainly by itself; after it, a "batched" bucket whose
        # saved state is not yet placeable is all-reduced plainly here, once.
        compressing, plain_here = state.iter >= state.start_powerSGD_iter, False
        if compressing:
            self._to_buffer_device(bucket.index(), buffer)
        if compressing and not self._prepare(bucket):
            compressing, plain_here = False, True
        before, after = state.total_numel_before_compression, state.total_numel_after_compression
        with _cuda_synchronize_skips_cpu() if self.guard_cpu_synchronize else contextlib.nullcontext():
            if plain_here:
                future = default_hooks.allreduce_hook(state.process_group, bucket)
                state.maybe_increase_iter(bucket)
            else:
                future = self._hook_fn(state, bucket)
            if self.synchronous:
                future = _completed(future.wait())
        if compressing:
            numel_before = state.total_numel_before_compression - before
            numel_after = state.total_numel_after_compression - after
        else:
            numel_before = numel_after = numel
        self._stats.numel_before += numel_before
        self._stats.numel_after += numel_after
        self._stats.bytes += numel_after * element_size
        self._stats.bytes_uncompressed += numel * element_size
        return future

    def take_stats(self) -> CommunicationStats:
        """The communication since the last call (one optimizer step when called once per step), then reset."""
        stats, self._stats = self._stats, CommunicationStats()
        return stats

    def _to_buffer_device(self, index: int, buffer: Tensor) -> None:
        """Put this bucket's residual, P and Q where its gradients are: every tensor the hook hands to a collective
        must be on a device of the process group's backend (NCCL has no CPU tensors: "No backend type associated
        with device type cpu"). A no-op once they are (one device comparison per tensor and bucket)."""
        for memory in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict):
            tensor = memory.get(index)
            if tensor is not None and tensor.device != buffer.device:
                memory[index] = tensor.to(buffer.device)

    # -------------------------------------------------------------------------------- layouts
    def _prepare(self, bucket: dist.GradBucket) -> bool:
        """Make the state dicts hold this bucket's state; ``False`` if it must wait a step (see the class docstring)."""
        index = bucket.index()
        params = bucket.parameters()
        known = self._layouts.get(index)
        ready = True
        if known is None or not known.holds(params):
            self._layout_changed = True
            if known is not None:  # DDP rebuilt its buckets: re-key every bucket's state, rebuild each as it comes
                for old_index in self._layouts:
                    self._pending.update(self._split(old_index, pop=True))
                self._layouts.clear()
                self._restoring = bool(self._pending)
                self.relayouts += 1
            buffer = bucket.buffer()
            base = buffer.storage_offset()
            layout = _Layout(
                params=params,
                names=tuple(self._names[id(p)] for p in params),
                offsets=[int(g.storage_offset()) - int(base) for g in bucket.gradients()],  # views into the buffer
                shapes=[p.shape for p in params],
            )
            self._layouts[index] = layout
            ready = self._assemble(index, layout, buffer)
        if bucket.is_last():
            if not self._layout_changed:  # a whole step on unchanged buckets: whatever was not placed is stale
                self._pending.clear()
                self._restoring = False
            self._layout_changed = False
        return ready

    def _split(self, index: int, pop: bool) -> dict[Group, dict[str, Tensor]]:
        """Bucket ``index``'s residual and Q, re-keyed by group (removed from the state dicts when ``pop``)."""
        state, layout = self.state, self._layouts[index]
        take = dict.pop if pop else dict.get
        residual = take(state.error_dict, index, None)
        q = take(state.q_memory_dict, index, None)
        if pop:
            state.p_memory_dict.pop(index, None)
        out: dict[Group, dict[str, Tensor]] = {}
        if self.variant == "batched":
            entry = {k: v for k, v in (("residual", residual), ("q", q)) if v is not None}
            return {layout.names: entry} if entry else {}
        if residual is not None:
            for name, offset, shape in zip(layout.names, layout.offsets, layout.shapes):
                out.setdefault((name,), {})["residual"] = residual[offset : offset + shape.numel()]
        if q is not None:
            position = 0
            for i, m, r in _compressed_order(
                layout.shapes, state.matrix_approximation_rank, state.min_compression_rate
            ):
                out.setdefault((layout.names[i],), {})["q"] = q[position : position + m * r]
                position += m * r
        return out

    def _assemble(self, index: int, layout: _Layout, buffer: Tensor) -> bool:
        """Put this bucket's state into the state dicts. ``False``: saved "batched" state waits for its bucket."""
        state = self.state
        if self.variant == "batched":
            if not self._restoring:
                return True  # torch's hook starts the bucket's state itself
            entry = self._pending.pop(layout.names, None)
            if entry is None:
                return False
            side = math.ceil(math.sqrt(buffer.numel()))
            residual, q = entry.get("residual"), entry.get("q")
            if state.use_error_feedback and residual is not None and residual.numel() == side * side:
                state.error_dict[index] = residual.to(buffer)
            if state.warm_start and q is not None and q.shape == (side, state.matrix_approximation_rank):
                state.q_memory_dict[index] = q.to(buffer)
                state.p_memory_dict[index] = torch.zeros_like(state.q_memory_dict[index])
            return True
        entries = [self._pending.pop((name,), {}) for name in layout.names]
        if state.use_error_feedback and any("residual" in e for e in entries):
            residual = buffer.new_zeros(buffer.numel())
            for entry, offset, shape in zip(entries, layout.offsets, layout.shapes):
                if entry.get("residual") is not None and entry["residual"].numel() == shape.numel():
                    residual[offset : offset + shape.numel()] = entry["residual"]
            state.error_dict[index] = residual
        if state.warm_start:
            # Every Q is placed here, a missing one drawn per parameter, so torch's hook never draws one per bucket
            # (with a seed from its RNG): the run does not depend on how DDP buckets the gradients.
            order = _compressed_order(layout.shapes, state.matrix_approximation_rank, state.min_compression_rate)
            qs = []
            for i, m, r in order:
                q = entries[i].get("q")
                qs.append(q if q is not None and q.numel() == m * r else self._initial_q(layout.names[i], m * r))
            state.q_memory_dict[index] = torch.cat([q.to(buffer) for q in qs] or [buffer[:0]])
            state.p_memory_dict[index] = buffer.new_zeros(sum(layout.shapes[i][0] * r for i, _, r in order))
        return True

    def _initial_q(self, name: str, numel: int) -> Tensor:
        """A standard normal Q for parameter ``name``, the same on every rank (torch's hook orthogonalizes it)."""
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.random_seed}:{name}".encode()))
        return torch.randn(numel, generator=generator)

    # -------------------------------------------------------------------------------- state
    def _groups_state(self) -> dict[Group, dict[str, Tensor]]:
        groups = {g: dict(entry) for g, entry in self._pending.items()}
        for index in self._layouts:
            for group, entry in self._split(index, pop=False).items():
                groups.setdefault(group, {}).update(entry)
        return groups

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state, as tensors and plain values on the CPU (safe for ``weights_only`` loading).

        Keys: ``format``, ``hook``, ``matrix_approximation_rank``, ``start_powerSGD_iter``, ``iter``, ``rng`` (the
        NumPy Mersenne-Twister state as ``keys``/``pos``/``has_gauss``/``cached_gaussian``), the two compression
        counters, ``world_size`` (1 here; :func:`gather_state_dict` fills in every rank), ``q`` (group key ->
        warm-start Q, identical on every rank) and ``residuals`` (one dict group key -> error-feedback residual per
        rank). A group key is a parameter name, or for "batched" the comma-joined names of one bucket's parameters.
        """
        import numpy as np

        state = self.state
        _, keys, pos, has_gauss, cached_gaussian = state.rng.get_state(legacy=True)
        groups = self._groups_state()
        return {
            "format": STATE_FORMAT,
            "hook": self.variant,
            "matrix_approximation_rank": int(state.matrix_approximation_rank),
            "start_powerSGD_iter": int(state.start_powerSGD_iter),
            "iter": int(state.iter),
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
            "total_numel_before_compression": int(state.total_numel_before_compression),
            "total_numel_after_compression": int(state.total_numel_after_compression),
            "world_size": 1,
            # Copies: the hook updates Q in place.
            "q": {",".join(g): e["q"].to("cpu", copy=True) for g, e in groups.items() if "q" in e},
            "residuals": [
                {",".join(g): e["residual"].to("cpu", copy=True) for g, e in groups.items() if "residual" in e}
            ],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> list[str]:
        """Restore a :meth:`state_dict` / :func:`gather_state_dict` result; call after registration, before training.

        The iteration, RNG and counters are always restored (``start_powerSGD_iter`` is not: it is a setting).
        Residuals are restored only when saved from ``world_size`` ranks (each rank's differ), Q only when saved with
        the same hook variant and rank. What cannot be restored starts fresh, as at the first compression step.

        Returns:
            Why parts of the state were not restored (empty when everything was), for the caller to report.

        Raises:
            ValueError: if ``state_dict`` is not a PowerSGD state of a known format.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
            raise ValueError(
                f"Expected a PowerSGD state dict of format {STATE_FORMAT}, got {type(state_dict).__name__}."
            )
        import numpy as np

        state = self.state
        state.iter = int(state_dict["iter"])
        rng = state_dict["rng"]
        keys = np.asarray(rng["keys"].numpy(), dtype=np.uint32)
        state.rng.set_state(("MT19937", keys, int(rng["pos"]), int(rng["has_gauss"]), float(rng["cached_gaussian"])))
        state.total_numel_before_compression = int(state_dict["total_numel_before_compression"])
        state.total_numel_after_compression = int(state_dict["total_numel_after_compression"])

        reasons: list[str] = []
        q: Mapping[str, Tensor] = state_dict["q"]
        residuals: Mapping[str, Tensor] = {}
        saved_world = int(state_dict["world_size"])
        if state_dict["hook"] != self.variant:
            reasons.append(f"saved with hook={state_dict['hook']!r}, now hook={self.variant!r}: residuals and Q reset")
            q = {}
        else:
            if int(state_dict["matrix_approximation_rank"]) != state.matrix_approximation_rank and q:
                reasons.append(
                    f"saved with matrix_approximation_rank={state_dict['matrix_approximation_rank']}, now "
                    f"{state.matrix_approximation_rank}: warm-start matrices reset"
                )
                q = {}
            if saved_world != world_size:
                if any(state_dict["residuals"]):
                    reasons.append(
                        f"saved from {saved_world} ranks, now {world_size}: error-feedback residuals reset "
                        "(each rank's residual belongs to its own shard of the data)"
                    )
            else:
                residuals = state_dict["residuals"][rank]
        pending: dict[Group, dict[str, Tensor]] = {}
        for kind, tensors in (("q", q), ("residual", residuals)):
            for key, tensor in tensors.items():
                group = (key,) if self.variant == "powersgd" else tuple(key.split(","))
                pending.setdefault(group, {})[kind] = tensor
        for index in self._layouts:
            self._split(index, pop=True)  # drop whatever the hook held: the loaded state replaces it
        self._layouts.clear()
        self._pending = pending
        self._restoring = bool(pending)
        return reasons


def powersgd_comm_hook(hook, bucket):  # type: ignore[no-untyped-def]
    """The function registered with DDP. Left unannotated: DDP compares annotations to ``dist.GradBucket`` and
    ``Future[Tensor]`` objects, and postponed annotations would be strings."""
    return hook.run(bucket)


def register_powersgd_hook(
    model: DistributedDataParallel,
    *,
    hook: HookVariant = "powersgd",
    matrix_approximation_rank: int = 2,
    start_powerSGD_iter: int = 1_000,
    min_compression_rate: float = 2.0,
    use_error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 1e-8,
    random_seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
    synchronous: bool | None = None,
) -> PowerSGDHook:
    """Register PowerSGD on ``model`` (after ``init_process_group``, before the first backward) and return its state.

    Args:
        model: the ``DistributedDataParallel`` model.
        hook: ``"powersgd"`` (layer-wise, the paper's algorithm) or ``"batched"`` (one matrix per bucket).
        matrix_approximation_rank: the rank r of each approximation: lower compresses more.
        start_powerSGD_iter: optimizer steps of plain all-reduce before compression starts; at least 2 with error
            feedback or warm start (DDP rebuilds its buckets after the first iteration).
        min_compression_rate: a gradient is compressed only if that shrinks it at least this much.
        use_error_feedback: carry each step's approximation error into the next step's gradient.
        warm_start: reuse the last step's Q instead of a random one.
        orthogonalization_epsilon: added to column norms during orthogonalization; keeps an all-zero gradient
            column (a frozen or unused layer) from producing NaN. 1e-8 is far below any float32 gradient norm that
            matters; torch's default is 0.
        random_seed: seed of the random Q initialization (the same on every rank).
        process_group: the group to all-reduce over; ``None`` is the default group.
        synchronous: finish each bucket's collectives before the hook returns. ``None``: everywhere but NCCL
            (:func:`waits_each_bucket`).

    Example::

        ddp = DistributedDataParallel(model)
        powersgd = register_powersgd_hook(ddp, matrix_approximation_rank=2, start_powerSGD_iter=10)
        ...  # train; powersgd.take_stats() after each step says what was sent
        torch.save(gather_state_dict(powersgd), "powersgd.pt")  # on every rank; rank 0 gets all residuals
    """
    owner = "register_powersgd_hook"
    options = {name: value for name, value in locals().items() if name in POWERSGD_OPTIONS}
    validate_powersgd_options(owner, hook, options)
    check_optional_bool(owner, "synchronous", synchronous)
    check_instance(owner, "model", model, DistributedDataParallel, "a DistributedDataParallel model")
    group = process_group if process_group is not None else dist.group.WORLD
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if synchronous is None:
        synchronous = waits_each_bucket(str(dist.get_backend(group)), device.type)
    state = _torch_powersgd.PowerSGDState(process_group=process_group, **options)
    powersgd = PowerSGDHook(
        state,
        variant=hook,
        parameter_names={id(p): name for name, p in model.module.named_parameters()},
        synchronous=synchronous,
        guard_cpu_synchronize=synchronous and device.type == "cpu" and torch.cuda.is_available(),
        random_seed=random_seed,
    )
    model.register_comm_hook(powersgd, powersgd_comm_hook)
    return powersgd


def gather_state_dict(hook: PowerSGDHook, dst: int = 0) -> dict[str, Any] | None:
    """:meth:`PowerSGDHook.state_dict` with every rank's residuals, on rank ``dst``; ``None`` on the others.

    A collective: every rank of the hook's process group must call it. Rank ``dst`` briefly holds every rank's
    residuals (world size x the gradient size of the compressed buckets).
    """
    local = hook.state_dict()
    group = hook.state.process_group
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return local
    is_dst = dist.get_rank() == dst
    gathered: list[Any] | None = [None] * world_size if is_dst else None
    dist.gather_object(local["residuals"][0], gathered, dst=dst, group=group)
    if not is_dst:
        return None
    local["residuals"] = gathered
    local["world_size"] = world_size
    return local
