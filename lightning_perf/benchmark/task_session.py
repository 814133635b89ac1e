"""``lightning-perf bench --tasks tasks.csv`` and ``--ref REF``: many benches, one summary, git refs side by side.

Entry points: :class:`TaskSpec`, :func:`run_tasks`, :class:`TaskSetupError`. Exit status 0 when every task ran and
nothing regressed, 1 otherwise, 2 for a ref that does not exist. Design notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_perf._io import atomic_write_text
from lightning_perf.benchmark.compare import (
    DEFAULT_THRESHOLD,
    METHOD,
    UNIT_SUFFIX,
    IncompatibleResultsError,
    ResultsFileError,
    compare_files,
)
from lightning_perf.benchmark.compare_text import format_value, interval_text, percent_change
from lightning_perf.benchmark.refs import (
    WORKING_TREE,
    Checkout,
    GitRefError,
    file_label,
    ref_checkout,
    repository_root,
    resolve_ref,
    working_tree,
)
from lightning_perf.benchmark.report import output_paths, unused_output
from lightning_perf.benchmark.tasks import Task, one_line
from lightning_perf.profiling import markdown_table

__all__ = [
    "DEFAULT_OUTPUT",
    "BenchCall",
    "BenchOutcome",
    "TaskSetupError",
    "TaskSpec",
    "run_bench_subprocess",
    "run_tasks",
]

DEFAULT_OUTPUT = Path("bench-results") / "tasks"
SUMMARY_KIND = "lightning-perf-bench-tasks"
Options = tuple[tuple[str | None, tuple[str, ...]], ...]


class TaskSetupError(ValueError):
    """A ref, a config file or an output directory that cannot be used, found before any bench runs (one line)."""


@dataclass(frozen=True)
class TaskSpec:
    """The tasks to run and how, as the command line parsed them.

    Attributes:
        tasks: the checked tasks (a task file's rows, or the command line's own model).
        refs: ``--ref`` in order, the first the reference; empty: each task's own refs, else the working tree.
        options: the command line's other bench options, ``(dest, tokens)`` per option as typed; a column the task
            fills replaces the option of the same dest.
        output: the results directory (default :data:`DEFAULT_OUTPUT`).
        tasks_file: the task file as given (messages name it); None for the command line's own model.
        command: the command line, recorded in the summary.
    """

    tasks: tuple[Task, ...]
    refs: tuple[str, ...] = ()
    options: Options = ()
    output: Path | None = None
    tasks_file: Path | None = None
    force: bool = False
    quiet: bool = False
    fail_fast: bool = False
    command: tuple[str, ...] = ("lightning-perf", "bench")


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
    task: Task
    ref: str
    output: Path
    checkout: Checkout | None = None
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
        return "working tree" if self.ref == WORKING_TREE else self.ref

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


def run_tasks(spec: TaskSpec, runner: Callable[[BenchCall], BenchOutcome] | None = None) -> int:
    """Run every task on each of its refs, then write and print the summary; see the module notes.

    Args:
        spec: what to run.
        runner: runs one bench (default :func:`run_bench_subprocess`); tests pass a fake.

    Returns:
        The exit status: 0, or 1 when a task failed or a ref regressed.

    Raises:
        TaskSetupError: a ref that does not exist, a config file missing from the working tree, or an output
            directory that cannot be created; raised before any bench runs.
    """
    output_dir = Path(spec.output if spec.output is not None else DEFAULT_OUTPUT).absolute()
    commits = _check_refs(spec)
    runs = _plan(spec, output_dir)
    _check_configs_exist(spec, runs)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        expected = f"a directory that can be created ({exc.strerror or exc})"
        raise TaskSetupError(f"argument --output: {str(spec.output)!r} is not valid. Expected {expected}.") from None
    here = working_tree(exclude=[output_dir])
    say = (lambda text: None) if spec.quiet else (lambda text: print(text, flush=True))
    refs_named = sorted({run.ref for run in runs}, key=[run.ref for run in runs].index)
    say(
        f"bench: {len(spec.tasks)} task(s)" + (f" from {spec.tasks_file}" if spec.tasks_file else "") + f" x ref(s) "
        f"{', '.join(refs_named)}: {len(runs)} bench run(s), each in its own process; results under {output_dir}"
    )
    _run_all(spec, runs, commits, here, runner or run_bench_subprocess, say)
    return _finish(spec, runs, output_dir)


# ------------------------------------------------------------------------------------------- before any work


def _cell(spec: TaskSpec, task: Task, column: str) -> str:
    return f"{spec.tasks_file}, line {task.line}, column {column!r}"


def _check_refs(spec: TaskSpec) -> dict[str, str]:
    """Every ref named anywhere, resolved to its commit before any work."""
    for ref in spec.refs:
        if spec.refs.count(ref) > 1:
            raise TaskSetupError(f"argument --ref: {ref!r} is not valid. Expected each ref once.")
    repo = repository_root()
    commits: dict[str, str] = {}
    named = [(ref, None) for ref in spec.refs] + [(ref, t) for t in spec.tasks for ref in t.refs]
    for ref, task in named:
        if ref == WORKING_TREE or ref in commits:
            continue
        try:
            if repo is None:
                raise GitRefError(f"{ref!r} is not valid: {os.getcwd()!r} is not inside a git repository")
            commits[ref] = resolve_ref(ref, repo)
        except GitRefError as exc:
            where = "argument --ref" if task is None else _cell(spec, task, "ref")
            raise TaskSetupError(f"{where}: {one_line(exc)}") from None
    for task in spec.tasks:
        if len(set(task.refs)) != len(task.refs):
            raise TaskSetupError(f"{_cell(spec, task, 'ref')}: a ref appears twice")
    return commits


def _plan(spec: TaskSpec, output_dir: Path) -> list[_Run]:
    """One run per task and ref, each with its own results file (an existing one is kept unless ``force``)."""
    runs = []
    for task in spec.tasks:
        refs = list(task.refs or spec.refs or [WORKING_TREE])
        labels = [file_label(ref) for ref in refs]
        for i, ref in enumerate(refs):
            label = labels[i] if labels.count(labels[i]) == 1 else f"{labels[i]}-{i + 1}"
            stem = task.name if not (task.refs or spec.refs) else f"{task.name}@{label}"
            runs.append(_Run(task, ref, unused_output(output_dir / f"{stem}.json", force=spec.force)))
    return runs


def _check_configs_exist(spec: TaskSpec, runs: Sequence[_Run]) -> None:
    for run in runs:
        if run.ref != WORKING_TREE:
            continue  # the file may exist only at that ref: the bench says so if it does not
        for path in run.task.config:
            if not Path(path).is_file():
                where = _cell(spec, run.task, "config") if spec.tasks_file else "argument --config"
                raise TaskSetupError(f"{where}: {str(path)!r} is not valid. Expected the path of an existing YAML file")


# ----------------------------------------------------------------------------------------------------- running


def _run_all(
    spec: TaskSpec,
    runs: Sequence[_Run],
    commits: dict[str, str],
    here: Checkout,
    runner: Callable[[BenchCall], BenchOutcome],
    say: Callable[[str], None],
) -> None:
    """Each run in turn; a ref is checked out once, and its worktree removed at the end whatever happens."""
    with ExitStack() as stack:
        checkouts: dict[str, Checkout] = {WORKING_TREE: here}
        for i, run in enumerate(runs, start=1):
            try:
                if run.ref not in checkouts:
                    checkouts[run.ref] = stack.enter_context(ref_checkout(run.ref, commit=commits[run.ref]))
            except GitRefError as exc:
                run.status, run.error = "failed", one_line(exc)
            else:
                _execute(run, checkouts[run.ref], _bench_argv(spec, run, checkouts[run.ref]), runner)
            took = f", {run.wall_s:.0f} s" if run.wall_s is not None else ""
            what = "ok" if run.status == "ok" else f"{run.status}: {run.error}"
            say(f"[{i}/{len(runs)}] {run.task.name} @ {run.label}: {what}{took}")
            if run.status == "failed" and spec.fail_fast:
                break


def _bench_argv(spec: TaskSpec, run: _Run, checkout: Checkout) -> list[str]:
    """The command line's options (a column the task fills wins), the task's, then this run's output."""
    filled = run.task.columns_set()
    argv = [token for dest, tokens in spec.options if dest not in filled for token in tokens]
    argv += run.task.argv(config_path=checkout.path_for)
    return argv + ["--output", str(run.output), "--quiet"] + (["--force"] if spec.force else [])


