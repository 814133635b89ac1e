"""`lightning-perf bench --tasks` and `--ref`: one bench per task and ref, failures reported while the others go on,
git refs compared as `lightning-perf compare` compares, worktrees removed whatever happens.

The bench subprocess is replaced by a fake that writes a results file (its step times scaled by a constant of the
user's project, imported the way the bench would import it); one test runs the real bench on a tiny workload."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_perf.benchmark import task_session as _tasks
from lightning_perf.benchmark.task_session import BenchCall, BenchOutcome
from lightning_perf.cli import main
from tests.benchmark.test_refs import make_project, worktrees

HEADER = "name,config,configs,steps,batch_size,workload"


def _results(call: BenchCall, factor: float) -> dict[str, Any]:
    runs, summary = [], []
    for config, step in (("baseline", 0.010), ("channels_last", 0.008)):
        for repeat in range(3):
            noise = 1 + 0.01 * np.random.default_rng(repeat + 10 * len(config)).standard_normal(12)
            steps = (step * factor * noise).tolist()
            runs.append(
                {
                    "spec": {"config": config, "repeat": repeat},
                    "ok": True,
                    "batch_size": 4,
                    "step_times_s": steps,
                    "step_median_s": float(np.median(steps)),
                    "throughput": 4 / float(np.median(steps)),
                    "step_memory_bytes": 1000,
                }
            )
        first = config == "baseline"
        summary.append(
            {
                "config": config,
                "step_median_s": step * factor,
                "speedup": 1.0 if first else 1.25,
                "speedup_ci95": None if first else [1.2, 1.3],
                "speedup_verdict": None if first else "faster",
                "error": None,
            }
        )
    options = {"workload": "convnet", "preset": "tiny", "device": "cpu", "precision": "32-true", "stage": "fit"}
    return {"kind": "lightning-perf-bench", "options": options, "summary": summary, "runs": runs}


class FakeBench:
    """Stands in for ``run_bench_subprocess``: records each call and writes a results file at ``--output``."""

    def __init__(self, fail: tuple[str, ...] = (), import_factor: bool = False, interrupt: bool = False) -> None:
        self.fail, self.import_factor, self.interrupt = fail, import_factor, interrupt
        self.calls: list[BenchCall] = []
        self.factors: list[str] = []

    def __call__(self, call: BenchCall) -> BenchOutcome:
        self.calls.append(call)
        assert call.argv[call.argv.index("--output") + 1] == str(call.output) and "--quiet" in call.argv
        if self.interrupt:
            raise KeyboardInterrupt
        if call.task in self.fail or call.label.split()[0] in self.fail:
            return BenchOutcome(1, "table\n", "a warning\nlightning-perf bench: failed: RuntimeError: boom at step 3\n")
        factor = 1.0
        if self.import_factor:  # the user's module, imported as the bench would: from the run's tree first
            code = "import userpkg.constants as c; print(c.FACTOR)"
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=call.cwd, env=call.env, capture_output=True, text=True, check=True
            )
            factor = float(done.stdout)
            self.factors.append(done.stdout.strip())
        results = _results(call, factor)
        if "--batch-sizes" in call.argv:  # a sweep: one report per batch size in one file
            results = {"kind": "lightning-perf-bench-sweep", "by_batch_size": [{"batch_size": 8, **results}]}
        call.output.write_text(json.dumps(results))
        call.output.with_suffix(".md").write_text("# bench\n")
        return BenchOutcome(0, "table\n", "")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBench:
    bench = FakeBench()
    monkeypatch.setattr(_tasks, "run_bench_subprocess", bench)
    return bench


def _tasks_file(directory: Path, *rows: str, header: str = HEADER) -> Path:
    path = directory / "tasks.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def _summary(out: Path, name: str = "summary.json") -> dict[str, Any]:
    return json.loads((out / name).read_text())


def test_each_task_writes_its_files_and_one_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeBench, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # not a git repository: the working tree, unlabelled
    tasks = _tasks_file(tmp_path, "a,,,,,convnet", "b,,baseline;channels_last+compile,3,8,lm")
    status = main(
        ["bench", "--tasks", str(tasks), "--output", "out", "--steps", "7", "--repeats", "2", "--preset=tiny"]
    )
    assert status == 0
    first, second = fake.calls
    # the command line applies where a task leaves a cell empty; a filled cell wins
    assert first.argv[:6] == ["--steps", "7", "--repeats", "2", "--preset=tiny", "--workload"]
    assert second.argv[:4] == ["--repeats", "2", "--preset=tiny", "--configs"]
    assert second.argv[4:11] == [
        "baseline,channels_last+compile",
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--workload",
        "lm",
    ]
    assert "7" not in second.argv and "--tasks" not in second.argv + first.argv
    assert first.output == tmp_path / "out" / "a.json" and first.cwd == tmp_path
    summary = _summary(tmp_path / "out")
    assert summary["kind"] == "lightning-perf-bench-tasks" and summary["failed"] == [] and summary["comparisons"] == []
    assert [(r["task"], r["label"], r["status"]) for r in summary["runs"]] == [
        ("a", "working tree", "ok"),
        ("b", "working tree", "ok"),
    ]
    row = summary["runs"][1]["rows"][1]
    assert (row["config"], row["ratio"], row["ratio_ci95"], row["verdict"]) == (
        "channels_last",
        1.25,
        [1.2, 1.3],
        "faster",
    )
    out = capsys.readouterr().out
    assert "[1/2] a @ working tree: ok" in out and "[2/2] b @ working tree: ok" in out
    assert "1.25x [1.20-1.30]" in out and "every task ran" in out
    for name in ("a.json", "a.md", "b.json", "b.md", "summary.json", "summary.md"):
        assert f"wrote {tmp_path / 'out' / name}\n" in out
    assert "1.25x [1.20-1.30]" in (tmp_path / "out" / "summary.md").read_text()


def test_a_failing_task_is_reported_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    bench = FakeBench(fail=("b",))
    monkeypatch.setattr(_tasks, "run_bench_subprocess", bench)
    tasks = _tasks_file(tmp_path, "a,,,,,convnet", "b,,,,,convnet", "c,,,,,convnet")
    assert main(["bench", "--tasks", str(tasks), "--output", "out"]) == 1
    assert [call.task for call in bench.calls] == ["a", "b", "c"]
    summary = _summary(tmp_path / "out")
    error = "lightning-perf bench: failed: RuntimeError: boom at step 3"
    assert summary["failed"] == [f"b @ working tree: {error}"]
    assert [r["status"] for r in summary["runs"]] == ["ok", "failed", "ok"]
    log = tmp_path / "out" / "b.log"
    assert summary["runs"][1]["log"] == str(log) and error in log.read_text()
    out = capsys.readouterr().out
    assert f"[2/3] b @ working tree: failed: {error}" in out and f"wrote {log}" in out and "1 failed" in out

    bench.calls.clear()
    assert main(["bench", "--tasks", str(tasks), "--output", "out", "--fail-fast"]) == 1
    assert [call.task for call in bench.calls] == ["a", "b"]
    summary = _summary(tmp_path / "out", "summary-2.json")  # the first summary is kept
    assert [r["status"] for r in summary["runs"]] == ["ok", "failed", "not run"]
    assert summary["not_run"] == ["c @ working tree"] and "1 not run (--fail-fast)" in capsys.readouterr().out


def test_a_batch_size_sweep_is_summarized_per_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeBench
) -> None:
    monkeypatch.chdir(tmp_path)
    tasks = _tasks_file(tmp_path, "a,,,,,convnet")
    assert main(["bench", "--tasks", str(tasks), "--output", "out", "--batch-sizes", "8"]) == 0
    assert "--batch-sizes" in fake.calls[0].argv
    rows = _summary(tmp_path / "out")["runs"][0]["rows"]
    assert [row["config"] for row in rows] == ["baseline (batch 8)", "channels_last (batch 8)"]
    assert "| 1.00x " in (tmp_path / "out" / "summary.md").read_text()


def test_files_are_never_overwritten_silently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeBench) -> None:
    monkeypatch.chdir(tmp_path)
    tasks = _tasks_file(tmp_path, "a,,,,,convnet")
    for _ in range(2):
        assert main(["bench", "--tasks", str(tasks), "--output", "out"]) == 0
    assert [call.output.name for call in fake.calls] == ["a.json", "a-2.json"]
    assert (tmp_path / "out" / "summary-2.json").is_file()
    assert main(["bench", "--tasks", str(tasks), "--output", "out", "--force"]) == 0
    assert fake.calls[-1].output.name == "a.json" and "--force" in fake.calls[-1].argv
    assert not (tmp_path / "out" / "summary-3.json").exists()


@pytest.mark.parametrize(
    ("rows", "extra", "words"),
    [
        (("a,,,,,convnet", "b,,,zero,,convnet"), [], "tasks.csv, line 3, column 'steps': 'zero' is not valid"),
        (
            ("a,,warp,,,convnet",),
            [],
            "line 2, column 'configs': 'warp' is not valid. Expected registered names (unknown configuration 'warp'",
        ),
        (("a,missing.yaml,,,,",), [], "line 2, column 'config': "),
        (("a,,,,,convnet",), ["--workload", "lm"], "argument --workload: not valid with --tasks"),
        (("a,,,,,convnet",), ["--ref", "nope"], "argument --ref: 'nope' is not valid"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_any_task(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fake: FakeBench,
    capsys: pytest.CaptureFixture[str],
    rows: tuple[str, ...],
    extra: list[str],
    words: str,
) -> None:
    make_project(tmp_path / "project")  # a repository, so that only the ref itself is wrong
    monkeypatch.chdir(tmp_path / "project")
    tasks = _tasks_file(tmp_path, *rows)
    with pytest.raises(SystemExit) as caught:
        main(["bench", "--tasks", str(tasks), "--output", str(tmp_path / "out"), *extra])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-perf bench: error: ") and words in err
    assert fake.calls == [] and not (tmp_path / "out").exists()


def test_a_ref_in_the_task_file_that_does_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeBench
) -> None:
    make_project(tmp_path / "project")
    monkeypatch.chdir(tmp_path / "project")
    tasks = _tasks_file(tmp_path, "a,,,,,convnet,v1;v9", header=f"{HEADER},ref")
    with pytest.raises(SystemExit, match="2"):
        main(["bench", "--tasks", str(tasks)])
    assert fake.calls == []


pytest_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest_git
def test_refs_side_by_side_labelled_compared_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "project"
    commits = make_project(root)
    monkeypatch.chdir(root)
    bench = FakeBench(import_factor=True)
    monkeypatch.setattr(_tasks, "run_bench_subprocess", bench)
    tasks = _tasks_file(root / "configs", "t,cli.yaml,,,,")  # the config relative to the task file
    status = main(["bench", "--tasks", str(tasks), "--ref", "v1", "--ref", "v2", "--output", str(tmp_path / "out")])
    assert status == 1  # v2 doubles the step time: a regression against v1, the reference
    assert bench.factors == ["1", "2"]  # each ref's own module, first on the import path
    for call, ref in zip(bench.calls, ("v1", "v2")):
        config = Path(call.argv[call.argv.index("--config") + 1])
        assert config == call.cwd / "configs" / "cli.yaml" and call.cwd != root  # inside that ref's worktree
        assert call.label == f"{ref} ({commits[ref][:7]})" and call.output.name == f"t@{ref}.json"
        assert not call.cwd.exists()  # removed afterwards
    assert len(worktrees(root)) == 1
    summary = _summary(tmp_path / "out")
    assert [(r["label"], r["commit"]) for r in summary["runs"]] == [
        (f"v1 ({commits['v1'][:7]})", commits["v1"]),
        (f"v2 ({commits['v2'][:7]})", commits["v2"]),
    ]
    (comparison,) = summary["comparisons"]
    assert comparison["reference"].startswith("v1") and comparison["candidate"].startswith("v2")
    assert {"baseline: step time", "channels_last: step time"} <= set(comparison["regressions"])
    step = next(r for r in comparison["rows"] if r["config"] == "baseline" and r["metric"] == "step time")
    assert step["ratio"] == pytest.approx(2.0, rel=0.05) and step["verdict"] == "slower"
    assert summary["regressions"][0].startswith("t: baseline: step time (v2")
    out = capsys.readouterr().out
    assert "REGRESSION beyond 5% and the noise" in out and "+100" in out


@pytest_git
def test_worktrees_are_removed_when_a_task_fails_or_is_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "project"
    make_project(root)
    monkeypatch.chdir(root)
    bench = FakeBench(fail=("v2",), import_factor=True)
    monkeypatch.setattr(_tasks, "run_bench_subprocess", bench)
    argv = ["bench", "--workload", "convnet", "--ref", "v1", "--ref", "v2", "--output", str(tmp_path / "out")]
    assert main(argv) == 1
    assert len(bench.calls) == 2 and all(not call.cwd.exists() for call in bench.calls)
    summary = _summary(tmp_path / "out")
    assert summary["comparisons"][0]["notes"] == [
        f"not compared: {summary['runs'][1]['label']} has no results (failed)"
    ]
    assert len(worktrees(root)) == 1

    interrupted = FakeBench(interrupt=True)
    monkeypatch.setattr(_tasks, "run_bench_subprocess", interrupted)
    assert main(argv) == 130
    assert len(interrupted.calls) == 1 and not interrupted.calls[0].cwd.exists() and len(worktrees(root)) == 1


@pytest_git
def test_the_dirty_working_tree_is_benchmarked_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "project"
    commits = make_project(root)
    monkeypatch.chdir(root)
    bench = FakeBench(import_factor=True)
    monkeypatch.setattr(_tasks, "run_bench_subprocess", bench)
    argv = ["bench", "--workload", "convnet", "--ref", "v2", "--ref", ".", "--output", "bench-results/tasks"]
    assert main(argv) == 0  # the results under --output do not make the tree dirty
    assert bench.calls[1].label == f"working tree ({commits['v2'][:7]})" and bench.calls[1].cwd == root
    (root / "userpkg" / "constants.py").write_text("FACTOR = 1\n")  # uncommitted: twice as fast as v2
    assert main(argv) == 0
    assert bench.factors == ["2", "2", "2", "1"]
    assert bench.calls[3].label == "working tree (dirty)"
    assert [c.output.name for c in bench.calls[2:]] == ["convnet@v2-2.json", "convnet@working-tree-2.json"]
    assert bench.calls[3].argv[:2] == ["--workload", "convnet"]
    summary = _summary(root / "bench-results" / "tasks", "summary-2.json")
    assert summary["runs"][1]["dirty"] is True and summary["regressions"] == []
    assert "working tree (dirty)" in capsys.readouterr().out


@pytest.mark.slow
def test_a_real_tiny_bench_per_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    tasks = _tasks_file(tmp_path, "tiny,,baseline,2,4,convnet", "broken,,baseline,2,4,convnet")
    argv = ["bench", "--tasks", str(tasks), "--preset", "tiny", "--warmup-steps", "1", "--repeats", "1", "--threads=1"]
    real = _tasks.run_bench_subprocess

    def runner(call: BenchCall) -> BenchOutcome:
        if call.task == "broken":  # a bench that cannot start: a real subprocess failing with one line
            call = replace(call, argv=[*call.argv, "--device", "cuda:99"])
        return real(call)

    monkeypatch.setattr(_tasks, "run_bench_subprocess", runner)
    assert main([*argv, "--output", "out"]) == 1
    results = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert results["kind"] == "lightning-perf-bench" and results["summary"][0]["config"] == "baseline"
    assert results["options"]["steps"] == 2 and results["options"]["repeats"] == 1
    summary = _summary(tmp_path / "out")
    assert [r["status"] for r in summary["runs"]] == ["ok", "failed"]
    assert "--device" in summary["runs"][1]["error"]
    assert summary["runs"][0]["rows"][0]["time_s"] > 0


def test_the_options_cut_for_the_tasks_know_every_flag_of_bench() -> None:
    """The command line is cut into options by name (no parser internals): its list of value-less flags must be the
    parser's, or an option after a new flag would swallow the next token."""
    import argparse

    from lightning_perf.cli import bench, build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in subparsers.choices["bench"]._actions if a.nargs == 0 for s in a.option_strings}
    assert flags - {"-h", "--help"} == bench._FLAGS
    items = bench._option_items(["--quiet", "--steps", "3", "--configs=a,b", "--force", "x"])
    assert items == [("quiet", ["--quiet"]), ("steps", ["--steps", "3"]), ("configs", ["--configs=a,b"]),
                     ("force", ["--force"]), (None, ["x"])]  # fmt: skip
