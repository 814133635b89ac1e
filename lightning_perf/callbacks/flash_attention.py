"""Swap the model's attention modules for fused kernels (flash-attn 2 or SDPA) while the Trainer runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._validation import FILTER_FN, check_bool, check_instance
from lightning_perf._warnings import warn_once
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.functional.attention.kernels import HALF_DTYPES
from lightning_perf.functional.attention.swap import (
    ACTIONS,
    ALREADY_FUSED,
    KEPT,
    SWAPPED,
    SWITCHED_CONFIG,
    UNCHANGED,
    AttentionAdapter,
    AttentionDecision,
    SwapResult,
    swap_attention,
    time_against_original,
)
from lightning_perf.functional.surgery import restore_modules, take_over_modes
from lightning_perf.profiling.step_phases import is_compiled

_KEEP_OWN_BELOW = 0.95
"""On a CPU in half precision, a swapped module's original goes back when it measured at most this fraction of the
swap's time at the first training batch (forward and backward)."""


class FlashAttentionCallback(UndoOnExit):
    """Runs the model's attention through flash-attn 2 where it applies, else PyTorch's fused SDPA kernels.

    In ``setup`` (after ``configure_model``, before the optimizer and DDP exist) every attention module an adapter
    knows is swapped for a version that computes through a fused kernel, after a parity check against the original on
    random inputs (forward and backward, in eval mode and in training mode with and without dropout); in ``teardown``
    (or ``on_exception``, when the run fails or is interrupted) the originals go back, holding the trained weights. A
    swapped module takes over the original's train/eval mode and follows Lightning's switches around validation. The
    swapped modules hold the original parameters under the same names: ``state_dict`` keys, checkpoints and the
    optimizer are unaffected.

    Kernel per module: flash-attn 2 (``pip install 'lightning-perf[flash]'``) on CUDA GPUs of compute capability 8.0+
    when attention computes in fp16/bf16 (``precision="bf16-mixed"`` or ``"16-mixed"``) with head size <= 256 and no
    arbitrary mask; otherwise SDPA, whose dispatcher picks the best backend for the device (flash / memory-efficient /
    cuDNN on CUDA, a fused flash kernel on CPU). Each choice and its reason is logged on rank zero and kept in
    :attr:`decisions`.

    Modules it knows: ``nn.MultiheadAttention`` (on its own or inside ``nn.TransformerEncoderLayer`` /
    ``DecoderLayer``; calls with ``need_weights=True``, its default, keep the original path, so pass
    ``need_weights=False`` where you discard the weights), the common hand-written pattern (a fused q/k/v ``Linear``,
    eager softmax attention, an output ``Linear``; causal or not: timm's ViT ``Attention``, MONAI's ``SABlock``),
    Hugging Face models with eager attention (their configuration is switched to ``"sdpa"``, and back at teardown), and
    whatever your own :class:`~lightning_perf.functional.attention.swap.AttentionAdapter` knows. A swapped module takes
    the
    calls its original takes: default arguments (``attn_mask=None``, ``is_causal=False``) and masks whose meaning was
    learned from the original run the kernel; any other argument makes that call run the original code, reported once
    by name. Modules that already call SDPA (timm's ``fused_attn=True``, Hugging Face ``"sdpa"``) are reported as
    already fused and left alone. A module it cannot swap stays unchanged, with the reason in :attr:`decisions`.

    Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) attention modules inside
    sharded blocks are recognised and checked on plain stand-in weights of their full shapes (the same on every rank,
    no collective call) and then swapped holding the real sharded parameters, which FSDP2 gathers as before. Kept, with
    the reason: an attention module ``fully_shard`` was applied to itself, and one that holds sharded parameters itself
    rather than in child layers (``nn.MultiheadAttention``).

    When it helps: attention-heavy models, long sequences (the fused kernels never build the ``(T, T)`` score
    matrix: memory grows with ``T`` instead of ``T^2``), hand-written attention. When it does nothing:
    ``nn.MultiheadAttention`` called with ``need_weights=False`` already runs SDPA inside torch, so the gain there
    comes from flash-attn on GPUs only.

    Args:
        adapters: extra :class:`~lightning_perf.functional.attention.swap.AttentionAdapter` instances, or class paths of
            adapters built without arguments (YAML), tried before the registered and built-in ones.
        filter_fn: ``filter_fn(module, name) -> bool`` restricting which modules are considered.
        parity_check: compare each swapped module with its original before installing it. A mismatch keeps the
            original and warns with a :class:`~lightning_perf.FallbackWarning`.
        strict: raise instead of falling back when a parity check fails.
        time_first_batch: on a CPU under ``precision="bf16-mixed"`` / ``"16-mixed"``, where which kernel wins depends
            on the module and its shapes (SDPA computes in float32 there when that is faster; a module's own
            half-precision matmuls can still beat it), time each kind of swapped module against its original on the
            first training batch's real call (forward and backward, alternating, 5 times each, about 0.1 s once) and
            put the originals back where they are at least 5% faster; the decision's reason gives both times (the
            default lm keeps its own attention, vit the swap). Skipped for a compiled model (a swap back would
            recompile). The decision and its timings are in :attr:`first_batch` and the callback's ``state_dict``: a run
            that loads it (a resumed fit, a later repeat of ``lightning-perf bench``) runs the same code without timing
            again.

    Attributes:
        decisions: module name -> ``(kernel, reason)`` for every attention module found in the last ``setup``;
            ``kernel`` is ``"flash_attn"``, ``"sdpa"`` or ``"unchanged"``, and ``decision.action`` says what was done:
            ``"swapped"``, ``"already fused"``, ``"switched config"`` or ``"kept"``.
        fallbacks: swapped module name -> ``{argument: calls}`` for the calls that ran the original code during the
            last run (an argument the kernel cannot serve), filled at teardown.
        first_batch: what ``time_first_batch`` decided, as data (empty when nothing was timed): ``timings``, one
            ``{"modules", "own_ms", "swapped_ms", "kept_own"}`` per kind of module, and ``replayed`` when the decision
            came from a loaded ``state_dict`` instead of this run's timing.

    Raises:
        ValueError: for an adapter class path that does not import or does not name an ``AttentionAdapter``.
        TypeError: for ``adapters`` that are not a list, a ``filter_fn`` that is not callable, a non-bool
            ``parity_check``, ``strict`` or ``time_first_batch``.

    Example::

        from lightning_perf.callbacks import FlashAttentionCallback

        trainer = Trainer(precision="bf16-mixed", callbacks=[FlashAttentionCallback()])
    """

    def __init__(
        self,
        adapters: Sequence[AttentionAdapter | str] = (),
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        parity_check: bool = True,
        strict: bool = False,
        time_first_batch: bool = True,
    ) -> None:
        if isinstance(adapters, (str, AttentionAdapter)):
            adapters = [adapters]
        if not isinstance(adapters, (list, tuple)):
            raise TypeError(
                f"`FlashAttentionCallback(adapters={adapters!r})` is not valid. Expected a list of AttentionAdapter "
                "instances or class paths such as 'my_project.attention.MyAttentionAdapter'."
            )
        self.adapters = [_resolve_adapter(a) for a in adapters]
        check_instance("FlashAttentionCallback", "filter_fn", filter_fn, (type(None), Callable), FILTER_FN)
        self.parity_check = check_bool("FlashAttentionCallback", "parity_check", parity_check)
        self.strict = check_bool("FlashAttentionCallback", "strict", strict)
        self.time_first_batch = check_bool("FlashAttentionCallback", "time_first_batch", time_first_batch)
        self.filter_fn = filter_fn
        self.decisions: dict[str, AttentionDecision] = {}
        self.fallbacks: dict[str, dict[str, int]] = {}
        self._result = SwapResult()
        self._device = torch.device("cpu")
        self._compute_dtype: torch.dtype | None = None
        # (CPU, half precision) per kind of swapped module: its names and the first call a swapped one received
        self._probes: list[_Probe] = []
        self.first_batch: dict[str, Any] = {}
        self._replay: dict[str, Any] | None = None  # an earlier run's first_batch (load_state_dict), applied instead

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"first_batch": self.first_batch} if self.first_batch else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._replay = dict(state_dict.get("first_batch") or {}) or None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device
        self._compute_dtype = compute_dtype(str(trainer.precision))
        run_after_configure_model(pl_module, self._swap)

    def _swap(self, pl_module: pl.LightningModule) -> None:
        result = swap_attention(
            pl_module,
            adapters=self.adapters,
            device=self._device,
            compute_dtype=self._compute_dtype,
            filter_fn=self.filter_fn,
            parity_check=self.parity_check,
            strict=self.strict,
        )
        self.decisions = result.decisions
        self._result = result
        if self.time_first_batch and self._device.type == "cpu" and self._compute_dtype in HALF_DTYPES:
            self._probes = _Probe.for_swap(result)
        if not result.decisions:
            warn_once(
                f"FlashAttentionCallback found no attention module in {type(pl_module).__name__} that it knows "
                "(nn.MultiheadAttention, fused-QKV self-attention, or one a registered AttentionAdapter matches): "
                "nothing changes."
            )
            return
        lines = [f"  {name}: {d.action}, {d.kernel} ({d.reason})" for name, d in result.decisions.items()]
        counts = Counter(d.action for d in result.decisions.values())
        summary = ", ".join(f"{counts[action]} {action}" for action in ACTIONS if counts[action])
        rank_zero_info(
            f"FlashAttentionCallback: {len(result.swapped)} of {len(result.decisions)} attention modules swapped "
            f"({summary})\n" + "\n".join(lines)
        )
        if not result.swapped and counts[ALREADY_FUSED] < len(result.decisions):
            warn_once(
                "FlashAttentionCallback left every attention module unchanged: "
                + "; ".join(f"{name}: {reason}" for name, (_, reason) in result.decisions.items())
            )

    def _undo(self, pl_module: pl.LightningModule) -> None:
        discard_pending_surgery(pl_module)
        for probe in self._probes:
            probe.stop()
        self._probes = []
        self.fallbacks = {
            name: dict(counts)
            for name, (_, swapped) in self._result.replaced.items()
            if (counts := getattr(swapped, "fallbacks", None))
        }
        if self.fallbacks:
            rank_zero_info(
                "FlashAttentionCallback: calls that ran the original attention code (argument: calls): "
                + "; ".join(f"{name}: {counts}" for name, counts in self.fallbacks.items())
            )
        self._result.undo(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._replay is None or not self._probes:  # nothing loaded, or nothing this run would time
            return
        for probe in self._probes:
            probe.stop()
        self._probes = []
        for timing in self._replay.get("timings", []):  # the same modules as the run that timed them, where present
            self._decide(pl_module, [n for n in timing.get("modules", ()) if n in self._result.replaced], timing)
        self.first_batch = {**self._replay, "replayed": True}

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._probes:
            return
        probes, self._probes = self._probes, []
        compiled = is_compiled(pl_module)
        timings = []
        for probe in probes:
            probe.stop()
            if compiled or (timed := probe.time(self._compute_dtype)) is None:  # compiled: a swap back recompiles
                continue
            own, swapped = (round(t, 3) for t in timed)
            timings.append({"modules": probe.names, "own_ms": own, "swapped_ms": swapped,
                            "kept_own": not own > _KEEP_OWN_BELOW * swapped})  # fmt: skip
            self._decide(pl_module, probe.names, timings[-1])
        self.first_batch = {"timings": timings} if timings else {}

    def _decide(self, pl_module: pl.LightningModule, names: list[str], timing: dict[str, Any]) -> None:
        """Keep the swap of ``names`` or put their own code back, as ``timing`` (a :attr:`first_batch` entry) says."""
        if not names:
            return
        where = "an earlier run's first training batch" if self._replay else "the first training batch"
        text = f"at {where}, forward and backward: own {timing['own_ms']:.2f} ms, swapped {timing['swapped_ms']:.2f} ms"
        if not timing["kept_own"]:
            for name in names:
                kept = self.decisions[name]
                self.decisions[name] = AttentionDecision(kept.kernel, f"{kept.reason}; {text}", kept.action)
            return
        back = {name: self._result.replaced.pop(name) for name in names}
        restore_modules(pl_module, back)
        kernel = self.decisions[names[0]].kernel
        reason = f"kept: its own code beat {kernel} on this CPU in {self._compute_dtype} ({text})"
        for name in names:
            self.decisions[name] = AttentionDecision(UNCHANGED, reason, KEPT)
        rank_zero_info(f"FlashAttentionCallback: {len(back)} module(s) like {names[0]} back to their own code; "
                       f"{reason}")  # fmt: skip

    @property
    def swapped(self) -> list[str]:
        """Names of the modules that compute with a fused kernel because of the last ``setup`` (swapped, or switched
        by configuration); modules found already fused are not among them."""
        return [name for name, d in self.decisions.items() if d.action in (SWAPPED, SWITCHED_CONFIG)]


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype attention computes in under a Lightning ``precision`` setting (``None``: full precision)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return None


def _resolve_adapter(adapter: AttentionAdapter | str) -> AttentionAdapter:
    if isinstance(adapter, AttentionAdapter):
        return adapter
    if isinstance(adapter, str) and adapter:
        import importlib

        module_path, _, name = adapter.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_path), name) if module_path else None
        except Exception as err:  # ImportError, AttributeError, or whatever the user's module raises on import
            raise ValueError(f"`FlashAttentionCallback(adapters=[{adapter!r}])`: cannot import it ({err}).") from err
        if isinstance(cls, type) and issubclass(cls, AttentionAdapter):
            try:
                return cls()
            except TypeError as err:
                raise ValueError(
                    f"`FlashAttentionCallback(adapters=[{adapter!r}])`: the class cannot be built without arguments "
                    f"({err}). Pass an instance instead."
                ) from err
    raise ValueError(
        f"`FlashAttentionCallback(adapters=[{adapter!r}])` is not valid. Expected AttentionAdapter instances or class "
        "paths of AttentionAdapter subclasses, such as 'my_project.attention.MyAttentionAdapter'."
    )


