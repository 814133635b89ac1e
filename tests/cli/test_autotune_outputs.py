"""``lightning-perf autotune`` never overwrites a file silently and names every file it wrote; a disturbed reference
prints "unreliable" and no figure. Scripted trials: the CLI's plumbing is tested, not this machine's speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_perf.cli import main
from lightning_perf.tuning.conditions import TrialWatch
from tests.tuning._scripted import script_trials, scripted_result

ARGS = ["autotune", "--workload", "convnet", "--preset", "tiny", "--precisions", "", "--optimizations", ""]
ARGS += ["--no-batch-size", "--no-data-loading", "--quiet"]


def _written(out: str) -> list[str]:
    return [line.removeprefix("wrote ") for line in out.splitlines() if line.startswith("wrote ")]


def test_a_second_run_is_numbered_and_force_overwrites(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8)})
    output = tmp_path / "tuned.yaml"
    assert main([*ARGS, "--output", str(output)]) == 0
    first = capsys.readouterr().out
    assert _written(first) == [str(output), str(output.with_suffix(".json"))]
    assert main([*ARGS, "--output", str(output)]) == 0
    second = capsys.readouterr().out
    numbered = tmp_path / "tuned-2.yaml"
    assert "this run is numbered (tuned-2.yaml; --force overwrites)" in second
    assert _written(second) == [str(numbered), str(numbered.with_suffix(".json"))]
    output.write_text("edited")
    assert main([*ARGS, "--output", str(output), "--force"]) == 0
    assert _written(capsys.readouterr().out) == [str(output), str(output.with_suffix(".json"))]
    assert output.read_text().startswith("# lightning-perf autotune")
    assert not (tmp_path / "tuned-3.yaml").exists()


def test_a_disturbed_reference_says_unreliable_and_prints_no_figure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = {
        "baseline": scripted_result(0.100, 8),
        "baseline (repeat)": scripted_result(0.278, 8),
        "baseline (again)": scripted_result(0.600, 8),
    }  # a third run agrees with neither
    script_trials(monkeypatch, script)  # fmt: skip
    monkeypatch.setattr(TrialWatch, "causes", lambda self, token, label, steps: [])
    output = tmp_path / "tuned.yaml"
    assert main([*ARGS, "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "Recommended: nothing: unreliable: the two baseline runs of the unchanged model differ 2.78x" in out
    assert "the baseline's throughput" not in out
    report = json.loads(output.with_suffix(".json").read_text())
    assert report["reliability"]["reliable"] is False and report["recommendation"]["speedup"] is None
