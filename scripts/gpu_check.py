"""The one command for a GPU machine: time-boxed sections, at most 8 result files, a summary printed last.

Run it through ``scripts/gpu_check.sh OUTDIR`` (it picks the Python that has torch). Sections, each in a fresh process
under coreutils ``timeout`` (so a slow one cannot eat the next one's time), within one overall budget (default 500 s:
with the machine's start, one call of under 10 minutes; a section that no longer fits is skipped and named, to be run
in a second call with ``--sections``):

1. ``gpu-tests``: ``pytest -m gpu`` over the whole suite (``-n 4`` with pytest-xdist).
2. ``bench-lm-compiled``: ``lightning-perf bench`` on the GPT-2-small-scale ``lm`` (``--preset gpu``): fp32,
   bf16 + compile and ``fp8`` (bf16 + float8 + compile), the float8 goal measured beside what it is set against.
3. ``bench-lm-fit``: the same ``lm``: fp32, bf16 autocast, and the stack a GPU user adds (bf16 + flash attention +
   fused optimizer + backend flags).
4. ``cuda-matrix``: the registry's generic and trust tests on CUDA, ``pytest --device cuda tests/test_generic.py
   tests/test_trust.py`` (``-n auto`` with pytest-xdist).
5. ``bench-convnet-predict``: the ResNet-50-scale ``convnet`` at 224x224, predict: fp32, bf16, bf16 + channels-last.
6. ``bench-lm-regional``: the ``lm`` stack with ``compile_regional``, in the time left (with too little left it says
   so, to be run alone with ``--sections``).

Nothing is installed over the machine's torch: the project goes on ``PYTHONPATH``; missing optional packages are
listed, not installed. Wheels carried in a folder (``$WHEELS``, else ``shared/wheels``, else ``.whl``) are installed
with ``pip install --no-deps --target`` into a temporary directory put on ``PYTHONPATH`` (never a torch, triton or
NVIDIA wheel). On a machine without CUDA the CUDA sections are skipped with the reason and the bench runs once on the
CPU at the ``tiny`` preset, to check its command line (a few minutes at most).

Files in OUTDIR (at most 8): ``gpu_check.log`` (every child's output), ``junit.xml`` (both pytest sections),
``gpu_check.json`` and ``gpu_check.md`` (environment, sections, bench tables), and the bench's own report of each
bench section that ran (``bench-lm-compiled.json``, ``bench-lm-fit.json``, ``bench-convnet-predict.json``,
``bench-lm-regional.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 500.0
MAX_FILES = 8
LOG, JUNIT, RESULTS, MARKDOWN = "gpu_check.log", "junit.xml", "gpu_check.json", "gpu_check.md"
# Importable name -> (what installs it, "pure" when a carried wheel works on any machine, else "binary").
OPTIONAL = {
    "torchao": ("torchao", "pure (its C extensions may not load; its Python paths run)"),
    "monai": ("monai", "pure"),
    "einops": ("einops", "pure"),
    "jsonargparse": ("jsonargparse[signatures]", "pure"),
    "docstring_parser": ("docstring-parser", "pure"),
    "typeshed_client": ("typeshed-client", "pure"),
    "onnx": ("onnx", "binary"),
    "onnxscript": ("onnxscript", "pure"),
    "onnxruntime": ("onnxruntime-gpu", "binary"),
    "tensorrt": ("tensorrt", "binary"),
    "torch_tensorrt": ("torch-tensorrt", "binary"),
    "flash_attn": ("flash-attn", "binary"),
    "transformers": ("transformers", "pure"),
    "timm": ("timm", "pure"),
    "matplotlib": ("matplotlib", "binary"),
    "rich": ("rich", "pure"),
    "yaml": ("pyyaml", "binary"),
    "xdist": ("pytest-xdist", "pure"),
    "pytest_timeout": ("pytest-timeout", "pure"),
}
_NEVER_CARRIED = ("torch-", "torch_", "triton", "nvidia_", "nvidia-")


@dataclass
class Context:
    """What the sections need to know about the machine and the run."""

    python: str
    outdir: Path
    tmp: Path
    cuda: bool
    device: str
    env: dict[str, str]
    has_xdist: bool
    has_timeout_plugin: bool
    bench_configs: list[str]
    box_scale: float = 1.0


@dataclass
class Result:
    """One section's outcome: ``status`` is passed, failed, skipped or timed out; ``detail`` says why or how many."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    box_s: float = 0.0
    command: list[str] = field(default_factory=list)
    rc: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    configs: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Section:
    name: str
    box_s: float
    kind: str  # "pytest" or "bench"
    plan: Callable[[Context], list[str] | str]  # the command, or why it does not run
    min_s: float = 10.0  # not started with less time left in the budget than this


