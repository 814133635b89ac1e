"""``lightning-perf bench``: configurations side by side on a reference workload or the user's own model, each run
in a fresh process.

The user's model comes from ``--model pkg.mod:Class --datamodule pkg.mod:Class`` (JSON arguments) and/or LightningCLI
``--config`` files (their ``trainer:`` settings apply to every configuration); ``--stage predict|validate|test``
measures inference per batch (latency percentiles, throughput, cold first batch, warm-up, memory) instead of training
steps; ``--batch-sizes 1,8,32`` repeats the bench per batch size and adds a batch-scaling table.

The parser imports nothing heavy (the workload names are :mod:`lightning_perf.cli._common`'s); torch, Lightning and
rich load in :func:`run`; ``--tasks``/``--ref`` hand a spec to :mod:`lightning_perf.benchmark.task_session`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import (
    add_device_argument,
    add_preset_argument,
    add_source_arguments,
    check_output,
    check_source_options,
    fail,
    load_user_source,
    positive_int_list,
    setting,
    spec_error,
)
from lightning_perf.optimizations import STAGES

# The no-argument bench: sized to finish in about three minutes on a 2-core CPU (3 configurations x 3 repeats, each a
# fresh process), with enough steps per repeat for the bootstrap interval to be informative.
DEFAULT_STEPS = 15
DEFAULT_WARMUP_STEPS = 3
DEFAULT_TIME_BUDGET_S = 150.0  # benchmark.settle's default (not imported: --help stays light)
DEFAULT_PREDICT_BATCHES = 5


HELP = "measure configurations side by side on a reference workload or your own model"
DESCRIPTION = (
    "Train a reference workload or your own model (--model/--datamodule, --config) under each configuration (fresh "
    "process per run, repeats interleaved) and print step time, throughput, warm-up, memory and inference speed "
    "against baseline; --stage predict measures per-batch inference latency instead."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``bench``."""
    add_source_arguments(parser, "configuration", "a reference workload (default: convnet)")
    _add_what_arguments(parser)
    _add_run_arguments(parser)
    _add_output_arguments(parser)


def _add_what_arguments(parser: argparse.ArgumentParser) -> None:
    """What is measured: the stage, the configurations, the workload's size."""
    parser.add_argument(
        "--stage",
        default="fit",
        choices=STAGES,
        help="what to measure: fit (training steps) or an inference stage (per-batch latency) (default: %(default)s)",
    )
    parser.add_argument(
        "--configs",
        help="comma-separated configuration names; join names with '+' to stack them "
        "(e.g. baseline,channels_last+compile). 'all' runs every registered one. --list shows them. "
        "default: baseline and the configurations this device can accelerate (the output says what it left out)",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    add_preset_argument(parser)


# The options that are settings of the bench's spec, each --NAME (its unit suffix dropped), parsed and checked by the
# spec's own table (benchmark.spec.parse_setting): (setting, default, help).
_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("steps", DEFAULT_STEPS, "steady-state steps per run (default %(default)s)"),
    ("warmup_steps", DEFAULT_WARMUP_STEPS, "excluded warm-up steps (default %(default)s)"),
    ("repeats", "auto", "runs per configuration: auto (default) adds interleaved repeats until every speed-up's 95%% "
     "interval is within --target or --time-budget is spent; N runs exactly N (from 5 on the interval comes from "
     "the spread between repeats, below from a bootstrap over steps)"),
    ("target", "5%", "with --repeats auto: a speed-up is settled when its 95%% interval is within +-TARGET "
     "(default %(default)s)"),
    ("time_budget_s", DEFAULT_TIME_BUDGET_S, "with --repeats auto: seconds of measuring, single configurations and "
     "the winners' stack together (default %(default)g: the default bench ends within about 3 minutes on 2 cores)"),
    ("batch_size", None, "default: the preset's (the model's)"),
    ("precision", None, "precision of every configuration that does not set its own (default: the --config file's, "
     "else 32-true)"),
    ("predict_batches", DEFAULT_PREDICT_BATCHES, "timed inference batches (default %(default)s); 0 skips inference "
     "timing"),
    ("num_workers", 0, "DataLoader workers (default 0)"),
    ("threads", None, "intra-op threads of every run (default: the usable cores less the load seen at the start, at "
     "least 1)"),
)  # fmt: skip


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How long each run is, how many repeats settle a speed-up, and the Trainer and data settings of every run."""
    for name, default, text in _SETTINGS:
        parser.add_argument("--" + name.removesuffix("_s").replace("_", "-"), type=setting(name), default=default,
                            help=text)  # fmt: skip
    parser.add_argument(
        "--batch-sizes",
        type=positive_int_list,
        metavar="N,N,...",
        help="sweep the batch size: one section per size and a batch-scaling table (e.g. 1,8,32)",
    )
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the report goes, and the task file and git refs that run many benches."""
    parser.add_argument(
        "--output",
        type=Path,
        help="JSON report path; Markdown and PNG are written beside it (default: bench-results/WORKLOAD.json). "
        "An existing report is never overwritten: the new one gets a run number (WORKLOAD-2.json) unless --force",
    )
    parser.add_argument("--force", action="store_true", help="overwrite the report files if they exist")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    parser.add_argument(
        "--tasks",
        type=Path,
        metavar="CSV",
        help="a task file: one bench per row (name,config,configs,steps,batch_size,...), each written under --output",
    )
    parser.add_argument(
        "--ref",
        action="append",
        metavar="REF",
        help="a git ref of your project to benchmark in a temporary worktree, repeatable (the first is the reference)",
    )
    parser.add_argument("--fail-fast", action="store_true", help="with --tasks: stop at the first failing task")


