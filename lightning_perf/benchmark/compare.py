"""Compare two result files, old and new: which configurations got slower, beyond the threshold and the noise.

Reads the bench's results JSON (``lightning-perf bench --output``; the older files in ``docs/bench/`` too) and
pytest-benchmark's ``--benchmark-json`` output. Files are parsed as JSON and nothing else: no pickle, no code.

What is compared, per configuration (matched by name) and per figure both files have:

==============  =====================================================================  ==============
figure          a repeat's figure                                                      better
==============  =====================================================================  ==============
step time       the median of its steady-state steps (``runs[].step_times_s``;         lower
                older files: ``step_median_s``)
throughput      ``runs[].throughput`` (samples/s)                                      higher
step memory     ``runs[].step_memory_bytes``                                           lower
predict time    the median of its predict batches (``runs[].predict_step_times_s``)    lower
time            pytest-benchmark: the median of its rounds (``stats.data``, saved      lower
                with ``--benchmark-save-data``; without it only the median exists)
==============  =====================================================================  ==============

The two files are independent runs, each repeat its own process: the change is new/old of the geometric means of
the per-repeat figures with Welch's t interval on their logarithms
(:func:`lightning_perf.profiling.intervals.unpaired_ratio`), so the variation between processes counts at every
number of repeats. With one repeat on a side (a pytest-benchmark file, a summary without runs) there is no interval
and no verdict: a bootstrap over that process's steps is kept as an indicative figure, labelled as such.

Two files measured on different things are refused (:class:`IncompatibleResultsError`): a different kind of file,
workload, stage (``--stage``: fit or an inference stage), workload size (preset), batch size, device, precision, or
machine (CPU model, core count, GPU) when both files record it.

An inference stage's file (``--stage predict``) is compared on its per-batch latency, as predict time (every timed
batch of every repeat). A ``--batch-sizes`` file (``kind: lightning-perf-bench-sweep``) is compared per
configuration and batch size, its entries named ``config @ batch N``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_perf._validation import check_number, is_number
from lightning_perf.profiling.intervals import NO_CLEAR_DIFFERENCE, paired_ratio, unpaired_ratio
from lightning_perf.profiling.stats import median_of_repeats

__all__ = [
    "BENCH_KIND",
    "DEFAULT_THRESHOLD",
    "METHOD",
    "METRICS",
    "PYTEST_BENCHMARK_KIND",
    "FileComparison",
    "IncompatibleResultsError",
    "Metric",
    "MetricRow",
    "ResultFile",
    "ResultsFileError",
    "check_compatible",
    "compare_files",
    "compare_results",
    "load_results",
]

BENCH_KIND = "lightning-perf-bench"
SWEEP_KIND = "lightning-perf-bench-sweep"  # `bench --batch-sizes`: one bench report per batch size
PYTEST_BENCHMARK_KIND = "pytest-benchmark"
MAX_FILE_BYTES = 512 * 2**20  # a results file is a few MB at most; refuse to read something else whole
DEFAULT_THRESHOLD = 0.05
"""The smallest change worth a verdict (5%), as a fraction."""
METHOD = (
    "change: new/old of the geometric means of the per-repeat figures (each repeat a process); 95% interval: Welch t "
    "on their logarithms (the variation between processes counts); verdict: the interval excludes no change and the "
    "change is beyond the threshold; one repeat on a side: no interval, no verdict"
)
ONE_REPEAT = "one repeat: no interval between processes, no verdict; (in brackets) within one process, indicative"
FASTER, SLOWER = "faster", "slower"
UNIT_SUFFIX = {"s": "_s", "bytes": "_bytes", "samples/s": "_samples_per_s"}
"""The suffix of a figure's keys in the JSON rows, per unit (``old_median_s``)."""


class ResultsFileError(ValueError):
    """A results file that cannot be read: missing, not JSON, or not the JSON of a known kind. One-line message."""


class IncompatibleResultsError(ValueError):
    """Two results files measured on different things (the message names what differs, old and new)."""


@dataclass(frozen=True)
class Metric:
    """A figure that can be compared: ``key`` in the samples, ``label`` printed, ``unit`` and its direction."""

    key: str
    label: str
    unit: str  # "s", "samples/s" or "bytes"
    higher_is_better: bool = False
    speed: bool = True  # a time or a speed: its "slower" verdict is a regression (memory is reported, not gated)