# ------------------------------------------------------------------------------------------------------ sections


def _pytest(ctx: Context, workers: str, *args: str) -> list[str]:
    cmd = [ctx.python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args]
    if ctx.has_xdist:
        cmd += ["-n", workers]
    if ctx.has_timeout_plugin:
        cmd += ["--timeout", "150"]
    return cmd


def _plan_gpu_tests(ctx: Context) -> list[str] | str:
    if not ctx.cuda:
        return "no CUDA device (torch.cuda.is_available() is False): the gpu-marked tests would all skip"
    return _pytest(ctx, "4", "-m", "gpu", "tests", f"--junitxml={ctx.tmp / 'gpu-tests.xml'}")


def _plan_matrix(ctx: Context) -> list[str] | str:
    if not ctx.cuda:
        return "no CUDA device: the registry's generic and trust tests on CUDA need one (on CPU CI runs them)"
    return _pytest(
        ctx,
        "auto",
        "--device",
        "cuda",
        "tests/test_generic.py",
        "tests/test_trust.py",
        f"--junitxml={ctx.tmp / 'cuda-matrix.xml'}",
    )


def _bench(ctx: Context, name: str, *args: str) -> list[str]:
    # Not --quiet: the progress lines (one a run, with its step time) land in the log, also from a bench its box stops.
    return [ctx.python, "-m", "lightning_perf", "bench", *args, "--output", str(ctx.tmp / f"{name}.json")]


def _available(ctx: Context, wanted: list[str]) -> str:
    """The comma-joined configurations of ``wanted`` whose every '+'-joined part the bench knows."""
    known = set(ctx.bench_configs)
    return ",".join(c for c in wanted if all(part in known for part in c.split("+")))


def _plan_bench_lm(ctx: Context) -> list[str] | str:
    if not ctx.cuda:  # the command line checked on the CPU, at the tiny preset: not a measurement
        common = ["--workload", "lm", "--preset", "tiny", "--device", "cpu", "--steps", "2", "--warmup-steps", "1"]
        return _bench(ctx, "bench-lm-fit", *common, "--repeats", "1", "--predict-batches", "0", "--configs", "baseline")
    configs = _available(ctx, ["baseline", "bf16-mixed", _LM_STACK])
    return _bench(ctx, "bench-lm-fit", *_LM_GPU, "--configs", configs)


_LM_STACK = "bf16-mixed+flash_attention+fused_optimizer+backend_flags"
_LM_GPU = ["--workload", "lm", "--preset", "gpu", "--device", "cuda", "--steps", "10", "--warmup-steps", "3"]
_LM_GPU += ["--repeats", "1", "--predict-batches", "0"]


def _plan_bench_lm_compiled(ctx: Context) -> list[str] | str:
    if not ctx.cuda:
        return "no CUDA device: the compiled configurations are measured on the GPU only"
    # fp8 is bf16-mixed + float8 + whole-model compile: its goal is set against bf16-mixed + compile, measured beside.
    compiled = _available(ctx, ["bf16-mixed+compile", "fp8"])
    if not compiled:
        return "the bench has neither compile nor fp8 (`lightning-perf bench --list`)"
    # Apart from bench-lm-fit: a cold compile takes a minute, and a bench stopped by its box writes no report.
    return _bench(ctx, "bench-lm-compiled", *_LM_GPU_COMPILED, "--configs", f"baseline,{compiled}")


def _plan_bench_lm_regional(ctx: Context) -> list[str] | str:
    if not ctx.cuda:
        return "no CUDA device: the compiled configurations are measured on the GPU only"
    regional = _available(ctx, [f"{_LM_STACK}+compile_regional"])
    if not regional:
        return "the bench has no compile_regional (`lightning-perf bench --list`)"
    return _bench(ctx, "bench-lm-regional", *_LM_GPU_COMPILED, "--configs", f"baseline,{regional}")


_LM_GPU_COMPILED = [*_LM_GPU[: _LM_GPU.index("--steps")], "--steps", "30", "--warmup-steps", "5"]
_LM_GPU_COMPILED += ["--repeats", "1", "--predict-batches", "0"]


