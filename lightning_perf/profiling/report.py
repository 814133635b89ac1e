"""Report writers shared by every observer, the benchmark and the tuner: JSON, Markdown and rich tables, PNG charts.

Every file is written atomically (a temporary sibling renamed into place), so an interrupted run never leaves a
half-written report. Charts use matplotlib, imported only inside the plotting functions and drawn on a standalone
``matplotlib.figure.Figure`` with the Agg canvas: the user's pyplot state and global backend are left untouched.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib
import json
import math
import numbers
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from lightning_perf._imports import require
from lightning_perf._io import atomic_path, atomic_write_text
from lightning_perf.profiling.machine import fixed_environment

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "SCHEMA_VERSION",
    "environment_info",
    "format_bytes",
    "format_number",
    "format_ratio",
    "format_seconds",
    "markdown_table",
    "plot_bars",
    "plot_lines",
    "plot_stacked_steps",
    "print_table",
    "text_table",
    "to_jsonable",
    "wrap_lines",
    "write_json",
]

SCHEMA_VERSION = 1
"""Version of the JSON report layout; bumped whenever a reader would have to change."""

PathLike = str | os.PathLike[str]


# ------------------------------------------------------------------------------------------------------ environment


def environment_info() -> dict[str, Any]:
    """The software and hardware a measurement was taken on, for the ``environment`` key of every report.

    Returns:
        Versions (``lightning_perf``, ``torch``, ``lightning``, ``python``), ``platform``, ``machine``, ``cpu``
        (model name), ``cpu_count`` and ``cpu_count_usable`` (this process's affinity), ``torch_threads``, ``libc``,
        ``malloc_mmap_threshold`` (the environment variable that makes CPU peak memory truthful, or None),
        ``cuda`` (the CUDA version torch was built with, or None) and, when a GPU is visible, ``cuda_device``,
        ``cuda_capability`` (e.g. ``"9.0"``) and ``cuda_device_count``. What cannot change within a process
        (versions, the platform, the CPU model, the libc) is read once per process: reading it costs tens of
        milliseconds (package metadata, the libc's version from the interpreter's binary).
    """
    import torch

    from lightning_perf.profiling.machine import usable_cpu_count

    info: dict[str, Any] = {
        **fixed_environment(),
        "cpu_count_usable": usable_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "cuda_device": None,
        "cuda_capability": None,
        "cuda_device_count": 0,
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        info.update(
            cuda_device=torch.cuda.get_device_name(index),
            cuda_capability=f"{major}.{minor}",
            cuda_device_count=torch.cuda.device_count(),
        )
    return info


# ------------------------------------------------------------------------------------------------------------- JSON


def to_jsonable(obj: Any, where: str = "report") -> Any:
    """Convert ``obj`` to data the ``json`` module writes as strict JSON.

    Non-finite floats become ``None`` (JSON has no NaN); paths, dtypes, devices and dates become strings; enums
    their value; objects with a ``to_dict()`` method and dataclasses become dicts; tensors and NumPy values their
    Python numbers or lists; tuples and sets lists; mapping keys strings.

    Raises:
        TypeError: for anything else, naming where in ``obj`` it sits.
    """
    import torch  # here: the formatters and tables of this module serve `compare`, which needs no torch

    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {(k if isinstance(k, str) else str(k)): to_jsonable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        items = [to_jsonable(v, f"{where}[...]") for v in obj]
        try:
            return sorted(items)  # a stable order, so two reports of the same thing compare equal
        except TypeError:
            return items
    if isinstance(obj, (PurePath, torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value, where)
    if isinstance(obj, (datetime.datetime, datetime.date, datetime.time)):
        return obj.isoformat()
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict) and not isinstance(obj, type):
        return to_jsonable(to_dict(), where)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)}
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist(), where)
    if isinstance(obj, numbers.Integral):  # NumPy integers
        return int(obj)
    if isinstance(obj, numbers.Real):  # NumPy floats other than float64
        return to_jsonable(float(obj), where)
    tolist = getattr(obj, "tolist", None)  # NumPy arrays
    if callable(tolist):
        return to_jsonable(tolist(), where)
    raise TypeError(f"`write_json`: {where} is a {type(obj).__name__!r}, which has no JSON form. Convert it first.")


def write_json(report: Mapping[str, Any], path: PathLike) -> Path:
    """Write ``report`` as indented JSON at ``path``, atomically; returns the path.

    ``schema_version`` (:data:`SCHEMA_VERSION`) and ``environment`` (:func:`environment_info`) are added when the
    report lacks them; the caller's dict is not modified. Values are converted by :func:`to_jsonable` (NaN becomes
    null). The whole document is serialized before anything is written, so a value that cannot be converted raises
    and leaves no file behind, not even a temporary one.

    Raises:
        TypeError: if a value has no JSON form.
    """
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **report}
    if "environment" not in data:
        data["environment"] = environment_info()
    text = json.dumps(to_jsonable(data), indent=2, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


# ---------------------------------------------------------------------------------------------------- human units


def _three_digits(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _signed_three_digits(x: float) -> str:
    return ("-" if x < 0 else "") + _three_digits(abs(x))


def _missing(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def format_bytes(n: float | None) -> str:
    """Bytes in binary units with about three significant digits: ``"512 B"``, ``"64.0 MiB"``, ``"1.50 GiB"``.

    Negative sizes (memory freed) keep their sign; ``None`` and NaN give ``"n/a"``.
    """
    if n is None or _missing(float(n)):
        return "n/a"
    sign, value = ("-" if n < 0 else ""), abs(float(n))
    if value < 1024:
        return f"{sign}{value:.0f} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    exponent = 0
    value /= 1024
    while value >= 1024 and exponent < len(units) - 1:
        value /= 1024
        exponent += 1
    return f"{sign}{_three_digits(value)} {units[exponent]}"


def format_seconds(s: float | None) -> str:
    """A duration with a readable unit: ``"850 ns"``, ``"12.3 us"``, ``"4.56 ms"``, ``"1.20 s"``, ``"2 min 05 s"``.

    ``None`` and NaN give ``"n/a"``; negative durations (differences) keep their sign.
    """
    if s is None or _missing(float(s)):
        return "n/a"
    sign, value = ("-" if s < 0 else ""), abs(float(s))
    if math.isinf(value):
        return f"{sign}inf"
    if value == 0:
        return "0 s"
    for limit, scale, unit in ((1e-6, 1e9, "ns"), (1e-3, 1e6, "us"), (1, 1e3, "ms"), (60, 1, "s")):
        if value < limit:
            return f"{sign}{_three_digits(value * scale)} {unit}"
    total = round(value)
    if total < 3600:
        return f"{sign}{total // 60} min {total % 60:02d} s"
    return f"{sign}{total // 3600} h {total % 3600 // 60:02d} min"


def format_number(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix`` (``format_number(0.5, ".1f", "%")``), or ``"n/a"``."""
    return "n/a" if value is None else f"{format(value, spec)}{suffix}"


