"""Write docs/benchmarks.md from the result files in docs/bench/ and the prose in docs/benchmarks.template.md.

The page shows the present: one section per machine kind (picked from each file's ``machine`` record: CPU with AVX2
only, CPU with AVX-512/AMX, GPU), one table per result file with its command, date, commit and reliability. Older
rounds live in git history. Figures come from the files only:

- files written by the current bench carry their summary (ratios with a 95% interval and a verdict, the disturbed flag,
  the likely cause), computed by ``lightning_perf.benchmark`` when they ran: it is printed as stored;
- files written by the earlier bench hold a median and the min-max of the repeats only, but keep every step time: their
  intervals and verdicts are recomputed here with the bench's own functions (``lightning_perf.profiling.intervals.
  paired_ratio``, paired per repeat as the bench pairs them, and ``lightning_perf.profiling.reliability.assess``, from
  the samples' dispersion only, as those runs recorded no machine load). Neither imports torch.

Template directives (HTML comments, one line each):

- ``<!-- tables KIND -->``: the tables of every result file of that machine kind (``cpu-avx2``, ``cpu-avx512``,
  ``gpu``);
- ``<!-- files A.json, B.json | kind=... | date=... | machine=... | command=... -->``: what a file does not record
  itself (older files have no machine record, date or command); the page says that these come from the template.

    python docs/make_benchmarks_md.py           # rewrite docs/benchmarks.md
    python docs/make_benchmarks_md.py --check   # exit 1 when the page is not what the files and template give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
BENCH = DOCS / "bench"
TEMPLATE = DOCS / "benchmarks.template.md"
PAGE = DOCS / "benchmarks.md"
BASELINE = "baseline"
_DIRECTIVE = re.compile(r"^<!--\s*(tables|files)\s+(.*?)\s*-->\s*$")
_WORKLOAD_ORDER = ("convnet", "unet3d", "vit", "lm")
_AVX512 = ("avx512f", "amx_tile", "amx_bf16", "amx_int8")
_FLAGS_SHOWN = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
_OBSERVERS = {  # examples/observer_overhead.py's configuration keys
    "empty": "an empty `Callback()`",
    "bottleneck": "`BottleneckCallback`",
    "memory": "`MemoryProfilerCallback`",
    "memory-every-step": "`MemoryProfilerCallback` (every step)",
    "simple": "Lightning `SimpleProfiler`",
    "advanced": "Lightning `AdvancedProfiler`",
    "pytorch": "Lightning `PyTorchProfiler`",
}


# ------------------------------------------------------------------------------------------------ reading the files


def machine_kind(machine: dict[str, Any]) -> str:
    """``gpu`` for a run on a GPU, ``cpu-avx512`` for a CPU with AVX-512 or AMX, else ``cpu-avx2``."""
    if machine.get("gpu"):
        return "gpu"
    flags = machine.get("cpu_flags") or {}
    return "cpu-avx512" if any(flags.get(f) for f in _AVX512) else "cpu-avx2"


def describe_machine(machine: dict[str, Any]) -> str:
    """The machine in one line: CPU model, cores, the instruction-set flags that decide kernels, GPU, versions."""
    parts = [machine.get("cpu") or "unknown CPU"]
    if machine.get("cpu_count"):
        parts[0] += f", {machine['cpu_count']} logical CPUs"
    flags = machine.get("cpu_flags") or {}
    if flags:
        have = [f for f in _FLAGS_SHOWN if flags.get(f)]
        lack = [f for f in _FLAGS_SHOWN if f in flags and not flags.get(f)]
        parts.append("flags: " + (", ".join(have) or "none of " + ", ".join(_FLAGS_SHOWN)))
        if lack:
            parts.append("without " + ", ".join(lack))
    if machine.get("gpu"):
        gpu = f"{machine.get('gpu_count', 1)} x {machine['gpu']}"
        parts.append(gpu + (f" (driver {machine['gpu_driver']})" if machine.get("gpu_driver") else ""))
    versions = [f"{k} {machine[k]}" for k in ("torch", "lightning") if machine.get(k)]
    return "; ".join(parts + versions)


def parse_template(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The template's lines, and what the ``files`` directives declare per file name."""
    declared: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = _DIRECTIVE.match(line)
        if match and match.group(1) == "files":
            names, *fields = (part.strip() for part in match.group(2).split(" | "))
            values = dict(field.split("=", 1) for field in fields)
            for name in names.split(","):
                declared[name.strip()] = values
    return text.splitlines(), declared


