"""DDP with PowerSGD gradient compression on any backend, whose compression state survives a checkpoint resume."""

from __future__ import annotations

import difflib
import inspect
import math
import os
import pickle
import re
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_perf._validation import check_bool, check_choice, check_instance, check_number
from lightning_perf._warnings import FallbackWarning, warn_once
from lightning_perf.functional.powersgd import (
    POWERSGD_OPTIONS,
    CommunicationStats,
    HookVariant,
    PowerSGDHook,
    gather_state_dict,
    register_powersgd_hook,
    validate_powersgd_options,
)

#: Top-level checkpoint key of the gathered PowerSGD state.
CHECKPOINT_KEY = "powersgd"
# DDPStrategy arguments that would install another communication hook or a post-local-SGD averager.
_COMM_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_POWERSGD_ARGUMENTS = (*POWERSGD_OPTIONS, "hook", "log_stats")  # kept as attributes of the strategy


def _check_ddp_kwargs(owner: str, kwargs: dict[str, Any]) -> None:
    """Refuse at construction what ``DistributedDataParallel`` would refuse only at fit: an unknown keyword, or one
    that Lightning sets itself (``module``, ``device_ids``)."""
    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "device_ids"}
    for name in kwargs:
        if name in accepted:
            continue
        near = difflib.get_close_matches(name, sorted(accepted | _OWN_ARGUMENTS), n=1)
        hint = f" Did you mean `{near[0]}`?" if near else ""
        raise TypeError(
            f"`{owner}({name}={kwargs[name]!r})` is not valid: `{name}` is neither an argument of {owner} nor of "
            f"torch's DistributedDataParallel.{hint} Expected one of the DistributedDataParallel arguments: "
            f"{', '.join(sorted(accepted))}."
        )


