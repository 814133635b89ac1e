"""``lightning-perf bench``: configurations side by side on a reference workload or the user's own model, each run
in a fresh process.

The user's model comes from ``--model pkg.mod:Class --datamodule pkg.mod:Class`` (JSON arguments) and/or LightningCLI
``--config`` files (their ``trainer:`` settings apply to every configuration); ``--stage predict|validate|test``
measures inference per batch (latency percentiles, throughput, cold first batch, warm-up, memory) instead of training
steps; ``--batch-sizes 1,8,32`` repeats the bench per batch size and adds a batch-scaling table.

The parser imports nothing heavy: the configuration names come from :mod:`lightning_perf.optimizations` (plain data)
and the workload names from :mod:`lightning_perf.cli._common`; torch, Lightning and rich load in :func:`run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import (
    PRESET_NAMES,
    STAGE_NAMES,
    TRAINER_PRECISIONS,
    add_source_arguments,
    check_output,
    check_source_options,
    fail,
    load_user_source,
    non_negative_int,
    positive_int,
    positive_int_list,
    spec_error,
)
from lightning_perf.optimizations import BASELINE

# The no-argument bench: sized to finish in about three minutes on a 2-core CPU (3 configurations x 3 repeats, each a
# fresh process), with enough steps per repeat for the bootstrap interval to be informative.
DEFAULT_STEPS = 15
DEFAULT_WARMUP_STEPS = 3
DEFAULT_REPEATS = "auto"
DEFAULT_TARGET = "5%"
DEFAULT_TIME_BUDGET_S = 150.0  # benchmark.settle's default (not imported: --help stays light)
DEFAULT_PREDICT_BATCHES = 5


def repeats_value(text: str) -> int | str:
    """``--repeats``: ``auto`` or an integer >= 1."""
    return "auto" if text.strip() == "auto" else positive_int(text)


def target_value(text: str) -> float:
    """``--target``: a percentage (``5%``) or a fraction (``0.05``) between 0 and 1, exclusive."""
    expected = "a percentage such as 5% (or a fraction such as 0.05), above 0 and below 100%"
    stripped = text.strip()
    try:
        value = float(stripped[:-1]) / 100.0 if stripped.endswith("%") else float(stripped)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid. Expected {expected}.") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid. Expected {expected}.")
    return value


def seconds_value(text: str) -> float:
    """``--time-budget``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid. Expected a number of seconds > 0, e.g. 150.")
    return value


