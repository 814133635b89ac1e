"""Cold first step and steady step of whole-model vs regional ``torch.compile``, each variant in a fresh process.

Every measurement runs in its own interpreter with its own new, empty inductor cache folder (as a new job on a new
machine), on a plain training step of a reference workload (forward, loss, backward, AdamW step), and prints one JSON
line. The variants are interleaved round by round, so a load change on a shared machine hits all of them alike.

Variants: ``eager``; ``whole`` (``compile_regions(model)``, the LightningModule's forward); ``blocks``
(``regions="auto"``: the repeated blocks only, the rest eager; on a CPU with inductor's ``cpp_wrapper``, one C++
build per graph, see :mod:`lightning_perf.functional.compile.startup`); ``blocks-py`` (the same with
``options={"cpp_wrapper": False}``: inductor's Python wrapper, one C++ build per fused kernel). ``libraries`` counts
the C++ libraries built (``.so`` files in the cache folder).

Usage::

    python benchmarks/compile_regions.py --workload lm --depth 8 --rounds 2
    python benchmarks/compile_regions.py --workload vit --rounds 2
    python benchmarks/compile_regions.py --workload lm --depth 8 --steady 200 --variants whole,blocks

``--steady N`` compares steady steps only: every variant's model in one process (same weights, same batch), compiled
and warmed, then N rounds of one step of each, alternating, so load changes hit all alike; prints the medians.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = {"eager": "eager", "whole": None, "blocks": "auto", "blocks-py": "auto"}
OPTIONS = {"blocks-py": {"cpp_wrapper": False}}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: the first step's time and the median of the steady steps."""
    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.functional.compile.regions import CompileMonitor, compile_regions

    torch.set_num_threads(args.threads)
    overrides = {"depth": args.depth} if args.depth else {}
    model, data = make_workload(args.workload, args.preset, **overrides)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    regions = VARIANTS[args.variant]
    options = OPTIONS.get(args.variant)
    compiled = None if regions == "eager" else compile_regions(model, regions, options=options, strict=True)
    monitor = CompileMonitor()
    monitor.start()

    def step() -> float:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model.compute(batch)[0]
        loss.backward()
        optimizer.step()
        return time.perf_counter() - began

    first = step()
    stats = monitor.stop()
    if args.breakdown:  # where the first step's compile time went, per phase (torch's own timers), to stderr
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str", aggregate=True), file=sys.stderr, flush=True)
    for _ in range(2):
        step()
    steady = [step() for _ in range(args.steps)]
    return {
        "first_step_s": first,
        "steady_step_s": statistics.median(steady),
        "compile_time_s": stats.compile_time_s,
        "graphs": stats.unique_graphs,
        "compiled": len(compiled.names) if compiled is not None else 0,
        "libraries": len(
            glob.glob(os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "-"), "**", "*.so"), recursive=True)
        ),
    }


def measure_steady(args: argparse.Namespace) -> None:
    """Steady steps of every variant, alternating in one process (compile caches warm after the first steps)."""
    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.functional.compile.regions import compile_regions

    torch.set_num_threads(args.threads)
    overrides = {"depth": args.depth} if args.depth else {}
    steps: dict[str, Any] = {}
    for variant in args.variants.split(","):
        model, data = make_workload(args.workload, args.preset, **overrides)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if VARIANTS[variant] != "eager":
            compile_regions(model, VARIANTS[variant], options=OPTIONS.get(variant), strict=True)

        def step(model: Any = model, batch: Any = batch, optimizer: Any = optimizer) -> float:
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model.compute(batch)[0].backward()
            optimizer.step()
            return time.perf_counter() - began

        for _ in range(3):
            step()
        steps[variant] = step
        print(f"{variant}: compiled and warm", flush=True)
    times: dict[str, list[float]] = {variant: [] for variant in steps}
    for _ in range(args.steady):
        for variant, step in steps.items():
            times[variant].append(step())
    base = statistics.median(times[next(iter(times))])
    for variant, runs in times.items():
        median = statistics.median(runs)
        print(f"  {variant:9s} steady {median * 1e3:7.1f} ms (median of {len(runs)})  {median / base:.3f}x the first")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (the preset's by default)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true", help="print torch's compile phase timers per variant")
    parser.add_argument("--steady", type=int, default=0, help="only steady steps: N alternating rounds in one process")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steady:
        measure_steady(args)
        return
    if args.variant:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    results: dict[str, list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for variant in args.variants.split(","):
            command = [sys.executable, __file__, "--variant", variant, "--workload", args.workload]
            command += ["--preset", args.preset, "--steps", str(args.steps), "--threads", str(args.threads)]
            command += ["--depth", str(args.depth)] if args.depth else []
            command += ["--breakdown"] if args.breakdown else []
            with tempfile.TemporaryDirectory(prefix="inductor-") as inductor:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "PYTHONWARNINGS": "ignore"}
                done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                print(f"{variant}: failed\n{done.stderr[-3000:]}", flush=True)
                continue
            result = json.loads(lines[-1].removeprefix("RESULT "))
            if args.breakdown:
                print(done.stderr[-4000:], flush=True)
            results.setdefault(variant, []).append(result)
            load = os.getloadavg()[0]
            print(f"round {round_} {variant}: {result} (load {load:.1f})", flush=True)
    eager = statistics.median(r["steady_step_s"] for r in results.get("eager", [{"steady_step_s": float("nan")}]))
    print(f"\n{args.workload} depth={args.depth or 'preset'} ({args.rounds} round(s), medians):")
    for variant, runs in results.items():
        first = statistics.median(r["first_step_s"] for r in runs)
        steady = statistics.median(r["steady_step_s"] for r in runs)
        ratio = ""
        if variant != "whole" and "whole" in results:
            ratio = (
                f"  first step {statistics.median(r['first_step_s'] for r in results['whole']) / first:.1f}x shorter"
            )
        print(
            f"  {variant:9s} first step {first:6.1f} s  steady {steady * 1e3:7.1f} ms  speed-up {eager / steady:.2f}x"
            f"{ratio}"
        )


if __name__ == "__main__":
    main()
