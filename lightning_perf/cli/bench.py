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
import shlex
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import (
    PRESET_NAMES,
    STAGE_NAMES,
    TRAINER_PRECISIONS,
    UsageError,
    add_source_arguments,
    device,
    fail,
    load_user_source,
    non_negative_int,
    one_line,
    positive_int,
    positive_int_list,
)

BASELINE = "baseline"
# The no-argument bench: sized to finish in about three minutes on a 2-core CPU (3 configurations x 3 repeats, each a
# fresh process), with enough steps per repeat for the bootstrap interval to be informative.
DEFAULT_STEPS = 15
DEFAULT_WARMUP_STEPS = 3
DEFAULT_REPEATS = 3
DEFAULT_PREDICT_BATCHES = 5


def config_names() -> list[str]:
    """``baseline`` and every registered optimization (a light import: the list is plain data)."""
    from lightning_perf.optimizations import names

    return [BASELINE, *names()]


def parse_configs(text: str) -> list[str]:
    """``--configs``: ``all``, or comma-separated names, each a registered name or a ``+``-joined stack of them."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if items == ["all"]:
        return items
    known = config_names()
    expected = f"comma-separated names from {', '.join(known)} (join names with '+' to stack them), or all"
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid. Expected {expected}.")
    for item in items:
        parts = [part.strip() for part in item.split("+")]
        unknown = [part for part in parts if part not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not valid: unknown configuration {unknown[0]!r}. Expected {expected}."
            )
    return items


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
        type=parse_configs,
        default=None,
        help="comma-separated configuration names; join names with '+' to stack them "
        "(e.g. baseline,channels_last+compile). 'all' runs every registered one. --list shows them. "
        "default: baseline and the configurations this device can accelerate (the output says what it left out)",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--preset", default="default", choices=PRESET_NAMES, help="workload size, default: %(default)s")
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
        type=positive_int,
        default=DEFAULT_REPEATS,
        help="runs per configuration (default %(default)s; from 5 on the interval comes from the spread between "
        "repeats, below from a bootstrap over steps)",
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
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
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


def _check_output(parser: argparse.ArgumentParser, output: Path | None) -> None:
    if output is None:
        return
    if output.is_dir():
        fail(parser, "--output", str(output), "a file path for the JSON report, not a directory")
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        fail(parser, "--output", str(output), "a path whose existing parent is a directory")


def _check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Contradictory or incomplete options, found before anything heavy is imported."""
    if args.model is not None and args.datamodule is None and not args.config:
        fail(parser, "--model", args.model, "--datamodule as well (the LightningDataModule class, pkg.mod:Class)")
    if args.datamodule is not None and args.model is None and not args.config:
        fail(parser, "--datamodule", args.datamodule, "--model as well (the LightningModule class, pkg.mod:Class)")
    if args.model is None and not args.config:
        for option, value in (("--model-args", args.model_args), ("--datamodule-args", args.datamodule_args)):
            if value is not None:
                fail(parser, option, value, f"{option} together with --model or --config")
    if args.workload is not None and args.config:
        fail(
            parser, "--config", str(args.config[0]), "no --config with --workload (the file builds your model; use "
            "--model/--datamodule or the file's model: and data: sections)",
        )  # fmt: skip
    if args.batch_size is not None and args.batch_sizes is not None:
        fail(parser, "--batch-sizes", ",".join(map(str, args.batch_sizes)), "no --batch-sizes with --batch-size")
    if args.device == "mps":
        fail(parser, "--device", args.device, "cpu, cuda or cuda:N (the bench does not run on mps)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the benchmark (or ``--list``); exit status 0, 1 when a configuration failed, 2 for bad arguments."""
    if args.tasks is not None or args.ref:
        from lightning_perf.cli._tasks import run_tasks

        return run_tasks(args, parser)
    _check_output(parser, args.output)
    _check_combinations(args, parser)
    from rich.console import Console

    from lightning_perf.benchmark.configs import available_configs, default_configs, get_config, split_by_stage
    from lightning_perf.profiling import print_table

    console = Console()
    if args.list:
        rows = [
            [name, "all" if len(get_config(name).stages) == 4 else ",".join(get_config(name).stages),
             get_config(name).description]
            for name in available_configs()
        ]  # fmt: skip
        print_table(["configuration", "stages", "what it adds to a plain Trainer"], rows, title="Configurations",
                    console=console)  # fmt: skip
        return 0
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(parser, "--device", args.device, "cpu: no CUDA device is visible")
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
    left_out: list[tuple[str, str]] = []
    if args.configs is None:
        import torch

        configs, left_out = default_configs(torch.device(args.device), stage=args.stage)
    else:
        configs = available_configs() if args.configs == ["all"] else list(args.configs)
        configs, left_out = split_by_stage(configs, args.stage)
        if args.configs == ["all"]:
            left_out = [(name, why) for name, why in left_out if name != "baseline"]
    from lightning_perf.benchmark.runner import BenchOptions

    sizes = args.batch_sizes or [args.batch_size]
    all_options = []
    for size in sizes:
        try:
            all_options.append(
                BenchOptions(
                    workload=label,
                    configs=configs,
                    preset=args.preset,
                    steps=args.steps,
                    warmup_steps=args.warmup_steps,
                    repeats=args.repeats,
                    batch_size=size,
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
            )
        except ValueError as exc:
            raise UsageError(f"argument --configs: {one_line(str(exc))}") from None
    argv = ["lightning-perf", *getattr(args, "argv", ["bench"])]
    if len(all_options) == 1:
        return _run_bench(args, all_options[0], left_out, shlex.join(argv), argv, console)
    return _run_sweep(args, all_options, left_out, shlex.join(argv), argv, console)


def _default_output(options: Any) -> Path:
    stage = "" if options.stage == "fit" else f"-{options.stage}"
    return Path("bench-results") / f"{options.workload}{stage}.json"


def _run_sweep(
    args: argparse.Namespace,
    all_options: list[Any],
    left_out: list[tuple[str, str]],
    command: str,
    argv: list[str],
    console: Any,
) -> int:
    """``--batch-sizes``: one bench per batch size, one JSON (``by_batch_size``) and one Markdown with a section per
    size and the batch-scaling table."""
    from lightning_perf.benchmark.report import unused_output, write_sweep_outputs

    reports, status = [], 0
    for options in all_options:
        if not args.quiet:
            console.print(f"batch size {options.batch_size}", style="bold", soft_wrap=True)
        report, code = _measure(args, options, left_out, command, argv, console)
        reports.append((options.batch_size, report))
        status = max(status, code)
    requested = args.output or _default_output(all_options[0]).with_name(
        _default_output(all_options[0]).stem + "-batch-sizes.json"
    )
    output = unused_output(requested, force=args.force)
    if output != requested:
        console.print(f"{requested} exists: this run is numbered (--force overwrites)", soft_wrap=True)
    for path in write_sweep_outputs(reports, output):
        console.print(f"wrote {path}", soft_wrap=True, markup=False)
    return status


def _run_bench(
    args: argparse.Namespace,
    options: Any,
    left_out: list[tuple[str, str]],
    command: str,
    argv: list[str],
    console: Any,
) -> int:
    from lightning_perf.benchmark.runner import unused_output, write_outputs

    report, status = _measure(args, options, left_out, command, argv, console)
    requested = args.output or _default_output(options)
    output = unused_output(requested, force=args.force)
    written = write_outputs(report, output)
    if output != requested:
        console.print(f"{requested} exists: this run is numbered (--force overwrites)", soft_wrap=True)
    for path in written:
        console.print(f"wrote {path}", soft_wrap=True, markup=False)
    if status:
        console.print(f"[red]{len(report.failed)} configuration(s) failed[/red]: see the table and {output}")
    return status


def _measure(
    args: argparse.Namespace,
    options: Any,
    left_out: list[tuple[str, str]],
    command: str,
    argv: list[str],
    console: Any,
) -> tuple[Any, int]:
    """Run one bench and print its table; ``(report, exit status)``."""
    from lightning_perf.benchmark.report import (
        INFERENCE_CONSOLE_COLUMNS,
        INFERENCE_CONSOLE_LEGEND,
        inference_console_rows,
        title,
    )
    from lightning_perf.benchmark.runner import (
        CONSOLE_COLUMNS,
        CONSOLE_LEGEND,
        console_rows,
        reliability_lines,
        run_benchmark,
    )
    from lightning_perf.benchmark.utilization import unknown_mfu_lines
    from lightning_perf.profiling import rich_table

    plain = not console.is_terminal
    if not args.quiet:
        console.print(
            f"bench: {', '.join(options.configs)} on {options.workload}"
            f"{'' if options.source else f' ({options.preset})'}, {options.stage}, {options.device}: "
            f"{options.repeats} repeats x ({options.warmup_steps} warm-up + {options.steps} "
            f"{'steps' if options.stage == 'fit' else 'batches'}), each run in a fresh process",
            soft_wrap=True,
        )
        for name, why in left_out:
            console.print(f"left out {name}: {why}", soft_wrap=True)
    if args.quiet:
        report = run_benchmark(options, command=command, argv=argv, left_out=left_out)
    elif plain:  # a log or a pipe: one line per finished run, nothing redrawn

        def line(event: Any) -> None:
            print(event.line(), flush=True)

        report = run_benchmark(options, command=command, argv=argv, left_out=left_out, on_run=line)
    else:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("[bold]bench[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("starting", total=len(options.configs) * options.repeats)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, description=what)

            report = run_benchmark(options, progress=progress, command=command, argv=argv, left_out=left_out)

    from rich import box

    heading = f"{title(report).replace('`', '')}: {options.repeats} x {options.steps}"
    if report.stage == "fit":
        table = rich_table(list(CONSOLE_COLUMNS), console_rows(report), title=heading + " steps")
    else:
        table = rich_table(list(INFERENCE_CONSOLE_COLUMNS), inference_console_rows(report), title=heading + " batches")
    table.box, table.pad_edge = box.SIMPLE_HEAD, False
    console.print(table)
    console.print(CONSOLE_LEGEND if report.stage == "fit" else INFERENCE_CONSOLE_LEGEND, style="dim")
    for note in report.notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False)
    for warning in reliability_lines(report):
        console.print(warning, style="yellow", soft_wrap=True, markup=False)
    for reason in unknown_mfu_lines(report.summaries):
        console.print(reason, style="dim", soft_wrap=True, markup=False)
    return report, 1 if report.failed else 0