def _execute(run: _Run, checkout: Checkout, argv: list[str], runner: Callable[[BenchCall], BenchOutcome]) -> None:
    run.checkout = checkout
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


def _error_line(outcome: BenchOutcome, results: dict[str, Any] | None) -> str:
    """Why a bench failed, in one line: its own error line, else its failed rows, else its last words."""
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


# ----------------------------------------------------------------------------------------------------- summary


def _figure_keys(run: _Run, row: dict[str, Any]) -> tuple[str, str]:
    """The time and ratio keys a row shows: the median step for fit, the median per-batch latency for inference."""
    stage = (run.results or {}).get("options", {}).get("stage") or run.task.stage or "fit"
    if stage == "fit":
        return "step_median_s", "speedup"
    if row.get("latency_p50_s") is not None:
        return "latency_p50_s", "latency_p50_speedup"
    return "predict_step_median_s", "predict_speedup"


def _summary_rows(run: _Run) -> list[dict[str, Any]]:
    """Each configuration's figure against baseline (per batch size for a ``--batch-sizes`` sweep)."""
    if run.results is None:
        return []
    sections = run.results.get("by_batch_size")  # a --batch-sizes sweep: one report per batch size
    if not isinstance(sections, list):
        sections = [run.results]
    rows = []
    for section in (s for s in sections if isinstance(s, dict)):
        size = section.get("batch_size") if section is not run.results else None
        for row in (r for r in section.get("summary", []) if isinstance(r, dict)):
            time_key, ratio_key = _figure_keys(run, row)
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
    by_task: dict[str, list[_Run]] = {}
    for run in runs:
        by_task.setdefault(run.task.name, []).append(run)
    return [
        _compare_pair(task, task_runs[0], candidate, threshold)
        for task, task_runs in by_task.items()
        for candidate in task_runs[1:]
    ]


