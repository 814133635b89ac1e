"""The ``lightning-perf`` command (also ``python -m lightning_perf``).

``lightning-perf bench`` trains a reference workload under named configurations, each in a fresh process, and shows
their effect side by side against ``baseline``; ``lightning-perf autotune`` measures a model (a reference workload or
the user's own classes) and recommends its fastest safe configuration; ``lightning-perf export`` exports a checkpoint
for deployment. Bad arguments exit with status 2 and say what is valid.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_perf.cli._common import non_negative_int as _non_negative_int
from lightning_perf.cli._common import positive_int as _positive_int

DEFAULT_BENCH_CONFIGS = "baseline,bf16-mixed"


def build_parser() -> argparse.ArgumentParser:
    from lightning_perf.demos import PRESETS, workload_names

    parser = argparse.ArgumentParser(prog="lightning-perf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser(
        "bench",
        help="measure configurations side by side on a reference workload",
        description="Train a reference workload under each configuration (fresh process per run, repeats "
        "interleaved) and print step time, throughput, warm-up, memory and inference speed against baseline.",
    )
    bench.add_argument("--workload", default="convnet", choices=workload_names(), help="default: %(default)s")
    bench.add_argument(
        "--configs",
        default=DEFAULT_BENCH_CONFIGS,
        help="comma-separated configuration names; join names with '+' to stack them "
        "(e.g. baseline,channels_last+compile). 'all' runs every registered one. --list shows them. "
        "default: %(default)s",
    )
    bench.add_argument("--list", action="store_true", help="list the configurations and exit")
    bench.add_argument("--preset", default="default", choices=PRESETS, help="workload size, default: %(default)s")
    bench.add_argument("--steps", type=_positive_int, default=20, help="steady-state steps per run (default 20)")
    bench.add_argument("--warmup-steps", type=_positive_int, default=5, help="excluded warm-up steps (default 5)")
    bench.add_argument("--repeats", type=_positive_int, default=3, help="runs per configuration (default 3)")
    bench.add_argument("--batch-size", type=_positive_int, default=None, help="default: the preset's")
    bench.add_argument(
        "--precision",
        default="32-true",
        choices=["32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"],
        help="precision of every configuration that does not set its own (default: %(default)s)",
    )
    bench.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    bench.add_argument("--predict-batches", type=_non_negative_int, default=10, help="0 skips inference timing")
    bench.add_argument("--num-workers", type=_non_negative_int, default=0, help="DataLoader workers (default 0)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--output",
        type=Path,
        default=None,
        help="JSON report path; Markdown and PNG are written beside it (default: bench-results/WORKLOAD.json)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress display")
    bench.set_defaults(handler=_bench, subparser=bench)
    from lightning_perf.export_cli import add_export_parser

    add_export_parser(sub)
    from lightning_perf.tuning.cli import add_autotune_parser

    add_autotune_parser(sub)
    return parser


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
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
    configs = available_configs() if args.configs.strip() == "all" else [c for c in args.configs.split(",") if c]
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device!r}: no CUDA device is visible; use --device cpu.")
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
        parser.error(str(exc))
    output = args.output or Path("bench-results") / f"{args.workload}.json"
    command = shlex.join(["lightning-perf", *argv])

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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return int(args.handler(args, args.subparser, argv))


if __name__ == "__main__":
    raise SystemExit(main())
