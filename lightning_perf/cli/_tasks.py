"""``lightning-perf bench --tasks tasks.csv`` and ``--ref REF``: many benches, one summary, git refs side by side.

Each task (a row of the task file, or the command line itself with ``--ref`` alone) runs once per ref as its own
``python -m lightning_perf bench`` subprocess, so a crashing task cannot take the others down. A git ref is checked
out in a temporary worktree that is first on the task's import path (:mod:`lightning_perf.benchmark.refs`); without a
ref the working tree runs as it is. Every task writes its JSON and Markdown under ``--output`` (a directory), named
after the task (``NAME.json``, or ``NAME@REF.json`` with refs), and the run ends with ``summary.json`` and
``summary.md`` across tasks. With several refs the first is the reference and each other ref's results are compared
with it as ``lightning-perf compare`` does (:mod:`lightning_perf.benchmark.compare`).

Exit status: 0 when every task ran and nothing regressed, 1 when a task failed or a ref is slower than the reference
beyond the threshold and the noise, 2 for a malformed task file or a ref that does not exist (before any work).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_perf.cli._common import UsageError, fail, one_line

__all__ = ["DEFAULT_OUTPUT", "BenchCall", "BenchOutcome", "run_bench_subprocess", "run_tasks"]

DEFAULT_OUTPUT = Path("bench-results") / "tasks"
SUMMARY_KIND = "lightning-perf-bench-tasks"
_RUNNER_DESTS = frozenset({"tasks", "ref", "fail_fast", "output", "force", "quiet"})
_SOURCE_DESTS = frozenset({"workload", "model", "datamodule", "model_args", "datamodule_args", "config"})


@dataclass(frozen=True)
class BenchCall:
    """One bench to run: ``lightning-perf bench ARGV`` in ``cwd`` with ``env``, writing its JSON at ``output``."""

    task: str
    label: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    output: Path


@dataclass(frozen=True)
class BenchOutcome:
    """What a bench subprocess left: its exit status and its output."""

    returncode: int
    stdout: str = ""
    stderr: str = ""


def run_bench_subprocess(call: BenchCall) -> BenchOutcome:
    """Run ``python -m lightning_perf bench ...`` for ``call`` and wait for it (output captured)."""
    done = subprocess.run(
        [sys.executable, "-m", "lightning_perf", "bench", *call.argv],
        cwd=call.cwd,
        env=call.env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return BenchOutcome(done.returncode, done.stdout, done.stderr)


@dataclass
class _Run:
    task: Any  # benchmark.tasks.Task
    ref: str
    output: Path
    checkout: Any = None  # benchmark.refs.Checkout, once checked out
    status: str = "not run"  # "ok", "failed", "not run"
    error: str | None = None
    returncode: int | None = None
    wall_s: float | None = None
    log: Path | None = None
    results: dict[str, Any] | None = None
    written: list[Path] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.checkout is not None:
            return self.checkout.label
        return "working tree" if self.ref == "." else self.ref

    def to_dict(self) -> dict[str, Any]:
        checkout = self.checkout
        return {
            "task": self.task.name,
            "line": self.task.line or None,
            "ref": self.ref,
            "label": self.label,
            "commit": checkout.commit if checkout is not None else None,
            "dirty": checkout.dirty if checkout is not None else None,
            "status": self.status,
            "error": self.error,
            "exit_status": self.returncode,
            "wall_s": self.wall_s,
            "results": str(self.output) if self.results is not None else None,
            "log": str(self.log) if self.log else None,
            "rows": _summary_rows(self),
        }


# --------------------------------------------------------------------------------------------- the command line


def _option_items(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """The command line cut into (dest, tokens) items, each option with its value (``dest`` None: not an option)."""
    by_string = {s: a for a in parser._actions for s in a.option_strings}
    items: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, _ = token.partition("=")
        action = by_string.get(name) if token.startswith("-") else None
        if action is None:
            items.append((None, [token]))
        elif action.nargs == 0 or eq:
            items.append((action.dest, [token]))
        else:
            items.append((action.dest, list(tokens[i : i + 2])))
            i += 1
        i += 1
    return items


def _passthrough(items: list[tuple[str | None, list[str]]], drop: set[str] | frozenset[str]) -> list[str]:
    return [token for dest, tokens in items if dest not in drop for token in tokens]


def _implicit_task(args: argparse.Namespace) -> Any:
    """The command line's own model as a task (``--ref`` without ``--tasks``)."""
    from lightning_perf.benchmark.tasks import task_from_options

    if args.model is not None:
        name = args.model.rpartition(":")[2]
    elif args.config:
        name = Path(args.config[0]).stem
    else:
        name = args.workload or "convnet"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "bench"
    options = {
        "workload": args.workload,
        "model": args.model,
        "datamodule": args.datamodule,
        "model_args": json.dumps(args.model_args) if args.model_args is not None else None,
        "datamodule_args": json.dumps(args.datamodule_args) if args.datamodule_args is not None else None,
        "config": args.config,
    }
    return task_from_options(name, options)