def format_ratio(
    ratio: float | None, ci95: Sequence[float] | None, verdict: str | None = None, digits: int = 2, sep: str = " "
) -> str:
    """``"1.52x [1.40-1.65] faster"``: a ratio, its 95% interval (left out when there is none) and its verdict after
    ``sep``; ``"n/a"`` without a ratio. The one way every report writes a ratio."""
    if ratio is None:
        return "n/a"
    text = f"{ratio:.{digits}f}x"
    if ci95 is not None and ci95[0] != ci95[1]:
        text += f" [{ci95[0]:.{digits}f}-{ci95[1]:.{digits}f}]"
    return f"{text}{sep}{verdict}" if verdict else text


# ----------------------------------------------------------------------------------------------------------- tables


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, numbers.Real)) and not isinstance(value, bool)


def _cell_text(value: object) -> str:
    if value is None:
        return ""
    if _is_number(value) and not isinstance(value, numbers.Integral):
        x = float(value)  # type: ignore[arg-type]
        if math.isnan(x):
            return "n/a"
        return f"{x:.0f}" if math.isfinite(x) and abs(x) >= 1e4 else f"{x:.4g}"
    return str(value)


def _check_rows(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[bool]:
    """Validate the row widths; return, per column, whether every filled cell is a number (right-aligned)."""
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(f"Table row {i} has {len(row)} cells, expected {len(columns)} (one per column).")
    return [
        all(_is_number(row[j]) for row in rows if row[j] is not None) and any(row[j] is not None for row in rows)
        for j in range(len(columns))
    ]


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """A GitHub-flavoured Markdown table, padded so it also reads well as plain text.

    Numbers are shown with four significant digits (NaN as ``n/a``, None as an empty cell) and numeric columns are
    right-aligned; pre-format cells (:func:`format_bytes`, :func:`format_seconds`) for units. ``|`` in a cell is
    escaped and line breaks become ``<br>``.

    Args:
        columns: header cells.
        rows: one sequence of cells per row, as many as ``columns``.
        title: an optional bold caption line above the table.

    Raises:
        ValueError: if a row does not have one cell per column.

    Example::

        >>> print(markdown_table(["config", "speed-up"], [["baseline", 1.0], ["compile", 1.482]]))
        | config   | speed-up |
        | -------- | -------: |
        | baseline |        1 |
        | compile  |    1.482 |
    """
    numeric = _check_rows(columns, rows)

    def escape(text: str) -> str:
        return text.replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    header = [escape(str(c)) for c in columns]
    body = [[escape(_cell_text(cell)) for cell in row] for row in rows]
    widths = [max([3, len(header[j])] + [len(r[j]) for r in body]) for j in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(cells, widths, numeric)]
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric)) + " |"
    lines = [line([h.ljust(w) for h, w in zip(header, widths)]), rule, *(line(r) for r in body)]
    if title:
        lines = [f"**{escape(title)}**", "", *lines]
    return "\n".join(lines)


