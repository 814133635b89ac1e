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