def _plan_bench_convnet(ctx: Context) -> list[str] | str:
    if not ctx.cuda:
        return "no CUDA device: the GPU-sized predict bench (the fit bench ran once on the CPU to check the command)"
    configs = _available(ctx, ["baseline", "bf16-true", "bf16-true+channels_last"])
    common = ["--workload", "convnet", "--preset", "gpu", "--device", "cuda", "--stage", "predict"]
    # 128 images of 224x224 are generated on the host per batch (about half a second on one core): 8 loader workers
    # keep the section inside its box (the bench times the device's batches, not the host's loading).
    timing = ["--repeats", "1", "--predict-batches", "10", "--num-workers", "8"]
    return _bench(ctx, "bench-convnet-predict", *common, *timing, "--configs", configs)


# Boxes from the 2026-11-27 H200 run (torch 2.11): the gpu tests take about 110 s with 4 workers (the float8 fit
# alone 62 s), the compiled bench 174 s (three fresh processes, two cold compiles of 22-26 s, about 60 s of process
# start-up). The default budget holds the first three in one call; the rest go in a second call (README, "GPU").
SECTIONS = (
    Section("gpu-tests", 120.0, "pytest", _plan_gpu_tests),
    # The float8 goal second: the one figure the check must bring back.
    Section("bench-lm-compiled", 240.0, "bench", _plan_bench_lm_compiled, min_s=180.0),
    Section("bench-lm-fit", 125.0, "bench", _plan_bench_lm, min_s=90.0),
    Section("cuda-matrix", 180.0, "pytest", _plan_matrix, min_s=120.0),
    Section("bench-convnet-predict", 70.0, "bench", _plan_bench_convnet, min_s=60.0),
    Section("bench-lm-regional", 150.0, "bench", _plan_bench_lm_regional, min_s=120.0),
)


# ---------------------------------------------------------------------------------------------------- running


def run_boxed(
    cmd: list[str], box_s: float, log: Any, env: dict[str, str], signal_name: str = "TERM"
) -> tuple[int, bool, float]:
    """Run ``cmd`` under coreutils ``timeout`` (the whole process group is signalled, xdist workers too; KILL 15 s
    after ``signal_name`` if still running): return code, whether the box ran out, seconds. pytest gets ``INT``: it
    stops as on Ctrl-C and still writes its JUnit report of the tests that ran."""
    start = time.monotonic()
    box = max(1, round(box_s))
    timeout = shutil.which("timeout")
    wrapped = [timeout, "-s", signal_name, "-k", "15", str(box), *cmd] if timeout else cmd
    log.write(f"\n$ {' '.join(cmd)}   # time box {box} s\n")
    log.flush()
    proc = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=box + 30)
    except subprocess.TimeoutExpired:  # no coreutils timeout here: end the group this script started
        os.killpg(proc.pid, 9)
        rc = proc.wait()
        return rc, True, time.monotonic() - start
    return rc, rc in (124, 137) or (not timeout and rc == -9), time.monotonic() - start


def junit_counts(path: Path) -> tuple[dict[str, int], list[str]]:
    """Tests, failures, errors and skips of a JUnit file, and the failing tests' ids (first line of each message)."""
    if not path.is_file():
        return {}, []
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing = []
    for case in root.iter("testcase"):
        for problem in [*case.findall("failure"), *case.findall("error")]:
            message = (problem.get("message") or "").strip().splitlines()[:1]
            failing.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:160] if message else ''}")
    return counts, failing


def pytest_result(rc: int, timed_out: bool, junit: Path) -> tuple[str, str, dict[str, int]]:
    counts, failing = junit_counts(junit)
    tally = (
        f"{counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} passed, {counts['failures']} "
        f"failed, {counts['errors']} errors, {counts['skipped']} skipped"
        if counts
        else "no JUnit report"
    )
    if timed_out:
        return "timed out", f"stopped by its time box ({tally})", counts
    if rc == 0:
        return "passed", tally, counts
    if rc == 5:
        return "skipped", "no tests collected", counts
    more = "; ".join(failing[:8]) + (f"; ... {len(failing) - 8} more" if len(failing) > 8 else "")
    return "failed", f"rc {rc}: {tally}" + (f". {more}" if more else " (see gpu_check.log)"), counts


