"""`lightning-perf bench` end to end on the tiny preset, and its argument errors (exit status 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_perf.cli import main


@pytest.fixture(autouse=True)
def _no_real_peak_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real bench below must not spend seconds measuring this machine's matmul peak (tests/profiling/test_flops.py
    # tests that measurement); a fixed figure keeps the MFU column filled.
    import torch

    from lightning_perf.profiling import flops

    def fake(dtype: torch.dtype = torch.float32, *args: object, **kwargs: object) -> flops.PeakFlops:
        return flops.PeakFlops(1e11, f"fake matmul {dtype} (tests)")

    monkeypatch.setattr(flops, "measure_cpu_peak_flops", fake)


def test_bench_writes_measured_json_markdown_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    argv = [
        "bench",
        "--workload",
        "convnet",
        "--preset",
        "tiny",
        "--configs",
        "baseline,bf16-mixed",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--repeats",
        "1",
        "--predict-batches",
        "3",
        "--output",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["schema_version"] >= 1
    summary = {s["config"]: s for s in report["summary"]}
    assert list(summary) == ["baseline", "bf16-mixed"]
    for s in summary.values():
        assert s["runs"] == 1 and s["error"] is None
        assert 0 < s["step_median_s"] < 10
        assert s["throughput"] > 0 and s["predict_throughput"] > 0
        assert s["warmup_s"] > 0 and s["first_forward_s"] > 0
        assert s["peak_memory_bytes"] > 0
    assert summary["baseline"]["speedup"] == pytest.approx(1.0)
    run = report["runs"][1]
    assert len(run["step_times_s"]) == 3  # steady-state steps only, warm-up excluded
    assert summary["bf16-mixed"]["speedup"] == pytest.approx(report["runs"][0]["step_median_s"] / run["step_median_s"])
    bf16 = summary["bf16-mixed"]
    # One repeat: one pair of processes, no interval and no verdict either way (the steps of one process vary together).
    assert bf16["speedup_ci95"] is None and bf16["speedup_verdict"] == "one repeat: no interval"
    assert bf16["speedup_method"] == "one paired repeat: no interval"
    assert bf16["step_times_s"] == [run["step_times_s"]]
    # 3 predict batches, 2 of them warm-up: one timed batch per side and one repeat leave no interval, and say so.
    assert bf16["predict_speedup_ci95"] is None and bf16["predict_speedup_method"] == "one paired repeat: no interval"
    assert bf16["predict_speedup_verdict"] == "one repeat: no interval"
    assert isinstance(report["reliability"]["reliable"], bool) and isinstance(report["reliability"]["causes"], list)
    assert report["machine"]["torch_threads"] >= 1 and "cpu_flags" in report["machine"]
    assert report["run"]["command"].startswith("lightning-perf bench") and report["run"]["end_time"]
    markdown = out.with_suffix(".md").read_text()
    assert (
        "speed-up" in markdown
        and "paired within a repeat" in markdown
        and "lightning-perf bench" in markdown
        and "bf16-mixed" in markdown
    )
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "bf16-mixed" in printed and "wrote" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--configs", "baseline,warp_drive"], "unknown configuration 'warp_drive'"),
        (["bench", "--steps", "0"], "'0' is not valid. Expected an integer >= 1"),
        (["bench", "--workload", "mnist"], "'mnist' is not valid. Expected one of convnet"),
        (["bench", "--device", "tpu"], "'tpu' is not valid. Expected auto, cpu, cuda"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_exit_2_and_say_what_is_valid(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_list_shows_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and "bf16-mixed" in printed
