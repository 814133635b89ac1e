"""Utilization in the bench: FLOPs counted once on the untransformed workload, the peak by device and dtype, MFU with
its interval in the summary, the console's MFU column within 80 columns, and an unknown count said, not guessed.

The peak's measurement is never real here (tests/benchmark/conftest.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.benchmark import runner
from lightning_perf.benchmark.report import CONSOLE_COLUMNS, console_rows, markdown_report, reliability_lines
from lightning_perf.benchmark.results import BenchReport, ConfigSummary
from lightning_perf.benchmark.runner import summarize_runs
from lightning_perf.benchmark.spec import BenchSpec, RunSpec
from lightning_perf.benchmark.structure import training_step_flops
from lightning_perf.benchmark.utilization import (
    add_utilization,
    machine_peak,
    mfu_cell,
    step_median_ci95,
    unknown_mfu_lines,
    utilization_markdown,
)
from lightning_perf.benchmark.worker import RunResult, run
from lightning_perf.optimizations import BASELINE
from lightning_perf.profiling import PeakFlops
from tests._models import run_result
from tests.benchmark.conftest import BusyBench

FLOPS = 2_000_000_000


def _run(config: str, repeat: int, step: float, flops: int | None = FLOPS, error: str | None = None) -> RunResult:
    steps = (step * (1 + 0.03 * np.random.default_rng(repeat + 7 * len(config)).standard_normal(10))).tolist()
    counted = repeat == 0  # the bench counts on repeat 0 only
    counts = {"flops_per_step": flops if counted else None, "flops_error": error if counted else None}
    return run_result(config, repeat, steps, throughput=4 / step, **counts)


def _summaries(**kw: Any) -> list[ConfigSummary]:
    return summarize_runs(
        {
            BASELINE: [_run(BASELINE, r, 0.2, **kw) for r in range(3)],
            "channels_last": [_run("channels_last", r, 0.1, **kw) for r in range(3)],
        }
    )


def test_the_summary_row_carries_mfu_from_flops_step_time_and_peak() -> None:
    rows = _summaries()
    asked: list[str] = []

    def peak_of(config: str) -> PeakFlops:
        asked.append(config)
        return PeakFlops(1e11, "given")

    add_utilization(rows, peak_of)
    assert asked == [BASELINE, "channels_last"]
    for row in rows:
        assert row.flops_per_step == FLOPS and row.flops_error is None
        low, high = row.step_median_ci95_s
        assert low <= row.step_median_s <= high and low < high
        assert row.achieved_flops_per_second == pytest.approx(FLOPS / row.step_median_s)
        assert row.mfu == pytest.approx(FLOPS / row.step_median_s / 1e11)
        assert row.mfu_ci95[0] <= row.mfu <= row.mfu_ci95[1]
        assert row.mfu_ci95 == pytest.approx([FLOPS / high / 1e11, FLOPS / low / 1e11])
        assert (row.peak_flops_per_second, row.peak_source, row.peak_causes) == (1e11, "given", [])
    by_name = {row.config: row for row in rows}
    assert by_name["channels_last"].mfu == pytest.approx(2 * by_name[BASELINE].mfu, rel=0.1)  # twice as fast


def test_the_mfu_cell() -> None:
    from types import SimpleNamespace

    def cell(mfu: float | None, disturbed: bool = False, causes: tuple[str, ...] = ()) -> str:
        return mfu_cell(SimpleNamespace(mfu=mfu, disturbed=disturbed, peak_causes=list(causes)))

    assert (cell(0.1234), cell(0.01234), cell(0.0001234), cell(None)) == ("12%", "1.2%", "0.012%", "-")
    assert (cell(0.5, disturbed=True), cell(0.5, causes=("load",)), cell(0.5, True, ("load",))) == ("?50%",) * 3


def test_an_unknown_peak_leaves_mfu_unknown_but_keeps_the_achieved_rate() -> None:
    rows = _summaries()
    add_utilization(rows, lambda config: PeakFlops(None, "unknown: no table entry for 'Some GPU'"))
    for row in rows:
        assert row.achieved_flops_per_second is not None and row.mfu is None and row.mfu_ci95 is None
        assert row.peak_source.startswith("unknown") and mfu_cell(row) == "-"
    assert unknown_mfu_lines(rows) == ["MFU unknown: peak FLOP/s unknown: no table entry for 'Some GPU'"]


def test_a_peak_below_the_achieved_rate_gives_no_mfu_and_says_why() -> None:
    """Seen: bf16-mixed on a CPU without bf16 instructions printed an MFU of 490% against the emulated bf16 matmul
    peak. A utilization above 100% means the peak does not represent the run's kernels: unknown, with the reason."""
    rows = _summaries()
    achieved = FLOPS / rows[1].step_median_s  # channels_last, the faster row
    peak = achieved / 4.9
    add_utilization(rows, lambda config: PeakFlops(peak, "measured matmul 2048^3 bf16"))
    by_name = {row.config: row for row in rows}
    fast, slow = by_name["channels_last"], by_name[BASELINE]
    assert fast.mfu is None and fast.mfu_ci95 is None and mfu_cell(fast) == "-"
    assert fast.achieved_flops_per_second == pytest.approx(achieved)
    assert fast.peak_source.startswith("unknown: the achieved rate is 4.9x the peak (measured matmul 2048^3 bf16)")
    assert slow.mfu is None and slow.peak_source.startswith("unknown: the achieved rate is 2.")
    lines = unknown_mfu_lines(rows)
    assert len(lines) == 2 and all("does not represent this configuration's kernels" in line for line in lines)