def _check_arguments(owner: str, arguments: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Refuse at construction what would fail at fit; drop from ``kwargs`` the communication-hook arguments that
    LightningCLI passes (as ``None``) for every DDPStrategy."""
    given = [name for name in _COMM_HOOK_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"`{owner}({given[0]}=...)` is not supported: this strategy registers its own PowerSGD communication "
            "hook. Use `lightning.pytorch.strategies.DDPStrategy` for another hook."
        )
    validate_powersgd_options(owner, arguments["hook"], arguments)
    for name in ("log_stats", "gradient_as_bucket_view", "static_graph", "find_unused_parameters"):
        check_bool(owner, name, arguments[name])
    for name in _COMM_HOOK_ARGUMENTS:
        kwargs.pop(name, None)
    _check_ddp_kwargs(owner, kwargs)
    expected = "a datetime.timedelta (e.g. `timedelta(minutes=30)`, the time a collective may wait) or None"
    check_instance(owner, "timeout", arguments["timeout"], (timedelta, type(None)), expected)
    check_choice(owner, "start_method", arguments["start_method"], _START_METHODS)
    if arguments["bucket_cap_mb"] is not None:
        check_number(owner, "bucket_cap_mb", arguments["bucket_cap_mb"], exclusive=True)


def default_start_iter(optimizer_steps: float) -> int:
    """10% of the run's optimizer steps, at least 2 (DDP's bucket rebuild) and at most 1000 (torch's default).

    An unbounded run (``max_steps=-1, max_epochs=-1``) starts at 1000.
    """
    if not math.isfinite(optimizer_steps):
        return 1_000
    return max(2, min(1_000, math.ceil(0.1 * optimizer_steps)))


class PowerSGDDDPStrategy(DDPStrategy):
    """Distributed data parallel training with PowerSGD gradient compression (Vogels et al., NeurIPS 2019).

    Each gradient matrix is all-reduced as a rank-``matrix_approximation_rank`` approximation ``P Q^T``; what the
    approximation misses is added to the next step's gradient (error feedback). At rank 2 a ResNet-style network
    sends tens of times fewer bytes per step. It pays where the network, not the computation, limits the step:
    many workers on slow links (see ``examples/powersgd_bandwidth.py``). On one fast node it costs time: each
    compressed bucket needs two all-reduces and a few small matrix products.

    What it does beyond ``DDPStrategy(ddp_comm_hook=powerSGD_hook, ddp_comm_state=...)``:

    - registers the hook on every backend: NCCL on GPUs (asynchronous, torch's hook as is) and gloo on CPUs (each
      bucket finished before the hook returns: torch's hook deadlocks on gloo otherwise); Lightning's own
      registration is skipped off CUDA, silently;
    - builds torch's ``PowerSGDState`` once the process group exists, so it also works with ``ddp_spawn``;
    - runs on CPU tensors while CUDA is visible (torch's hook would call ``torch.cuda.synchronize`` on a CPU device);
    - saves every rank's PowerSGD state in checkpoints (iteration, RNG, warm-start Q matrices, and each rank's
      error-feedback residuals, gathered to rank 0, under the checkpoint key ``"powersgd"``; tensors and plain values
      only, so ``torch.load(weights_only=True)`` reads it) and restores it on resume, keyed by parameter name so
      DDP's bucket rebuild after a resume does not mix it up. Resuming on another number of processes resets the
      residuals (with a warning); a resumed layer-wise run trains exactly as an uninterrupted one;
    - logs per optimizer step, through ``LightningModule.log``: ``powersgd/compression_rate`` (gradient elements
      over elements sent), ``powersgd/allreduce_bytes`` (bytes handed to all-reduce per rank) and
      ``powersgd/uncompressed_bytes`` (what plain DDP would have sent).

    Also ``Trainer(strategy="ddp_powersgd")`` once ``lightning_perf.strategies`` or ``lightning_perf.callbacks`` is
    imported; a LightningCLI YAML names the class (``class_path: lightning_perf.strategies.PowerSGDDDPStrategy``).
    Sync BatchNorm is the Trainer's ``sync_batchnorm=True``, as with any DDP strategy.

    The state is gathered when a checkpoint is saved, so ``trainer.save_checkpoint`` must run on every rank (as for
    any DDP checkpoint); rank 0 briefly holds every rank's residuals. It is kept after ``fit`` so that a checkpoint
    saved after training includes it.

    Args:
        matrix_approximation_rank: rank r of each gradient's approximation. Lower compresses more; 1-4 is typical
            (the paper reaches full accuracy on ResNet-18/CIFAR-10 at 2).
        start_powerSGD_iter: optimizer steps of plain all-reduce before compression starts (early training is the
            most sensitive to gradient error). ``None`` (default): 10% of the run's optimizer steps, at least 2 and
            at most 1000 (from ``trainer.estimated_stepping_batches``; kept from the checkpoint on resume). Counted
            in optimizer steps: under gradient accumulation gradients are all-reduced once per window.
        min_compression_rate: a gradient is compressed only if its ``n x m`` elements shrink at least this much
            (``(n + m) r``); the others, biases and norms among them, are all-reduced plainly.
        use_error_feedback: carry each rank's approximation error into its next gradient (needed for accuracy).
        warm_start: start each step's power iteration from the last step's Q (better approximation, no new random
            matrices).
        orthogonalization_epsilon: added to column norms when orthogonalizing, so that an all-zero gradient column
            (a frozen or unused layer) gives zeros instead of NaN; 1e-8 is negligible next to real gradient norms.
        hook: ``"powersgd"`` (layer-wise: the paper's algorithm) or ``"batched"`` (each bucket compressed as one
            square matrix: less computation, usually much lower accuracy unless the rank is 1; a resumed run
            all-reduces plainly for one step before its saved state applies).
        random_seed: seed of the random initial Q matrices (the same on every rank).
        log_stats: log the compression statistics above every optimizer step.
        gradient_as_bucket_view: DDP option: gradients are views into the communication buckets (saves memory).
        static_graph: DDP option for models whose used parameters never change; not with gradient accumulation.
        bucket_cap_mb: DDP bucket size in MiB (``None``: DDP's default, 25).
        find_unused_parameters: DDP option for models that skip some parameters in a step.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
            timeout, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: other ``DistributedDataParallel`` arguments (e.g. ``broadcast_buffers``).

    Raises:
        ValueError: for a rank < 1, a negative or non-integer ``start_powerSGD_iter``, ``start_powerSGD_iter`` < 2
            with error feedback or warm start, an unknown ``hook``, a negative ``min_compression_rate`` or epsilon,
            a non-positive ``bucket_cap_mb``, a ``start_method`` other than ``"popen"``, ``"spawn"``, ``"fork"``,
            ``"forkserver"``, or any of DDPStrategy's own communication-hook arguments (``ddp_comm_hook``,
            ``ddp_comm_state``, ``ddp_comm_wrapper``, ``model_averaging_period``); at ``fit``, for
            ``static_graph=True`` with ``Trainer(accumulate_grad_batches > 1)``.
        TypeError: for a non-boolean flag, a ``timeout`` that is not a ``datetime.timedelta``, or a keyword that is
            not an argument of the strategy or of ``DistributedDataParallel`` (a near name is suggested).

    Example::

        from lightning_perf.strategies import PowerSGDDDPStrategy

        trainer = Trainer(accelerator="gpu", devices=8, strategy=PowerSGDDDPStrategy(matrix_approximation_rank=2))
    """

    hook: HookVariant
    start_powerSGD_iter: int | None
    log_stats: bool

    def __init__(
        self,
        matrix_approximation_rank: int = 2,
        start_powerSGD_iter: int | None = None,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 1e-8,
        hook: HookVariant = "powersgd",
        random_seed: int = 0,
        log_stats: bool = True,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        arguments = {name: value for name, value in locals().items() if name in _OWN_ARGUMENTS}
        _check_arguments(type(self).__name__, arguments, kwargs)
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(**{name: arguments[name] for name in _DDP_ARGUMENTS}, **kwargs)
        for name in _POWERSGD_ARGUMENTS:
            setattr(self, name, arguments[name])
        self.min_compression_rate = float(min_compression_rate)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self._powersgd: PowerSGDHook | None = None
        self._loaded_state: dict[str, Any] | None = None

    @property
    def powersgd(self) -> PowerSGDHook | None:
        """The registered hook's state (torch's ``PowerSGDState`` is ``.state``), or ``None`` before the first fit."""
        return self._powersgd

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._ddp_kwargs.get("static_graph") and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"`{type(self).__name__}(static_graph=True)` cannot be used with "
                f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`: torch's reducer asserts on the "
                "skipped gradient synchronization of the accumulation steps (checked with torch 2.13). Set "
                "static_graph=False or accumulate_grad_batches=1."
            )
        try:
            super().setup(trainer)
        finally:
            self._loaded_state = None  # used by _register_ddp_hooks when fitting; stale for any later run

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        super().teardown()
        # Lightning's forward redirection (each DDP step) puts the module's own bound `forward` back as an instance
        # attribute; drop it so the module is the plain one again (after a fit, and after one that failed).
        own = vars(module).get("forward") if module is not None else None
        if module is not None and getattr(own, "__func__", None) is type(module).forward:
            del module.forward

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only; PowerSGD is registered on every device.
        assert isinstance(self.model, DistributedDataParallel) and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        start = self.start_powerSGD_iter
        if start is None:
            saved = (self._loaded_state or {}).get("start_powerSGD_iter")
            start = int(saved) if saved is not None else default_start_iter(trainer.estimated_stepping_batches)
        options = {name: getattr(self, name) for name in POWERSGD_OPTIONS}
        options["start_powerSGD_iter"] = start
        self._powersgd = register_powersgd_hook(self.model, hook=self.hook, **options)
        if self._loaded_state is not None:
            reasons = self._powersgd.load_state_dict(
                self._loaded_state, rank=self.global_rank, world_size=self.world_size
            )
            for reason in reasons:
                warn_once(f"`{type(self).__name__}` resumed without part of its state: {reason}.", FallbackWarning)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        if self._powersgd is not None and self.log_stats:
            self._log(self._powersgd.take_stats())
        return output

    def _log(self, stats: CommunicationStats) -> None:
        if not stats.numel_after or self.lightning_module is None:  # nothing all-reduced (no_sync, no backward)
            return
        self.lightning_module.log_dict(
            {
                "powersgd/compression_rate": stats.compression_rate,
                "powersgd/allreduce_bytes": float(stats.bytes),
                "powersgd/uncompressed_bytes": float(stats.bytes_uncompressed),
            },
            on_step=True,
            on_epoch=False,
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank gets here (Trainer.save_checkpoint calls it on all ranks): gather each rank's residuals to rank 0.
        # A weights-only checkpoint (no optimizer states) carries no training state, so no PowerSGD state either.
        if self._powersgd is not None and "optimizer_states" in checkpoint and dist.is_initialized():
            state = gather_state_dict(self._powersgd)
            if self.is_global_zero:
                checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint with ``torch.load(weights_only=True)``, whatever ``weights_only`` asks: nothing from a
        file is executed. A checkpoint that holds other objects needs them allowed by the user, explicitly, with
        ``torch.serialization.add_safe_globals``; the error names the global it met."""
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            met = f"the global `{found.group(1)}`" if found else "an object outside torch's weights-only allowlist"
            raise pickle.UnpicklingError(
                f"`{type(self).__name__}` reads checkpoints with `torch.load(weights_only=True)` only"
                + (" (weights_only=False was asked for and is not honoured)" if weights_only is False else "")
                + f"; {os.fspath(checkpoint_path)!r} holds {met}, which it does not load. If you trust the file, "
                "allow its classes with `torch.serialization.add_safe_globals([...])`."
            ) from exc
        self._loaded_state = checkpoint.get(CHECKPOINT_KEY)  # applied once the hook is registered in setup
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # Not DDPStrategy's names ("ddp", "ddp_spawn", ...): those must keep building a plain DDPStrategy.
        strategy_registry.register(
            "ddp_powersgd", cls, description="DDP with PowerSGD gradient compression (lightning_perf)", override=True
        )


# The strategy's own argument names, for "did you mean" suggestions on a misspelled keyword.
_OWN_ARGUMENTS = frozenset(inspect.signature(PowerSGDDDPStrategy.__init__).parameters) - {"self", "kwargs"}
# Those handed to DDPStrategy as they are (bucket_cap_mb only when given, so that DDP keeps its own default).
_DDP_ARGUMENTS = _OWN_ARGUMENTS - {*_POWERSGD_ARGUMENTS, "bucket_cap_mb"}

# `Trainer(strategy="ddp_powersgd")` once `lightning_perf.strategies` (or `.callbacks`, which imports it) is imported.
PowerSGDDDPStrategy.register_strategies(StrategyRegistry)
