"""Recompute the intervals, verdicts and dispersion flags of result files written by the earlier bench.

The first results in docs/bench/ were written before the bench reported intervals: their summaries hold a median
ratio with the min-max of the repeats. Their raw per-repeat step times (`runs[].step_times_s`) are kept, so the
current bench's own summary code (`lightning_perf.benchmark.runner.summarize_runs`) and reliability judgement
(`lightning_perf.profiling.reliability.assess`, here from the samples' dispersion only: those runs recorded no
machine load) can be applied to them unchanged. Prints one Markdown table per file.

    python docs/reanalyze_bench.py docs/bench/convnet-cpu.json docs/bench/lm-cpu.json ...
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from lightning_perf.benchmark.runner import mark_disturbed, summarize_runs
from lightning_perf.benchmark.worker import RunResult
from lightning_perf.profiling.reliability import assess

_RENAMED = {"step_s": "step_median_s", "predict_step_s": "predict_step_median_s"}
_FIELDS = {f.name for f in dataclasses.fields(RunResult)}


def _result(run: dict) -> RunResult:
    values = {}
    for key, value in run.items():
        key = _RENAMED.get(key, key)
        if isinstance(value, dict) and key != "spec":  # the old stats dicts: keep the median
            value = value.get("median")
        if key in _FIELDS:
            values[key] = value
    return RunResult(**values)


def _ratio(summary: object, name: str) -> str:
    value = getattr(summary, name, None)
    if value is None:
        return "-"
    interval = getattr(summary, f"{name}_ci95", None)
    text = f"{value:.2f}x"
    if interval:
        text += f" [{interval[0]:.2f}-{interval[1]:.2f}]"
    return text


def table(path: Path) -> str:
    data = json.loads(path.read_text())
    results: dict[str, list[RunResult]] = {}
    for run in data["runs"]:
        results.setdefault(run["spec"]["config"], []).append(_result(run))
    summaries = summarize_runs(results)
    samples = {s.config: s.step_times_s for s in summaries if s.step_times_s}
    reliability = assess([], samples, cores_used=1, cpu_count=2)
    mark_disturbed(summaries, reliability, [])
    lines = [
        f"`{path}` ({data['summary'][0].get('runs', '?')} repeats; recomputed by `python docs/reanalyze_bench.py`)",
        "",
        "| configuration | step (median) | speed-up [95% CI] | verdict | step memory | predict speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        mark = " (disturbed)" if getattr(s, "disturbed", False) else ""
        verdict = "baseline" if s.config == "baseline" else (s.speedup_verdict or "-")
        step = f"{s.step_median_s * 1e3:.0f} ms" if s.step_median_s else "-"
        lines.append(
            f"| {s.config}{mark} | {step} | {_ratio(s, 'speedup') if s.config != 'baseline' else '1.00x'} | "
            f"{verdict} | {_ratio(s, 'memory_ratio')} | {_ratio(s, 'predict_speedup')} |"
        )
    if not reliability.reliable:
        lines += ["", *(f"- not reliable: {cause}" for cause in reliability.causes)]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(table(Path(name)))
        print()
