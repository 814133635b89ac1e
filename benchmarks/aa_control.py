"""A/A control of the bench: `lightning-perf bench --configs baseline,aa_control` run N times, each in a fresh process.

``aa_control`` is baseline under another name, so every verdict other than "no clear difference" is a false one. At a
nominal 95% the documented rate is at most 5% (:mod:`lightning_perf.profiling.intervals`): at most 1 of 20 runs should
say "faster" or "slower". ``--busy 1`` starts one steady busy loop (a subprocess spinning in pure Python) before each
run and kills it after, to check the same beside a steady load. Each run uses the bench's defaults (budget, workload,
repeats auto) and writes its results file into a temporary folder; the JSON written here holds the command, the
machine (CPU model and flags, torch), every run's ratio, interval, method, repeats and verdict, and the count of runs
that did not say "no clear difference".

Usage::

    python benchmarks/aa_control.py --runs 20 --output docs/curves/aa-control-quiet.json
    python benchmarks/aa_control.py --runs 20 --busy 1 --output docs/curves/aa-control-busy.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_perf.benchmark.configs import AA_CONTROL
from lightning_perf.profiling import write_json
from lightning_perf.profiling.intervals import NO_CLEAR_DIFFERENCE
from lightning_perf.profiling.machine import describe_machine

BENCH = [sys.executable, "-c", "import sys; from lightning_perf.cli import main; sys.exit(main())", "bench"]
BUSY_LOOP = "while True:\n    pass\n"


def one_run(index: int, busy: int, folder: Path, extra: list[str]) -> dict[str, Any]:
    """One bench of baseline against the control in a fresh process (beside ``busy`` busy loops): its answer."""
    output = folder / f"run-{index}.json"
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
    start = time.perf_counter()
    try:
        proc = subprocess.run([*BENCH, "--configs", f"baseline,{AA_CONTROL}", "--output", str(output), *extra],
                              capture_output=True, text=True)  # fmt: skip
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(timeout=30)
    if proc.returncode or not output.is_file():
        return {"run": index, "error": (proc.stderr or proc.stdout)[-2000:], "verdict": None}
    report = json.loads(output.read_text())
    row = next(r for r in report["summary"] if r["config"] == AA_CONTROL)
    return {"run": index, "wall_s": time.perf_counter() - start, "speedup": row.get("speedup"),
            "ci95": row.get("speedup_ci95"), "method": row.get("speedup_method"), "repeats": row.get("speedup_n"),
            "verdict": row.get("speedup_verdict"), "disturbed": row.get("disturbed"),
            "threads": report.get("machine", {}).get("threads"), "notes": report.get("notes", [])}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="benches run, one after the other")
    parser.add_argument("--busy", type=int, choices=(0, 1), default=0, help="1: one steady busy loop beside each")
    parser.add_argument("--output", type=Path, help="the JSON to write (docs/curves/aa-control-<quiet|busy>.json)")
    parser.add_argument("bench_args", nargs="*", help="more `lightning-perf bench` arguments, after --")
    args = parser.parse_args(argv)
    machine = describe_machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="aa-control-") as folder:
        for index in range(args.runs):
            runs.append(one_run(index, args.busy, Path(folder), args.bench_args))
            print(json.dumps({k: runs[-1].get(k) for k in ("run", "speedup", "ci95", "verdict", "error")}), flush=True)
    result = {
        "command": "python " + " ".join(sys.argv),
        "bench_command": " ".join(["lightning-perf", "bench", "--configs", f"baseline,{AA_CONTROL}", *args.bench_args]),
        "load": "one steady busy loop (pure Python) beside each run" if args.busy else "quiet",
        "machine": {
            "cpu": machine.get("cpu"),
            "cpu_count": machine.get("cpu_count"),
            "cpu_flags": machine.get("cpu_flags"),
            "torch": machine.get("torch"),
        },
        "runs": runs,
        "not_no_clear_difference": sum(r["verdict"] != NO_CLEAR_DIFFERENCE for r in runs),
    }
    print(json.dumps({"runs": len(runs), "not_no_clear_difference": result["not_no_clear_difference"]}))
    if args.output:
        write_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