def _compare_pair(task: str, reference: _Run, candidate: _Run, threshold: float) -> dict[str, Any]:
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
        return entry
    try:
        done = compare_files(reference.output, candidate.output, threshold).to_dict()
    except (ResultsFileError, IncompatibleResultsError) as exc:
        entry["notes"].append(f"not compared: {one_line(exc)}")
    else:
        entry.update(rows=done["rows"], regressions=done["regressions"], notes=done["notes"])
    return entry


def _is_baseline(config: Any) -> bool:
    return config == "baseline" or str(config).startswith("baseline (batch ")


def _run_table(runs: Sequence[_Run]) -> str:
    rows = []
    for run in runs:
        figures = _summary_rows(run)
        if not figures:
            rows.append([run.task.name, run.label, run.status, "", "", "", run.error or ""])
        for figure in figures:
            what = figure["time_key"].removesuffix("_s").replace("_", " ")
            time_text = f"{format_value(figure['time_s'], 's')} ({what})" if figure["time_s"] is not None else "n/a"
            verdict = "reference" if _is_baseline(figure["config"]) else (figure["verdict"] or "n/a")
            verdict += " (disturbed)" if figure["disturbed"] else ""
            note = figure["error"] or figure["skipped"] or (run.error if run.status != "ok" else "") or ""
            ratio, ci = figure["ratio"], figure["ratio_ci95"]
            ratio_text = (
                "n/a" if ratio is None else f"{ratio:.2f}x [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else f"{ratio:.2f}x"
            )
            if _is_baseline(figure["config"]) and ratio is None and figure["time_s"] is not None:
                ratio_text = "1.00x"
            rows.append(
                [run.task.name, run.label, run.status, figure["config"], time_text, ratio_text, f"{verdict} {note}"]
            )
    columns = ["task", "ref", "status", "configuration", "time", "vs baseline [95% interval]", "verdict / error"]
    return markdown_table(columns, rows)