class Result:
    """One result file: its data, machine kind, machine line, date and command, each with where it came from."""

    def __init__(self, path: Path, declared: dict[str, str] | None) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text())
        declared = declared or {}
        run = self.data.get("run") or {}
        machine = self.data.get("machine") or _gpu_check_machine(self.data)
        if machine:
            self.kind, self.machine = machine_kind(machine), describe_machine(machine)
        elif "kind" in declared:
            self.kind, self.machine = declared["kind"], declared.get("machine", "not recorded")
        else:
            raise ValueError(f"{path.name} has no machine record: declare its kind in {TEMPLATE.name}")
        self.date = (run.get("start_time") or "")[:10] or declared.get("date", "not recorded")
        self.command = run.get("command") or self.data.get("command") or declared.get("command", "")
        commit = run.get("git_commit")
        self.commit = f"{commit[:7]}{' (dirty)' if run.get('git_dirty') in (True, 'True') else ''}" if commit else ""
        self.from_template = machine is None

    @property
    def format(self) -> str:
        if "runs" in self.data and "summary" in self.data:
            return "bench"
        if self.data.get("kind") == "lightning-perf-autotune":
            return "autotune"
        if "sections" in self.data and "environment" in self.data:
            return "gpu-check"
        if "results" in self.data and "arguments" in self.data:
            return "observers"
        if "recipe" in self.data and "latency" in self.data:
            return "quantized"
        raise ValueError(f"{self.path.name}: not a result format this page knows")

    @property
    def workload(self) -> str:
        options = self.data.get("options") or {}
        return str(options.get("workload") or self.data.get("source") or self.path.stem)

    def sort_key(self) -> tuple[Any, ...]:
        name = self.workload
        order = _WORKLOAD_ORDER.index(name) if name in _WORKLOAD_ORDER else len(_WORKLOAD_ORDER)
        stage = (self.data.get("options") or {}).get("stage") or "fit"
        return (self.format != "bench", order, name, stage != "fit", self.path.name)


def _gpu_check_machine(data: dict[str, Any]) -> dict[str, Any] | None:
    """``scripts/gpu_check.py``'s environment record in the bench's ``machine`` shape (GPU, driver, versions)."""
    env = data.get("environment") if "sections" in data else None
    if not isinstance(env, dict):
        return None
    gpu = env.get("gpu")
    cpu = f"host CPU not recorded; CUDA {env.get('torch_cuda')}, compute capability {env.get('capability')}"
    return {"cpu": cpu if gpu else "no CUDA device", "gpu": gpu, "gpu_count": 1, "gpu_driver": env.get("driver"),
            "torch": env.get("torch"), "lightning": env.get("lightning")}  # fmt: skip


# ---------------------------------------------------------------------------------- older files: recompute summaries


