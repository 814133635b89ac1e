"""``lightning-perf autotune``: the auto-tuner from the command line.

Either a reference workload (``--workload convnet``) or the user's own classes by import path::

    lightning-perf autotune --model my_project.models:Segmenter --datamodule my_project.data:Scans \\
        --model-args '{"depth": 4}' --time-budget 300 --output tuned.yaml

writes ``tuned.yaml`` (a LightningCLI config: ``python train.py fit --config tuned.yaml``) and ``tuned.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'{text!r} is not a JSON object (expected {{"name": value, ...}})')
    return value


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_autotune_parser(sub: Any) -> argparse.ArgumentParser:
    from lightning_perf.cli import _non_negative_int, _positive_int
    from lightning_perf.demos import PRESETS, workload_names
    from lightning_perf.tuning.tuner import OPTIMIZATIONS, PRECISIONS

    parser = sub.add_parser(
        "autotune",
        help="measure a model and recommend its fastest safe configuration",
        description="Try precision, channels-last, compile, backend flags, fused optimizer, DataLoader workers and "
        "batch size on a model, each trial in a fresh process, and keep only what measurably helps without "
        "changing the losses. Writes the recommendation as a LightningCLI YAML and as JSON.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", choices=workload_names(), help="a reference workload")
    what.add_argument("--model", help="the LightningModule class, as package.module:ClassName")
    parser.add_argument("--preset", default="default", choices=PRESETS, help="workload size, default: %(default)s")
    parser.add_argument("--datamodule", help="the LightningDataModule class (with --model)")
    parser.add_argument("--model-args", type=_json_object, default={}, help="JSON object of the model's arguments")
    parser.add_argument("--datamodule-args", type=_json_object, default={}, help="JSON object of its arguments")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument(
        "--time-budget", type=float, default=300.0, help="seconds for the whole search (default: %(default)s)"
    )
    parser.add_argument("--steps", type=_positive_int, default=10, help="measured steps per trial (default 10)")
    parser.add_argument("--warmup-steps", type=_positive_int, default=3, help="excluded steps per trial (default 3)")
    parser.add_argument(
        "--precisions", type=_names, default=None, help=f"mixed precisions to try (default: those of {PRECISIONS})"
    )
    parser.add_argument(
        "--optimizations",
        type=_names,
        default=list(OPTIMIZATIONS),
        help=f"configurations to try stacking, in order (default: {','.join(OPTIMIZATIONS)})",
    )
    parser.add_argument("--max-batch-size", type=_positive_int, default=None, help="default: 4x the model's own")
    parser.add_argument("--no-batch-size", action="store_true", help="keep the model's batch size")
    parser.add_argument("--no-data-loading", action="store_true", help="keep the DataLoader settings")
    parser.add_argument("--max-num-workers", type=_non_negative_int, default=None, help="default: the CPU count")
    parser.add_argument("--min-gain", type=float, default=0.03, help="smallest speed-up kept (default 0.03)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="YAML path; the JSON goes beside it (default: autotune-results/NAME.yaml)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(handler=_autotune, subparser=parser)
    return parser


def _autotune(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    from rich.console import Console

    from lightning_perf.tuning import AutoTuner, ImportSource, ModelError, TuningError

    if args.model is not None and args.datamodule is None:
        parser.error("--model needs --datamodule (the LightningDataModule class, as package.module:ClassName)")
    if args.workload is not None and args.datamodule is not None:
        parser.error("--datamodule goes with --model, not with --workload")
    try:
        kwargs: dict[str, Any] = {}
        if args.workload is not None:
            kwargs.update(workload=args.workload, preset=args.preset)
            name = f"{args.workload}-{args.preset}"
        else:
            kwargs["source"] = ImportSource(args.model, args.datamodule, args.model_args, args.datamodule_args)
            kwargs["source"].load()  # fail here, as a usage error, when the classes cannot be imported or built
            name = args.model.replace(":", ".").rsplit(".", 1)[-1]
        tuner = AutoTuner(
            **kwargs,
            device=args.device,
            time_budget_s=args.time_budget,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            precisions=args.precisions,
            optimizations=args.optimizations,
            tune_batch_size=not args.no_batch_size,
            max_batch_size=args.max_batch_size,
            tune_data_loading=not args.no_data_loading,
            max_num_workers=args.max_num_workers,
            min_gain=args.min_gain,
            seed=args.seed,
            progress=not args.quiet,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        result = tuner.run()
    except ModelError as exc:
        print(str(exc))
        return 1
    except TuningError as exc:
        parser.error(str(exc))
    if args.quiet:
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
        result.print(console)
    output = args.output or Path("autotune-results") / f"{name}.yaml"
    output.parent.mkdir(parents=True, exist_ok=True)
    for path in result.write(output, output.with_suffix(".json")):
        print(f"wrote {path}")
    return 0
