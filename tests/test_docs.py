"""The documentation pages stay what their sources give: docs/benchmarks.md is regenerated from docs/bench/."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_benchmarks_md", DOCS / "make_benchmarks_md.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load_generator()


def test_benchmarks_page_is_up_to_date(generator: ModuleType) -> None:
    expected = generator.render(generator.TEMPLATE.read_text())
    actual = generator.PAGE.read_text()
    assert actual == expected, "docs/benchmarks.md is out of date: run `python docs/make_benchmarks_md.py`"


def test_page_and_readme_stay_short() -> None:
    for page in (DOCS / "benchmarks.md", ROOT / "README.md"):
        lines = page.read_text().count("\n")
        assert lines < 250, f"{page.name} has {lines} lines; the goal is under 250 (move detail to docs/)"


def test_every_result_file_has_a_table_and_every_linked_file_exists(generator: ModuleType) -> None:
    page = generator.PAGE.read_text()
    for path in sorted((DOCS / "bench").glob("*.json")):
        assert f"(bench/{path.name})" in page or f"`{path.name}`" in page, f"{path.name} is on no table"
    for target in re.findall(r"\]\((bench/[^)]+)\)", page):
        assert (DOCS / target).exists(), f"docs/benchmarks.md links {target}, which does not exist"


def test_machine_kind_is_read_from_the_record(generator: ModuleType) -> None:
    avx2 = {"avx2": True, "avx512f": False, "amx_tile": False}
    assert generator.machine_kind({"cpu_flags": avx2}) == "cpu-avx2"
    assert generator.machine_kind({"cpu_flags": {**avx2, "avx512f": True}}) == "cpu-avx512"
    assert generator.machine_kind({"cpu_flags": {**avx2, "amx_tile": True}}) == "cpu-avx512"
    assert generator.machine_kind({"cpu_flags": avx2, "gpu": "NVIDIA H200"}) == "gpu"
    line = generator.describe_machine({"cpu": "AMD EPYC", "cpu_count": 2, "cpu_flags": avx2, "torch": "2.13.0"})
    assert line == "AMD EPYC, 2 logical CPUs; flags: avx2; without avx512f, amx_tile; torch 2.13.0"


def test_a_new_result_file_lands_in_its_machine_section_or_is_refused(generator: ModuleType, tmp_path: Path) -> None:
    source = json.loads((DOCS / "bench" / "own-model-predict-cpu.json").read_text())
    source["machine"] = {**source["machine"], "gpu": "NVIDIA H100", "gpu_count": 1, "gpu_driver": "580"}
    (tmp_path / "gpu-run.json").write_text(json.dumps(source))
    page = generator.render("# t\n\n## GPU\n\n<!-- tables gpu -->\n", bench=tmp_path)
    assert "1 x NVIDIA H100 (driver 580)" in page and "[gpu-run.json](bench/gpu-run.json)" in page
    compile_row = next(row for row in source["summary"] if row["config"] == "compile")
    assert f"| compile | {generator._seconds(compile_row['latency_p50_s'])} | " in page
    with pytest.raises(ValueError, match="no '<!-- tables KIND -->' for machine kind"):
        generator.render("# t\n\n<!-- tables cpu-avx2 -->\n", bench=tmp_path)
    del source["machine"]
    (tmp_path / "gpu-run.json").write_text(json.dumps(source))
    with pytest.raises(ValueError, match=r"gpu-run\.json has no machine record"):
        generator.render("# t\n\n<!-- tables gpu -->\n", bench=tmp_path)


def test_the_generator_imports_no_torch() -> None:
    code = (
        "import runpy, sys; g = runpy.run_path(sys.argv[1], run_name='docs'); g['render'](g['TEMPLATE'].read_text());"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(DOCS / "make_benchmarks_md.py")], capture_output=True,
                         text=True, check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "False", (
        "docs/make_benchmarks_md.py imported torch (through lightning_perf.profiling.intervals or .reliability?): "
        "the docs test should stay fast"
    )


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve() -> None:
    for page in (ROOT / "README.md", DOCS / "guide.md", DOCS / "benchmarks.md"):
        for target, fragment in re.findall(r"\]\(((?:docs/)?[\w\-./]*\.md)?(?:#([\w\-]+))?\)", page.read_text()):
            if not target and not fragment:
                continue
            linked = (page.parent / target) if target else page
            assert linked.exists(), f"{page.name} links {target}, which does not exist"
            if fragment:
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)}
                assert fragment in anchors, f"{page.name} links {target}#{fragment}: no such heading"


# A result file named on a page (not a command's `--output`): `docs/bench/x.json` from the repository root,
# `bench/x.json` beside a docs/ page.
_RESULT_FILE = re.compile(
    r"(?<![\w./-])(?<!--output )((?:docs/)?(?:bench|curves)/[\w./-]*[\w-]\.(?:json|md|yaml|png|log|xml))"
)
_PAGES = (ROOT / "README.md", *sorted(DOCS.glob("*.md")))
_FIGURE = re.compile(r"\d(?:\.\d+)?x\b|\bx\d|\d%|\d(?:\.\d+)? (?:ms|s)\b")
_RATIO_WITH_INTERVAL = re.compile(r"\d+\.\d+x \[\d+\.\d+-\d+\.\d+\]")
# Figures of scripts whose output was never committed, kept with this mark until measured again (the machine they
# ran on is shared, so they were not): keep this list short, and add no script without a reason.
_NO_FILE = "no result file; not re-measured"
_NO_FILE_SCRIPTS = tuple(
    f"examples/{name}.py" for name in ("compile_warm_start", "dynamic_int8_warm_start", "powersgd_bandwidth")
)


def _result_path(page: Path, name: str) -> Path:
    return ROOT / name if name.startswith("docs/") else page.parent / name


def test_every_result_file_named_on_a_page_exists() -> None:
    named = set()
    for page in _PAGES:
        for name in _RESULT_FILE.findall(page.read_text()):
            named.add(name)
            assert _result_path(page, name).is_file(), f"{page.name} names {name}, which does not exist"
    assert {"docs/bench/timed-as-training/lm-cpu-avx512.json", "docs/curves/checkpoint-budget-lm-cpu.json"} <= named


def _clauses(cell: str) -> list[str]:
    """A table cell cut at its semicolons outside parentheses and brackets: one claim each."""
    clauses, depth, start = [], 0, 0
    for i, char in enumerate(cell):
        depth += (char in "([") - (char in ")]")
        if char == ";" and depth == 0:
            clauses.append(cell[start:i])
            start = i + 1
    return [*clauses, cell[start:]]


def _last_cell(row: str) -> str:
    return row.strip().rstrip("|").rsplit(" | ", 1)[-1]


def _sources(name: str) -> list[str]:
    """Where a figure from result file NAME may be quoted from: the file, its Markdown sibling, and its table on
    docs/benchmarks.md (intervals recomputed from the raw steps), a disturbed row's ratios marked `?` as the bench
    does."""
    path = ROOT / name
    texts = [p.read_text() for p in dict.fromkeys((path, path.with_suffix(".md"))) if p.is_file()]
    page = (DOCS / "benchmarks.md").read_text()
    caption = page.find(f"(bench/{path.relative_to(DOCS / 'bench')})") if name.startswith("docs/bench/") else -1
    if caption >= 0:
        rows = page[caption:].split("\n\n", 1)[0].splitlines()
        texts += [re.sub(r"(\d+\.\d+x \[)", r"?\1", row) if " | yes |" in row else row for row in rows]
    return texts


def _figure_problems(table: list[str]) -> list[str]:
    """What is wrong with the figures in a table's last column: a claim with a figure that names no result file (one
    named in the column's header covers every row) and carries no allowed mark, a ratio with its interval that is in
    none of its files, a ratio its files mark disturbed (`?1.62x`) and the claim does not."""
    header_files = _RESULT_FILE.findall(_last_cell(table[0]))
    problems = []
    for row in table[2:]:
        for clause in map(str.strip, _clauses(_last_cell(row))):
            if not _FIGURE.search(clause):
                continue
            files = _RESULT_FILE.findall(clause) or header_files
            if not files:
                if _NO_FILE not in clause or not any(script in clause for script in _NO_FILE_SCRIPTS):
                    problems.append(f"names no result file: {clause}")
                continue
            texts = [text for name in files for text in _sources(name)]
            for figure in _RATIO_WITH_INTERVAL.findall(clause):
                holding = [text for text in texts if figure in text]
                if not holding:
                    problems.append(f"{figure} is in none of {files}")
                elif any(f"?{figure}" in text for text in holding) and "disturbed" not in clause:
                    problems.append(f"{figure} is disturbed in {files}, not in: {clause}")
    return problems


def _readme_table(heading: str) -> list[str]:
    section = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("heading", ["Optimizations", "Observers"])
def test_every_figure_in_the_readme_tables_names_its_result_file(heading: str) -> None:
    table = _readme_table(heading)
    assert len(table) > 3
    assert _figure_problems(table) == []


def test_the_figure_rule_flags_a_missing_file_a_wrong_figure_and_a_dropped_disturbed_mark() -> None:
    lm = "([f](docs/bench/timed-as-training/lm-cpu-avx512.json))"
    table = [
        "| name | measured |",
        "|---|---|",
        "| a | lm 1.62x [1.36-1.85] (disturbed) " + lm + "; no figure here |",
        "| b | convnet 2.15x faster |",
        f"| c | lm 1.63x [1.36-1.85] {lm} |",
        f"| d | lm 1.62x [1.36-1.85] {lm} |",
        f"| e | 2.0x (`examples/mine.py`; {_NO_FILE}); 1.9x (`examples/compile_warm_start.py`; {_NO_FILE}) |",
    ]
    problems = _figure_problems(table)
    assert len(problems) == 4, problems
    assert problems[0] == "names no result file: convnet 2.15x faster"
    assert problems[1].startswith("1.63x [1.36-1.85] is in none of")
    assert problems[2].startswith("1.62x [1.36-1.85] is disturbed in")
    assert problems[3] == f"names no result file: 2.0x (`examples/mine.py`; {_NO_FILE})"


def test_a_figure_without_a_file_is_marked_only_beside_an_allowed_script() -> None:
    used = set()
    for page in _PAGES:
        text = page.read_text()
        for mark in re.finditer(re.escape(_NO_FILE), text):
            before = text[max(0, mark.start() - 400) : mark.start()]
            scripts = [script for script in _NO_FILE_SCRIPTS if script in before]
            assert scripts, f"{page.name}: '{_NO_FILE}' at offset {mark.start()} names none of {_NO_FILE_SCRIPTS}"
            used.update(scripts)
    assert used == set(_NO_FILE_SCRIPTS), f"allowed but no longer used (remove): {set(_NO_FILE_SCRIPTS) - used}"
