"""``lightning-perf compare``: exit 0 without a regression, 1 with one, 2 (one line) for anything it cannot compare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_perf.cli import main
from lightning_perf.cli.compare import percentage
from tests.benchmark._compare_files import bench_results, pytest_benchmark_results, scaled, write


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    data = bench_results()
    broken = tmp_path / "broken.json"
    broken.write_text("{oops", encoding="utf-8")
    return {
        "old": write(tmp_path / "old.json", data),
        "doubled": write(tmp_path / "doubled.json", scaled(data, 2.0, configs=("channels_last",))),
        "other_workload": write(tmp_path / "lm.json", bench_results(workload="lm")),
        "other_batch": write(tmp_path / "b64.json", bench_results(batch_size=64)),
        "other_device": write(tmp_path / "cuda.json", bench_results(device="cuda")),
        "other_cpu": write(tmp_path / "cpu.json", bench_results(cpu="Other CPU")),
        "pytest": write(tmp_path / "pb.json", pytest_benchmark_results()),
        "pytest_slow": write(tmp_path / "pb2.json", pytest_benchmark_results({"test_steps[baseline]": 0.02}, seed=3)),
        "broken": broken,
        "autotune": write(tmp_path / "autotune.json", {"kind": "lightning-perf-autotune", "trials": []}),
        "dir": tmp_path,
    }


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    try:
        code = main(["compare", *map(str, argv)])
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_file_against_itself_exits_0(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, files["old"], files["old"])
    assert code == 0, err
    assert "no regression beyond 5% and the noise" in out
    assert "slower" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_doubled_step_times_exit_1_naming_the_configuration(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, files["old"], files["doubled"])
    assert code == 1
    assert "REGRESSION beyond 5% and the noise: channels_last (step time +100%" in out
    assert "baseline (" not in out.split("REGRESSION", 1)[1]


def test_a_larger_threshold_lets_the_regression_pass(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, files["old"], files["doubled"], "--threshold", "150%")
    assert code == 0
    assert "no regression beyond 150% and the noise" in out


def test_pytest_benchmark_pair(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, files["pytest"], files["pytest"])[0] == 0
    code, out, _ = _run(capsys, files["pytest"], files["pytest_slow"])
    assert code == 0  # one process a side: no verdict, said so
    assert "one repeat: no interval between processes, no verdict" in out.replace("\n  ", " ")
    assert "only in old: my-model/test_steps[channels_last]" in out


@pytest.mark.parametrize("suffix", [".json", ".md"])
def test_output_file_is_written_and_announced_never_overwritten_silently(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    target = tmp_path / f"report{suffix}"
    code, out, _ = _run(capsys, files["old"], files["doubled"], "--output", target)
    assert code == 1
    assert f"wrote {target}" in out
    text = target.read_text(encoding="utf-8")
    if suffix == ".json":
        report = json.loads(text)
        assert report["kind"] == "lightning-perf-compare" and report["threshold"] == 0.05
        assert "channels_last: step time" in report["regressions"]
    else:
        assert "| channels_last | step time |" in text
    code, _, err = _run(capsys, files["old"], files["old"], "--output", target)
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert target.read_text(encoding="utf-8") == text
    assert _run(capsys, files["old"], files["old"], "--output", target, "--force")[0] == 0
    assert target.read_text(encoding="utf-8") != text


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0%", 0.0), ("2.5%", 0.025), (" 10% ", 0.1), ("150%", 1.5)])
def test_threshold_is_a_percentage_with_its_sign(text: str, value: float) -> None:
    assert percentage(text) == pytest.approx(value)


BAD = [
    (["{old}"], "NEW.json"),  # one file only
    ([], "OLD.json"),
    (["{old}", "{missing}"], "missing"),
    (["{dir}", "{old}"], "directory"),
    (["{old}", "{old}", "--threshold", "5"], "'5'"),
    (["{old}", "{old}", "--threshold", "0.05"], "'0.05'"),
    (["{old}", "{old}", "--threshold=-5%"], "'-5%'"),
    (["{old}", "{old}", "--threshold", "-5%"], "--threshold"),  # argparse reads -5% as an option
    (["{old}", "{old}", "--threshold", "nan%"], "'nan%'"),
    (["{old}", "{old}", "--threshold", "inf%"], "'inf%'"),
    (["{old}", "{old}", "--threshold", "five%"], "'five%'"),
    (["{old}", "{old}", "--threshold", "%"], "'%'"),
    (["{old}", "{old}", "--thresh", "5%"], "--thresh"),  # no abbreviation
    (["{old}", "{old}", "--output", "report.txt"], "report.txt"),
    (["{old}", "{old}", "--output", "{dir}"], "--output"),
    (["{old}", "{old}", "--output", "{missing_dir}/r.json"], "existing directory"),
    (["{old}", "{broken}"], "is not valid JSON"),
    (["{old}", "{autotune}"], "lightning-perf-autotune"),
    (["{old}", "{other_workload}"], "different workload (old 'convnet', new 'lm')"),
    (["{old}", "{other_batch}"], "different batch size (old 32, new 64)"),
    (["{old}", "{other_device}"], "different device (old 'cpu', new 'cuda')"),
    (["{old}", "{other_cpu}"], "different machine: CPU"),
    (["{old}", "{pytest}"], "pytest-benchmark"),
    (["{old}", "{old}", "--bogus"], "--bogus"),
]


@pytest.mark.parametrize(("argv", "named"), BAD, ids=[" ".join(a) or "none" for a, _ in BAD])
def test_bad_invocations_exit_2_with_one_line(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    paths = {key: str(path) for key, path in files.items()} | {
        "missing": str(tmp_path / "missing.json"),
        "missing_dir": str(tmp_path / "no-such-dir"),
    }
    code, out, err = _run(capsys, *(arg.format(**paths) for arg in argv))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(("lightning-perf compare: error:", "lightning-perf: error: unrecognized arguments"))
    assert named in lines[0]
    assert "Traceback" not in err and out == ""


def test_the_header_is_whole_within_80_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / ("a-long-folder-name-" * 4) / "bench-results"
    deep.mkdir(parents=True)
    old = write(deep / "convnet-main-branch.json", bench_results())
    code, out, err = _run(capsys, old, old)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "..." not in out and "…" not in out
    header = "".join(line.strip() for line in lines[: next(i for i, line in enumerate(lines) if not line.strip())])
    assert str(old).replace(" ", "") in header.replace(" ", "")  # every character of the path, wrapped, not cut
