"""Compile the model (or its repeated blocks) with ``torch.compile``, in place, and report what compiling cost."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_perf._validation import check_bool, check_int, check_str_sequence
from lightning_perf._warnings import NoEffectWarning, warn_once
from lightning_perf.callbacks._undo import UndoOnExit
from lightning_perf.functional.compile.cache import (
    compile_cache_key,
    load_compile_cache,
    save_compile_cache,
    use_inductor_cache_dir,
)
from lightning_perf.functional.compile.regions import (
    STAGES,
    CompiledModules,
    CompileMonitor,
    compile_options,
    inside_wrappers,
    select_regions,
    top_level_blocks,
    validate_regions,
)
from lightning_perf.functional.compile.startup import startup_options
from lightning_perf.profiling import PhaseTimer, format_seconds
from lightning_perf.profiling.step_phases import is_compiled

# The loop whose first batch shows whether the step method calls the compiled forward, per trainer entry point.
_MAIN_LOOP = {"fit": "train", "validate": "validation", "test": "test", "predict": "predict"}
_STEP_METHOD = {
    "train": "training_step",
    "validation": "validation_step",
    "test": "test_step",
    "predict": "predict_step",
}


def _evaluation_hooks(loop: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """``on_<loop>_batch_start`` / ``_end`` of :class:`CompileCallback` for an evaluation or predict loop."""

    def batch_start(
        self: CompileCallback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._batch_start()

    def batch_end(
        self: CompileCallback,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._check_forward_ran(pl_module, loop)

    return batch_start, batch_end


class CompileCallback(UndoOnExit):
    """Compile the LightningModule's ``forward``, or its repeated blocks, with ``torch.compile``, in place.

    What is compiled (``regions``):

    - ``None`` (default): the LightningModule's ``forward``, i.e. what ``self(x)`` runs inside ``training_step`` and
      the other step methods. The loss, metrics and ``self.log`` calls around it stay eager, which keeps graph breaks
      out of the compiled code. If the step method turns out not to call ``self(...)`` (it calls ``self.net(x)``, say:
      nothing compiled ran in the first batch), the module's own sub-modules holding parameters are compiled instead,
      which is said once on rank zero.
    - ``"auto"``: the largest group of repeated sibling blocks of one class (a transformer's layers, a ResNet's
      residual blocks), found by structure. Identical blocks share one compiled code object, so the model compiles
      about as fast as one block: use it to cut cold-start time. The rest (embeddings, head) runs eager. On a CPU,
      with the inductor backend and no ``mode`` or ``options`` given, the blocks are compiled with inductor's
      ``cpp_wrapper`` (one C++ build per graph rather than per fused kernel, the cold start's largest part there; see
      :mod:`~lightning_perf.functional.compile.startup`); ``options={"cpp_wrapper": False}`` turns that off.
    - a list of module classes, or class paths as strings for YAML (``"torch.nn.TransformerEncoderLayer"``), or bare
      class names: their outermost instances are compiled.

    Compilation is in place (``nn.Module.compile`` style): module objects, parameters and ``state_dict`` keys stay as
    they are, so checkpoints carry no ``_orig_mod.`` prefix and load with or without the callback. It is applied at
    the start of each trainer entry point listed in ``stages`` (``fit`` covers its validation loop too), after every
    ``setup`` and after DDP wrapping, so it sees the final modules whatever surgery other callbacks did, in any order;
    ``teardown`` makes the modules plain again (torch keeps its compiled code, so a second ``fit`` reuses it). Under
    DDP each rank compiles its modules inside the DDP wrapper (Lightning routes ``training_step`` through the
    LightningModule's ``__call__`` there; that outer call runs eager and the step's ``self(x)`` compiled). The
    gradients of a compiled region are ready when its compiled backward ends, so finer regions overlap the gradient
    all-reduce with computation better.

    Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` per block in ``configure_model``) compilation goes
    inside the wrappers: whatever ``regions`` selects that holds ``fully_shard``-ed blocks (the LightningModule with
    ``regions=None``, say) is replaced by those blocks, and each is compiled in its ``forward``, so FSDP2's all-gather
    and reshard hooks stay eager around the compiled code, as when each block is compiled before ``fully_shard``
    (torchtitan's order). Activation checkpointing patched in by
    :class:`~lightning_perf.callbacks.GradCheckpointCallback` runs inside the compiled region. Identical blocks share
    one compiled graph. Gradients are those of the eager run (tested on 2 CPU processes).

    A compiler failure (raised lazily, at a module's first call) re-runs that call eagerly and turns compilation off
    for that module class, with a :class:`~lightning_perf.FallbackWarning` carrying the cause; ``strict=True`` raises
    instead. An error of the model itself propagates unchanged.

    ``mode="reduce-overhead"`` records CUDA graphs on a CUDA device for training and inference (each batch is marked as
    a new CUDA graph step); on another device it warns once (:class:`~lightning_perf.NoEffectWarning`) and compiles
    without them.

    Warm starts (``cache``): with each checkpoint Lightning saves during ``fit`` and at the end of a ``fit`` that
    finished (each time only if something was compiled since the last write), global rank zero writes the compiled
    code of the run to ``cache``, atomically, with a key (torch, Python, device, the
    compiled modules' classes and parameter shapes, the compile options); at the start of the next run, on every rank
    and before the first compiled step, the file is loaded into torch's compile caches if its key matches, so the first
    steps skip most of the compiling (see :mod:`lightning_perf.functional.compile.cache` for the format and what it
    trusts). The file is code (torch runs what it holds), so it is signed with your own secret key and only a file
    signed with it is loaded: an unsigned, foreign, truncated or altered file is refused with one
    :class:`~lightning_perf.NoEffectWarning` saying why, and the run compiles from cold. Every rank must see the file
    (a shared file system, or copy it to each node before the job) and the key (a home folder the nodes share). On the
    CPU the file does not hold the compiled C++ kernels (native code, which this library never loads from a file), so
    a warm start still builds them; ``inductor_cache_dir`` keeps torch's own kernel cache in a private folder of the
    run, which a resume on the same machine reuses through torch's own loading (the variable is restored at teardown).

    At the end of ``fit``, on rank zero, it reports the compile time (spent in torch's compiler, and the first
    ``warmup_steps`` training steps in all) apart from the steady-state step time, with the graphs, graph breaks and
    recompilations seen during the fit (process-wide counters). The figures are kept in :attr:`report` and logged to
    the trainer's loggers under ``compile/``.

    Args:
        mode: ``None`` (default), ``"default"``, ``"reduce-overhead"``, ``"max-autotune"`` or
            ``"max-autotune-no-cudagraphs"``.
        fullgraph: make a graph break an error (a compiler failure: falls back, or raises if ``strict``).
        dynamic: ``None`` (automatic dynamic shapes after a recompilation), ``True`` or ``False``.
        backend: a torch.compile backend name or callable; ``"inductor"`` by default.
        options: inductor options (not together with ``mode``). Given, they replace the CPU regional default
            ``{"cpp_wrapper": True}``.
        regions: ``None``, ``"auto"`` or a list of module classes / class paths / class names (see above).
        stages: the trainer entry points that run compiled, among ``"fit"``, ``"validate"``, ``"test"`` and
            ``"predict"`` (default: all); the others run eager.
        strict: raise compiler failures instead of falling back to eager.
        warmup_steps: leading training steps reported as warm-up (they include compilation).
        cache: a file, or a folder to hold ``torch_compile_cache.bin``, to load the compiled code from at the start
            of each run and save it to at the end of each ``fit`` (e.g. beside the checkpoints); ``None``: neither.
        inductor_cache_dir: a folder, private to you, for torch's own on-disk compile cache while compiled (instead
            of ``/tmp/torchinductor_<user>``): a later run on the same machine loads the compiled C++ kernels from it,
            which ``cache`` does not carry (see
            :func:`~lightning_perf.functional.compile.cache.use_inductor_cache_dir`).
        trust_cache: load a ``cache`` file that is not signed with your key (another user's or machine's): this
            **runs code from that file**; only for a file you trust as you trust code.

    Raises:
        ValueError: for an unknown mode, backend name, stage or region class path, ``mode`` with ``options``, empty
            ``regions`` or ``stages``, or ``warmup_steps`` < 1.
        TypeError: for an argument of the wrong type.

    Attributes:
        report: the figures of the last ``fit`` (empty before): ``compiled`` (module names, ``""`` the LightningModule),
            ``compile_time_s``, ``compilations``, ``recompiles``, ``unique_graphs``, ``graph_breaks``,
            ``graph_break_reasons``, ``cudagraph_recordings``, ``warmup_steps``, ``warmup_time_s``, ``steady_steps``,
            ``steady_step_time_s`` (median), ``fallbacks`` (module class -> cause), ``cache_loaded`` (whether this
            run started from a ``cache`` file).

    Example::

        trainer = Trainer(callbacks=[CompileCallback(regions="auto")])
        trainer.fit(model, datamodule=data)
        print(trainer.callbacks[0].report["compile_time_s"])
    """

    def __init__(
        self,
        mode: str | None = None,
        *,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str | Callable[..., Any] = "inductor",
        options: Mapping[str, Any] | None = None,
        regions: str | Sequence[type[nn.Module] | str] | None = None,
        stages: str | Iterable[str] = STAGES,
        strict: bool = False,
        warmup_steps: int = 2,
        cache: str | os.PathLike[str] | None = None,
        inductor_cache_dir: str | os.PathLike[str] | None = None,
        trust_cache: bool = False,
    ) -> None:
        owner = type(self).__name__
        self._compile_kwargs = compile_options(
            mode=mode, fullgraph=fullgraph, dynamic=dynamic, backend=backend, options=options, owner=owner
        )
        self.mode = mode
        self.backend = backend
        self.regions = validate_regions(regions, owner)
        self.stages = check_str_sequence(owner, "stages", stages, STAGES)
        self.strict = check_bool(owner, "strict", strict)
        self.warmup_steps = check_int(owner, "warmup_steps", warmup_steps, 1)  # the first steps: compilation
        for name, path, expected in (
            ("cache", cache, "a file or folder path to keep the compiled code in between runs"),
            ("inductor_cache_dir", inductor_cache_dir, "a folder path for torch's own compile cache, private to you"),
        ):
            if path is not None and (not isinstance(path, (str, os.PathLike)) or not os.fspath(path)):
                raise TypeError(
                    f"`{owner}({name}={path!r})` is not valid. Expected None or {expected}: a str or PathLike."
                )
        self.cache, self.inductor_cache_dir = cache, inductor_cache_dir
        self.trust_cache = check_bool(owner, "trust_cache", trust_cache)
        self._cache_dir_stack = contextlib.ExitStack()
        self.report: dict[str, Any] = {}
        self._compiled: CompiledModules | None = None
        self._entry_check: str | None = None  # the loop whose first batch must have called the compiled forward
        self._monitor = CompileMonitor()
        self._timer: PhaseTimer | None = None
        self._cudagraph_steps = False
        self._said_inside_wrappers = False
        self._cache_key: dict[str, Any] | None = (
            None  # set while compiled with a cache: what the saved file is keyed on
        )
        self._cache_tried = False  # the cache file is loaded once per process
        self._cache_loaded = False
        self._cache_saved_at = -1  # compilations counted when the cache file was last written in this fit

    # ------------------------------------------------------------------------------------------ applying, undoing

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stage = trainer.state.fn.value if trainer.state.fn is not None else None
        if self._compiled is not None or stage not in self.stages:
            return  # compiled already in this entry point (fit's validation loop), or this stage runs eager
        selected = select_regions(pl_module, self.regions)
        modules = inside_wrappers(pl_module, selected)
        if modules != selected:
            self._note_inside_wrappers(trainer, modules)
        if not modules:
            warn_once(
                f"`{type(self).__name__}(regions={self.regions!r})` found nothing to compile in "
                f"{type(pl_module).__name__}: no repeated blocks holding parameters, or no module of the classes "
                "given. The model runs eagerly.",
                NoEffectWarning,
            )
        if self.mode == "reduce-overhead":
            if pl_module.device.type == "cuda":
                self._cudagraph_steps = True
            else:
                warn_once(
                    f"`{type(self).__name__}(mode='reduce-overhead')` uses CUDA graphs, which need a CUDA device; on "
                    f"{pl_module.device.type} it compiles without them (as the default mode).",
                    NoEffectWarning,
                )
        if self.inductor_cache_dir is not None:  # before loading `cache`, which fills torch's on-disk caches
            self._cache_dir_stack.enter_context(use_inductor_cache_dir(self.inductor_cache_dir))
        kwargs = startup_options(pl_module, modules, self._compile_kwargs)  # on a CPU: a quicker cold start
        self._compiled = CompiledModules(modules, kwargs, strict=self.strict)
        if self.cache is not None:
            self._load_cache(modules, pl_module.device, kwargs)
        whole = self.regions is None
        self._entry_check = _MAIN_LOOP[stage] if whole and modules == selected else None
        self._monitor.start()
        if stage == "fit":
            self._timer = PhaseTimer(pl_module.device, warmup_steps=self.warmup_steps)

    def _load_cache(
        self, modules: list[tuple[str, nn.Module]], device: torch.device, compile_kwargs: dict[str, Any]
    ) -> None:
        assert self.cache is not None
        self._cache_key = compile_cache_key(modules, compile_kwargs, device)
        if not self._cache_tried:  # every rank, before the first compiled call
            self._cache_tried = True
            self._cache_loaded = load_compile_cache(self.cache, self._cache_key, trusted=self.trust_cache)
            if self._cache_loaded:
                rank_zero_info(f"{type(self).__name__}: loaded the compiled code of an earlier run from {self.cache}.")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls teardown only for a run that finished: a failed or interrupted fit saves nothing more.
        if stage == "fit":
            self._save_cache(trainer, "this fit")
        super().teardown(trainer, pl_module, stage)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # With each checkpoint, so that a run killed later resumes warm; only when something new was compiled.
        if trainer.state.fn is not None and trainer.state.fn.value == "fit":
            self._save_cache(trainer, "this fit so far")

    def _save_cache(self, trainer: pl.Trainer, what: str) -> None:
        if self.cache is None or self._cache_key is None or not trainer.is_global_zero:
            return
        compilations = self._monitor.stats.compilations
        if compilations == self._cache_saved_at:
            return
        written = save_compile_cache(self.cache, self._cache_key)
        if written is not None:
            self._cache_saved_at = compilations
            rank_zero_info(f"{type(self).__name__}: saved the compiled code of {what} to {written}.")

    def _note_inside_wrappers(self, trainer: pl.Trainer, modules: list[tuple[str, nn.Module]]) -> None:
        if self._said_inside_wrappers:
            return
        self._said_inside_wrappers = True
        rank_zero_info(
            f"{type(self).__name__}(regions={self.regions!r}): the model is sharded with FSDP2 "
            f"({type(trainer.strategy).__name__}), so each of its {len(modules)} fully_shard-ed block(s) is compiled "
            "in its forward, inside its wrapper (the all-gather and reshard hooks stay outside the compiled code): "
            + ", ".join(name for name, _ in modules[:4])
            + (", ..." if len(modules) > 4 else "")
        )

    def _undo(self, pl_module: pl.LightningModule | None = None) -> None:
        if self._compiled is not None:
            self._compiled.remove()
            self._compiled = None
        self._monitor.stop()
        self._timer = None
        self._entry_check = None
        self._cudagraph_steps = False
        self._cache_key = None
        self._cache_saved_at = -1
        self._cache_dir_stack.close()

    def _check_forward_ran(self, pl_module: pl.LightningModule, loop: str) -> None:
        """After the first batch of the main loop: if the compiled forward never ran, compile the sub-modules."""
        if self._entry_check != loop or self._compiled is None:
            return
        self._entry_check = None
        if self._compiled.calls > 0:
            return
        self._compiled.remove()
        blocks = top_level_blocks(pl_module)
        self._compiled = CompiledModules(blocks, self._compile_kwargs, strict=self.strict)
        method = f"{type(pl_module).__name__}.{_STEP_METHOD[loop]}"
        if blocks:
            rank_zero_info(
                f"{type(self).__name__}: {method} does not call the module's forward (`self(...)`), so compiling it "
                f"had no effect; compiling its sub-modules instead: {', '.join(name for name, _ in blocks)}."
            )
        else:
            warn_once(
                f"`{type(self).__name__}()`: {method} does not call the module's forward (`self(...)`) and the module "
                "has no sub-module holding parameters, so nothing runs compiled. Pass `regions=[...]` naming the "
                "module classes to compile.",
                NoEffectWarning,
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    # Every entry point starts the same way (in fit's own validation loop `_apply` finds the modules compiled already).
    on_validation_start = on_test_start = on_predict_start = on_fit_start

    # ---------------------------------------------------------------------------------------------- per batch

    def _batch_start(self) -> None:
        if self._cudagraph_steps:
            # CUDA graph trees reuse output memory from one step to the next; tell them where a step begins.
            torch.compiler.cudagraph_mark_step_begin()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start()
        if self._timer is not None:
            self._timer.start("step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is not None and "step" in self._timer.running:
            self._timer.stop("step")
            self._timer.end_step()
        self._check_forward_ran(pl_module, "train")

    # Validation, test and predict batches: the same two hooks, made once per loop by `_evaluation_hooks` below.
    on_validation_batch_start, on_validation_batch_end = _evaluation_hooks("validation")
    on_test_batch_start, on_test_batch_end = _evaluation_hooks("test")
    on_predict_batch_start, on_predict_batch_end = _evaluation_hooks("predict")

    # ------------------------------------------------------------------------------------------------- report

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._compiled is None:
            return
        stats = self._monitor.stats
        report: dict[str, Any] = {"compiled": list(self._compiled.names), **stats.to_dict()}
        warmup = self._timer.step_totals(warmup=True) if self._timer is not None else []
        steady = self._timer.summary().get("step") if self._timer is not None else None
        report["warmup_steps"] = len(warmup)
        report["warmup_time_s"] = math.fsum(warmup)
        report["steady_steps"] = steady.count if steady is not None else 0
        report["steady_step_time_s"] = steady.median if steady is not None else float("nan")
        report["fallbacks"] = dict(self._compiled.failures)
        report["cache_loaded"] = self._cache_loaded
        self.report = report
        rank_zero_info(self._describe(report))
        metrics = {
            f"compile/{key}": float(report[key])
            for key in ("compile_time_s", "recompiles", "unique_graphs", "graph_breaks", "warmup_time_s")
        }
        if report["steady_steps"]:
            metrics["compile/steady_step_time_s"] = float(report["steady_step_time_s"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _describe(self, report: dict[str, Any]) -> str:
        names = report["compiled"]
        what = "the LightningModule's forward" if names == [""] else f"{len(names)} module(s) ({', '.join(names[:4])}"
        what += "" if names == [""] else (", ...)" if len(names) > 4 else ")")
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        lines = [
            f"{type(self).__name__}: compiled {what} with backend={backend!r}, mode={self.mode!r}.",
            f"  compiling: {format_seconds(report['compile_time_s'])} in torch.compile, {report['unique_graphs']} "
            f"graph(s), {report['graph_breaks']} graph break(s), {report['recompiles']} recompilation(s)",
            f"  warm-up: {report['warmup_steps']} step(s) in {format_seconds(report['warmup_time_s'])}; steady state: "
            f"median {format_seconds(report['steady_step_time_s'])} per step over {report['steady_steps']} step(s)",
        ]
        for cls, cause in report["fallbacks"].items():
            lines.append(f"  fell back to eager for {cls}: {cause}")
        return "\n".join(lines)

    # -------------------------------------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict[str, Any]:
        # Live compile state (modules, CUDA events, registered compiler callbacks) stays with this process.
        state = self.__dict__.copy()
        state.update(_compiled=None, _timer=None, _entry_check=None, _cudagraph_steps=False, _monitor=CompileMonitor())
        state.update(_cache_key=None, _cache_tried=False, _cache_loaded=False, _cache_dir_stack=contextlib.ExitStack())
        return state


def runs_compiled(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the model will run compiled: a CompileCallback in the Trainer, or a module compiled in place."""
    return any(isinstance(c, CompileCallback) for c in getattr(trainer, "callbacks", ())) or is_compiled(pl_module)