def _comparison_table(comparisons: Sequence[dict[str, Any]]) -> str | None:
    rows = []
    for entry in comparisons:
        for row in entry["rows"]:
            unit, suffix = row["unit"], UNIT_SUFFIX[row["unit"]]
            rows.append(
                [
                    entry["task"],
                    row["config"],
                    row["metric"],
                    f"{format_value(row[f'old_median{suffix}'], unit)} ({entry['reference']})",
                    f"{format_value(row[f'new_median{suffix}'], unit)} ({entry['candidate']})",
                    "-" if row["ratio"] is None else percent_change(row["ratio"]),
                    interval_text(row["ratio_ci95"]),
                    row["verdict"] + (" (REGRESSION)" if row["regression"] else ""),
                ]
            )
        rows += [[entry["task"], "", "", entry["reference"], entry["candidate"], "", "", n] for n in entry["notes"]]
    columns = ["task", "configuration", "figure", "reference", "candidate", "change", "95% interval", "verdict"]
    return markdown_table(columns, rows) if rows else None


def _summary(spec: TaskSpec, runs: Sequence[_Run], output_dir: Path) -> dict[str, Any]:
    comparisons = _compare_runs(runs, DEFAULT_THRESHOLD)
    return {
        "kind": SUMMARY_KIND,
        "command": shlex.join(spec.command),
        "tasks_file": str(spec.tasks_file) if spec.tasks_file is not None else None,
        "output": str(output_dir),
        "threshold": DEFAULT_THRESHOLD,
        "method": METHOD,
        "runs": [run.to_dict() for run in runs],
        "comparisons": comparisons,
        "failed": [f"{run.task.name} @ {run.label}: {run.error}" for run in runs if run.status == "failed"],
        "not_run": [f"{run.task.name} @ {run.label}" for run in runs if run.status == "not run"],
        "regressions": [
            f"{c['task']}: {r} ({c['candidate']} vs {c['reference']})" for c in comparisons for r in c["regressions"]
        ],
    }


def _verdicts(summary: dict[str, Any]) -> list[str]:
    failed, not_run, regressions = summary["failed"], summary["not_run"], summary["regressions"]
    lines = [f"{len(failed)} failed: " + "; ".join(failed) if failed else "every task ran"]
    if not_run:
        lines.append(f"{len(not_run)} not run (--fail-fast): {', '.join(not_run)}")
    if summary["comparisons"]:
        pct = f"{summary['threshold'] * 100:g}%"
        lines.append(
            f"REGRESSION beyond {pct} and the noise: {'; '.join(regressions)}"
            if regressions
            else f"no regression beyond {pct} and the noise (the first ref is the reference)"
        )
    return lines


def _finish(spec: TaskSpec, runs: Sequence[_Run], output_dir: Path) -> int:
    """Write ``summary.json`` and ``summary.md``, print the tables and verdicts; the exit status."""
    summary = _summary(spec, runs, output_dir)
    compared = _comparison_table(summary["comparisons"])
    tables = [_run_table(runs), "", *([compared, ""] if compared else [])]
    verdicts = _verdicts(summary)
    markdown = [
        "# lightning-perf bench: tasks",
        "",
        f"Command: `{summary['command']}`",
        "",
        *tables,
        "Time: the median step (fit) or per-batch latency (inference); vs baseline: baseline's time / this time "
        "within the same task and ref (> 1 is faster), with its 95% interval. Refs: each later ref against the "
        f"first; {METHOD}.",
        "",
        *(f"- {line}" for line in verdicts),
        "",
    ]
    json_path = unused_output(output_dir / "summary.json", force=spec.force)
    md_path = json_path.with_suffix(".md")
    atomic_write_text(json_path, json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n")
    atomic_write_text(md_path, "\n".join(markdown))
    if not spec.quiet:
        print()
        print("\n".join(tables).rstrip())
    for line in verdicts:
        print(line)
    written = [path for run in runs for path in run.written] + [run.log for run in runs if run.log]
    for path in [*written, json_path, md_path]:
        print(f"wrote {path}")
    return 1 if summary["failed"] or summary["regressions"] else 0