def test_a_disturbed_peak_marks_the_mfu_and_warns() -> None:
    rows = _summaries()
    cause = "other processes' load: they kept 1.50 cores busy"
    disturbed = PeakFlops(5e10, "measured matmul 512^3 fp32 (disturbed, not cached)", (cause,))
    add_utilization(rows, lambda config: disturbed)
    assert all(mfu_cell(row).startswith("?") for row in rows)
    report = BenchReport(options={}, command="x", summaries=rows)
    assert reliability_lines(report) == [
        f"warning: peak FLOP/s measured while disturbed by {cause}: the MFU against it is too high (marked ?)"
    ]
    section = "\n".join(utilization_markdown(rows))
    assert f"(disturbed by {cause})" in section and "%] *" in section


def test_the_peak_is_asked_once_per_matmul_setting() -> None:
    results = {name: [_run(name, 0, 0.2)] for name in (BASELINE, "channels_last", "bf16-mixed", "backend_flags")}
    rows = summarize_runs(results)
    asked: list[tuple[str, str, bool]] = []

    def peak(device: str, precision: str, fast_fp32_matmul: bool) -> PeakFlops:
        asked.append((device, precision, fast_fp32_matmul))
        return PeakFlops(1e12, f"given for {precision}")

    add_utilization(rows, runner._peak_lookup(BenchSpec(preset="tiny"), {}, peak))
    assert asked == [("cpu", "32-true", False), ("cpu", "bf16-mixed", False), ("cpu", "32-true", True)]
    assert {row.config: row.peak_source for row in rows}["bf16-mixed"] == "given for bf16-mixed"


def test_the_console_table_with_mfu_fits_80_columns() -> None:
    from lightning_perf.profiling.report import text_table

    results = {
        BASELINE: [_run(BASELINE, r, 0.2) for r in range(2)],
        "channels_last+compile+fused_optimizer": [
            _run("channels_last+compile+fused_optimizer", r, 0.5) for r in range(2)
        ],
        "bf16-mixed": [_run("bf16-mixed", r, 0.05) for r in range(2)],
    }
    rows = summarize_runs(results)
    add_utilization(rows, lambda config: PeakFlops(1e11, "measured", ("other processes' load",)))
    for row in rows:
        row.disturbed = True
        row.likely_cause = "compile warm-up not amortized" if row.config != BASELINE else None
    assert "MFU" in CONSOLE_COLUMNS
    text = text_table(list(CONSOLE_COLUMNS), console_rows(BenchReport(options={}, command="x", summaries=rows)))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "MFU" in text and "(disturbed)" in text
    for row in rows:
        assert mfu_cell(row) in text and mfu_cell(row).startswith("?")


def test_uncountable_flops_leave_mfu_unknown_with_the_reason() -> None:
    rows = _summaries(flops=None, error="RuntimeError: SmallNet is not attached to a `Trainer`.")
    add_utilization(rows, lambda config: pytest.fail("no peak is measured when no FLOPs are known"))
    for row in rows:
        assert row.mfu is None and row.flops_per_step is None and "not attached" in row.flops_error
        assert mfu_cell(row) == "-"
    section = "\n".join(utilization_markdown(rows))
    assert "unknown: RuntimeError: SmallNet is not attached to a `Trainer`." in section


def test_step_median_interval_is_seeded_contains_the_median_and_sees_repeats() -> None:
    rng = np.random.default_rng(0)
    close = [(0.1 * (1 + 0.01 * rng.standard_normal(10))).tolist() for _ in range(3)]
    apart = [[0.1 * (1 + r) * x / 0.1 for x in steps] for r, steps in enumerate(close)]
    point = float(np.median([np.median(s) for s in close]))
    low, high = step_median_ci95(close, point)
    assert low <= point <= high and step_median_ci95(close, point) == [low, high]
    low_apart, high_apart = step_median_ci95(apart, float(np.median([np.median(s) for s in apart])))
    assert high_apart - low_apart > 10 * (high - low)  # repeats 2x and 3x apart widen it, steps alone would not
    assert step_median_ci95([[0.1]], 0.1) is None


# ------------------------------------------------------------------------------------------------------------ peaks