CONSOLE_WIDTH = 80
"""The width every console line of the bench, compare and the tuner fits in: nothing is cut, long text is wrapped."""


def wrap_lines(text: str, width: int = CONSOLE_WIDTH, indent: str = "  ") -> list[str]:
    """``text`` wrapped at spaces to lines of at most ``width`` characters, continuation lines indented by ``indent``.

    A word longer than a line (a long path) is broken rather than cut, so nothing is lost and no line is longer than
    ``width``; explicit line breaks in ``text`` are kept.
    """
    lines = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(
            paragraph, width, subsequent_indent=indent, break_on_hyphens=False, break_long_words=True
        ) or [""]
    return lines


def _words_width(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def text_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[object] | str],
    title: str | None = None,
    width: int = CONSOLE_WIDTH,
    gap: int = 2,
) -> str:
    """A plain-text table that fits ``width`` columns without cutting anything: cells wrap at spaces.

    Columns start at their natural width; while the table is too wide, the widest column that can still wrap
    without breaking a word gives up one character. Only when even the longest words do not fit are words broken
    (never shortened with an ellipsis). Cells may hold line breaks; numbers are formatted as in
    :func:`markdown_table` and right-aligned. A row given as a string is a heading line across the table (wrapped).

    Raises:
        ValueError: if a row does not have one cell per column, or ``width`` leaves no room for them.
    """
    numeric = _check_rows(columns, [row for row in rows if not isinstance(row, str)])
    header = [str(c) for c in columns]
    body = [row if isinstance(row, str) else [_cell_text(cell) for cell in row] for row in rows]
    cells = [header, *(row for row in body if not isinstance(row, str))]
    count = len(columns)
    if width < count * (1 + gap):
        raise ValueError(f"`text_table(width={width!r})` is too narrow for {count} columns.")
    natural = [max(max(len(line) for line in (row[j].splitlines() or [""])) for row in cells) for j in range(count)]
    floor = [max(1, max(_words_width(row[j]) for row in cells)) for j in range(count)]
    widths = [max(n, 1) for n in natural]
    room = width - gap * (count - 1)
    while sum(widths) > room:
        shrinkable = [j for j in range(count) if widths[j] > floor[j]]
        if not shrinkable:  # the longest words do not fit: break them, widest column first
            shrinkable = [j for j in range(count) if widths[j] > 1]
        j = max(shrinkable, key=lambda k: widths[k])
        widths[j] -= 1

    def render(row: Sequence[str], align: Sequence[bool]) -> list[str]:
        wrapped = [wrap_lines(cell, w, indent="") for cell, w in zip(row, widths)]
        height = max(len(w) for w in wrapped)
        out = []
        for i in range(height):
            parts = []
            for lines, w, right in zip(wrapped, widths, align):
                piece = lines[i] if i < len(lines) else ""
                parts.append(piece.rjust(w) if right else piece.ljust(w))
            out.append((" " * gap).join(parts).rstrip())
        return out

    lines = wrap_lines(title, width) if title else []
    lines += render(header, [False] * count)
    lines.append((" " * gap).join("-" * w for w in widths))
    for row in body:
        lines += wrap_lines(row, width) if isinstance(row, str) else render(row, numeric)
    return "\n".join(lines)