def recompute_summary(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Ratios with intervals, verdicts and disturbed flags for a file written before the bench computed them.

    Pairs repeat ``i`` of each configuration with baseline's repeat ``i``, as the bench's ``summarize_runs`` does, and
    judges dispersion with the bench's ``assess`` (no machine load was recorded by those runs).
    """
    from lightning_perf.profiling.intervals import paired_ratio
    from lightning_perf.profiling.reliability import assess

    by_config: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        if run.get("ok"):
            by_config.setdefault(run["spec"]["config"], []).append(run)
    baseline = {r["spec"]["repeat"]: r for r in by_config.get(BASELINE, [])}
    rows, samples = [], {}
    for stored in data["summary"]:
        name, row = stored["config"], dict(stored)
        runs = sorted(by_config.get(name, []), key=lambda r: r["spec"]["repeat"])
        steps = [r["step_times_s"] for r in runs if r.get("step_times_s")]
        if steps:
            samples[name] = steps
        paired = [(baseline[r["spec"]["repeat"]], r) for r in runs if r["spec"]["repeat"] in baseline]
        for key in [k for k in row if k.startswith(("speedup", "memory_ratio", "predict_speedup"))]:
            row.pop(key)  # the earlier summary's median-of-repeats figures: replaced below
        if name == BASELINE:
            row["speedup"] = 1.0
        elif pairs := [(b["step_times_s"], r["step_times_s"]) for b, r in paired if b["step_times_s"]]:
            row.update(paired_ratio([b for b, _ in pairs], [r for _, r in pairs]).to_dict("speedup"))
            memory = [(float(r["step_memory_bytes"]), float(b["step_memory_bytes"])) for b, r in paired
                      if r.get("step_memory_bytes") and b.get("step_memory_bytes")]  # fmt: skip
            if memory:
                estimate = paired_ratio([m for m, _ in memory], [m for _, m in memory], above_one="more memory",
                                        below_one="less memory")  # fmt: skip
                row.update(estimate.to_dict("memory_ratio"))
        rows.append(row)
    reliability = assess([], samples, cores_used=1, cpu_count=2)
    for row in rows:
        own = row["config"] in reliability.disturbed_configs
        via_baseline = row["config"] != BASELINE and BASELINE in reliability.disturbed_configs
        row["disturbed"] = own or via_baseline
    return rows, list(reliability.causes)


# ------------------------------------------------------------------------------------------------------------ tables


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.2f} s"
    ms = value * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _ratio(row: dict[str, Any], name: str) -> str:
    value = row.get(name)
    if value is None:
        return "-"
    interval = row.get(f"{name}_ci95")
    return f"{value:.2f}x" + (f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else "")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    keep = [i for i in range(len(header)) if i < 2 or any(row[i] not in ("", "-") for row in rows if len(row) > 2)]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    for row in rows:
        cells = [row[i] for i in keep] if len(row) > 2 else [*row, *([""] * (len(keep) - 2))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bench_table(result: Result) -> tuple[list[str], str]:
    """The rows of a bench file and the reliability line."""
    data = result.data
    if data.get("reliability") is None:
        rows, causes = recompute_summary(data)
        judged = "from the samples' dispersion: no machine load recorded"
    else:
        rows, causes = data["summary"], list(data["reliability"].get("causes") or [])
        judged = "watched by the bench"
    inference = (data.get("options") or {}).get("stage", "fit") != "fit"
    if inference:
        header = ["configuration", "p50 latency", "p50 speed-up [95% CI]", "verdict", "peak memory [95% CI]"]
    else:
        header = ["configuration", "step (median)", "speed-up [95% CI]", "verdict", "step memory [95% CI]"]
        header += ["predict speed-up [95% CI]", "cold first step"]
    header += ["disturbed", "likely cause"]
    cells = []
    for row in rows:
        name = row["config"]
        if row.get("skipped") or (row.get("error") and not row.get("runs")):
            cells.append([name, f"not run: {row.get('skipped') or row.get('error')}"])
            continue
        if inference:
            speed = "latency_p50_speedup" if "latency_p50_speedup" in row else "speedup"
            figures = [_seconds(row.get("latency_p50_s") or row.get("step_median_s")), _ratio(row, speed)]
            figures += [_verdict(row, speed), _ratio(row, "peak_memory_ratio")]
        else:
            figures = [_seconds(row.get("step_median_s")), _ratio(row, "speedup"), _verdict(row, "speedup")]
            figures += [_ratio(row, "memory_ratio"), _ratio(row, "predict_speedup"), _seconds(row.get("first_step_s"))]
        disturbed = "yes" if row.get("disturbed") else "no"
        cells.append([name, *figures, disturbed, row.get("likely_cause") or ""])
    state = f"**disturbed** ({judged}): " + "; ".join(causes) if causes else f"nothing disturbed the run ({judged})"
    return _table(header, cells), state.rstrip(".")


def _verdict(row: dict[str, Any], name: str) -> str:
    return "reference" if row["config"] == BASELINE else row.get(f"{name}_verdict") or "-"


def autotune_table(results: Sequence[Result]) -> list[str]:
    cells = []
    for r in results:
        rec = r.data.get("recommendation") or {}
        stack = " + ".join(rec.get("configs") or []) or "nothing"
        if rec.get("batch_size"):
            stack += f", batch {rec['batch_size']}"
        trials = r.data.get("trials") or []
        measured = sum(1 for t in trials if t.get("step_median_s"))
        speed = f"{rec['speedup']:.2f}x" if rec.get("speedup") else "-"
        cells.append([f"`{r.path.name}`", r.data.get("source", ""), f"{r.data.get('elapsed_s', 0):.0f} s",
                      f"{measured} / {len(trials)}", stack, speed])  # fmt: skip
    header = ["file", "model", "tuning time", "trials measured / listed", "recommendation", "tuner's ratio"]
    return _table(header, cells)


def observers_table(result: Result) -> list[str]:
    """One row per step size and configuration: step time, ratio to no observer with its interval, self-report.

    Reads both result formats of examples/observer_overhead.py: the current one (``step_mean_s``: each fit's mean
    step, ``self_minus_outside_pp``) and the earlier one (``step_median_s`` only)."""
    cells, mean = [], False
    for size, configs in result.data["results"].items():
        for name, e in configs.items():
            low, high = e.get("ratio_to_none_ci95") or (None, None)
            own = sorted(e.get("self_reported_share") or [])
            end = sorted(e.get("end_of_fit_extra_s") or [])
            mean = mean or "step_mean_s" in e
            gap = e.get("self_minus_outside_pp")
            d = 4 if "step_mean_s" in e else 3  # digits
            aa = name == "none" and low is not None and low != high  # toggle design: the A/A check
            cells.append([
                f"{size}: {_OBSERVERS.get(name, name)}" + (" (A/A: nothing switched)" if aa else ""),
                _seconds(e.get("step_mean_s", e.get("step_median_s"))),
                f"{e['ratio_to_none']:.{d}f}x [{low:.{d}f}-{high:.{d}f}]" if name != "none" or aa else "-",
                f"{own[len(own) // 2]:.2%} ({own[0]:.2%}-{own[-1]:.2%})" if own else "",
                f"{gap:+.2f} pp" if gap is not None else "",
                _seconds(end[len(end) // 2]) if end and name != "none" else "",
            ])  # fmt: skip
    header = ["steps: configuration", "mean step" if mean else "median step", "ratio to none [95%]",
              "self-report (median; range)", "self - outside", "end of fit"]  # fmt: skip
    return _table(header, cells)


def quantized_table(result: Result) -> list[str]:
    data, cells = result.data, []
    for row in data.get("latency") or []:
        cells.append([f"latency, batch {row['batch_size']}", _seconds(row.get("float_median_s")),
                      _seconds(row.get("quantized_median_s")), f"{row['speedup']:.2f}x faster"])  # fmt: skip
    v = data.get("validation") or {}
    if v:
        gap = f"gap {v.get('accuracy_gap_pp', 0):+.2f} pp"
        cells.append([f"accuracy ({v.get('samples')} samples)", f"{v.get('reference_accuracy', 0):.2%}",
                      f"{v.get('quantized_accuracy', 0):.2%}", gap])  # fmt: skip
        cells.append(["agreement with the fake-quantized model", "", f"top-1 {v.get('top1_agreement', 0):.0%}",
                      f"cosine {v.get('cosine', 0):.5f}"])  # fmt: skip
    recipe = data.get("recipe") or {}
    return _table(["", "fp32", f"int8 ({recipe.get('mode', '?')}, {recipe.get('backend', '?')})", "ratio"], cells)


def gpu_check_line(result: Result) -> str:
    """One call of the GPU check in one line: its file, command and date, then each section that ran and how."""
    ran = []
    for section in result.data["sections"]:
        if section["status"] != "skipped":
            detail = " ".join(str(section.get("detail", "")).split())[:200]
            ran.append(f"`{section['name']}` **{section['status']}** ({section['seconds']:.0f} s of "
                       f"{section['box_s']:.0f} s: {detail})")  # fmt: skip
    head = f"- GPU check [{result.path.name}](bench/{result.path.name}) · `{result.command}` · {result.date}"
    return f"{head}: {'; '.join(ran) or 'no section ran'}"


def caption(result: Result, what: str, state: str = "") -> str:
    """One line above a table: what it is, the command, the date, the commit, the file and the reliability."""
    parts = [f"**{what}**", f"`{result.command}`" if result.command else "command not recorded", result.date]
    if result.commit:
        parts.append(f"commit {result.commit}")
    parts.append(f"[{result.path.name}](bench/{result.path.name})")
    return " · ".join(parts + ([state] if state else []))


def render_section(results: Sequence[Result]) -> list[str]:
    """The tables of one machine kind, grouped by workload."""
    if not results:
        return []
    lines: list[str] = []
    machines = sorted({(r.from_template, r.machine) for r in results})
    for from_template, machine in machines:
        files = [f"`{r.path.name}`" for r in results if r.machine == machine]
        if from_template:
            lines.append(f"- {', '.join(files)}: {machine} (not recorded in the files; from the page's template)")
        elif len(machines) > 1:
            lines.append(f"- {'every other file' if len(files) > 3 else ', '.join(files)}: {machine} (from the files)")
        else:
            lines.append(f"- Every file: {machine} (from the files' `machine` record)")
    tuned = [r for r in results if r.format == "autotune"]
    checks = [r for r in results if r.format == "gpu-check"]
    if checks:
        lines += [gpu_check_line(r) for r in sorted(checks, key=lambda r: r.path.name)]  # below the machine lines
    for r in sorted((r for r in results if r.format not in ("autotune", "gpu-check")), key=Result.sort_key):
        if r.format == "bench":
            stage = (r.data.get("options") or {}).get("stage") or "fit"
            table, state = bench_table(r)
            lines += ["", caption(r, f"{r.workload}, {'training' if stage == 'fit' else stage}", state), *table]
        elif r.format == "observers":
            lines += ["", caption(r, "observers' own cost (short: tiny MLP; long: convnet, CPU)"), *observers_table(r)]
        else:
            model = str((r.data.get("metadata") or {}).get("model_class", "model")).rsplit(".", 1)[-1]
            lines += ["", caption(r, f"{model}: the quantized int8 model against fp32"), *quantized_table(r)]
    if tuned:
        command = tuned[0].command or "command not recorded"
        dates = sorted({r.date for r in tuned})
        lines += ["", f"**auto-tuner** · `{command}` · {', '.join(dates)}", *autotune_table(tuned)]
    return lines


# -------------------------------------------------------------------------------------------------------------- page


def render(template: str, bench: Path = BENCH) -> str:
    """The page: the template with each ``tables`` directive replaced by that machine kind's tables."""
    lines, declared = parse_template(template)
    results = [Result(p, declared.get(p.name)) for p in sorted(bench.glob("*.json"))]
    placed = {m.group(2) for line in lines if (m := _DIRECTIVE.match(line)) and m.group(1) == "tables"}
    unplaced = sorted({r.kind for r in results} - placed)
    if unplaced:
        raise ValueError(f"{TEMPLATE.name} has no '<!-- tables KIND -->' for machine kind(s) {unplaced}")
    out: list[str] = []
    for line in lines:
        match = _DIRECTIVE.match(line)
        if match is None:
            out.append(line)
        elif match.group(1) == "tables":
            out += render_section([r for r in results if r.kind == match.group(2)])
    text = "\n".join(out).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    parser.add_argument("--output", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    page = render(TEMPLATE.read_text())
    if args.check:
        if not args.output.exists() or args.output.read_text() != page:
            print(f"{args.output} is out of date: run python docs/make_benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(page)
    print(f"wrote {args.output} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
