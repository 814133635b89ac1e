"""One ``lightning-perf bench`` from its validated spec to the files: progress, the table, warnings, the report.

``lightning-perf bench`` parses its arguments into a :class:`~lightning_perf.benchmark.spec.BenchSpec` and calls
:func:`run_bench`; a script can do the same. ``--list`` is :func:`list_configs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.results import BenchReport, RunEvent
from lightning_perf.benchmark.spec import BenchSpec

__all__ = ["default_output", "list_configs", "run_bench"]


def list_configs(console: Any = None) -> int:
    """Print every registered configuration with the stages it applies to and what it adds; exit status 0."""
    from rich.console import Console

    from lightning_perf.benchmark.configs import available_configs, get_config
    from lightning_perf.optimizations import STAGES
    from lightning_perf.profiling import print_table

    rows = []
    for name in available_configs():
        config = get_config(name)
        rows.append([name, "all" if config.stages == STAGES else ",".join(config.stages), config.description])
    columns = ["configuration", "stages", "what it adds to a plain Trainer"]
    print_table(columns, rows, title="Configurations", console=console or Console())
    return 0


def default_output(spec: BenchSpec) -> Path:
    """``bench-results/<workload>[-<stage>].json`` (``-batch-sizes`` added for a sweep)."""
    stage = "" if spec.stage == "fit" else f"-{spec.stage}"
    sweep = "-batch-sizes" if spec.batch_sizes else ""
    return Path("bench-results") / f"{spec.workload}{stage}{sweep}.json"


def run_bench(
    spec: BenchSpec,
    *,
    output: Path | None = None,
    force: bool = False,
    quiet: bool = False,
    argv: Sequence[str] = ("lightning-perf", "bench"),
    console: Any = None,
) -> int:
    """Measure ``spec`` (one bench per batch size for a sweep), print the tables and write the report files.

    Args:
        spec: what to measure.
        output: the JSON report's path (Markdown and PNG beside it); default :func:`default_output`. An existing
            report is kept: the new one gets a run number, unless ``force``.
        force: overwrite existing report files.
        quiet: no progress display.
        argv: the command line, recorded in the report.
        console: a ``rich`` console (default: stdout).

    Returns:
        The exit status: 0, or 1 when a configuration failed.
    """
    import shlex

    from rich.console import Console

    from lightning_perf.benchmark.report import unused_output, write_outputs, write_sweep_outputs

    console = console or Console()
    command = shlex.join(argv)
    if not quiet:
        console.print(f"device: {spec.device} ({spec.device_reason})", soft_wrap=True, markup=False)
    reports: list[tuple[int, BenchReport]] = []
    status = 0
    for one in spec.per_batch_size():
        if spec.batch_sizes and not quiet:
            console.print(f"batch size {one.batch_size}", style="bold", soft_wrap=True)
        report, code = _measure(one, command, list(argv), console, quiet)
        reports.append((one.batch_size or 0, report))
        status = max(status, code)
    requested = output or default_output(spec)
    path = unused_output(requested, force=force)
    if path != requested:
        console.print(f"{requested} exists: this run is numbered (--force overwrites)", soft_wrap=True)
    written = write_sweep_outputs(reports, path) if spec.batch_sizes else write_outputs(reports[0][1], path)
    for item in written:
        console.print(f"wrote {item}", soft_wrap=True, markup=False)
    failed = sum(len(report.failed) for _, report in reports)
    if failed:
        console.print(f"[red]{failed} configuration(s) failed[/red]: see the table and {path}")
    return status


def _measure(spec: BenchSpec, command: str, argv: list[str], console: Any, quiet: bool) -> tuple[BenchReport, int]:
    """Run one bench and print its table; ``(report, exit status)``."""
    from lightning_perf.benchmark.runner import run_benchmark
    from lightning_perf.profiling.report import wrap_lines

    if not quiet:
        unit = "steps" if spec.stage == "fit" else "batches"
        repeats = (
            f"{spec.repeats} repeats"
            if spec.repeats
            else f"repeats until every speed-up is within +-{spec.target:.0%} (at most {spec.time_budget_s:.0f} s)"
        )
        intro = (
            f"bench: {', '.join(spec.names)} on {spec.workload}{'' if spec.source else f' ({spec.preset})'}, "
            f"{spec.stage}, {spec.device}: {repeats} x ({spec.warmup_steps} warm-up + {spec.steps} {unit}), each run "
            "in a fresh process; then the winners together"
        )
        for name, why in [("", intro), *spec.left_out]:
            for text in wrap_lines(f"{name}: {why}" if name else why):
                console.print(text, soft_wrap=True, markup=False, highlight=False)
    if quiet:
        report = run_benchmark(spec, command=command, argv=argv)
    elif not console.is_terminal:  # a log or a pipe: one line per finished run, nothing redrawn

        def line(event: RunEvent) -> None:
            print(event.line(), flush=True)

        report = run_benchmark(spec, command=command, argv=argv, on_run=line)
    else:
        from rich import progress as rp

        columns = (rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), rp.TimeRemainingColumn())
        with rp.Progress(rp.TextColumn("[bold]bench[/bold] {task.description}"), *columns, console=console,
                         transient=True) as bar:  # fmt: skip
            task = bar.add_task("starting", total=len(spec.names) * (spec.repeats or 2))

            def progress(done: int, total: int, what: str) -> None:
                bar.update(task, completed=done, total=total, description=what)

            report = run_benchmark(spec, progress=progress, command=command, argv=argv)
    _print_report(report, spec, console)
    return report, 1 if report.failed else 0


def _print_report(report: BenchReport, spec: BenchSpec, console: Any) -> None:
    """The table, its legend, notes, warnings, the settling of the repeats and the recommendation, in 80 columns."""
    from lightning_perf.benchmark.console import console_lines

    for line in console_lines(report):
        style = "yellow" if line.startswith("warning:") else "bold" if line.startswith("Recommendation:") else None
        console.print(line, style=style, soft_wrap=True, markup=False, highlight=False)
