"""Export the trained model for deployment when ``fit`` ends: TensorRT, or ONNX when TensorRT cannot run, validated.

The logic is :func:`lightning_perf.deploy.export.export_model`; this callback picks the weights (the best
checkpoint of a ``ModelCheckpoint`` when there is one), the example input and the held-out batches, and runs it once,
on rank zero, after training.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_perf._io import load_checkpoint
from lightning_perf._validation import check_bool, check_file_stem, check_instance, is_int
from lightning_perf._warnings import FallbackWarning
from lightning_perf.callbacks._model_hooks import discard_pending_surgery, refuse_sharded, run_after_configure_model
from lightning_perf.callbacks._trainer_data import default_dirpath, run_metadata, step_call, val_dataloader
from lightning_perf.deploy.backend import BACKENDS, validate_options
from lightning_perf.deploy.export import ExportError, ExportReport, export_model
from lightning_perf.deploy.inputs import (
    example_inputs_from_shapes,
    model_inputs,
    through_batch_hooks,
)
from lightning_perf.functional.inputs import CallRecorder, as_input_tuple, split_inputs

__all__ = ["TensorRTExportCallback"]


class TensorRTExportCallback(Callback):
    """At the end of ``fit``, export the model (TensorRT, falling back to ONNX), prove it matches, and time it.

    On rank zero only, a deep copy of the model in eval mode gets the weights of the best checkpoint of the trainer's
    ``ModelCheckpoint`` (the final weights when there is none) and is exported with each backend in turn until one
    produces an artifact that passes validation on held-out batches of the validation data at several batch sizes
    (output names, shapes, NaN/Inf, max abs/rel difference, cosine similarity). The trained model and the checkpoints
    are never modified. The artifact and ``<filename>.export.json`` with the validation figures and the latency of
    the export against eager PyTorch are committed as one artifact set, ``<filename>/``, next to the checkpoints (or
    in ``dirpath``); see :mod:`lightning_perf.deploy.artifacts`. Checkpoints are read with ``weights_only=True``.

    A backend that cannot run (TensorRT not installed, no CUDA) or fails falls back to the next with a
    :class:`~lightning_perf.FallbackWarning`; the fit itself never fails because of the export unless
    ``strict=True``. Bad options fail at construction. Under ``ModelParallelStrategy`` or ``FSDPStrategy`` (or with
    modules sharded by ``fully_shard``) it warns once at ``setup`` (a :class:`~lightning_perf.NoEffectWarning` naming
    the strategy) and exports nothing: export the consolidated checkpoint with ``lightning-perf export`` after
    training.

    Args:
        backends: tried in order: ``"tensorrt"`` (torch-tensorrt, CUDA only) and/or ``"onnx"`` (onnxruntime); one
            name alone (``backends="onnx"``) means that back-end only, with no fallback.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"`` of the export.
        batch_range: ``(min, opt, max)`` of the dynamic batch dimension.
        dynamic_dims: other dynamic dimensions, ``{dim: (min, opt, max)}`` for the first input or a list of such
            dicts, one per input (e.g. a sequence length).
        dirpath: where to write; default the ``ModelCheckpoint``'s directory, else ``<default_root_dir>/export``.
        filename: name of the artifact set and stem of its files (``model.onnx``, ``model.trt.pt2``, ``.export.json``).
        input_shapes: per-input sample shapes without the batch dimension (float inputs) to trace with. Without them
            the example is the module's ``example_input_array``, else the first call training made to ``forward``
            (several, nested or keyword inputs: each batched tensor a named input), else the first validation batch.
        input_key: the model input's key when batches are dicts.
        validation_batch_sizes: batch sizes to validate and time; default min, opt and max of ``batch_range``.
        tolerance: override of the precision's default tolerance, e.g. ``{"atol": 1e-3}``.
        latency_iterations: timed calls per batch size, eager and export interleaved at equal threads (the report
            records both sides' count); about as long as the export itself on a small model. 0 skips timing.
        latency_warmup: untimed calls first.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default the model's device if it is a GPU, else CUDA when
            available, else CPU.
        onnx_providers: onnxruntime execution providers in order of preference.
        opset: ONNX opset (default: the exporter's).
        use_best_checkpoint: export the best checkpoint's weights rather than the final ones.
        strict: raise when a backend fails instead of falling back (the fit then fails).

    Raises:
        ValueError: for an invalid option (unknown backend or precision, ``min > opt`` or ``opt > max``...).

    Example::

        trainer = Trainer(callbacks=[ModelCheckpoint(monitor="val_loss"), TensorRTExportCallback(precision="fp16")])
        trainer.fit(model, datamodule=data)  # then: <checkpoint dir>/model/model.trt.pt2 (or model.onnx)
    """

    def __init__(
        self,
        backends: Sequence[str] | str = BACKENDS,
        precision: str = "fp32",
        batch_range: Sequence[int] = (1, 8, 32),
        dynamic_dims: Mapping[int, Sequence[int]] | Sequence[Mapping[int, Sequence[int]]] | None = None,
        dirpath: str | Path | None = None,
        filename: str = "model",
        input_shapes: Sequence[Sequence[int]] | None = None,
        input_key: str | None = None,
        validation_batch_sizes: Sequence[int] | None = None,
        tolerance: Mapping[str, float] | None = None,
        latency_iterations: int = 20,
        latency_warmup: int = 3,
        device: str | None = None,
        onnx_providers: Sequence[str] | None = None,
        opset: int | None = None,
        use_best_checkpoint: bool = True,
        strict: bool = False,
    ) -> None:
        arguments = dict(locals())  # first, while the arguments are all it holds
        # Every argument but these is an option of export_model, checked by validate_options.
        own = ("self", "dirpath", "filename", "input_shapes", "input_key", "device", "use_best_checkpoint")
        self.export_kwargs: dict[str, Any] = {name: value for name, value in arguments.items() if name not in own}
        checked = validate_options(**self.export_kwargs, device=device, owner=type(self).__name__)
        batch = checked.batch_range
        self.export_kwargs["backends"] = list(checked.backends)
        self.export_kwargs["batch_range"] = (batch.min, batch.opt, batch.max)
        if input_shapes is not None:
            _check_input_shapes(type(self).__name__, input_shapes)
            example_inputs_from_shapes(input_shapes)  # raises on a bad shape, now rather than after training
        owner = type(self).__name__
        check_file_stem(owner, "filename", filename)
        check_instance(owner, "dirpath", dirpath, (type(None), str, os.PathLike), "None or a directory path")
        check_instance(owner, "input_key", input_key, (type(None), str), "None or the input's key in dict batches")
        if input_key == "":
            raise ValueError(f"`{owner}(input_key='')` is not valid. Expected None or a non-empty key.")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.input_shapes = None if input_shapes is None else [tuple(s) for s in input_shapes]
        self.input_key = input_key
        self.device = device
        self.use_best_checkpoint = check_bool(owner, "use_best_checkpoint", use_best_checkpoint)
        self.report: ExportReport | None = None
        """The report of the last export (rank zero), ``None`` before one ran or when it could not start."""
        self._refused = False  # this fit trains sharded (FSDP2): nothing is exported at its end
        self._recorder: CallRecorder | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._refuse(trainer, None):
            return
        example = pl_module.example_input_array
        if self.input_shapes is None and example is not None:
            as_input_tuple(example, f"{type(pl_module).__name__}.example_input_array")  # a dict input fails here
        elif self.input_shapes is None:
            self._recorder = CallRecorder(pl_module)  # the example: the call training makes
        # A model that shards itself in configure_model is sharded only once that has run.
        run_after_configure_model(pl_module, lambda module: self._refuse(trainer, module))

    def _refuse(self, trainer: pl.Trainer, pl_module: pl.LightningModule | None) -> bool:
        self._refused = refuse_sharded(
            type(self).__name__,
            trainer,
            pl_module,
            "the model's parameters are sharded across processes (FSDP2 DTensors) and an export needs the whole model "
            "in one process",
            "save a full checkpoint (`ModelParallelStrategy(save_distributed_checkpoint=False)`) or consolidate the "
            "sharded one (`python -m lightning.fabric.utilities.consolidate_checkpoint <folder>`), then export it "
            "after training with `lightning-perf export <checkpoint> --module-class ...`",
        )
        return self._refused

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or self._refused:
            return
        try:
            self.report = self._export(trainer, pl_module)
        except ExportError:
            raise
        except Exception as exc:
            if self.export_kwargs["strict"]:
                raise ExportError(f"TensorRTExportCallback could not export: {type(exc).__name__}: {exc}") from exc
            warnings.warn(
                f"TensorRTExportCallback could not export the model ({type(exc).__name__}: {exc}); the trained model "
                "and its checkpoints are unchanged.",
                FallbackWarning,
                stacklevel=2,
            )
            return
        _log_summary(self.report)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        discard_pending_surgery(pl_module)  # a fit that failed before `configure_model` ran
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recorder is not None:
            self._recorder.remove()  # a fit that never called forward

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_recorder": None}  # a hook on this process's model

    def _export(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ExportReport:
        checkpoint = _best_checkpoint(trainer) if self.use_best_checkpoint else None
        model = _detached_copy(pl_module, trainer)
        if checkpoint is not None:
            model.load_state_dict(_load_state_dict(checkpoint))

        datamodule = getattr(trainer, "datamodule", None)
        val_loader = val_dataloader(trainer, pl_module)
        call = None if self._recorder is None else self._recorder.call
        batches = None
        if val_loader is not None:
            loader = model_inputs(pl_module, val_loader, datamodule=datamodule)
            batches = (step_call(pl_module, batch, call, self.input_key) for batch in loader)
        example: Any
        if self.input_shapes is not None:
            example, source = (
                example_inputs_from_shapes(self.input_shapes, batch_size=self.export_kwargs["batch_range"][2]),
                "input_shapes",
            )
        elif pl_module.example_input_array is not None:
            example = as_input_tuple(
                through_batch_hooks(pl_module, pl_module.example_input_array, datamodule=datamodule)
            )
            source = "example_input_array"
        elif call is not None:
            example, source = call, call.source
        else:
            first = next(model_inputs(pl_module, val_loader, datamodule=datamodule), None) if val_loader else None
            if first is None:
                raise ValueError(
                    f"no example input for {type(pl_module).__name__}: its `forward` was never called during the fit "
                    "and there is no validation data. Set `example_input_array` on the module or pass "
                    "`TensorRTExportCallback(input_shapes=[...])`."
                )
            example, source = split_inputs(first, self.input_key), "the first validation batch"

        device = self.device
        if device is None and pl_module.device.type == "cuda":
            device = str(pl_module.device)
        metadata = {
            "source": "checkpoint" if checkpoint is not None else "final weights",
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "example_source": source,
            **run_metadata(trainer, pl_module),
        }
        return export_model(
            model,
            example,
            **self.export_kwargs,
            dirpath=self.dirpath or default_dirpath(trainer, "export"),
            filename=self.filename,
            validation_data=batches,
            input_key=self.input_key,
            device=device,
            metadata=metadata,
        )


# ------------------------------------------------------------------------------------------------------ helpers


def _check_input_shapes(owner: str, shapes: Any) -> None:
    """A list of shapes, one per model input, each a non-empty sequence of positive ints (no batch dimension)."""
    expected = (
        "Expected a list of shapes, one per model input, each without the batch dimension: e.g. [(3, 32)] for one "
        "input of 3x32 samples, [(3, 224, 224), (10,)] for two inputs"
    )

    def is_list(value: Any) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, (str, bytes, Mapping)) and bool(value)

    if not is_list(shapes):
        raise ValueError(f"`{owner}(input_shapes={shapes!r})` is not valid. {expected}.")
    if all(is_int(size, 1) for size in shapes):  # one shape given flat, the commonest slip
        raise ValueError(
            f"`{owner}(input_shapes={shapes!r})` is not valid: that is one shape, not a list of shapes. {expected}; "
            f"did you mean input_shapes=[{tuple(shapes)!r}]?"
        )
    for i, shape in enumerate(shapes):
        if not is_list(shape) or not all(is_int(size, 1) for size in shape):
            raise ValueError(
                f"`{owner}(input_shapes={shapes!r})` is not valid: input {i}'s shape {shape!r} is not a sequence of "
                f"positive sizes. {expected}."
            )


def _detached_copy(pl_module: pl.LightningModule, trainer: pl.Trainer) -> pl.LightningModule:
    """A deep copy of the module without its trainer (copying the trainer would copy loaders, loggers, processes).

    ``deepcopy`` looks every object up in ``memo`` first: mapping the trainer to ``None`` makes the copy's trainer
    reference ``None`` and leaves the trainer itself alone.
    """
    return copy.deepcopy(pl_module, memo={id(trainer): None})


def _best_checkpoint(trainer: pl.Trainer) -> Path | None:
    """The best checkpoint of the trainer's (first) ``ModelCheckpoint``, if it wrote one."""
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    return Path(best) if best and Path(best).is_file() else None


def _load_state_dict(path: Path) -> dict[str, Any]:
    # weights_only=True, no fallback: a file never runs code; more globals are the user's add_safe_globals.
    return load_checkpoint(path, map_location="cpu", what="TensorRTExportCallback: the best checkpoint")["state_dict"]


def _log_summary(report: ExportReport) -> None:
    attempt = report.attempt
    if attempt is None:
        rank_zero_info(f"TensorRTExportCallback: no validated export. Report: {report.report_path}")
        return
    sizes = ", ".join(str(v.batch_size) for v in attempt.validation)
    speed = "; ".join(f"batch {r.batch_size}: {r.format_speedup()} against eager" for r in attempt.latency)
    rank_zero_info(
        f"TensorRTExportCallback: exported with {report.backend} ({report.precision}) to {report.artifact}, "
        f"validated at batch sizes {sizes}{'; ' + speed if speed else ''}. Report: {report.report_path}"
    )