STEP_TIME = Metric("step_time", "step time", "s")
THROUGHPUT = Metric("throughput", "throughput", "samples/s", higher_is_better=True)
STEP_MEMORY = Metric("step_memory", "step memory", "bytes", speed=False)
PREDICT_TIME = Metric("predict_time", "predict time", "s")
ROUND_TIME = Metric("time", "time", "s")
METRICS: tuple[Metric, ...] = (STEP_TIME, THROUGHPUT, STEP_MEMORY, PREDICT_TIME, ROUND_TIME)
"""Every figure, in the order rows are printed."""

# Memory is not a speed: its verdict is worded as a size.
_MEMORY_WORDS = {SLOWER: "more memory", FASTER: "less memory", NO_CLEAR_DIFFERENCE: NO_CLEAR_DIFFERENCE}


@dataclass
class Entry:
    """One configuration (bench) or one benchmark (pytest-benchmark) of a file: its samples per metric key."""

    name: str
    repeats: dict[str, list[list[float]]] = field(default_factory=dict)  # metric key -> per repeat: steps or [figure]
    stats_only: dict[str, float] = field(default_factory=dict)  # metric key -> median, when no samples were saved
    status: str | None = None  # "skipped: ..." or "failed: ..." when nothing was measured


@dataclass
class ResultFile:
    """A loaded results file: what it measured (``identity``), where (``machine``) and its entries by name."""

    path: str
    kind: str
    entries: dict[str, Entry]
    identity: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    warnings: list[str] = field(default_factory=list)
    disturbed: set[str] = field(default_factory=set)  # configurations whose runs the bench found disturbed


@dataclass
class MetricRow:
    """One configuration's one figure, old against new (JSON keys follow the results conventions)."""

    config: str
    metric: str
    unit: str
    old_median: float | None
    new_median: float | None
    n_old: int  # repeats
    n_new: int
    ratio: float | None = None  # new / old
    ratio_ci95: tuple[float, float] | None = None  # between processes: >= 2 repeats a side
    within_process_ci95: tuple[float, float] | None = None  # one repeat: indicative only
    verdict: str = NO_CLEAR_DIFFERENCE
    regression: bool = False
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        suffix = UNIT_SUFFIX[self.unit]
        data[f"old_median{suffix}"], data[f"new_median{suffix}"] = data.pop("old_median"), data.pop("new_median")
        return data


@dataclass
class FileComparison:
    """The comparison of two results files."""

    old: ResultFile
    new: ResultFile
    threshold: float
    rows: list[MetricRow] = field(default_factory=list)
    only_in_old: list[str] = field(default_factory=list)
    only_in_new: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[MetricRow]:
        """Rows slower beyond the threshold and the noise."""
        return [row for row in self.rows if row.regression]

    def to_dict(self) -> dict[str, Any]:
        sides = (("old", self.old), ("new", self.new))
        return {
            "kind": "lightning-perf-compare",
            **{side: {"path": f.path, "kind": f.kind, "description": f.description} for side, f in sides},
            "threshold": self.threshold,
            "method": METHOD,
            "rows": [row.to_dict() for row in self.rows],
            "regressions": [f"{row.config}: {row.metric}" for row in self.regressions],
            "only_in_old": self.only_in_old,
            "only_in_new": self.only_in_new,
            "notes": [*self.old.warnings, *self.new.warnings, *self.notes],
        }


# ------------------------------------------------------------------------------------------------------- loading


def _fail(path: str, message: str) -> ResultsFileError:
    return ResultsFileError(f"{path}: {message}")