def _check_refs(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tasks: Sequence[Any], repo: Path | None
) -> dict[str, str]:
    """Every ref named anywhere, resolved to its commit before any work; a bad one exits 2 with one line."""
    from lightning_perf.benchmark.refs import WORKING_TREE, GitRefError, resolve_ref

    commits: dict[str, str] = {}
    cli_refs = list(args.ref or [])
    for ref in cli_refs:
        if cli_refs.count(ref) > 1:
            fail(parser, "--ref", ref, "each ref once")
    named = [(ref, None) for ref in cli_refs] + [(ref, t) for t in tasks for ref in t.refs]
    for ref, task in named:
        if ref == WORKING_TREE or ref in commits:
            continue
        try:
            if repo is None:
                raise GitRefError(f"{ref!r} is not valid: {os.getcwd()!r} is not inside a git repository")
            commits[ref] = resolve_ref(ref, repo)
        except GitRefError as exc:
            if task is None:
                parser.error(f"argument --ref: {one_line(exc)}")
            parser.error(f"{args.tasks}, line {task.line}, column 'ref': {one_line(exc)}")
    for task in tasks:
        if len(set(task.refs)) != len(task.refs):
            parser.error(f"{args.tasks}, line {task.line}, column 'ref': a ref appears twice")
    return commits


def _check_configs_exist(parser: argparse.ArgumentParser, args: argparse.Namespace, runs: Sequence[_Run]) -> None:
    from lightning_perf.benchmark.refs import WORKING_TREE

    for run in runs:
        if run.ref != WORKING_TREE:
            continue  # the file may exist only at that ref: the bench says so if it does not
        for path in run.task.config:
            if not Path(path).is_file():
                where = f"{args.tasks}, line {run.task.line}, column 'config'" if args.tasks else "argument --config"
                parser.error(f"{where}: {str(path)!r} is not valid. Expected the path of an existing YAML file")


def _plan(tasks: Sequence[Any], cli_refs: Sequence[str], output_dir: Path, force: bool) -> list[_Run]:
    from lightning_perf.benchmark.refs import WORKING_TREE, file_label
    from lightning_perf.benchmark.report import unused_output

    runs = []
    for task in tasks:
        refs = list(task.refs or cli_refs or [WORKING_TREE])
        labels = [file_label(ref) for ref in refs]
        for i, ref in enumerate(refs):
            label = labels[i] if labels.count(labels[i]) == 1 else f"{labels[i]}-{i + 1}"
            stem = task.name if refs == [WORKING_TREE] and not cli_refs and not task.refs else f"{task.name}@{label}"
            runs.append(_Run(task, ref, unused_output(output_dir / f"{stem}.json", force=force)))
    return runs


# ----------------------------------------------------------------------------------------------------- running


def _error_line(outcome: BenchOutcome, results: dict[str, Any] | None) -> str:
    lines = [line.strip() for line in outcome.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("lightning-perf")]
    if ours:
        return ours[-1]
    if results is not None:
        failed = [row for row in results.get("summary", []) if isinstance(row, dict) and row.get("error")]
        if failed:
            return "; ".join(f"{row.get('config')}: {one_line(row['error'])}" for row in failed)
    if lines:
        return lines[-1]
    out = [line.strip() for line in outcome.stdout.splitlines() if line.strip()]
    return out[-1] if out else f"exit status {outcome.returncode}"