def config_names() -> list[str]:
    """``baseline`` and every registered optimization (a light import: the list is plain data)."""
    from lightning_perf.optimizations import names

    return [BASELINE, *names()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``lightning-perf`` sub-parsers."""
    parser = subparsers.add_parser(
        "bench",
        help="measure configurations side by side on a reference workload or your own model",
        description="Train a reference workload or your own model (--model/--datamodule, --config) under each "
        "configuration (fresh process per run, repeats interleaved) and print step time, throughput, warm-up, memory "
        "and inference speed against baseline; --stage predict measures per-batch inference latency instead.",
        allow_abbrev=False,
    )
    add_source_arguments(parser, "configuration", "a reference workload (default: convnet)")
    parser.add_argument(
        "--stage",
        default="fit",
        choices=STAGE_NAMES,
        help="what to measure: fit (training steps) or an inference stage (per-batch latency) (default: %(default)s)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated configuration names; join names with '+' to stack them "
        "(e.g. baseline,channels_last+compile). 'all' runs every registered one. --list shows them. "
        "default: baseline and the configurations this device can accelerate (the output says what it left out)",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--preset",
        default=None,
        metavar="PRESET",
        help=f"workload size, one of {', '.join(PRESET_NAMES)} (default: gpu on a CUDA device where the workload has "
        "it, else default)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=DEFAULT_STEPS, help="steady-state steps per run (default %(default)s)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=positive_int,
        default=DEFAULT_WARMUP_STEPS,
        help="excluded warm-up steps (default %(default)s)",
    )
    parser.add_argument(
        "--repeats",
        type=repeats_value,
        default=DEFAULT_REPEATS,
        help="runs per configuration: auto (default) adds interleaved repeats until every speed-up's 95%% interval "
        "is within --target or --time-budget is spent; N runs exactly N (from 5 on the interval comes from the spread "
        "between repeats, below from a bootstrap over steps)",
    )
    parser.add_argument(
        "--target",
        type=target_value,
        default=DEFAULT_TARGET,
        help="with --repeats auto: a speed-up is settled when its 95%% interval is within +-TARGET "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--time-budget",
        type=seconds_value,
        default=DEFAULT_TIME_BUDGET_S,
        metavar="SECONDS",
        help="with --repeats auto: seconds of measuring, single configurations and the winners' stack together "
        "(default %(default)g: the default bench ends within about 3 minutes on a 2-core CPU)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default: the preset's (the model's)")
    parser.add_argument(
        "--batch-sizes",
        type=positive_int_list,
        default=None,
        metavar="N,N,...",
        help="sweep the batch size: one section per size and a batch-scaling table (e.g. 1,8,32)",
    )
    parser.add_argument(
        "--precision",
        default=None,
        choices=TRAINER_PRECISIONS,
        help="precision of every configuration that does not set its own (default: the --config file's, else 32-true)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda or cuda:N (default: auto: CUDA when a CUDA device is visible; the output says which)",
    )
    parser.add_argument(
        "--predict-batches",
        type=non_negative_int,
        default=DEFAULT_PREDICT_BATCHES,
        help="timed inference batches (default %(default)s); 0 skips inference timing",
    )
    parser.add_argument("--num-workers", type=non_negative_int, default=0, help="DataLoader workers (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON report path; Markdown and PNG are written beside it (default: bench-results/WORKLOAD.json). "
        "An existing report is never overwritten: the new one gets a run number (WORKLOAD-2.json) unless --force",
    )
    parser.add_argument("--force", action="store_true", help="overwrite the report files if they exist")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument(
        "--tasks",
        type=Path,
        default=None,
        metavar="CSV",
        help="a task file: one bench per row (name,config,configs,steps,batch_size,...), each written under --output",
    )
    parser.add_argument(
        "--ref",
        action="append",
        default=None,
        metavar="REF",
        help="a git ref of your project to benchmark in a temporary worktree, repeatable (the first is the reference)",
    )
    parser.add_argument("--fail-fast", action="store_true", help="with --tasks: stop at the first failing task")
    parser.set_defaults(run=run, subparser=parser)
    return parser


def _check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Contradictory or incomplete options, found before anything heavy is imported."""
    check_source_options(
        parser, args, "the file builds your model; use --model/--datamodule or the file's model: and data: sections"
    )
    if args.datamodule is not None and args.model is None and not args.config:
        fail(parser, "--datamodule", args.datamodule, "--model as well (the LightningModule class, pkg.mod:Class)")
    if args.model is None and not args.config:
        for option, value in (("--model-args", args.model_args), ("--datamodule-args", args.datamodule_args)):
            if value is not None:
                fail(parser, option, value, f"{option} together with --model or --config")
    if args.batch_size is not None and args.batch_sizes is not None:
        fail(parser, "--batch-sizes", ",".join(map(str, args.batch_sizes)), "no --batch-sizes with --batch-size")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Parse the arguments into one :class:`~lightning_perf.benchmark.spec.BenchSpec` and run it (or ``--list``);
    exit status 0, 1 when a configuration failed, 2 for bad arguments (before any measurement)."""
    if args.tasks is not None or args.ref:
        from lightning_perf.cli._tasks import run_tasks

        return run_tasks(args, parser)
    check_output(parser, "--output", args.output, "the JSON report")
    _check_combinations(args, parser)
    if args.list:
        from lightning_perf.benchmark.session import list_configs

        return list_configs()
    own = args.model is not None or bool(args.config)
    source_dict, label, precision, precision_from, ignored = None, args.workload or "convnet", args.precision, None, {}
    if own:
        source, model, datamodule = load_user_source(args)
        source_dict, label = source.to_dict(), type(model).__name__
        file_precision = source.trainer_settings().get("precision")
        if precision is None and file_precision is not None:
            precision, precision_from = str(file_precision), "--config"
        if hasattr(source, "ignored_trainer_settings"):
            ignored = {k: repr(v) for k, v in source.ignored_trainer_settings().items()}
        if args.batch_size is not None or args.batch_sizes is not None:
            from lightning_perf.benchmark.sources import batch_size_holder

            if batch_size_holder(model, datamodule) is None:
                option = "--batch-size" if args.batch_size is not None else "--batch-sizes"
                value = args.batch_size if args.batch_size is not None else ",".join(map(str, args.batch_sizes))
                fail(parser, option, value, "a model or data module with an integer `batch_size` (attribute or "
                     "hparams) to set; this one has none")  # fmt: skip
    from lightning_perf.benchmark.session import run_bench
    from lightning_perf.benchmark.spec import BenchSpec, SpecError

    try:
        spec = BenchSpec(
            workload=label,
            configs=args.configs,
            preset=args.preset,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            repeats=None if args.repeats == "auto" else args.repeats,
            target=args.target if isinstance(args.target, float) else target_value(args.target),
            time_budget_s=args.time_budget,
            batch_size=args.batch_size,
            batch_sizes=tuple(args.batch_sizes or ()),
            precision=precision or "32-true",
            device=args.device,
            seed=args.seed,
            predict_batches=args.predict_batches,
            num_workers=args.num_workers,
            source=source_dict,
            stage=args.stage,
            precision_from=precision_from,
            ignored_trainer_settings=ignored,
        )
    except SpecError as exc:
        spec_error(parser, exc)
    argv = ["lightning-perf", *getattr(args, "argv", ["bench"])]
    return run_bench(spec, output=args.output, force=args.force, quiet=args.quiet, argv=argv)
