"""``lightning-perf export CHECKPOINT --module-class pkg.mod:Class``: deployment export of any Lightning checkpoint.

Runs :func:`lightning_perf.deploy.export.export_model` and commits the artifact with its report as one artifact set.
Exit status: 0 when an artifact passed validation, 1 when none did, 2 for bad arguments. The parser imports nothing
heavy. Design notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import (
    UsageError,
    at_least,
    choice_list,
    comma_names,
    device,
    existing_file,
    fail,
    invalid,
    module_class_spec,
    non_negative_int,
    one_line,
    positive_ints,
)

__all__ = ["EXPORT_BACKENDS", "EXPORT_PRECISIONS", "add_arguments", "run"]

# Plain data, so the parser needs no torch; tests/cli/test_export.py checks them against lightning_perf.deploy.
EXPORT_BACKENDS: tuple[str, ...] = ("tensorrt", "onnx")
"""``lightning_perf.deploy.BACKENDS``."""

EXPORT_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")
"""The keys of ``lightning_perf.deploy.PRECISIONS``."""


def _range(text: str) -> tuple[int, int, int]:
    expected = "MIN,OPT,MAX: three positive integers with min <= opt <= max, e.g. 1,8,32"
    values = positive_ints(text, expected)
    if len(values) != 3 or not values[0] <= values[1] <= values[2]:
        raise invalid(text, expected)
    return values[0], values[1], values[2]


def _shape(text: str) -> list[int]:
    expected = "D1xD2...: positive integer sizes, e.g. 3x224x224"
    try:
        return positive_ints(text.replace(",", "x"), expected, "x")
    except argparse.ArgumentTypeError:
        raise invalid(text, expected) from None  # the value as typed ('3,x'), not as rewritten


def _sizes(text: str) -> list[int]:
    return positive_ints(text, "B1,B2...: positive integer batch sizes, e.g. 1,8,32")


def _dynamic_dim(text: str) -> tuple[int, int, tuple[int, int, int]]:
    """``[INPUT:]DIM=MIN,OPT,MAX`` -> (input index, dim, range)."""
    expected = "[INPUT:]DIM=MIN,OPT,MAX with DIM >= 1, e.g. 1=16,64,128 for dimension 1 of the first input"
    where, sep, values = text.partition("=")
    input_index, _, dim = where.rpartition(":")
    try:
        index, dimension = int(input_index or 0), int(dim)
        rng = _range(values)
    except (ValueError, argparse.ArgumentTypeError):
        raise invalid(text, expected) from None
    if not sep or index < 0 or dimension < 1:
        raise invalid(text, expected)
    return index, dimension, rng


def _stem(text: str) -> str:
    if not text or "/" in text or "\\" in text or text.startswith("."):
        raise invalid(text, "a plain, non-hidden file stem, e.g. model")
    return text


HELP = "export a checkpoint for deployment (TensorRT or ONNX), validated against the model and timed"
DESCRIPTION = (
    "Load a checkpoint into the LightningModule class named, export it (TensorRT, else ONNX), validate the export "
    "against the model on held-out batches at several batch sizes, time it against eager PyTorch, and write the "
    "artifact and a JSON report next to the checkpoint. Exit status 0 when an export passed validation, 1 when none "
    "did."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``export``."""
    parser.add_argument("checkpoint", type=existing_file, help="a checkpoint written by Lightning")
    parser.add_argument(
        "--module-class",
        required=True,
        type=module_class_spec,
        metavar="MODULE:CLASS",
        help="the LightningModule class, e.g. my_pkg.models:Net",
    )
    parser.add_argument(
        "--datamodule-class",
        type=module_class_spec,
        metavar="MODULE:CLASS",
        help="LightningDataModule whose val_dataloader gives held-out batches for validation (and the example input "
        "when the module has no example_input_array)",
    )
    parser.add_argument(
        "--backends",
        type=choice_list(EXPORT_BACKENDS, what="backends"),
        default=list(EXPORT_BACKENDS),
        help=f"comma-separated, tried in order until one passes validation (default: {','.join(EXPORT_BACKENDS)})",
    )
    parser.add_argument("--precision", default="fp32", choices=EXPORT_PRECISIONS, help="default: %(default)s")
    parser.add_argument("--batch-range", type=_range, default=(1, 8, 32), metavar="MIN,OPT,MAX", help="default: 1,8,32")
    parser.add_argument(
        "--dynamic-dim",
        type=_dynamic_dim,
        action="append",
        default=[],
        metavar="[INPUT:]DIM=MIN,OPT,MAX",
        help="another dynamic dimension (repeatable), e.g. 1=16,64,128 for a sequence length",
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        action="append",
        metavar="D1xD2...",
        help="sample shape of a float input without the batch dimension (repeat per input), e.g. 3x224x224; "
        "needed when neither example_input_array nor a datamodule gives an example",
    )
    parser.add_argument("--input-key", help="the model input's key when batches are dicts")
    parser.add_argument(
        "--validation-batch-sizes",
        type=_sizes,
        metavar="B1,B2...",
        help="batch sizes to validate and time at, within --batch-range (default: its min, opt and max)",
    )
    parser.add_argument(
        "--latency-iterations",
        type=non_negative_int,
        default=20,
        help="timed calls per batch size, eager vs export at equal threads; 0 skips timing (default 20)",
    )
    parser.add_argument("--latency-warmup", type=non_negative_int, default=3, help="default: 3")
    parser.add_argument("--device", type=device, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--onnx-providers", type=comma_names, help="comma-separated ORT providers")
    parser.add_argument("--opset", type=at_least(18), help="ONNX opset >= 18 (default: exporter's)")
    parser.add_argument("--dirpath", type=Path, help="output directory (default: the checkpoint's)")
    parser.add_argument("--filename", type=_stem, help="artifact stem (default: the checkpoint's stem)")
    parser.add_argument("--strict", action="store_true", help="stop at the first backend that fails, no fallback")


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The checks that combine options, before anything heavy is imported."""
    if args.device == "mps":
        fail(parser, "--device", args.device, "cpu, cuda or cuda:N (export does not run on mps)")
    if len(set(args.backends)) != len(args.backends):
        fail(parser, "--backends", ",".join(args.backends), "distinct names from " + ", ".join(EXPORT_BACKENDS))
    low, _, high = args.batch_range
    for size in args.validation_batch_sizes or ():
        if not low <= size <= high:
            fail(parser, "--validation-batch-sizes", size, f"batch sizes within --batch-range {low}..{high}")
    if args.dirpath is not None and args.dirpath.exists() and not args.dirpath.is_dir():
        fail(parser, "--dirpath", str(args.dirpath), "a directory (this is a file)")
    from lightning_perf._io import checkpoint_problem  # stdlib only: the file's bytes, before torch is imported

    try:
        problem = checkpoint_problem(args.checkpoint)
    except OSError as exc:
        problem = f"it cannot be read ({exc.strerror or exc})"
    if problem is not None:
        parser.error(f"argument checkpoint: {str(args.checkpoint)!r} is not a PyTorch checkpoint: {one_line(problem)}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Export the checkpoint; exit status 0 when an export passed validation, 1 when none did, 2 for bad arguments."""
    _check(args, parser)
    import torch
    from rich.console import Console

    from lightning_perf.deploy.backend import validate_options
    from lightning_perf.deploy.export import ExportError, export_model
    from lightning_perf.deploy.inputs import example_inputs_from_shapes, model_inputs

    options = _export_options(args)
    try:
        validate_options(**options, owner="lightning-perf export")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    example = None
    if args.input_shape is not None:
        example = example_inputs_from_shapes(args.input_shape, batch_size=args.batch_range[2])
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(parser, "--device", args.device, "cpu: no CUDA device is visible")
    module_cls, datamodule_cls = _classes(args)
    model = _load_model(args.checkpoint, module_cls)
    loader, datamodule = _validation_loader(args.checkpoint, datamodule_cls)
    example = example if example is not None else _example(model, module_cls, loader, datamodule, args.input_key)
    console = Console()
    try:
        report = export_model(
            model,
            example,
            **options,
            dirpath=args.dirpath or args.checkpoint.parent,
            filename=args.filename or args.checkpoint.stem,
            validation_data=None if loader is None else model_inputs(model, loader, datamodule=datamodule),
            input_key=args.input_key,
            metadata={"checkpoint": str(args.checkpoint), "module_class": args.module_class},
        )
    except ExportError as exc:
        console.print(f"[red]export failed[/red]: {exc}")
        return 1
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _print_report(report, console)
    return 0 if report.ok else 1


# The options passed to export_model under their own names.
_EXPORT_OPTIONS = ("precision", "batch_range", "validation_batch_sizes", "latency_iterations", "latency_warmup",
                   "device", "onnx_providers", "opset", "strict")  # fmt: skip


def _export_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :func:`~lightning_perf.deploy.export.export_model` given on the command line."""
    dynamic_dims: list[dict[int, tuple[int, ...]]] = []
    for input_index, dim, rng in args.dynamic_dim:
        dynamic_dims.extend({} for _ in range(input_index + 1 - len(dynamic_dims)))
        dynamic_dims[input_index][dim] = rng
    options = {name: getattr(args, name) for name in _EXPORT_OPTIONS}
    return {**options, "backends": list(args.backends), "dynamic_dims": dynamic_dims or None}


def _classes(args: argparse.Namespace) -> tuple[Any, Any]:
    """The LightningModule class and the LightningDataModule class (or ``None``) named on the command line."""
    import lightning.pytorch as pl

    from lightning_perf.benchmark.sources import ImportClassError, import_class

    try:
        module_cls = import_class(args.module_class, pl.LightningModule, "--module-class")
        if args.datamodule_class is None:
            return module_cls, None
        return module_cls, import_class(args.datamodule_class, pl.LightningDataModule, "--datamodule-class")
    except ImportClassError as exc:
        raise UsageError(str(exc)) from None


def _load_model(checkpoint: Path, module_cls: Any) -> Any:
    """The module of a Lightning checkpoint, read with ``weights_only=True`` only (it fails before code runs)."""
    from lightning_perf._io import NotACheckpointError, UnsafeCheckpointError, load_checkpoint

    try:
        loaded = load_checkpoint(checkpoint, "cpu", what="file")
    except (UnsafeCheckpointError, NotACheckpointError) as exc:
        raise UsageError(f"argument checkpoint: {one_line(exc)}") from None
    if not isinstance(loaded, dict) or "state_dict" not in loaded:
        held = (
            f"a dict with the keys {sorted(map(str, loaded))[:5]}"
            if isinstance(loaded, dict)
            else type(loaded).__name__
        )
        raise UsageError(
            f"argument checkpoint: {str(checkpoint)!r} is a PyTorch file but not a Lightning checkpoint: it holds "
            f"{held}. Expected what Trainer.save_checkpoint writes (a dict with a 'state_dict')"
        )
    del loaded
    try:
        return module_cls.load_from_checkpoint(checkpoint, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(
            f"cannot load {str(checkpoint)!r} into {module_cls.__name__}: {type(exc).__name__}: {one_line(exc)}"
        ) from None


def _validation_loader(checkpoint: Path, datamodule_cls: Any) -> tuple[Any, Any]:
    """The validation loader and the datamodule built from the checkpoint's datamodule hyperparameters, if named."""
    if datamodule_cls is None:
        return None, None
    try:
        datamodule = datamodule_cls.load_from_checkpoint(checkpoint, weights_only=True)
        datamodule.setup("validate")
        return datamodule.val_dataloader(), datamodule
    except Exception as exc:
        raise UsageError(
            f"cannot build {datamodule_cls.__name__}'s validation data: {type(exc).__name__}: {one_line(exc)}"
        ) from None


def _example(model: Any, module_cls: Any, loader: Any, datamodule: Any, input_key: str | None) -> Any:
    """The example input: the module's ``example_input_array``, else the first validation batch's inputs."""
    from lightning_perf.deploy.inputs import model_inputs, through_batch_hooks
    from lightning_perf.functional.inputs import as_input_tuple, split_inputs

    try:
        if model.example_input_array is not None:
            return as_input_tuple(through_batch_hooks(model, model.example_input_array, datamodule=datamodule))
        if loader is not None:
            first = next(model_inputs(model, loader, datamodule=datamodule), None)
            if first is None:
                raise UsageError(f"{type(datamodule).__name__}'s validation data is empty")
            return split_inputs(first, input_key)
    except ValueError as exc:
        raise UsageError(f"no usable example input: {exc}") from None
    raise UsageError(
        f"{module_cls.__name__} has no example_input_array: give --datamodule-class for validation batches or "
        "--input-shape for each input"
    )


def _print_report(report: Any, console: Any) -> None:
    from lightning_perf.profiling import format_seconds, print_table

    rows = [[a.backend, a.status, a.runtime or "", a.reason or ""] for a in report.attempts]
    print_table(["backend", "status", "runtime", "reason"], rows, title="Export attempts", console=console)
    attempt = report.attempt if report.ok else (report.attempts[-1] if report.attempts else None)
    if attempt is not None and attempt.validation:
        rows = [
            [v.batch_size, o.name, o.max_abs_diff, o.max_rel_diff, o.cosine, "yes" if o.passed else (o.problem or "no")]
            for v in attempt.validation
            for o in v.outputs
        ]
        title = f"Validation of {attempt.backend} ({report.precision}) against the model on {report.validation_source}"
        print_table(
            ["batch", "output", "max abs diff", "max rel diff", "cosine", "passed"], rows, title=title, console=console
        )
    if attempt is not None and attempt.latency:
        rows = [
            [
                r.batch_size,
                format_seconds(r.baseline_median_s),
                format_seconds(r.baseline_p90_s),
                format_seconds(r.candidate_median_s),
                format_seconds(r.candidate_p90_s),
                r.format_speedup(),
                r.candidate_throughput,
            ]
            for r in attempt.latency
        ]
        columns = ["batch", "eager median", "eager p90", "export median", "export p90"]
        columns += ["speed-up [95% CI], verdict", "export samples/s"]
        print_table(columns, rows, title=f"Latency on {report.device}", console=console)
    if report.ok:
        console.print(f"wrote {report.artifact}")
    else:
        console.print("[red]no backend produced a validated export[/red]")
    console.print(f"wrote {report.report_path}")
