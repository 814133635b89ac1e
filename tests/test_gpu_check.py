"""scripts/gpu_check.sh: the plan on a CPU and on CUDA, time boxes, result classification, files written.

The real check runs on a GPU machine (minutes); here its parts run on small inputs: a dry run, a bench section stopped
by a one-second box, and the readers of pytest's and the bench's reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
CONFIGS = [
    "baseline",
    "bf16-mixed",
    "bf16-true",
    "channels_last",
    "flash_attention",
    "fused_optimizer",
    "backend_flags",
]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def known_configs(gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's configuration names without starting a Python to read them (seconds each)."""
    monkeypatch.setattr(gpu_check, "bench_config_names", lambda python, env: list(CONFIGS))


def test_the_wrapper_finds_a_python_with_torch_and_answers_help() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "OUTDIR" in proc.stdout.upper() and "--dry-run" in proc.stdout and "--sections" in proc.stdout


@pytest.mark.usefixtures("known_configs")
def test_dry_run_on_cpu_names_the_cuda_sections_it_skips_and_writes_nothing(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main([str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    skipped = "gpu-tests, bench-lm-compiled, cuda-matrix, bench-convnet-predict, bench-lm-regional"
    assert f"CUDA sections skipped (no CUDA device): {skipped}" in out
    assert "--preset tiny --device cpu" in out  # the bench's command line, checked on the CPU
    assert out.rstrip().splitlines()[-1] == "RESULT: OK"


@pytest.mark.usefixtures("known_configs")
def test_the_cuda_plan_runs_the_matrix_on_cuda_and_the_gpu_presets_with_their_stack(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main([str(tmp_path), "--dry-run", "--assume-cuda"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert " -m gpu tests " in lines["gpu-tests"]
    assert "--device cuda tests/test_generic.py tests/test_trust.py" in lines["cuda-matrix"]
    stack = "bf16-mixed+flash_attention+fused_optimizer+backend_flags"
    # compile_regional and fp8 join only when the bench has them (not in this list of names).
    assert "--preset gpu --device cuda" in lines["bench-lm-fit"]
    assert f"--configs baseline,bf16-mixed,{stack} " in lines["bench-lm-fit"]
    assert "--stage predict" in lines["bench-convnet-predict"]
    assert "--configs baseline,bf16-true,bf16-true+channels_last " in lines["bench-convnet-predict"]
    assert "SKIPPED" in lines["bench-lm-compiled"] and "neither compile nor fp8" in lines["bench-lm-compiled"]
    assert "SKIPPED" in lines["bench-lm-regional"] and "no compile_regional" in lines["bench-lm-regional"]


def test_compiled_configurations_run_apart_when_the_bench_has_them(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    known = [*CONFIGS, "compile", "compile_regional", "fp8"]
    monkeypatch.setattr(gpu_check, "bench_config_names", lambda python, env: known)
    sections = "bench-lm-compiled,bench-lm-regional"
    assert gpu_check.main([str(tmp_path), "--dry-run", "--assume-cuda", "--sections", sections]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    stack = "bf16-mixed+flash_attention+fused_optimizer+backend_flags"
    # fp8's goal is against bf16 + compile: both in one bench, so the ratio between them comes from one run.
    assert "--configs baseline,bf16-mixed+compile,fp8 " in lines["bench-lm-compiled"]
    assert f"--configs baseline,{stack}+compile_regional " in lines["bench-lm-regional"]
    assert "compile" not in lines["bench-lm-fit"]  # a timed-out compile never costs the plain figures


@pytest.mark.usefixtures("known_configs")
def test_a_section_past_its_time_box_is_stopped_and_the_files_stay_few(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bench section with a box of about a second: stopped, reported as timed out, and the summary is printed last.
    assert gpu_check.main([str(tmp_path), "--sections", "bench-lm-fit", "--box-scale", "0.01"]) == 1
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1] == "RESULT: FAILED: bench-lm-fit"
    assert any("bench-lm-fit" in line and "TIMED OUT" in line for line in out)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= gpu_check.MAX_FILES
    assert {"gpu_check.log", "junit.xml", "gpu_check.json", "gpu_check.md"} <= set(files)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["sections"]}
    assert statuses["bench-lm-fit"] == "timed out"
    assert statuses["gpu-tests"] == statuses["cuda-matrix"] == "skipped"
    assert "time box" in (tmp_path / "gpu_check.log").read_text()


def test_the_time_box_ends_the_whole_process_group(gpu_check: ModuleType, tmp_path: Path) -> None:
    # pytest-xdist workers are grandchildren: the box must end them too, not only the process it started.
    marker = tmp_path / "grandchild.pid"
    code = textwrap.dedent(
        f"""
        import signal, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])  # hangs until ended
        open({str(marker)!r}, "w").write(str(child.pid))
        signal.pause()
        """
    )
    with (tmp_path / "log").open("w") as log:
        rc, timed_out, seconds = gpu_check.run_boxed([sys.executable, "-c", code], 2, log, dict(os.environ))
    assert timed_out and rc in (124, 137) and seconds < 30
    pid = int(marker.read_text())
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:  # gone, or a zombie waiting for its (ended) parent
            assert stat.read().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        pass


def _junit(path: Path, cases: str, tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> Path:
    path.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="{errors}" '
        f'skipped="{skipped}">{cases}</testsuite></testsuites>'
    )
    return path


def test_pytest_results_are_read_from_junit(gpu_check: ModuleType, tmp_path: Path) -> None:
    ok = _junit(tmp_path / "ok.xml", '<testcase classname="t" name="a"/>', tests=3, skipped=1)
    counts = {"tests": 3, "failures": 0, "errors": 0, "skipped": 1}
    assert gpu_check.pytest_result(0, False, ok) == ("passed", "2 passed, 0 failed, 0 errors, 1 skipped", counts)
    failing = (
        '<testcase classname="tests.test_trust" name="x[PowerSGD]"><failure message="RuntimeError: boom&#10;more"/>'
    )
    bad = _junit(tmp_path / "bad.xml", failing + "</testcase>", tests=4, failures=1)
    status, detail, _ = gpu_check.pytest_result(1, False, bad)
    assert status == "failed" and "3 passed, 1 failed" in detail
    assert "tests.test_trust::x[PowerSGD]: RuntimeError: boom" in detail and "more" not in detail
    assert gpu_check.pytest_result(124, True, tmp_path / "none.xml")[:2] == (
        "timed out",
        "stopped by its time box (no JUnit report)",
    )
    assert gpu_check.pytest_result(5, False, ok)[:2] == ("skipped", "no tests collected")


def test_bench_results_name_each_configuration(gpu_check: ModuleType, tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    rows: list[dict[str, object]] = [
        {"config": "baseline", "speedup": 1.0, "step_median_s": 0.2},
        {"config": "bf16-mixed", "speedup": 2.39, "step_median_s": 0.08},
        {"config": "bf16-mixed+fp8", "speedup": None, "skipped": "needs torchao: pip install torchao"},
    ]
    report.write_text(json.dumps({"summary": rows}))
    status, detail, configs = gpu_check.bench_result(0, False, report)
    assert status == "passed"
    assert detail == "baseline: 1.00x; bf16-mixed: 2.39x; bf16-mixed+fp8: needs torchao: pip install torchao"
    assert [c["config"] for c in configs] == ["baseline", "bf16-mixed", "bf16-mixed+fp8"]
    rows[1]["error"] = "CUDA out of memory"
    report.write_text(json.dumps({"summary": rows}))
    assert gpu_check.bench_result(0, False, report)[0] == "failed"
    assert gpu_check.bench_result(1, False, tmp_path / "missing.json")[:2] == (
        "failed",
        "rc 1: no report written (see gpu_check.log)",
    )


def test_bad_arguments_are_refused(gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["out", "--sections", "gpu-tests,benchmark"])
    assert exit_info.value.code == 2
    assert "--sections 'gpu-tests,benchmark': unknown benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["out", "--assume-cuda"])


def test_pytest_stopped_by_its_box_still_reports_the_tests_that_ran(gpu_check: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "test_box.py").write_text(
        "import signal\n\ndef test_quick():\n    pass\n\ndef test_hangs():\n    signal.pause()\n"
    )
    junit = tmp_path / "box.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, f"--junitxml={junit}"]
    with (tmp_path / "log").open("w") as log:
        rc, timed_out, _ = gpu_check.run_boxed([*cmd, str(tmp_path / "test_box.py")], 8, log, dict(os.environ), "INT")
    status, detail, counts = gpu_check.pytest_result(rc, timed_out, junit)
    assert (status, counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]) == ("timed out", 1)
    assert detail.startswith("stopped by its time box (1 passed")