def _read_json(path: str | Path) -> Any:
    name = str(path)
    file = Path(path)
    if not file.is_file():
        raise _fail(name, "is a directory, not a results file" if file.is_dir() else "no such file")
    try:
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            raise _fail(name, f"is {size} bytes, too large for a results file (at most {MAX_FILE_BYTES})")
        text = file.read_bytes().decode("utf-8")
    except OSError as exc:
        raise _fail(name, f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise _fail(name, "is not text (expected a JSON results file)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(name, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise _fail(name, "is not a results file (JSON nested too deeply)") from None


def load_results(path: str | Path) -> ResultFile:
    """Load a bench results file or a pytest-benchmark JSON file.

    Raises:
        ResultsFileError: if the file is missing, unreadable, not JSON, or not a results file of a known kind (the
            message starts with the path and says which).
    """
    name = str(path)
    data = _read_json(path)
    if not isinstance(data, dict):
        raise _fail(name, f"is a JSON {type(data).__name__}, not a results file (expected a JSON object)")
    if data.get("kind") == BENCH_KIND or ("summary" in data and "options" in data):
        return _load_bench(name, data)
    if data.get("kind") == SWEEP_KIND:
        return _load_sweep(name, data)
    if isinstance(data.get("benchmarks"), list):
        return _load_pytest_benchmark(name, data)
    kind = data.get("kind")
    what = f"of kind {kind!r}" if isinstance(kind, str) else "of an unknown kind"
    raise _fail(
        name,
        f"is a JSON file {what}, not a results file "
        f"(expected the output of `lightning-perf bench --output` or `pytest --benchmark-json`)",
    )


def _numbers(value: Any, where: str, path: str) -> list[float]:
    """Finite positive numbers from a number or a (nested) list of them; ``None`` and empty give []."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise _fail(path, f"{where} is {value!r}, not a number")
    if isinstance(value, (int, float)):
        return [float(value)] if math.isfinite(value) and value > 0 else []
    if isinstance(value, list):
        out: list[float] = []
        for i, item in enumerate(value):
            out.extend(_numbers(item, f"{where}[{i}]", path))
        return out
    raise _fail(path, f"{where} is a JSON {type(value).__name__}, not a number or a list of numbers")


def _expect(value: Any, where: str, path: str, kind: type = dict) -> Any:
    """``value`` when it is a JSON object (``kind`` list: a list); ``None`` gives an empty one."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        expected = "a list" if kind is list else "an object"
        raise _fail(path, f"{where} is a JSON {type(value).__name__}, expected {expected}")
    return value


def _first(mapping: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if mapping.get(key) is not None:
            return mapping[key]
    return None


def _machine(*sources: Mapping[str, Any]) -> dict[str, Any]:
    """The machine's identity (CPU model, core count, GPU) from the first source that records each."""
    wanted = {
        "CPU": ("cpu_model", "cpu", "brand_raw", "processor"),
        "CPU cores": ("cpu_count", "count"),
        "GPU": ("gpu_name", "gpu", "cuda_device"),
    }
    out: dict[str, Any] = {}
    for label, keys in wanted.items():
        for source in sources:
            value = _first(source, *keys)
            if isinstance(value, dict):  # e.g. {"cpu": {"model": ...}}
                value = _first(value, "model", "name", "brand_raw")
            if isinstance(value, (str, int)) and not isinstance(value, bool) and value != "":
                out[label] = value
                break
    return out


def _run_description(run: Mapping[str, Any], environment: Mapping[str, Any]) -> list[str]:
    parts = []
    git_entry = run.get("git")
    git: Mapping[str, Any] = git_entry if isinstance(git_entry, dict) else {}
    commit = _first(run, "git_commit", "commit") or _first(git, "commit", "sha")
    if isinstance(commit, str) and commit:
        dirty = _first(run, "git_dirty", "dirty") or _first(git, "dirty")
        parts.append(f"commit {commit[:10]}{' (dirty)' if dirty is True else ''}")
    version = _first(run, "lightning_perf") or environment.get("lightning_perf")
    if isinstance(version, str):
        parts.append(f"lightning_perf {version}")
    started = _first(run, "start", "start_time", "started")
    if isinstance(started, str):
        parts.append(f"started {started}")
    return parts


def _load_bench(path: str, data: Mapping[str, Any]) -> ResultFile:
    options = _expect(data.get("options"), "options", path)
    environment = _expect(data.get("environment"), "environment", path)
    machine = _expect(data.get("machine"), "machine", path)
    run = _expect(data.get("run"), "run", path)
    summary = _expect(data.get("summary"), "summary", path, list)
    runs = _expect(data.get("runs"), "runs", path, list)
    entries: dict[str, Entry] = {}
    stage = str(options.get("stage") or "fit")  # files before --stage measured training
    inference = stage != "fit"
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    batch_sizes: set[int] = set()
    for i, item in enumerate(runs):
        record = _expect(item, f"runs[{i}]", path)
        spec = _expect(record.get("spec"), f"runs[{i}].spec", path)
        config = spec.get("config")
        if not isinstance(config, str):
            raise _fail(path, f"runs[{i}].spec.config is {config!r}, expected a configuration name")
        by_config.setdefault(config, []).append(record)
        if record.get("ok", True) and isinstance(record.get("batch_size"), int):
            batch_sizes.add(record["batch_size"])
    for i, item in enumerate(summary):
        row = _expect(item, f"summary[{i}]", path)
        config = row.get("config")
        if not isinstance(config, str):
            raise _fail(path, f"summary[{i}].config is {config!r}, expected a configuration name")
        entries[config] = _bench_entry(path, config, row, by_config.get(config, []), inference)
    for config, records in by_config.items():  # runs of a configuration missing from the summary
        if config not in entries:
            entries[config] = _bench_entry(path, config, {}, records, inference)
    batch = next(iter(batch_sizes)) if len(batch_sizes) == 1 else options.get("batch_size")
    identity = {key: options.get(key) for key in ("workload", "preset", "device", "precision")}
    identity |= {"batch size": batch, "stage": stage}
    warnings = []
    reliability = data.get("reliability")
    if isinstance(reliability, dict) and reliability.get("reliable") is False:
        causes = reliability.get("causes")
        because = "; ".join(str(c) for c in causes) if isinstance(causes, list) and causes else "no cause recorded"
        warnings.append(f"{path}: this run was disturbed ({because}); its figures may not be comparable")
    disturbed = reliability.get("disturbed_configs") if isinstance(reliability, dict) else None
    parts = [f"{identity['workload']}", f"{identity['device']}", *_run_description(run, environment)]
    return ResultFile(
        path=path,
        kind=BENCH_KIND,
        entries=entries,
        identity=identity,
        machine=_machine(machine, environment),
        description=", ".join(str(p) for p in parts if p and p != "None"),
        warnings=warnings,
        disturbed={c for c in disturbed if isinstance(c, str)} if isinstance(disturbed, list) else set(),
    )


def _load_sweep(path: str, data: Mapping[str, Any]) -> ResultFile:
    """A ``--batch-sizes`` file: every size's configurations, named ``config @ batch N``."""
    reports = _expect(data.get("by_batch_size"), "by_batch_size", path, list)
    if not reports:
        raise _fail(path, "by_batch_size is empty, expected one bench report per batch size")
    files = []
    for i, item in enumerate(reports):
        report = _expect(item, f"by_batch_size[{i}]", path)
        files.append((report.get("batch_size"), _load_bench(path, report)))
    merged = files[0][1]
    merged.entries = {
        f"{name} @ batch {size}": entry for size, loaded in files for name, entry in loaded.entries.items()
    }
    for entry_name, entry in merged.entries.items():
        entry.name = entry_name
    merged.identity["batch size"] = None  # each entry names its own
    merged.warnings = [w for _, loaded in files for w in loaded.warnings]
    merged.disturbed = {f"{c} @ batch {size}" for size, loaded in files for c in loaded.disturbed}
    return merged


def _bench_entry(
    path: str, config: str, row: Mapping[str, Any], records: list[Mapping[str, Any]], inference: bool = False
) -> Entry:
    entry = Entry(config)
    ok = [r for r in records if r.get("ok", True) is True and not r.get("skipped")]
    where = f"runs of {config!r}"
    step: list[list[float]] = []
    step_medians: list[float] = []
    predict: list[list[float]] = []
    predict_medians: list[float] = []
    throughput: list[float] = []
    memory: list[float] = []
    for record in ok:
        step.append(_numbers(record.get("step_times_s"), f"{where}: step_times_s", path))
        old_stats = _expect(record.get("step_s"), f"{where}: step_s", path)  # the older files' Stats dict
        step_medians += _numbers(_first(record, "step_median_s") or old_stats.get("median"), where, path)
        predict.append(_numbers(record.get("predict_step_times_s"), f"{where}: predict_step_times_s", path))
        old_predict = _expect(record.get("predict_step_s"), f"{where}: predict_step_s", path)
        predict_medians += _numbers(_first(record, "predict_step_median_s") or old_predict.get("median"), where, path)
        throughput += _numbers(record.get("throughput"), f"{where}: throughput", path)
        memory += _numbers(record.get("step_memory_bytes"), f"{where}: step_memory_bytes", path)
    if not records:  # no runs: the summary's figures (one value each), or per-repeat samples it may hold
        step = _per_repeat(row.get("step_times_s"), f"summary {config!r}: step_times_s", path)
        predict = _per_repeat(row.get("predict_step_times_s"), f"summary {config!r}: predict_step_times_s", path)
        step_medians = _numbers(row.get("step_median_s"), f"summary {config!r}: step_median_s", path)
        throughput = _numbers(row.get("throughput"), f"summary {config!r}: throughput", path)
        memory = _numbers(row.get("step_memory_bytes"), f"summary {config!r}: step_memory_bytes", path)
    if inference:  # an inference stage's "step" is the per-batch latency: compared once, as predict time
        step, step_medians, throughput = [], [], []
    for metric, groups, figures in (
        (STEP_TIME, step, step_medians),  # older files: one median per repeat, no steps
        (PREDICT_TIME, predict, predict_medians),
        (THROUGHPUT, [], throughput),
        (STEP_MEMORY, [], memory),
    ):
        repeats = [group for group in groups if group] or [[value] for value in figures]
        if repeats:
            entry.repeats[metric.key] = repeats
    if not entry.repeats:
        skipped = row.get("skipped") or next((r.get("skipped") for r in records if r.get("skipped")), None)
        error = row.get("error") or next((r.get("error") for r in records if r.get("error")), None)
        entry.status = f"skipped: {skipped}" if skipped else f"failed: {error}" if error else "no measurement"
    return entry


def _per_repeat(raw: Any, where: str, path: str) -> list[list[float]]:
    """A summary's ``[[...] per repeat]`` samples as groups (a flat list is one group)."""
    parts = raw if isinstance(raw, list) and raw and all(isinstance(r, list) for r in raw) else [raw]
    return [_numbers(part, where, path) for part in parts]


def _load_pytest_benchmark(path: str, data: Mapping[str, Any]) -> ResultFile:
    machine_info = _expect(data.get("machine_info"), "machine_info", path)
    cpu = _expect(machine_info.get("cpu"), "machine_info.cpu", path)
    commit = _expect(data.get("commit_info"), "commit_info", path)
    entries: dict[str, Entry] = {}
    names: list[tuple[str, str]] = []
    for i, item in enumerate(_expect(data.get("benchmarks"), "benchmarks", path, list)):
        bench = _expect(item, f"benchmarks[{i}]", path)
        name, fullname = bench.get("name"), bench.get("fullname")
        if not isinstance(name, str) or not name:
            raise _fail(path, f"benchmarks[{i}].name is {name!r}, expected a benchmark name")
        group = bench.get("group")
        key = f"{group}/{name}" if isinstance(group, str) and group else name
        names.append((key, fullname if isinstance(fullname, str) else key))
        stats = _expect(bench.get("stats"), f"benchmarks[{i}].stats", path)
        entry = Entry(key)
        where = f"benchmarks[{i}].stats"
        data_points = _numbers(stats.get("data") if "data" in stats else bench.get("data"), f"{where}.data", path)
        if data_points:
            entry.repeats[ROUND_TIME.key] = [data_points]  # every round in one process: one repeat
        else:
            value = stats.get("median")
            if not is_number(value) or value <= 0:
                raise _fail(path, f"{where}.median is {value!r}, expected a positive number")
            entry.stats_only[ROUND_TIME.key] = float(value)
        if key in entries:
            raise _fail(path, f"holds two benchmarks named {key!r}")
        entries[key] = entry
    parts = []
    if isinstance(commit.get("id"), str):
        parts.append(f"commit {commit['id'][:10]}{' (dirty)' if commit.get('dirty') is True else ''}")
    if isinstance(data.get("datetime"), str):
        parts.append(f"at {data['datetime']}")
    return ResultFile(
        path=path,
        kind=PYTEST_BENCHMARK_KIND,
        entries=entries,
        identity={},
        machine=_machine(cpu, machine_info),
        description=", ".join(["pytest-benchmark", *parts]),
    )


# ----------------------------------------------------------------------------------------------------- comparing


def check_compatible(old: ResultFile, new: ResultFile) -> None:
    """Refuse two files that measured different things.

    Raises:
        IncompatibleResultsError: naming each difference with the old and new value, e.g.
            ``different workload (old 'convnet', new 'lm')``.
    """
    if old.kind != new.kind:
        raise IncompatibleResultsError(f"cannot compare a {old.kind} file with a {new.kind} file")
    differences = []
    for label in old.identity.keys() | new.identity.keys():
        a, b = old.identity.get(label), new.identity.get(label)
        if a is not None and b is not None and a != b:
            differences.append(f"different {label} (old {a!r}, new {b!r})")
    for label in ("CPU", "CPU cores", "GPU"):
        a, b = old.machine.get(label), new.machine.get(label)
        if a is not None and b is not None and a != b:
            differences.append(f"different machine: {label} (old {a!r}, new {b!r})")
    if differences:
        order = ["workload", "stage", "preset", "batch size", "device", "precision", "machine"]
        differences.sort(key=lambda d: next((i for i, k in enumerate(order) if d.startswith(f"different {k}")), 9))
        raise IncompatibleResultsError("cannot compare: " + "; ".join(differences))


def compare_results(old: ResultFile, new: ResultFile, threshold: float = DEFAULT_THRESHOLD) -> FileComparison:
    """Compare two loaded files (checked with :func:`check_compatible` first).

    Args:
        old: the reference.
        new: the candidate.
        threshold: the smallest change worth a verdict, a fraction >= 0 (0.05 is 5%).
    """
    threshold = check_number("compare_results", "threshold", threshold)
    check_compatible(old, new)
    result = FileComparison(old=old, new=new, threshold=threshold)
    result.only_in_old = [name for name in old.entries if name not in new.entries]
    result.only_in_new = [name for name in new.entries if name not in old.entries]
    for name, before in old.entries.items():
        after = new.entries.get(name)
        if after is None:
            continue
        if before.status or after.status:
            side = "old" if before.status else "new"
            result.notes.append(f"{name}: not compared, {side} file: {before.status or after.status}")
            continue
        compared = False
        sides = [side for side, file in (("old", old), ("new", new)) if name in file.disturbed]
        for metric in METRICS:
            row = _compare_metric(name, metric, before, after, threshold)
            if row is not None:
                if sides:
                    row.note = f"disturbed in the {' and '.join(sides)} run: read with care"
                result.rows.append(row)
                compared = True
        if not compared:
            result.notes.append(f"{name}: no figure measured in both files")
    return result


def compare_files(old_path: str | Path, new_path: str | Path, threshold: float = DEFAULT_THRESHOLD) -> FileComparison:
    """Load two results files and compare them (:func:`load_results`, :func:`compare_results`).

    Raises:
        ResultsFileError: if a file cannot be read.
        IncompatibleResultsError: if they measured different things.
    """
    return compare_results(load_results(old_path), load_results(new_path), threshold)


def _compare_metric(name: str, metric: Metric, old: Entry, new: Entry, threshold: float) -> MetricRow | None:
    a, b = old.repeats.get(metric.key, []), new.repeats.get(metric.key, [])
    # The bench's own figure, the median of the per-repeat medians, so a file gives the same number in both commands.
    old_median = median_of_repeats(a) if a else old.stats_only.get(metric.key)
    new_median = median_of_repeats(b) if b else new.stats_only.get(metric.key)
    if old_median is None or new_median is None:
        return None
    row = MetricRow(name, metric.label, metric.unit, old_median, new_median, len(a) or 1, len(b) or 1)
    row.ratio = new_median / old_median
    if not (a and b):
        row.note = "statistics only (no raw samples; pytest --benchmark-save-data keeps them): no interval"
    elif min(len(a), len(b)) >= 2:
        above, below = (FASTER, SLOWER) if metric.higher_is_better else (SLOWER, FASTER)
        found = unpaired_ratio(b, a, above_one=above, below_one=below, threshold=threshold)
        row.ratio, row.ratio_ci95, row.verdict = found.ratio, (found.low, found.high), found.verdict
    else:
        pooled = paired_ratio([[v for r in b for v in r]], [[v for r in a for v in r]])
        row.ratio, row.note = pooled.ratio, ONE_REPEAT
        row.within_process_ci95 = (pooled.low, pooled.high) if pooled.has_interval else None
    row.regression = metric.speed and row.verdict == SLOWER
    if not metric.speed:
        row.verdict = _MEMORY_WORDS[row.verdict]
    return row