def _read_results(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _execute(run: _Run, argv: list[str], runner: Callable[[BenchCall], BenchOutcome]) -> None:
    from lightning_perf._io import atomic_write_text
    from lightning_perf.benchmark.report import output_paths

    checkout = run.checkout
    call = BenchCall(run.task.name, run.label, argv, checkout.cwd(), checkout.env(), run.output)
    started = time.perf_counter()
    outcome = runner(call)
    run.wall_s = time.perf_counter() - started
    run.returncode = outcome.returncode
    run.results = _read_results(run.output) if run.output.is_file() else None
    run.written = [p for p in output_paths(run.output) if p.is_file()] if run.results is not None else []
    if outcome.returncode == 0 and run.results is not None:
        run.status = "ok"
        return
    run.status = "failed"
    run.error = _error_line(outcome, run.results)
    if outcome.returncode == 0:
        run.error = f"the bench wrote no results file at {run.output}"
    run.log = run.output.with_suffix(".log")
    command = shlex.join(["lightning-perf", "bench", *argv])
    text = f"$ {command}\n# cwd: {call.cwd}\n# exit status {outcome.returncode}\n\n{outcome.stdout}\n{outcome.stderr}"
    atomic_write_text(run.log, text)


def _progress_line(i: int, total: int, run: _Run) -> str:
    took = f", {run.wall_s:.0f} s" if run.wall_s is not None else ""
    what = "ok" if run.status == "ok" else f"{run.status}: {run.error}"
    return f"[{i}/{total}] {run.task.name} @ {run.label}: {what}{took}"


def run_tasks(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    runner: Callable[[BenchCall], BenchOutcome] | None = None,
) -> int:
    """Run every task (``--tasks``) or the command line's bench on each ``--ref``; see the module docstring.

    Args:
        args: the parsed ``lightning-perf bench`` arguments (``args.argv``: the command line, as ``main`` sets it).
        parser: the ``bench`` parser (its validators check the task file's cells; errors exit 2 through it).
        runner: runs one bench (default :func:`run_bench_subprocess`); tests pass a fake.
    """
    from contextlib import ExitStack

    from lightning_perf.benchmark.refs import GitRefError, ref_checkout, repository_root, working_tree
    from lightning_perf.benchmark.tasks import TaskFileError, read_tasks

    runner = runner or run_bench_subprocess
    output_dir = Path(args.output if args.output is not None else DEFAULT_OUTPUT).absolute()
    if output_dir.exists() and not output_dir.is_dir():
        fail(parser, "--output", str(args.output), "a directory for the task results (with --tasks or --ref)")
    tokens = list(getattr(args, "argv", None) or ["bench"])[1:]
    items = _option_items(parser, tokens)
    if args.tasks is not None:
        given = [tokens[0] for dest, tokens in items if dest in _SOURCE_DESTS]
        if given:
            raise UsageError(
                f"argument {given[0].partition('=')[0]}: not valid with --tasks. Expected the model in "
                "each task's columns (config, model and datamodule, or workload)"
            )
        try:
            tasks = read_tasks(args.tasks, parser)
        except TaskFileError as exc:
            parser.error(one_line(exc))
    else:
        tasks = [_implicit_task(args)]
    repo = repository_root()
    commits = _check_refs(parser, args, tasks, repo)
    cli_refs = list(args.ref or [])
    runs = _plan(tasks, cli_refs, output_dir, args.force)
    _check_configs_exist(parser, args, runs)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(parser, "--output", str(args.output), f"a directory that can be created ({exc.strerror or exc})")
    here = working_tree(exclude=[output_dir])
    say = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    refs_named = sorted({run.ref for run in runs}, key=[run.ref for run in runs].index)
    say(
        f"bench: {len(tasks)} task(s)" + (f" from {args.tasks}" if args.tasks else "") + f" x ref(s) "
        f"{', '.join(refs_named)}: {len(runs)} bench run(s), each in its own process; results under {output_dir}"
    )
    with ExitStack() as stack:
        checkouts: dict[str, Any] = {".": here}
        for i, run in enumerate(runs, start=1):
            try:
                if run.ref not in checkouts:
                    checkouts[run.ref] = stack.enter_context(ref_checkout(run.ref, commit=commits[run.ref]))
            except GitRefError as exc:
                run.status, run.error = "failed", one_line(exc)
            else:
                run.checkout = checkouts[run.ref]
                drop = _RUNNER_DESTS | _SOURCE_DESTS | run.task.columns_set()  # a filled column beats the option
                argv = _passthrough(items, drop) + run.task.argv(config_path=run.checkout.path_for)
                argv += ["--output", str(run.output), "--quiet"] + (["--force"] if args.force else [])
                _execute(run, argv, runner)
            say(_progress_line(i, len(runs), run))
            if run.status == "failed" and args.fail_fast:
                break
    return _finish(args, runs, output_dir, say)


# ----------------------------------------------------------------------------------------------------- summary


def _ratio_text(row: dict[str, Any], key: str) -> str:
    ratio, ci = row.get(key), row.get(f"{key}_ci95")
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else f"{ratio:.2f}x"


def _figure_keys(run: _Run, row: dict[str, Any]) -> tuple[str, str]:
    """The time and ratio keys a row shows: the median step for fit, the median per-batch latency for inference."""
    stage = (run.results or {}).get("options", {}).get("stage") or run.task.stage or "fit"
    if stage == "fit":
        return "step_median_s", "speedup"
    if row.get("latency_p50_s") is not None:
        return "latency_p50_s", "latency_p50_speedup"
    return "predict_step_median_s", "predict_speedup"


def _summary_rows(run: _Run) -> list[dict[str, Any]]:
    if run.results is None:
        return []
    rows = []
    sections = run.results.get("by_batch_size")  # a --batch-sizes sweep: one report per batch size
    if not isinstance(sections, list):
        sections = [run.results]
    pairs = [
        (section, row)
        for section in sections
        if isinstance(section, dict)
        for row in section.get("summary", [])
        if isinstance(row, dict)
    ]
    for section, row in pairs:
        time_key, ratio_key = _figure_keys(run, row)
        size = section.get("batch_size") if section is not run.results else None
        rows.append(
            {
                "config": row.get("config") if size is None else f"{row.get('config')} (batch {size})",
                "time_key": time_key,
                "time_s": row.get(time_key),
                "ratio_key": ratio_key,
                "ratio": row.get(ratio_key),
                "ratio_ci95": row.get(f"{ratio_key}_ci95"),
                "verdict": row.get(f"{ratio_key}_verdict"),
                "disturbed": bool(row.get("disturbed")),
                "error": row.get("error"),
                "skipped": row.get("skipped"),
            }
        )
    return rows


def _compare_runs(runs: Sequence[_Run], threshold: float) -> list[dict[str, Any]]:
    """Per task with several refs: each later ref against the first, as ``lightning-perf compare`` decides."""
    from lightning_perf.benchmark.compare import IncompatibleResultsError, ResultsFileError, compare_files

    comparisons = []
    by_task: dict[str, list[_Run]] = {}
    for run in runs:
        by_task.setdefault(run.task.name, []).append(run)
    for task, task_runs in by_task.items():
        if len(task_runs) < 2:
            continue
        reference = task_runs[0]
        for candidate in task_runs[1:]:
            entry: dict[str, Any] = {
                "task": task,
                "reference": reference.label,
                "candidate": candidate.label,
                "old": str(reference.output),
                "new": str(candidate.output),
                "rows": [],
                "regressions": [],
                "notes": [],
            }
            if reference.results is None or candidate.results is None:
                missing = reference if reference.results is None else candidate
                entry["notes"].append(f"not compared: {missing.label} has no results ({missing.status})")
            else:
                try:
                    comparison = compare_files(reference.output, candidate.output, threshold)
                except (ResultsFileError, IncompatibleResultsError) as exc:
                    entry["notes"].append(f"not compared: {one_line(exc)}")
                else:
                    done = comparison.to_dict()
                    entry.update(rows=done["rows"], regressions=done["regressions"], notes=done["notes"])
            comparisons.append(entry)
    return comparisons


def _is_baseline(config: Any) -> bool:
    return config == "baseline" or str(config).startswith("baseline (batch ")


def _change(ratio: float | None) -> str:
    return "-" if ratio is None else f"{(ratio - 1.0) * 100.0:+.1f}%"


def _interval(ci: Sequence[float] | None) -> str:
    return "-" if not ci else f"{(ci[0] - 1.0) * 100.0:+.1f}..{(ci[1] - 1.0) * 100.0:+.1f}%"


def _tables(runs: Sequence[_Run], comparisons: Sequence[dict[str, Any]]) -> list[str]:
    from lightning_perf.benchmark.compare import format_value
    from lightning_perf.profiling import markdown_table

    rows = []
    for run in runs:
        figures = _summary_rows(run)
        if not figures:
            rows.append([run.task.name, run.label, run.status, "", "", "", run.error or ""])
            continue
        for figure in figures:
            what = figure["time_key"].removesuffix("_s").replace("_", " ")
            time_text = f"{format_value(figure['time_s'], 's')} ({what})" if figure["time_s"] is not None else "n/a"
            verdict = "reference" if _is_baseline(figure["config"]) else (figure["verdict"] or "n/a")
            if figure["disturbed"]:
                verdict += " (disturbed)"
            note = figure["error"] or figure["skipped"] or (run.error if run.status != "ok" else "") or ""
            baseline = _is_baseline(figure["config"]) and figure["ratio"] is None and figure["time_s"] is not None
            ratio = "1.00x" if baseline else _ratio_text(figure, "ratio")
            rows.append([run.task.name, run.label, run.status, figure["config"], time_text, ratio, f"{verdict} {note}"])
    columns = ["task", "ref", "status", "configuration", "time", "vs baseline [95% interval]", "verdict / error"]
    lines = [markdown_table(columns, rows), ""]
    compared = []
    for entry in comparisons:
        for row in entry["rows"]:
            unit = row["unit"]
            suffix = {"s": "_s", "bytes": "_bytes", "samples/s": "_samples_per_s"}[unit]
            verdict = row["verdict"] + (" (REGRESSION)" if row["regression"] else "")
            compared.append(
                [
                    entry["task"],
                    row["config"],
                    row["metric"],
                    f"{format_value(row[f'old_median{suffix}'], unit)} ({entry['reference']})",
                    f"{format_value(row[f'new_median{suffix}'], unit)} ({entry['candidate']})",
                    _change(row["ratio"]),
                    _interval(row["ratio_ci95"]),
                    verdict,
                ]
            )
        for note in entry["notes"]:
            compared.append([entry["task"], "", "", entry["reference"], entry["candidate"], "", "", note])
    if compared:
        columns = ["task", "configuration", "figure", "reference", "candidate", "change", "95% interval", "verdict"]
        lines += [markdown_table(columns, compared), ""]
    return lines


def _finish(args: argparse.Namespace, runs: Sequence[_Run], output_dir: Path, say: Callable[[str], None]) -> int:
    from lightning_perf._io import atomic_write_text
    from lightning_perf.benchmark.compare import METHOD
    from lightning_perf.benchmark.report import unused_output
    from lightning_perf.cli.compare import DEFAULT_THRESHOLD, percentage

    threshold = percentage(DEFAULT_THRESHOLD)
    comparisons = _compare_runs(runs, threshold)
    failed = [run for run in runs if run.status == "failed"]
    not_run = [run for run in runs if run.status == "not run"]
    regressions = [
        f"{c['task']}: {r} ({c['candidate']} vs {c['reference']})" for c in comparisons for r in c["regressions"]
    ]
    command = shlex.join(["lightning-perf", *(getattr(args, "argv", None) or ["bench"])])
    failed_lines = [f"{run.task.name} @ {run.label}: {run.error}" for run in failed]
    not_run_lines = [f"{run.task.name} @ {run.label}" for run in not_run]
    summary = {
        "kind": SUMMARY_KIND,
        "command": command,
        "tasks_file": str(args.tasks) if args.tasks is not None else None,
        "output": str(output_dir),
        "threshold": threshold,
        "method": METHOD,
        "runs": [run.to_dict() for run in runs],
        "comparisons": comparisons,
        "failed": failed_lines,
        "not_run": not_run_lines,
        "regressions": regressions,
    }
    json_path = unused_output(output_dir / "summary.json", force=args.force)
    md_path = json_path.with_suffix(".md")
    tables = _tables(runs, comparisons)
    verdicts = [f"{len(failed)} failed: " + "; ".join(failed_lines) if failed else "every task ran"]
    if not_run:
        verdicts.append(f"{len(not_run)} not run (--fail-fast): {', '.join(not_run_lines)}")
    if comparisons:
        pct = f"{threshold * 100:g}%"
        verdicts.append(
            f"REGRESSION beyond {pct} and the noise: {'; '.join(regressions)}"
            if regressions
            else f"no regression beyond {pct} and the noise (the first ref is the reference)"
        )
    markdown = [
        "# lightning-perf bench: tasks",
        "",
        f"Command: `{command}`",
        "",
        *tables,
        "Time: the median step (fit) or per-batch latency (inference); vs baseline: baseline's time / this time "
        "within the same task and ref (> 1 is faster), with its 95% interval. Refs: each later ref against the "
        f"first; {METHOD}.",
        "",
        *(f"- {line}" for line in verdicts),
        "",
    ]
    atomic_write_text(json_path, json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n")
    atomic_write_text(md_path, "\n".join(markdown))
    if not args.quiet:
        print()
        print("\n".join(tables).rstrip())
    for line in verdicts:
        print(line)
    written = [path for run in runs for path in run.written] + [run.log for run in runs if run.log]
    for path in [*written, json_path, md_path]:
        print(f"wrote {path}")
    return 1 if failed or regressions else 0
