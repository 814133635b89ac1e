"""Report writers: strict JSON with schema and environment, atomic files, Markdown and rich tables, PNG charts."""

from __future__ import annotations

import enum
import io
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from lightning_perf import _imports
from lightning_perf.profiling import (
    SCHEMA_VERSION,
    MemorySample,
    environment_info,
    format_bytes,
    format_seconds,
    markdown_table,
    plot_bars,
    plot_lines,
    plot_stacked_steps,
    print_table,
    summarize,
    write_json,
)
from lightning_perf.profiling import report as report_module

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(not _imports.is_available("matplotlib"), reason="matplotlib is not installed")


class Precision(enum.Enum):
    BF16 = "bf16-mixed"


@dataclass
class Spec:
    name: str
    out: Path


def test_json_round_trip_with_schema_environment_and_nan_as_null(tmp_path: Path) -> None:
    report: dict[Any, Any] = {
        "stats": summarize([1.0]),  # std is NaN
        "empty": summarize([]),
        "path": tmp_path / "x.json",
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "precision": Precision.BF16,
        "spec": Spec("a", Path("out")),
        "sample": MemorySample("cpu", 1, 2, 3, 4, "cpu-mallinfo2", True),
        "scalar": torch.tensor(2.5),
        "shape": (2, 3),
        "ratios": [1.0, math.inf, -math.inf],
        "tags": {"b", "a"},
        7: "int key",
    }
    target = write_json(report, tmp_path / "r" / "report.json")
    assert target == tmp_path / "r" / "report.json"
    data = json.loads(target.read_text())  # strict JSON: json.loads would accept NaN, so check the text too
    assert "NaN" not in target.read_text() and "Infinity" not in target.read_text()
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert next(iter(data)) == "schema_version"
    assert data["environment"]["torch"] == torch.__version__
    assert data["stats"]["median"] == 1.0 and data["stats"]["std"] is None
    assert data["empty"]["count"] == 0 and data["empty"]["median"] is None
    assert data["path"] == str(tmp_path / "x.json")
    assert data["dtype"] == "torch.bfloat16"
    assert data["device"] == "cpu"
    assert data["precision"] == "bf16-mixed"
    assert data["spec"] == {"name": "a", "out": "out"}
    assert data["sample"]["peak"] == 3 and data["sample"]["peak_since_reset"] is True
    assert data["scalar"] == 2.5
    assert data["shape"] == [2, 3]
    assert data["ratios"] == [1.0, None, None]
    assert data["tags"] == ["a", "b"]
    assert data["7"] == "int key"
    assert "schema_version" not in report and "environment" not in report  # the caller's dict is untouched


def test_json_keeps_the_callers_environment_and_schema(tmp_path: Path) -> None:
    target = write_json({"environment": {"host": "ci"}, "schema_version": 0}, tmp_path / "r.json")
    assert json.loads(target.read_text()) == {"schema_version": 0, "environment": {"host": "ci"}}


def test_unserializable_value_leaves_no_file_at_all(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    with pytest.raises(TypeError, match=r"report\['runs'\]\[1\]\['model'\] is a 'object'"):
        write_json({"runs": [{"model": 1}, {"model": object()}]}, target)
    assert list(tmp_path.iterdir()) == []


def test_failed_json_write_keeps_the_previous_report(tmp_path: Path) -> None:
    target = write_json({"run": 1}, tmp_path / "report.json")
    with pytest.raises(TypeError):
        write_json({"run": 2, "bad": object()}, target)
    assert json.loads(target.read_text())["run"] == 1
    assert list(tmp_path.iterdir()) == [target]


def test_environment_info_describes_this_machine() -> None:
    env = environment_info()
    assert env["torch"] == torch.__version__
    assert env["lightning"] and env["lightning_perf"]
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert isinstance(env["cpu_count"], int) and env["cpu_count"] >= 1
    assert env["torch_threads"] == torch.get_num_threads()
    if torch.cuda.is_available():
        assert env["cuda_device"] and env["cuda_capability"]
    else:
        assert env["cuda_device"] is None and env["cuda_device_count"] == 0
    json.dumps(env, allow_nan=False)


def test_markdown_table_text() -> None:
    text = markdown_table(
        ["config", "speed-up", "memory"],
        [["baseline", 1.0, "64.0 MiB"], ["com|pile", 1.48234, None], ["qat", math.nan, "1.50 GiB"]],
        title="Results",
    )
    assert text == (
        "**Results**\n"
        "\n"
        "| config    | speed-up | memory   |\n"
        "| --------- | -------: | -------- |\n"
        "| baseline  |        1 | 64.0 MiB |\n"
        "| com\\|pile |    1.482 |          |\n"
        "| qat       |      n/a | 1.50 GiB |"
    )


def test_markdown_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError, match="row 1 has 1 cells, expected 2"):
        markdown_table(["a", "b"], [[1, 2], [3]])