def print_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    title: str | None = None,
    console: Console | None = None,
    width: int = CONSOLE_WIDTH,
) -> None:
    """Print :func:`text_table` on ``console`` (a :class:`rich.console.Console`; stdout if None), as plain text."""
    text = text_table(columns, rows, title=title, width=width)
    if console is None:
        print(text)
    else:  # no markup: square brackets in a configuration name are shown as they are
        console.print(text, markup=False, highlight=False)


# ----------------------------------------------------------------------------------------------------------- charts


def _figure(purpose: str, figsize: tuple[float, float]) -> Any:
    require("matplotlib", purpose=purpose)
    figure_module = importlib.import_module("matplotlib.figure")
    agg = importlib.import_module("matplotlib.backends.backend_agg")
    fig = figure_module.Figure(figsize=figsize, layout="constrained")
    agg.FigureCanvasAgg(fig)  # attaches itself to ``fig``; pyplot and the global backend are never involved
    return fig


def _save_png(fig: Any, path: PathLike) -> Path:
    # The temporary name has no .png suffix, so the format is given explicitly.
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return Path(path)


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


def plot_bars(
    labels: Sequence[str],
    values: Sequence[float | None],
    errors: Sequence[float | tuple[float, float] | None] | None = None,
    *,
    path: PathLike,
    title: str = "",
    ylabel: str = "",
    reference: float | None = None,
    marks: Sequence[str | None] | None = None,
) -> Path:
    """A bar chart, one bar per label with optional error bars (e.g. speed-up per configuration), as PNG.

    Args:
        labels: bar names.
        values: bar heights; None draws no bar (a failed configuration).
        errors: per bar, a symmetric error, a ``(below, above)`` pair of distances from the value (e.g.
            ``(median - min, max - median)``), or None.
        path: the PNG to write (atomically).
        title: chart title.
        ylabel: y-axis label.
        reference: draw a dashed horizontal line at this height (e.g. 1.0 for "as fast as the baseline").
        marks: per bar, a short word saying why not to trust it (``"disturbed"``, ``"unsettled"``) or None: each
            word gets a hatch pattern and a legend entry.

    Labels, title and axis label are wrapped, never cut: a stack's name breaks after its ``+``.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (the ``plot`` extra).
        ValueError: if the inputs are empty or of different lengths.
    """
    if not labels:
        raise ValueError("`plot_bars()` got no bars: `labels` is empty.")
    if (
        len(values) != len(labels)
        or (errors is not None and len(errors) != len(labels))
        or (marks is not None and len(marks) != len(labels))
    ):
        raise ValueError(
            f"`plot_bars()` needs one value (and one error, one mark) per label: got {len(labels)} labels, "
            f"{len(values)} values{'' if errors is None else f', {len(errors)} errors'}"
            f"{'' if marks is None else f', {len(marks)} marks'}."
        )
    fig = _figure("plot_bars()", (max(5.0, 1.1 * len(labels) + 2.0), 4.5))
    ax = fig.add_subplot()
    heights = [_number(v) for v in values]
    yerr = None
    if errors is not None:
        below, above = [], []
        for err in errors:
            low, high = (0.0, 0.0) if err is None else (err, err) if isinstance(err, (int, float)) else err
            below.append(_number(low))
            above.append(_number(high))
        yerr = [below, above]
    positions = list(range(len(labels)))
    bars = ax.bar(positions, heights, yerr=yerr, capsize=4, color="tab:blue", alpha=0.85)
    _hatch(ax, bars, marks or ())
    ax.bar_label(
        bars, labels=["" if math.isnan(h) else _signed_three_digits(h) for h in heights], padding=2, fontsize=8
    )
    for position, height in zip(positions, heights):
        if math.isnan(height):  # say that a bar is missing rather than leave a gap that reads as zero
            ax.text(position, 0, "n/a", ha="center", va="bottom", fontsize=8)
    rotate = len(labels) > 6
    ax.set_xticks(
        positions,
        [_wrap_label(str(label), 16) for label in labels],
        rotation=30 if rotate else 0,
        ha="right" if rotate else "center",
        fontsize=8,
    )
    ax.set_xlim(-0.6, len(labels) - 0.4)  # a missing (NaN) bar at either end would otherwise fall off the axes
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle="--", linewidth=1)
    ax.set_title("\n".join(textwrap.wrap(title, max(30, int(fig.get_figwidth() * 11)))), fontsize=10)
    ax.set_ylabel("\n".join(textwrap.wrap(ylabel, 40)), fontsize=9)
    return _save_png(fig, path)


