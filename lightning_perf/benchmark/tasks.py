"""Task files for ``lightning-perf bench --tasks``: one bench per CSV row, read and checked before anything runs.

A malformed file raises :class:`TaskFileError` naming the file, the line and the column; no torch, no Lightning. The
file format (columns, separators, comments): docs/architecture.md, Module notes.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.spec import SpecError, parse_setting
from lightning_perf.optimizations import STAGES

__all__ = [
    "COLUMN_OPTIONS",
    "OPTIONAL_COLUMNS",
    "REQUIRED_COLUMNS",
    "SOURCE_COLUMNS",
    "STAGES",
    "WORKING_TREE",
    "Task",
    "TaskFileError",
    "one_line",
    "read_tasks",
    "task_from_options",
]

REQUIRED_COLUMNS: tuple[str, ...] = ("name", "config", "configs", "steps", "batch_size")
SOURCE_COLUMNS: tuple[str, ...] = ("config", "workload", "model", "datamodule", "model_args", "datamodule_args")
"""The columns that say which model a task measures."""
OPTIONAL_COLUMNS: tuple[str, ...] = (*SOURCE_COLUMNS[1:], "stage", "precision", "warmup_steps", "repeats", "ref")
COLUMN_OPTIONS = {c: "--" + c.replace("_", "-") for c in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS[:-1]) if c != "name"}
"""The bench option each column becomes (``name`` and ``ref`` are the task runner's, not the bench's)."""
WORKING_TREE = "."
"""The ``ref`` that means the working tree as it is (git refuses ``.`` as a ref name, so it cannot clash)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_RESERVED_NAMES = ("summary",)  # the runner writes summary.json / summary.md beside the tasks' files
MAX_FILE_BYTES = 16 * 2**20


class TaskFileError(ValueError):
    """A task file that cannot be used; the message (one line) names the file, the line and the column."""


@dataclass(frozen=True)
class Task:
    """One row of a task file (or the one task of a command line), checked.

    ``config`` holds absolute paths (relative ones were resolved against the task file's directory); ``configs``
    the configuration items (each a name or a ``+``-stack); ``refs`` the git refs to run it on (empty: the command
    line's ``--ref``, else the working tree). ``None`` and empty tuples mean "not set here".
    """

    name: str
    line: int = 0
    config: tuple[Path, ...] = ()
    configs: tuple[str, ...] = ()
    steps: int | None = None
    batch_size: int | None = None
    workload: str | None = None
    model: str | None = None
    datamodule: str | None = None
    model_args: str | None = None  # JSON text, as the option takes it
    datamodule_args: str | None = None
    stage: str | None = None
    precision: str | None = None
    warmup_steps: int | None = None
    repeats: int | None = None
    refs: tuple[str, ...] = ()

    def columns_set(self) -> set[str]:
        """The option columns this task fills (``config`` counted when it names any file)."""
        return {column for column in COLUMN_OPTIONS if getattr(self, column) not in (None, ())}

    def argv(self, config_path: Callable[[Path], Path] | None = None) -> list[str]:
        """The ``lightning-perf bench`` arguments of this task (its filled columns only), in column order.

        Args:
            config_path: maps each ``config`` file to the path to pass (a git ref's worktree copy); default as is.
        """
        argv: list[str] = []
        for column, option in COLUMN_OPTIONS.items():
            value = getattr(self, column)
            if value in (None, ()):
                continue
            if column == "config":
                for path in value:
                    argv += [option, str(config_path(path) if config_path else path)]
            elif column == "configs":
                argv += [option, ",".join(value)]
            else:
                argv += [option, str(value)]
        return argv


def _error(path: Path, line: int, column: str | None, message: str) -> TaskFileError:
    return TaskFileError(f"{path}, line {line}" + (f", column {column!r}" if column else "") + f": {message}")


def _invalid(value: str, expected: str) -> str:
    return f"{value!r} is not valid. Expected {expected}."


def _parse_cell(column: str, text: str, path: Path, check_names: bool) -> Any:
    """The cell's value (:class:`SpecError` when it is not valid)."""
    items = tuple(item.strip() for item in text.split(";") if item.strip())  # the list columns' items
    if column == "config":
        if not items:
            raise SpecError(column, text, "the path of a LightningCLI YAML file (several separated by ';')")
        return tuple(p if p.is_absolute() else (path.parent / p).absolute() for p in map(Path, items))
    if column == "configs":
        if not items or any("," in item for item in items):
            raise SpecError(column, text, "configuration names separated by ';', not ',' ('+' stacks them)")
        if check_names:
            parse_setting(column, ",".join(items))
        return items
    if column == "ref":
        if not items or any(r.startswith("-") or any(c.isspace() for c in r) for r in items):
            expected = "git refs separated by ';' (a branch, tag or commit; '.' is the working tree)"
            raise SpecError(column, text, expected)
        return items
    if column in ("workload", "precision") and not check_names:
        return text
    value = parse_setting(column, text)
    return json.dumps(value) if column.endswith("_args") else value