def _check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Contradictory or incomplete options, found before anything heavy is imported."""
    check_source_options(
        parser, args, "the file builds your model; use --model/--datamodule or the file's model: and data: sections"
    )
    if args.batch_size is not None and args.batch_sizes is not None:
        fail(parser, "--batch-sizes", ",".join(map(str, args.batch_sizes)), "no --batch-sizes with --batch-size")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Parse the arguments into one :class:`~lightning_perf.benchmark.spec.BenchSpec` and run it (or ``--list``, or
    the task session of ``--tasks``/``--ref``); exit status 0, 1 when a configuration failed, 2 for bad arguments
    (before any measurement)."""
    if args.tasks is not None or args.ref:
        return _run_tasks(args, parser)
    check_output(parser, "--output", args.output, "the JSON report")
    _check_combinations(args, parser)
    if args.list:
        from lightning_perf.benchmark.session import list_configs

        return list_configs()
    # The spec's settings under their own names (each option's dest is the setting less its unit suffix).
    settings: dict[str, Any] = {name: getattr(args, name.removesuffix("_s")) for name, _, _ in _SETTINGS}
    settings |= {name: getattr(args, name) for name in ("configs", "preset", "device", "seed", "stage")}
    settings |= {"workload": args.workload or "convnet", "precision": args.precision or "32-true"}
    if args.model is not None or args.config:
        settings.update(_own_model_settings(args, parser))
    from lightning_perf.benchmark.session import run_bench
    from lightning_perf.benchmark.spec import BenchSpec, SpecError

    try:
        spec = BenchSpec(batch_sizes=tuple(args.batch_sizes or ()), **settings)
    except SpecError as exc:
        spec_error(parser, exc)
    argv = ["lightning-perf", *getattr(args, "argv", ["bench"])]
    return run_bench(spec, output=args.output, force=args.force, quiet=args.quiet, argv=argv)


def _own_model_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The spec's settings from the user's model, built here once so that one that cannot be built exits 2 now."""
    from lightning_perf.benchmark.sources import batch_size_holder

    source, model, datamodule = load_user_source(args)
    settings: dict[str, Any] = {"workload": type(model).__name__, "source": source.to_dict()}
    if args.configs is None:  # the default set follows the model's structure: probed on the model built here
        from lightning_perf.benchmark.structure import structure_of

        settings["structure"] = structure_of(model, datamodule).to_dict()
    file_precision = source.trainer_settings().get("precision")
    if args.precision is None and file_precision is not None:
        settings.update(precision=str(file_precision), precision_from="--config")
    if hasattr(source, "ignored_trainer_settings"):
        settings["ignored_trainer_settings"] = {k: repr(v) for k, v in source.ignored_trainer_settings().items()}
    sizes = args.batch_size if args.batch_size is not None else args.batch_sizes
    if sizes is not None and batch_size_holder(model, datamodule) is None:
        option = "--batch-size" if args.batch_size is not None else "--batch-sizes"
        value = sizes if args.batch_size is not None else ",".join(map(str, sizes))
        expected = (
            "a model or data module with an integer `batch_size` (attribute or hparams) to set; this one has none"
        )
        fail(parser, option, value, expected)
    return settings


_TASK_RUNNER_DESTS = frozenset({"tasks", "ref", "fail_fast", "output", "force", "quiet"})
_FLAGS = frozenset({"--list", "--force", "--quiet", "--fail-fast"})  # the options that take no value


def _run_tasks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--tasks``/``--ref``: the tasks and the other options as one :class:`~lightning_perf.benchmark.task_session.
    TaskSpec` for :func:`~lightning_perf.benchmark.task_session.run_tasks` (a bad task file or ref: exit 2)."""
    from lightning_perf.benchmark.task_session import TaskSetupError, TaskSpec, run_tasks
    from lightning_perf.benchmark.tasks import SOURCE_COLUMNS, TaskFileError, read_tasks, task_from_options

    if args.output is not None and args.output.exists() and not args.output.is_dir():
        fail(parser, "--output", str(args.output), "a directory for the task results (with --tasks or --ref)")
    command = list(getattr(args, "argv", None) or ["bench"])
    items = _option_items(command[1:])
    given = [tokens[0] for dest, tokens in items if dest in SOURCE_COLUMNS]
    if args.tasks is not None and given:
        expected = "the model in each task's columns (config, model and datamodule, or workload)"
        parser.error(f"argument {given[0].partition('=')[0]}: not valid with --tasks. Expected {expected}")
    passed_on = [
        (dest, tuple(tokens)) for dest, tokens in items if dest not in _TASK_RUNNER_DESTS | set(SOURCE_COLUMNS)
    ]
    try:
        tasks = read_tasks(args.tasks, check_names=True) if args.tasks is not None else [task_from_options(vars(args))]
        flags = {name: getattr(args, name) for name in ("output", "force", "quiet", "fail_fast")}
        flags |= {"tasks_file": args.tasks, "command": ("lightning-perf", *command)}
        return run_tasks(TaskSpec(tuple(tasks), tuple(args.ref or ()), tuple(passed_on), **flags))
    except (TaskFileError, TaskSetupError) as exc:
        parser.error(str(exc))


def _option_items(tokens: list[str]) -> list[tuple[str | None, list[str]]]:
    """The command line cut into (dest, tokens) items, each option with its value (``dest`` None: not an option)."""
    items: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(tokens):
        name, eq, _ = tokens[i].partition("=")
        option = tokens[i].startswith("--")
        width = 1 if not option or name in _FLAGS or eq else 2
        items.append((name[2:].replace("-", "_") if option else None, tokens[i : i + width]))
        i += width
    return items