class _Probe:
    """One kind of swapped module (same class and parameter shapes): its names, and the first call one of them
    received in training (a forward pre-hook that removes itself), to time the original against the swap."""

    def __init__(self, names: list[str], original: nn.Module, swapped: nn.Module) -> None:
        self.names, self.original, self.swapped = names, original, swapped
        self.call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._handle = swapped.register_forward_pre_hook(self._capture, with_kwargs=True)

    @classmethod
    def for_swap(cls, result: SwapResult) -> list[_Probe]:
        kinds: dict[tuple[Any, ...], list[str]] = {}
        for name, (original, _) in result.replaced.items():
            if result.decisions[name].action == SWAPPED:
                key = (type(original), tuple(tuple(p.shape) for p in original.parameters()))
                kinds.setdefault(key, []).append(name)
        return [cls(names, *result.replaced[names[0]]) for names in kinds.values()]

    def _capture(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.call is None and module.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            copy = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
            self.call = (tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()})
            self.stop()

    def stop(self) -> None:
        self._handle.remove()

    def time(self, dtype: torch.dtype | None) -> tuple[float, float] | None:
        """``(ms original, ms swapped)`` on the captured call, or None (no call captured, or it cannot be timed)."""
        if self.call is None:
            return None
        take_over_modes(self.original, self.swapped)  # the original out of the model has missed Lightning's switches
        try:
            return time_against_original(self.original, self.swapped, *self.call, compute_dtype=dtype)
        except Exception:  # a timing is advice: never fail a fit over it, keep the swap
            return None
