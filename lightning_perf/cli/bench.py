"""``lightning-perf bench``: configurations side by side on a reference workload, each run in a fresh process.

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
    TRAINER_PRECISIONS,
    WORKLOAD_NAMES,
    UsageError,
    device,
    fail,
    non_negative_int,
    one_line,
    positive_int,
)

DEFAULT_CONFIGS = "baseline,bf16-mixed"
BASELINE = "baseline"


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
        help="measure configurations side by side on a reference workload",
        description="Train a reference workload under each configuration (fresh process per run, repeats "
        "interleaved) and print step time, throughput, warm-up, memory and inference speed against baseline.",
        allow_abbrev=False,
    )
    parser.add_argument("--workload", default="convnet", choices=WORKLOAD_NAMES, help="default: %(default)s")
    parser.add_argument(
        "--configs",
        type=parse_configs,
        default=DEFAULT_CONFIGS,
        help="comma-separated configuration names; join names with '+' to stack them "
        "(e.g. baseline,channels_last+compile). 'all' runs every registered one. --list shows them. "
        "default: %(default)s",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--preset", default="default", choices=PRESET_NAMES, help="workload size, default: %(default)s")
    parser.add_argument("--steps", type=positive_int, default=20, help="steady-state steps per run (default 20)")
    parser.add_argument("--warmup-steps", type=positive_int, default=5, help="excluded warm-up steps (default 5)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs per configuration (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="default: the preset's")
    parser.add_argument(
        "--precision",
        default="32-true",
        choices=TRAINER_PRECISIONS,
        help="precision of every configuration that does not set its own (default: %(default)s)",
    )
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--predict-batches", type=non_negative_int, default=10, help="0 skips inference timing")
    parser.add_argument("--num-workers", type=non_negative_int, default=0, help="DataLoader workers (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON report path; Markdown and PNG are written beside it (default: bench-results/WORKLOAD.json)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the benchmark (or ``--list``); exit status 0, 1 when a configuration failed, 2 for bad arguments."""
    _check_output(parser, args.output)
    if args.device == "mps":
        fail(parser, "--device", args.device, "cpu, cuda or cuda:N (the bench does not run on mps)")
    from rich.console import Console

    from lightning_perf.benchmark.configs import available_configs, get_config
    from lightning_perf.benchmark.runner import (
        TABLE_COLUMNS,
        TABLE_LEGEND,
        BenchOptions,
        run_benchmark,
        table_rows,
        write_outputs,
    )
    from lightning_perf.profiling import print_table

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
        console = Console(width=160)
    if args.list:
        rows = [[name, get_config(name).description] for name in available_configs()]
        print_table(["configuration", "what it adds to a plain Trainer"], rows, title="Configurations", console=console)
        return 0
    configs = available_configs() if args.configs == ["all"] else list(args.configs)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(parser, "--device", args.device, "cpu: no CUDA device is visible")
    try:
        options = BenchOptions(
            workload=args.workload,
            configs=configs,
            preset=args.preset,
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            repeats=args.repeats,
            batch_size=args.batch_size,
            precision=args.precision,
            device=args.device,
            seed=args.seed,
            predict_batches=args.predict_batches,
            num_workers=args.num_workers,
        )
    except ValueError as exc:
        raise UsageError(f"argument --configs: {one_line(exc)}") from None
    output = args.output or Path("bench-results") / f"{args.workload}.json"
    command = shlex.join(["lightning-perf", *getattr(args, "argv", ["bench"])])

    if args.quiet:
        report = run_benchmark(options, command=command)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("[bold]bench[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("starting", total=len(options.configs) * options.repeats)

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, description=what)

            report = run_benchmark(options, progress=progress, command=command)

    title = (
        f"{options.workload} ({options.preset}) on {options.device}: {options.repeats} repeats x {options.steps} steps"
    )
    print_table(list(TABLE_COLUMNS), table_rows(report), title=title, console=console)
    console.print(TABLE_LEGEND, style="dim")
    for path in write_outputs(report, output):
        console.print(f"wrote {path}")
    if report.failed:
        console.print(f"[red]{len(report.failed)} configuration(s) failed[/red]: see the table and {output}")
        return 1
    return 0