def bench_result(rc: int, timed_out: bool, report: Path) -> tuple[str, str, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    if report.is_file():
        for row in json.loads(report.read_text()).get("summary", []):
            rows.append({key: row.get(key) for key in ("config", "step_median_s", "speedup", "skipped", "error")})
            if "predict_speedup" in row:
                rows[-1]["predict_speedup"] = row.get("predict_speedup")
    parts = []
    for row in rows:
        why = row.get("error") or row.get("skipped")
        ratio = row.get("predict_speedup") if row.get("speedup") is None else row.get("speedup")
        parts.append(f"{row['config']}: {str(why)[:80] if why else (f'{ratio:.2f}x' if ratio else '?')}")
    detail = "; ".join(parts) or "no report written"
    if timed_out:
        return "timed out", f"stopped by its time box ({detail})", rows
    if rc != 0:
        return "failed", f"rc {rc}: {detail} (see gpu_check.log)", rows
    errors = [row["config"] for row in rows if row.get("error")]
    return ("failed" if errors else "passed"), detail, rows


# -------------------------------------------------------------------------------------------------- environment


def install_carried_wheels(tmp: Path, log: Any) -> tuple[list[str], Path | None]:
    """Install carried pure-Python wheels with ``--no-deps --target`` (never torch, triton or NVIDIA ones)."""
    folder = next(
        (
            Path(p)
            for p in (os.environ.get("WHEELS"), REPO / "shared" / "wheels", REPO / ".whl")
            if p and Path(p).is_dir()
        ),
        None,
    )
    wheels = sorted(str(w) for w in folder.glob("*.whl")) if folder else []
    wheels = [w for w in wheels if not Path(w).name.lower().startswith(_NEVER_CARRIED)]
    if not wheels:
        return [], None
    target = tmp / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    rc, _, _ = run_boxed([*cmd, str(target), *wheels], 60, log, dict(os.environ))
    return ([Path(w).name for w in wheels] if rc == 0 else []), (target if rc == 0 else None)


def environment(log: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        from importlib.metadata import version

        info["lightning"] = version("lightning")
    except Exception as exc:  # reported, not fatal: the check goes on
        info["lightning"] = f"missing ({type(exc).__name__})"
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=15
            )
            info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.write(f"nvidia-smi: {exc}\n")
    missing = {}
    for module, (package, kind) in OPTIONAL.items():
        if importlib.util.find_spec(module) is None:
            missing[module] = f"pip install {package} ({kind})"
    info["missing"] = missing
    return info


def run_record(start_time: str, argv: list[str]) -> dict[str, Any]:
    """When, with what command and at which commit this check ran (the docs' page reads it)."""
    record: dict[str, Any] = {"start_time": start_time, "command": " ".join(["scripts/gpu_check.sh", *argv])}
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=REPO, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return record
    if out.returncode == 0:
        record["git_commit"], record["git_dirty"] = out.stdout.strip(), bool(dirty.stdout.strip())
    return record


def bench_config_names(python: str, env: dict[str, str]) -> list[str]:
    code = "from lightning_perf.benchmark.configs import available_configs as a; print(','.join(a()))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=90)
    except subprocess.TimeoutExpired:
        return []
    return [name for name in out.stdout.strip().split(",") if name]


# ------------------------------------------------------------------------------------------------------- output


def summary_lines(results: list[Result], info: dict[str, Any], wall_s: float) -> list[str]:
    gpu = info.get("gpu") or "no GPU"
    lines = [
        "",
        f"GPU CHECK SUMMARY ({wall_s:.0f} s): {gpu}, driver {info.get('driver') or '?'}, torch {info['torch']} "
        f"(CUDA {info.get('torch_cuda') or '-'}), lightning {info.get('lightning')}, Python {info['python']}",
    ]
    width = max(len(r.name) for r in results) if results else 10
    for r in results:
        box = f" of {r.box_s:.0f} s" if r.box_s else ""
        lines.append(f"  {r.name:<{width}}  {r.status.upper():<9}  {r.seconds:5.0f} s{box}  {r.detail}")
    skipped_cuda = [r.name for r in results if r.status == "skipped" and "CUDA" in r.detail]
    if skipped_cuda:
        lines.append(f"CUDA sections skipped (no CUDA device): {', '.join(skipped_cuda)}")
    if info.get("missing"):
        lines.append("missing optional packages (not installed by this check): " + ", ".join(sorted(info["missing"])))
    bad = [r.name for r in results if r.status in ("failed", "timed out")]
    lines.append(f"RESULT: {'FAILED: ' + ', '.join(bad) if bad else 'OK'}")
    return lines


def write_markdown(path: Path, results: list[Result], info: dict[str, Any], bench_md: list[str]) -> None:
    out = ["# GPU check", "", "| section | status | seconds | detail |", "|---|---|---|---|"]
    out += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.detail.replace('|', '/')} |" for r in results]
    out += ["", "## Environment", ""]
    out += [f"- {key}: {value}" for key, value in info.items() if key != "missing"]
    out += [f"- missing {module}: {how}" for module, how in info.get("missing", {}).items()]
    for text in bench_md:
        out += ["", text]
    path.write_text("\n".join(out) + "\n")


