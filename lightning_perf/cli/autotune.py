"""``lightning-perf autotune``: the auto-tuner from the command line.

Tunes a reference workload (``--workload``) or the user's classes (``--model``, ``--datamodule``); writes a LightningCLI
YAML and a JSON file, never overwriting without ``--force``. The parser imports nothing heavy. Usage notes:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import (
    UsageError,
    add_device_argument,
    add_preset_argument,
    add_source_arguments,
    at_least,
    check_output,
    check_source_options,
    choice_list,
    fail,
    load_user_source,
    setting,
    spec_error,
)
from lightning_perf.optimizations import STAGES


def _search_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The precisions (for any stage: the tuner checks them against ``--stage``) and the optimizations the tuner can
    search (a light import: the list is plain data)."""
    from lightning_perf.optimizations import optimizations

    precisions = tuple(o.name for o in optimizations() if "precision" in o.trainer_kwargs)
    stackable = tuple(o.name for o in optimizations() if "precision" not in o.trainer_kwargs)
    return precisions, stackable


HELP = "measure a model and recommend its fastest safe configuration"
DESCRIPTION = (
    "Try precision, channels-last, compile, backend flags, fused optimizer, DataLoader workers and batch size on a "
    "model, each trial in a fresh process, and keep only what measurably helps without changing the losses. Writes "
    "the recommendation as a LightningCLI YAML and as JSON."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autotune``."""
    precisions, stackable = _search_lists()
    from lightning_perf.optimizations import tuner_search_list

    default_search = tuner_search_list("optimization")
    add_source_arguments(parser, "trial", "a reference workload")
    add_preset_argument(parser)
    add_device_argument(parser)
    parser.add_argument(
        "--stage",
        choices=STAGES,
        default="fit",
        help="what to tune: fit (training step time) or an inference stage (per-batch latency, throughput) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--time-budget",
        type=setting("time_budget_s"),
        default=300.0,
        help="seconds for the whole search (default: %(default)s)",
    )
    parser.add_argument("--steps", type=at_least(3), default=10, help="measured steps per trial, >= 3 (default 10)")
    parser.add_argument(
        "--warmup-steps", type=setting("warmup_steps"), default=3, help="excluded steps per trial (default 3)"
    )
    parser.add_argument(
        "--precisions",
        type=choice_list(precisions, what="precision", allow_empty=True),
        help=f"precisions to try, from {', '.join(precisions)}; '' for none (default: those the device supports "
        "for the stage: the mixed ones for fit, the -true ones first for inference)",
    )
    parser.add_argument(
        "--optimizations",
        type=choice_list(stackable, what="optimization", allow_empty=True),
        help=f"configurations to try stacking, in order, '' for none (default: {','.join(default_search)})",
    )
    parser.add_argument("--max-batch-size", type=setting("batch_size"), help="default: 4x the model's own")
    parser.add_argument("--no-batch-size", action="store_true", help="keep the model's batch size")
    parser.add_argument("--no-data-loading", action="store_true", help="keep the DataLoader settings")
    parser.add_argument("--max-num-workers", type=setting("num_workers"), help="default: the CPU count")
    parser.add_argument(
        "--min-gain", type=at_least(0, float), default=0.03, help="smallest speed-up kept (default 0.03)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=setting("threads"),
        help="intra-op threads of every trial (default: the usable cores less the load seen at the start, at least 1)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="YAML path; the JSON goes beside it (default: autotune-results/NAME.yaml)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="overwrite the output files if they exist (default: the new ones get a run number, NAME-2.yaml)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Contradictory or incomplete options, found before anything heavy is imported."""
    if args.workload is None and args.model is None and not args.config:
        parser.error("one of the arguments --workload --model --config is required")
    check_source_options(parser, args, "--config goes with your model")
    check_output(parser, "--output", args.output, "the YAML")
    if args.no_batch_size and args.max_batch_size is not None:
        fail(parser, "--max-batch-size", args.max_batch_size, "no --max-batch-size with --no-batch-size")
    if args.no_data_loading and args.max_num_workers is not None:
        fail(parser, "--max-num-workers", args.max_num_workers, "no --max-num-workers with --no-data-loading")


# The options passed to AutoTuner under their own names.
_TUNER_OPTIONS = ("device", "stage", "steps", "warmup_steps", "precisions", "optimizations", "max_batch_size",
                  "max_num_workers", "min_gain", "seed", "threads")  # fmt: skip


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the tuner; exit status 0, 1 when the model fails under its own settings, 2 for bad arguments."""
    _check_combinations(args, parser)
    from lightning_perf.benchmark.spec import SpecError
    from lightning_perf.tuning.tuner import AutoTuner, ModelError, TuningError

    kwargs: dict[str, Any] = {}
    if args.workload is not None:
        kwargs.update(workload=args.workload, preset=args.preset)
    else:
        source, model, _ = load_user_source(args)
        kwargs["source"] = source
        name = type(model).__name__
    try:
        tuner = AutoTuner(
            **kwargs,
            **{name: getattr(args, name) for name in _TUNER_OPTIONS},
            time_budget_s=args.time_budget,
            tune_batch_size=not args.no_batch_size,
            tune_data_loading=not args.no_data_loading,
            progress=not args.quiet,
        )
    except SpecError as exc:
        spec_error(parser, exc)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.workload is not None:
        name = f"{args.workload}-{tuner.preset}"
    if not args.quiet:
        print(f"device: {tuner.device} ({tuner.device_reason})")
    try:
        result = tuner.run()
    except ModelError as exc:
        print(str(exc))
        return 1
    except TuningError as exc:
        raise UsageError(str(exc)) from None
    if args.quiet:
        result.print()
    from lightning_perf.tuning.results import unused_output

    requested = args.output or Path("autotune-results") / f"{name}.yaml"
    output = unused_output(requested, force=args.force)
    if output != requested:
        print(f"{requested} or its .json exists: this run is numbered ({output.name}; --force overwrites)")
    output.parent.mkdir(parents=True, exist_ok=True)
    if result.undecided:
        result.retry_command = retry_command(getattr(args, "argv", ["autotune"]), args.time_budget, result.undecided)
    for path in result.write(output, output.with_suffix(".json"), force=args.force):
        print(f"wrote {path}")
    if result.undecided:
        print(result.next_step())
    return 0


def retry_command(argv: list[str], time_budget_s: float, undecided: list[str]) -> str:
    """The user's own command, to run when the machine is quiet; with twice the ``--time-budget`` when the budget was
    one of the reasons it could not decide."""
    import shlex

    args = list(argv)
    if any("lack of budget" in why for why in undecided):
        budget = f"{2 * time_budget_s:g}"
        at = [i for i, a in enumerate(args) if a == "--time-budget" or a.startswith("--time-budget=")]
        if not at:
            args += ["--time-budget", budget]
        elif "=" in args[at[-1]]:
            args[at[-1]] = f"--time-budget={budget}"
        elif at[-1] + 1 < len(args):
            args[at[-1] + 1] = budget
    return shlex.join(["lightning-perf", *args])
