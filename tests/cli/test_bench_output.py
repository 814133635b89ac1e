"""What `lightning-perf bench` tells its reader: the default choice and what it left out, one plain line per run when
piped, warnings for a disturbed run, files never overwritten silently and every one announced.

The measurement itself is replaced by synthetic results (the real one runs in tests/test_cli.py and
tests/benchmark/test_disturbed_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_perf.benchmark import runner
from lightning_perf.benchmark.results import BenchReport, RunEvent
from lightning_perf.benchmark.spec import BenchSpec
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.cli import main
from tests._models import run_result


def _result(config: str, repeat: int, step: float, flops_error: str | None = None) -> RunResult:
    steps = (step * (1 + 0.02 * np.random.default_rng(repeat).standard_normal(8))).tolist()
    return run_result(config, repeat, steps, throughput=4 / step, flops_error=flops_error)


@pytest.fixture
def fake_bench(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``run_benchmark`` replaced: it reports each planned run as the real one does and returns synthetic figures."""
    seen: dict[str, Any] = {"reliability": {"reliable": True, "causes": []}}

    def run_benchmark(options: BenchSpec, progress: Any = None, command: Any = None, **kw: Any):
        seen["options"], seen["left_out"] = options, list(options.left_out)
        results: dict[str, list[RunResult]] = {name: [] for name in options.configs}
        repeats = options.repeats or 3  # --repeats auto: three rounds here
        total, done = repeats * len(options.configs), 0
        for repeat in range(repeats):
            for i, name in enumerate(options.configs):
                results[name].append(_result(name, repeat, 0.1 * (1 + i), seen.get("flops_error")))
                done += 1
                if kw.get("on_run") is not None:
                    kw["on_run"](RunEvent(name, repeat, repeats, done, total, 0.1, done, total - done, "ok"))
        return BenchReport(
            options={"workload": options.workload, "preset": options.preset, "device": options.device,
                     "repeats": options.repeats, "steps": options.steps, "warmup_steps": options.warmup_steps},
            command=command,
            summaries=runner.summarize_runs(results),
            reliability=seen["reliability"],
            left_out=[{"config": n, "reason": r} for n, r in options.left_out],
        )  # fmt: skip

    monkeypatch.setattr(runner, "run_benchmark", run_benchmark)
    monkeypatch.setattr(
        "lightning_perf.benchmark.configs.device_capabilities",
        lambda device: {"cpu": True, "cuda": False, "fast_bf16": False},
    )
    return seen


def test_no_arguments_choose_by_capability_and_structure_and_say_what_was_left_out(
    fake_bench: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench"]) == 0
    options = fake_bench["options"]
    # the convnet's convolutions: channels_last; the device: no bf16; compile_regional (its repeated blocks, in 6
    # shapes: each compiled apart) only from a 400 s budget on a CPU
    assert list(options.configs) == ["baseline", "channels_last", "fused_optimizer"]
    assert (options.steps, options.warmup_steps, options.repeats, options.preset) == (15, 3, None, "default")
    assert (options.target, options.time_budget_s) == (0.05, 150.0)  # --repeats auto by default
    printed = capsys.readouterr().out
    assert "bf16-mixed: left out on CPU because this CPU has no bf16 instructions" in printed
    assert "compile: left out because ConvNetModule has 6 repeated BasicBlock blocks" in " ".join(printed.split())
    assert "flash_attention: left out because ConvNetModule has no attention module" in " ".join(printed.split())
    why = (
        "compile_regional: left out on CPU within a 150 s budget: ConvNetModule's 6 BasicBlock blocks come in 6 shapes"
    )
    assert why in " ".join(printed.split())
    assert all(len(line) <= 80 for line in printed.splitlines() if not line.startswith(("[", "wrote ")))
    assert "bf16 would be emulated" in printed
    # piped: one plain line per finished run, no progress bar
    lines = [line for line in printed.splitlines() if line.startswith("[")]
    assert len(lines) == 9 and lines[0].startswith("[1/9] baseline repeat 1/3: step 100.0 ms, elapsed")
    assert "about" in lines[0] and "left" in lines[0]
    written = [line.removeprefix("wrote ") for line in printed.splitlines() if line.startswith("wrote ")]
    assert written[:2] == [str(Path("bench-results/convnet.json")), str(Path("bench-results/convnet.md"))]
    assert all((tmp_path / path).exists() for path in written)
    data = json.loads((tmp_path / "bench-results/convnet.json").read_text())
    assert data["left_out"][0]["config"] == "bf16-mixed"
    assert "MFU" in printed  # the console table's utilization column
    assert main(["bench", "--time-budget", "400"]) == 0
    assert list(fake_bench["options"].configs) == ["baseline", "channels_last", "compile_regional", "fused_optimizer"]


def test_an_unknown_mfu_says_why(
    fake_bench: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_bench["flops_error"] = "RuntimeError: manual optimization: training_step runs its own backward"
    out = tmp_path / "r.json"
    assert main(["bench", "--configs", "baseline,channels_last", "--repeats", "1", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("MFU unknown: FLOPs per step not counted (RuntimeError: manual optimization") == 1
    data = json.loads(out.read_text())
    assert all(row["mfu"] is None and "manual optimization" in row["flops_error"] for row in data["summary"])
    assert "unknown: RuntimeError: manual optimization" in out.with_suffix(".md").read_text()


def test_an_existing_report_is_never_overwritten_silently(
    fake_bench: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "--configs", "baseline,channels_last", "--repeats", "1", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    first = out.read_text()
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == first
    assert f"wrote {tmp_path / 'r-2.json'}" in printed and f"wrote {tmp_path / 'r-2.md'}" in printed
    assert "exists: this run is numbered (--force overwrites)" in printed
    assert main([*argv, "--force"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and not (tmp_path / "r-3.json").exists()


def test_a_disturbed_run_prints_a_warning_per_cause_and_marks_its_figures(
    fake_bench: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    causes = ["other processes' load: they kept 1.80 cores busy", "dispersion of baseline: medians 40% apart"]
    fake_bench["reliability"] = {"reliable": False, "causes": causes}
    out = tmp_path / "r.json"
    assert main(["bench", "--configs", "baseline,channels_last", "--repeats", "2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    flat = " ".join(printed.split())  # warnings are wrapped to 80 columns
    for cause in causes:
        assert f"warning: measurement disturbed by {cause}" in flat
    assert "Reliability: disturbed" in out.with_suffix(".md").read_text()