def merge_junit(parts: list[Path], target: Path) -> None:
    root = ET.Element("testsuites")
    for part in parts:
        if part.is_file():
            tree = ET.parse(part).getroot()
            root.extend([tree] if tree.tag == "testsuite" else list(tree))
    ET.ElementTree(root).write(target, encoding="utf-8", xml_declaration=True)


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path, help="where the result files go (at most 8)")
    parser.add_argument("--dry-run", action="store_true", help="print the sections and their commands, run nothing")
    parser.add_argument(
        "--assume-cuda", action="store_true", help="with --dry-run: plan as on a CUDA machine (to read its commands)"
    )
    names = [s.name for s in SECTIONS]
    parser.add_argument("--sections", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    parser.add_argument("--box-scale", type=float, default=1.0, help="multiply every time box (tests use a tiny one)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="overall seconds for the sections")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(names))
    if unknown:
        parser.error(f"--sections {args.sections!r}: unknown {', '.join(unknown)}. Expected names from {names}.")
    if args.assume_cuda and not args.dry_run:
        parser.error("--assume-cuda plans only: use it with --dry-run")
    if not args.box_scale > 0 or not args.budget > 0:
        parser.error("--box-scale and --budget must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start, start_time = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if not args.dry_run:
        args.outdir.mkdir(parents=True, exist_ok=True)
    log_path = os.devnull if args.dry_run else args.outdir / LOG
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp_name, open(log_path, "w") as log:
        tmp = Path(tmp_name)
        carried, site = ([], None) if args.dry_run else install_carried_wheels(tmp, log)
        if site is not None:
            sys.path.insert(0, str(site))
        paths = [str(REPO), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
        info = environment(log)
        info["carried_wheels"] = carried
        ctx = Context(
            python=sys.executable,
            outdir=args.outdir,
            tmp=tmp,
            cuda=bool(info["cuda_available"]) or args.assume_cuda,
            device="cuda" if info["cuda_available"] or args.assume_cuda else "cpu",
            env=env,
            has_xdist=importlib.util.find_spec("xdist") is not None,
            has_timeout_plugin=importlib.util.find_spec("pytest_timeout") is not None,
            bench_configs=bench_config_names(sys.executable, env),
            box_scale=args.box_scale,
        )
        chosen = set(args.sections.split(","))
        results: list[Result] = []
        bench_md: list[str] = []
        for section in SECTIONS:
            box = section.box_s * args.box_scale
            plan = section.plan(ctx)
            if section.name not in chosen:
                results.append(Result(section.name, "skipped", "not selected (--sections)"))
                continue
            if isinstance(plan, str):
                results.append(Result(section.name, "skipped", plan))
                continue
            left = args.budget - (time.monotonic() - start)
            if args.dry_run:
                results.append(Result(section.name, "planned", " ".join(plan), box_s=box, command=plan))
                continue
            if left < min(box, section.min_s):
                why = f"the overall budget of {args.budget:.0f} s ran out"
                why += f" ({left:.0f} s left, {section.min_s:.0f} s needed)"
                results.append(Result(section.name, "skipped", f"{why}: run it alone with --sections {section.name}"))
                continue
            box = min(box, left)
            print(f"[gpu_check] {section.name}: running (time box {box:.0f} s)", flush=True)
            rc, timed_out, seconds = run_boxed(plan, box, log, env, "INT" if section.kind == "pytest" else "TERM")
            result = Result(section.name, "", "", seconds=seconds, box_s=box, command=plan, rc=rc)
            if section.kind == "pytest":
                result.status, result.detail, result.counts = pytest_result(rc, timed_out, tmp / f"{section.name}.xml")
            else:
                report = tmp / f"{section.name}.json"
                result.status, result.detail, result.configs = bench_result(rc, timed_out, report)
                if report.is_file():
                    shutil.copyfile(report, args.outdir / report.name)
                markdown = report.with_suffix(".md")
                if markdown.is_file():
                    bench_md.append(markdown.read_text())
            print(f"[gpu_check] {section.name}: {result.status} in {seconds:.0f} s", flush=True)
            results.append(result)
        wall = time.monotonic() - start
        lines = summary_lines(results, info, wall)
        if not args.dry_run:
            merge_junit([tmp / f"{s.name}.xml" for s in SECTIONS], args.outdir / JUNIT)
            payload = {"wall_s": wall, "run": run_record(start_time, argv), "environment": info}
            payload["sections"] = [asdict(r) for r in results]
            (args.outdir / RESULTS).write_text(json.dumps(payload, indent=2, default=str) + "\n")
            write_markdown(args.outdir / MARKDOWN, results, info, bench_md)
            log.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 1 if any(r.status in ("failed", "timed out") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