_HATCHES = ("//", "xx", "..", "\\\\", "++")


def _hatch(ax: Any, bars: Any, marks: Sequence[str | None]) -> None:
    """Each distinct mark word its hatch pattern on the bars it marks, and a legend entry."""
    words = list(dict.fromkeys(m for m in marks if m))
    for bar, mark in zip(bars, marks):
        if mark:
            bar.set_hatch(_HATCHES[words.index(mark) % len(_HATCHES)])
            bar.set_edgecolor("black")
    if words:
        patch = importlib.import_module("matplotlib.patches").Patch
        handles = [
            patch(facecolor="tab:blue", alpha=0.85, edgecolor="black", hatch=_HATCHES[i % len(_HATCHES)], label=word)
            for i, word in enumerate(words)
        ]
        ax.legend(handles=handles, fontsize="small", loc="best")


def _wrap_label(label: str, width: int) -> str:
    """A tick label on several lines (after ``+`` and spaces), whole."""
    return "\n".join(textwrap.wrap(label.replace("+", "+ "), width, break_long_words=False)).replace("+ ", "+")


def plot_stacked_steps(
    step_records: Sequence[Mapping[str, float]],
    path: PathLike,
    title: str = "",
    phases: Sequence[str] | None = None,
) -> Path:
    """Phase time per step stacked (milliseconds, one band per phase), e.g. from :attr:`PhaseTimer.steps`, as PNG.

    Args:
        step_records: one ``{phase: seconds}`` per step; a phase missing from a step counts 0 there.
        path: the PNG to write (atomically).
        title: chart title.
        phases: the phases to stack, bottom first (default: every phase in order of first appearance). Stack only
            phases that do not nest, or nested time is drawn twice.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (the ``plot`` extra).
        ValueError: if there are no steps.
    """
    if not step_records:
        raise ValueError("`plot_stacked_steps()` got no steps to plot.")
    if phases is None:
        phases = list(dict.fromkeys(name for record in step_records for name in record))
    fig = _figure("plot_stacked_steps()", (8.0, 4.0))
    ax = fig.add_subplot()
    # One filled band per phase (stepped like bars): a few artists whatever the number of steps, so drawing stays cheap.
    heights = [[record.get(name, 0.0) * 1e3 for record in step_records] for name in phases]
    if heights:
        ax.stackplot(range(len(step_records)), *heights, labels=[str(n) for n in phases], step="mid", linewidth=0)
    ax.set(title=title, xlabel="step", ylabel="time (ms)")
    if phases:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return _save_png(fig, path)


def plot_lines(
    series: Mapping[str, Sequence[float | None]],
    path: PathLike,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
) -> Path:
    """One line per named series against its sample index (e.g. a memory timeline), as PNG.

    Args:
        series: ``{name: values}``; None values leave a gap.
        path: the PNG to write (atomically).
        title: chart title.
        xlabel: x-axis label.
        ylabel: y-axis label.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        ModuleNotFoundError: if matplotlib is not installed (the ``plot`` extra).
        ValueError: if ``series`` is empty.
    """
    if not series:
        raise ValueError("`plot_lines()` got no series to plot.")
    fig = _figure("plot_lines()", (8.0, 4.0))
    ax = fig.add_subplot()
    for name, values in series.items():
        ax.plot(range(len(values)), [_number(v) for v in values], label=str(name), linewidth=1.2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return _save_png(fig, path)