def _check_source(task: dict[str, Any], path: Path, line: int) -> None:
    named = [column for column in ("config", "model", "workload") if task.get(column) is not None]
    expected = "one of: config (a LightningCLI YAML), model with datamodule, or workload"
    if not named:
        raise _error(path, line, "config", f"the task names no model. Expected {expected}")
    if len(named) > 1:
        raise _error(
            path, line, named[1], f"the task names its model twice ({' and '.join(named)}). Expected {expected}"
        )
    for column in ("datamodule", "model_args", "datamodule_args"):
        if task.get(column) is not None and task.get("model") is None:
            raise _error(path, line, column, f"{column} goes with model, and this task has no model")
    if task.get("model") is not None and task.get("datamodule") is None:
        raise _error(path, line, "datamodule", "model needs a datamodule (package.module:Class)")


def _rows(path: Path) -> Iterable[tuple[int, list[str]]]:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise TaskFileError(f"{path}: is {size} bytes, too large for a task file (at most {MAX_FILE_BYTES})")
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such file (expected a CSV task file)") from None
    except IsADirectoryError:
        raise TaskFileError(f"{path}: is a directory (expected a CSV task file)") from None
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TaskFileError(f"{path}: is not UTF-8 text (expected a CSV task file)") from None
    reader = csv.reader(text.splitlines(keepends=True), strict=True)
    start = 1
    try:
        for row in reader:
            line, start = start, reader.line_num + 1
            if not row or all(not cell.strip() for cell in row) or row[0].lstrip().startswith("#"):
                continue
            yield line, row
    except csv.Error as exc:
        raise _error(path, start, None, f"is not valid CSV ({exc})") from None


def read_tasks(path: str | Path, check_names: bool = False) -> list[Task]:
    """Read and check a task file; nothing runs.

    Args:
        path: the CSV file.
        check_names: check the configuration, precision and workload names too (they import the registries).

    Raises:
        TaskFileError: the file is missing, unreadable or malformed; the message names the file, the line and the
            column, e.g. ``tasks.csv, line 3, column 'steps': '0' is not valid. Expected an integer >= 1.``
    """
    path = Path(path)
    rows = iter(_rows(path))
    header_line, header = next(rows, (1, []))
    if not header:
        raise TaskFileError(f"{path}: is empty. Expected a header row with the columns {', '.join(REQUIRED_COLUMNS)}")
    columns = [cell.strip() for cell in header]
    known = (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS)
    for column in columns:
        if column not in known:
            raise _error(path, header_line, column, f"unknown column. Expected columns among {', '.join(known)}")
        if columns.count(column) > 1:
            raise _error(path, header_line, column, "appears twice in the header")
    missing = [column for column in REQUIRED_COLUMNS if column not in columns]
    if missing:
        raise _error(path, header_line, None, f"missing column(s) {', '.join(map(repr, missing))} in the header")
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for line, row in rows:
        if len(row) != len(columns):
            raise _error(
                path, line, None, f"has {len(row)} cells, the header has {len(columns)} (quote a cell holding a comma)"
            )
        values: dict[str, Any] = {}
        for column, cell in zip(columns, row):
            text = cell.strip()
            if column == "name":
                if not _NAME.match(text):
                    expected = "a file-safe name: letters, digits, '.', '_' or '-', starting with a letter or digit"
                    raise _error(path, line, column, _invalid(text, expected))
                if text.lower() in _RESERVED_NAMES:
                    raise _error(path, line, column, _invalid(text, "a name other than summary (the runner's file)"))
                if text.lower() in seen:
                    raise _error(
                        path, line, column, f"{text!r} is already the name of the task on line {seen[text.lower()]}"
                    )
                seen[text.lower()] = line
                values["name"] = text
                continue
            if not text:
                continue
            try:
                values["refs" if column == "ref" else column] = _parse_cell(column, text, path, check_names)
            except SpecError as exc:
                raise _error(path, line, column, _invalid(text, exc.expected)) from None
        _check_source(values, path, line)
        tasks.append(Task(line=line, **values))
    if not tasks:
        raise TaskFileError(f"{path}: has a header and no task. Expected one row per task")
    return tasks


def task_from_options(options: Mapping[str, Any]) -> Task:
    """The one task of a command line (``--ref`` without ``--tasks``): ``options`` maps column names to values; the
    task is named after the model class, the first config file or the workload."""
    values: dict[str, Any] = {k: options[k] for k in SOURCE_COLUMNS if options.get(k) not in (None, (), [])}
    if "config" in values:
        values["config"] = tuple(Path(p).absolute() for p in values["config"])
    for column in ("model_args", "datamodule_args"):
        if isinstance(values.get(column), dict):
            values[column] = json.dumps(values[column])
    if values.get("model") is not None:
        name = values["model"].rpartition(":")[2]
    else:
        name = Path(values["config"][0]).stem if values.get("config") else values.get("workload") or "convnet"
    return Task(name=re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "bench", **values)


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(str(text).split())