def test_print_table_shows_brackets_literally() -> None:
    console = Console(file=io.StringIO(), width=80, color_system=None)
    print_table(["config", "step"], [["[bold]odd[/bold]", 0.5]], title="Steps", console=console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "[bold]odd[/bold]" in out and "Steps" in out and "0.5" in out


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (64 << 20, "64.0 MiB"), (3 << 29, "1.50 GiB"),
     (-(64 << 20), "-64.0 MiB"), (None, "n/a"), (math.nan, "n/a")],
)  # fmt: skip
def test_format_bytes(n: float | None, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("s", "text"),
    [(0, "0 s"), (8.5e-7, "850 ns"), (1.23e-5, "12.3 us"), (4.56e-3, "4.56 ms"), (1.2, "1.20 s"),
     (125, "2 min 05 s"), (3725, "1 h 02 min"), (-0.002, "-2.00 ms"), (None, "n/a"), (math.nan, "n/a")],
)  # fmt: skip
def test_format_seconds(s: float | None, text: str) -> None:
    assert format_seconds(s) == text


@needs_matplotlib
def test_charts_are_png_files_written_atomically(tmp_path: Path) -> None:
    before = set(sys.modules)
    bars = {"errors": [None, (0.1, 0.2), 0.05], "title": "speed-up", "ylabel": "x", "reference": 1.0}
    written = [
        plot_bars(["baseline", "compile", "failed"], [1.0, 1.5, None], path=tmp_path / "bars.png", **bars),
        plot_stacked_steps([{"forward": 0.01, "backward": 0.02}, {"forward": 0.012}], tmp_path / "steps.png", "t"),
        plot_lines({"allocated": [1.0, 3.0, 2.0], "peak": [1.0, 3.0, None]}, tmp_path / "mem.png", "m", "step", "B"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.png", "mem.png", "steps.png"]
    assert "matplotlib.pyplot" not in set(sys.modules) - before  # drawn without pyplot's global state


@needs_matplotlib
@pytest.mark.parametrize(
    "call",
    [
        lambda p: plot_bars([], [], path=p),
        lambda p: plot_bars(["a", "b"], [1.0], path=p),
        lambda p: plot_stacked_steps([], p),
        lambda p: plot_lines({}, p),
    ],
)
def test_charts_refuse_empty_or_mismatched_input(tmp_path: Path, call) -> None:
    with pytest.raises(ValueError):
        call(tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


def test_missing_matplotlib_names_the_plot_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda module: False)
    with pytest.raises(ModuleNotFoundError, match=r"plot_bars\(\) needs `matplotlib`.*lightning-perf\[plot\]"):
        plot_bars(["a"], [1.0], path=tmp_path / "x.png")
    with pytest.raises(ModuleNotFoundError, match=r"lightning-perf\[plot\]"):
        plot_lines({"a": [1.0]}, tmp_path / "y.png")
    assert list(tmp_path.iterdir()) == []


_IMPORT_CHECK = """
import sys, types
# Load the measurement layer without lightning_perf/__init__.py, which imports Lightning (and Lightning imports
# matplotlib on its own): what is checked is that *our* modules do not import it until a chart is drawn.
package = types.ModuleType("lightning_perf")
package.__path__ = [PACKAGE_DIR]
sys.modules["lightning_perf"] = package
import lightning_perf.profiling
import lightning_perf.profiling.report  # the package exports lazily: load the module that draws
print("lightning:", "lightning" in sys.modules)
print("import:", "matplotlib" in sys.modules)
lightning_perf.profiling.report._figure("test", (1.0, 1.0))
print("draw:", "matplotlib" in sys.modules, "matplotlib.pyplot" in sys.modules)
"""


@needs_matplotlib
def test_importing_the_package_does_not_import_matplotlib() -> None:
    package_dir = str(Path(report_module.__file__).resolve().parents[1])
    script = _IMPORT_CHECK.replace("PACKAGE_DIR", repr(package_dir))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "lightning: False" in out  # the measurement layer does not need Lightning either
    assert "import: False" in out
    assert "draw: True False" in out  # drawing imports matplotlib, but never pyplot


def test_text_table_fits_80_columns_without_cutting_a_word() -> None:
    from lightning_perf.profiling.report import text_table

    rows = [
        ["baseline", 425.2, "1.00x", "reference (disturbed)", "1.00x", "25%"],
        ["fused_optimizer", 450.0, "?0.94x\n[0.88-1.01]", "? no clear difference (disturbed)", "~1.00x", "?24%"],
        ["channels_last+fused_optimizer", 262.1, "1.62x [1.51-1.82]", "faster; unsettled after 3 repeats", "", "40%"],
    ]
    text = text_table(["config", "step ms", "speed-up", "verdict", "memory", "MFU"], rows, title="convnet " * 15)
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in text
    for word in ("channels_last+fused_optimizer", "fused_optimizer", "(disturbed)", "[0.88-1.01]", "unsettled"):
        assert word in text  # every word whole, on one line
    assert "425.2" in text and lines[0].startswith("convnet convnet")


def test_text_table_breaks_words_only_when_they_cannot_fit() -> None:
    from lightning_perf.profiling.report import text_table

    text = text_table(["a", "b"], [["x" * 60, "y" * 60]], width=40)
    assert all(len(line) <= 40 for line in text.splitlines())
    assert text.count("x") == 60 and text.count("y") == 60  # broken, nothing lost
    with pytest.raises(ValueError, match="width"):
        text_table(["a", "b", "c"], [[1, 2, 3]], width=5)


def test_text_table_heading_rows_span_the_table_and_set_no_width() -> None:
    from lightning_perf.profiling.report import text_table

    heading = "channels_last+compile @ batch 4, a heading wider than every column"
    lines = text_table(["figure", "ms"], [heading, ["step", 1.5]], width=40).splitlines()
    assert lines[:2] == ["figure  ms", "------  ---"]  # the heading widened no column
    assert lines[2:4] == ["channels_last+compile @ batch 4, a", "  heading wider than every column"]
    assert lines[4] == "step    1.5"


def test_wrap_lines_keeps_every_word_within_80_columns() -> None:
    from lightning_perf.profiling.report import wrap_lines

    warning = "warning: measurement disturbed by " + "other processes used 1.9 of 2 cores " * 5 + "/a/" + "p" * 100
    lines = wrap_lines(warning)
    assert all(len(line) <= 80 for line in lines) and len(lines) > 2
    assert all(line.startswith("  ") for line in lines[1:])
    assert "".join(lines).replace(" ", "") == warning.replace(" ", "")


@needs_matplotlib
def test_bar_chart_labels_whole_and_marked_bars_hatched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_perf.profiling import report

    saved = []
    monkeypatch.setattr(report, "_save_png", lambda fig, path: saved.append(fig))
    labels = ["baseline", "channels_last+fused_optimizer", "fused_optimizer", "compile"]
    ylabel = "baseline step time / configuration's step time (95% interval)"
    marks = [None, "unsettled", "disturbed", None]
    report.plot_bars(labels, [1.0, 1.7, 0.95, 1.2], path=tmp_path / "bars.png", ylabel=ylabel, marks=marks)
    ax = saved[0].axes[0]
    ticks = [t.get_text().replace("\n", "") for t in ax.get_xticklabels()]
    assert ticks == labels
    assert ax.get_ylabel().replace("\n", " ") == ylabel and max(map(len, ax.get_ylabel().splitlines())) <= 40
    hatches = [bar.get_hatch() for bar in ax.patches]
    assert hatches[0] is None and hatches[3] is None and hatches[1] and hatches[2] and hatches[1] != hatches[2]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["unsettled", "disturbed"]