def test_a_cpu_peak_is_measured_once_in_the_runs_dtype_and_cached(_no_real_peak_measurement: list[Any]) -> None:
    first = machine_peak("cpu", "32-true")
    assert first.flops_per_second == 1e11 and not first.source.endswith("(cached)")
    assert machine_peak("cpu", "32-true").source.endswith("(cached)")
    machine_peak("cpu", "bf16-mixed")
    machine_peak("cpu", "32-true", True, cpu_bf16_instructions=True)  # float32 matmuls stay fp32: fp32's (cached)
    machine_peak("cpu", "32-true", True, cpu_bf16_instructions=False)  # no bf16 hardware: fp32 as before
    assert [dtype for dtype, _ in _no_real_peak_measurement] == [torch.float32, torch.bfloat16]
    assert machine_peak("cpu", "transformer-engine").flops_per_second is None


def test_a_gpu_peak_comes_from_the_table_before_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.fabric.utilities.throughput as throughput

    lightning_asked: list[Any] = []
    monkeypatch.setattr(throughput, "get_available_flops", lambda d, t: lightning_asked.append(t) or 123e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert machine_peak("cuda", "bf16-mixed").source == "table: H100 SXM bf16 dense"
    assert machine_peak("cuda", "bf16-mixed").flops_per_second == 989.5e12
    assert machine_peak("cuda", "32-true", True).source == "table: H100 SXM tf32 dense"
    assert lightning_asked == []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A5000")
    peak = machine_peak("cuda", "bf16-mixed")
    assert (peak.flops_per_second, peak.source) == (123e12, "given: Lightning get_available_flops")
    monkeypatch.setattr(throughput, "get_available_flops", lambda d, t: None)
    assert machine_peak("cuda", "bf16-mixed").flops_per_second is None


# ----------------------------------------------------------------------------------------------------------- worker


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 12, generator=generator), torch.randint(0, 3, (32,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=4)


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(12, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("loss", loss)  # warns outside a Trainer: silenced while counting
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _NeedsTrainer(_Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _ = self.trainer.global_step  # fine in a Trainer; raises outside one
        return super().training_step(batch, batch_idx)


class _Manual(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_one_training_step_is_counted_by_hand_formula() -> None:
    count = training_step_flops(_Net(), _Data(), torch.device("cpu"))
    # forward 2*B*in*out, backward weight gradient 2*B*in*out (no input gradient: the batch needs none)
    assert count.total == 2 * (2 * 4 * 12 * 3)
    assert set(count.by_operator) == {"aten.addmm", "aten.mm"}
    with pytest.raises(RuntimeError, match="manual optimization"):
        training_step_flops(_Manual(), _Data(), torch.device("cpu"))


def test_a_model_whose_flops_cannot_be_counted_still_runs_and_says_why() -> None:
    spec = RunSpec(workload="mine", config=BASELINE, steps=2, warmup_steps=1, predict_batches=0, count_flops=True)
    result = run(spec, build=lambda spec: (_NeedsTrainer(), _Data()))
    assert result.ok and result.step_median_s is not None
    assert result.flops_per_step is None and "not attached to a `Trainer`" in result.flops_error
    counted = run(spec, build=lambda spec: (_Net(), _Data()))
    assert counted.flops_per_step == 2 * (2 * 4 * 12 * 3) and counted.flops_error is None
    not_asked = run(replace(spec, count_flops=False), build=lambda spec: (_Net(), _Data()))
    assert not_asked.flops_per_step is None and not_asked.flops_error is None


def test_only_repeat_0_counts() -> None:
    spec = BenchSpec(preset="tiny", repeats=2, device="cpu")
    assert spec.run_spec(BASELINE, 0).count_flops is True
    assert spec.run_spec(BASELINE, 1).count_flops is False


@pytest.mark.slow
def test_a_tiny_bench_counts_equal_flops_for_every_configuration(busy_tiny_bench: BusyBench) -> None:
    """End to end, in worker processes: channels_last transforms the model and its inputs, the count does not see it.

    The bench (baseline and channels_last, 2 steps, one repeat, the peak given) is shared with
    tests/benchmark/test_disturbed_bench.py: busy processes beside it change its verdict, not what this test reads.
    """
    report, asked = busy_tiny_bench.report, busy_tiny_bench.peaks_asked
    assert asked == [("cpu", "32-true", False)]
    runs = {r["spec"]["config"]: r for r in report.runs}
    assert runs[BASELINE]["flops_per_step"] > 0 and runs[BASELINE]["flops_error"] is None
    assert runs[BASELINE]["flops_per_step"] == runs["channels_last"]["flops_per_step"]
    assert runs[BASELINE]["flops_by_operator"] == runs["channels_last"]["flops_by_operator"]
    assert "aten.convolution" in runs[BASELINE]["flops_by_operator"]
    data = report.to_dict()
    for row in data["summary"]:
        assert row["flops_per_step"] == runs[BASELINE]["flops_per_step"]
        assert row["mfu"] == pytest.approx(row["flops_per_step"] / row["step_median_s"] / 1e11)
        assert row["mfu_ci95"][0] <= row["mfu"] <= row["mfu_ci95"][1] and row["peak_source"] == "given (test)"
    markdown = markdown_report(report)
    assert "### Utilization" in markdown and "given (test)" in markdown
