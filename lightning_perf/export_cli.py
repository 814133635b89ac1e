"""``lightning-perf export CHECKPOINT --module-class pkg.mod:Class``: deployment export of any Lightning checkpoint.

Loads the checkpoint into the LightningModule class named (``Class.load_from_checkpoint``), takes held-out batches from
the validation data of the LightningDataModule class named (``--datamodule-class``, built from the checkpoint's saved
datamodule hyperparameters), and runs :func:`lightning_perf.functional.export.export_model`: TensorRT, else ONNX,
validated against the model at several batch sizes and timed against eager PyTorch. Prints what each backend did and
writes the artifact and a JSON report next to the checkpoint (or in ``--dirpath``).
Exit status: 0 when an artifact passed validation, 1 when none did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_perf.functional.export import BACKENDS, PRECISIONS


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace("x", ",").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None


def _batch_range(text: str) -> tuple[int, ...]:
    values = _int_list(text)
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,OPT,MAX (three integers)")
    return tuple(values)


def _dynamic_dim(text: str) -> tuple[int, int, tuple[int, ...]]:
    """``[INPUT:]DIM=MIN,OPT,MAX`` -> (input index, dim, range)."""
    try:
        where, values = text.split("=", 1)
        input_index, _, dim = where.rpartition(":")
        return int(input_index or 0), int(dim), _batch_range(values)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not [INPUT:]DIM=MIN,OPT,MAX (e.g. 1=16,64,128 for dimension 1 of the first input)"
        ) from None


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0")
    return value


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``export`` subcommand on ``subparsers`` (of ``lightning-perf``'s parser)."""
    parser = subparsers.add_parser(
        "export",
        help="export a checkpoint for deployment (TensorRT or ONNX), validated against the model and timed",
        description="Load a checkpoint into the LightningModule class named, export it (TensorRT, else ONNX), validate "
        "the export against the model on held-out batches at several batch sizes, time it against eager PyTorch, and "
        "write the artifact and a JSON report next to the checkpoint. Exit status 0 when an export passed validation, "
        "1 when none did.",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint written by Lightning")
    parser.add_argument(
        "--module-class",
        required=True,
        metavar="MODULE:CLASS",
        help="the LightningModule class, e.g. my_pkg.models:Net",
    )
    parser.add_argument(
        "--datamodule-class",
        default=None,
        metavar="MODULE:CLASS",
        help="LightningDataModule whose val_dataloader gives held-out batches for validation (and the example input "
        "when the module has no example_input_array)",
    )
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated, tried in order until one passes validation (default: %(default)s)",
    )
    parser.add_argument("--precision", default="fp32", choices=list(PRECISIONS), help="default: %(default)s")
    parser.add_argument(
        "--batch-range", type=_batch_range, default=(1, 8, 32), metavar="MIN,OPT,MAX", help="default: 1,8,32"
    )
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
        type=_int_list,
        action="append",
        default=None,
        metavar="D1xD2...",
        help="sample shape of a float input without the batch dimension (repeat per input), e.g. 3x224x224; "
        "needed when neither example_input_array nor a datamodule gives an example",
    )
    parser.add_argument("--input-key", default=None, help="the model input's key when batches are dicts")
    parser.add_argument(
        "--validation-batch-sizes",
        type=_int_list,
        default=None,
        metavar="B1,B2...",
        help="batch sizes to validate and time at (default: min, opt and max of --batch-range)",
    )
    parser.add_argument("--latency-iterations", type=_non_negative_int, default=20, help="0 skips timing (default 20)")
    parser.add_argument("--latency-warmup", type=_non_negative_int, default=3, help="default: 3")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--onnx-providers", default=None, help="comma-separated onnxruntime execution providers")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    parser.add_argument("--dirpath", type=Path, default=None, help="output directory (default: the checkpoint's)")
    parser.add_argument("--filename", default=None, help="artifact stem (default: the checkpoint's file stem)")
    parser.add_argument("--strict", action="store_true", help="stop at the first backend that fails, no fallback")
    parser.set_defaults(handler=_export, subparser=parser)
    return parser


def _import_class(spec: str, base: type, flag: str, parser: argparse.ArgumentParser) -> Any:
    module_name, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not name:
        parser.error(f"{flag} {spec!r}: expected MODULE:CLASS, e.g. my_pkg.models:Net")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        parser.error(f"{flag} {spec!r}: cannot import it ({type(exc).__name__}: {exc})")
    if not isinstance(cls, type) or not issubclass(cls, base):
        parser.error(f"{flag} {spec!r} is not a {base.__name__} subclass")
    return cls


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    import lightning.pytorch as pl
    from rich.console import Console

    from lightning_perf.callbacks.tensorrt_export import _model_inputs, _through_batch_hooks
    from lightning_perf.functional.export import (
        ExportError,
        as_input_tuple,
        example_inputs_from_shapes,
        export_model,
        split_inputs,
        validate_options,
    )

    dynamic_dims: list[dict[int, tuple[int, ...]]] = []
    for input_index, dim, rng in args.dynamic_dim:
        while len(dynamic_dims) <= input_index:
            dynamic_dims.append({})
        dynamic_dims[input_index][dim] = rng
    options: dict[str, Any] = {
        "backends": [b.strip() for b in args.backends.split(",") if b.strip()],
        "precision": args.precision,
        "batch_range": args.batch_range,
        "dynamic_dims": dynamic_dims or None,
        "validation_batch_sizes": args.validation_batch_sizes,
        "latency_iterations": args.latency_iterations,
        "latency_warmup": args.latency_warmup,
        "device": args.device,
        "onnx_providers": None if args.onnx_providers is None else args.onnx_providers.split(","),
        "opset": args.opset,
        "strict": args.strict,
    }
    try:
        validate_options(**options, owner="lightning-perf export")
        example = (
            None
            if args.input_shape is None
            else example_inputs_from_shapes(args.input_shape, batch_size=args.batch_range[2])
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if options["device"] is not None and str(options["device"]).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device!r}: no CUDA device is visible; use --device cpu.")
    if not args.checkpoint.is_file():
        parser.error(f"checkpoint {str(args.checkpoint)!r} does not exist")
    module_cls = _import_class(args.module_class, pl.LightningModule, "--module-class", parser)
    datamodule_cls = (
        None
        if args.datamodule_class is None
        else _import_class(args.datamodule_class, pl.LightningDataModule, "--datamodule-class", parser)
    )

    try:
        model = module_cls.load_from_checkpoint(args.checkpoint, map_location="cpu")
    except Exception as exc:
        parser.error(f"cannot load {str(args.checkpoint)!r} into {module_cls.__name__}: {type(exc).__name__}: {exc}")
    loader = None
    if datamodule_cls is not None:
        try:
            datamodule = datamodule_cls.load_from_checkpoint(args.checkpoint)
            datamodule.setup("validate")
            loader = datamodule.val_dataloader()
        except Exception as exc:
            parser.error(f"cannot build {datamodule_cls.__name__}'s validation data: {type(exc).__name__}: {exc}")
    try:
        if example is None and model.example_input_array is not None:
            example = as_input_tuple(_through_batch_hooks(model, model.example_input_array))
        if example is None and loader is not None:
            first = next(_model_inputs(model, loader), None)
            if first is None:
                parser.error(f"{datamodule_cls.__name__}'s validation data is empty")  # type: ignore[union-attr]
            example = split_inputs(first, args.input_key)
    except ValueError as exc:
        parser.error(f"no usable example input: {exc}")
    if example is None:
        parser.error(
            f"{module_cls.__name__} has no example_input_array: give --datamodule-class for validation batches or "
            "--input-shape for each input"
        )

    console = Console()
    try:
        report = export_model(
            model,
            example,
            **options,
            dirpath=args.dirpath or args.checkpoint.parent,
            filename=args.filename or args.checkpoint.stem,
            validation_data=None if loader is None else _model_inputs(model, loader),
            input_key=args.input_key,
            metadata={"checkpoint": str(args.checkpoint), "module_class": args.module_class},
        )
    except ExportError as exc:
        console.print(f"[red]export failed[/red]: {exc}")
        return 1
    except ValueError as exc:
        parser.error(str(exc))
    _print_report(report, console)
    return 0 if report.ok else 1


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
                format_seconds(r.eager_median_s),
                format_seconds(r.eager_p90_s),
                format_seconds(r.export_median_s),
                format_seconds(r.export_p90_s),
                r.speedup,
                r.export_throughput,
            ]
            for r in attempt.latency
        ]
        columns = ["batch", "eager median", "eager p90", "export median", "export p90", "speed-up", "export samples/s"]
        print_table(columns, rows, title=f"Latency on {report.device}", console=console)
    if report.ok:
        console.print(f"wrote {report.artifact}")
    else:
        console.print("[red]no backend produced a validated export[/red]")
    console.print(f"wrote {report.report_path}")
