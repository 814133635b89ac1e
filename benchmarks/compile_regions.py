"""Cold first step and steady step of whole-model vs regional ``torch.compile``, each variant in a fresh process.

Every measurement runs in its own interpreter with its own new, empty inductor cache folder (as a new job on a new
machine), on a plain training step of a reference workload (forward, loss, backward, AdamW step), and prints one JSON
line. The variants are interleaved round by round, so a load change on a shared machine hits all of them alike.

Variants: ``eager``; ``whole`` (``compile_regions(model)``, the LightningModule's forward); ``blocks``
(``regions="auto"``: the repeated blocks only, the rest eager); ``nested`` (``regions="auto+rest"``: the whole
forward compiled as one region in which each repeated block is a nested region traced and compiled once).

Usage::

    python benchmarks/compile_regions.py --workload lm --depth 8 --rounds 2
    python benchmarks/compile_regions.py --workload vit --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"eager": "eager", "whole": None, "blocks": "auto", "nested": "auto+rest"}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: the first step's time and the median of the steady steps."""
    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.functional.compile import CompileMonitor, compile_regions

    torch.set_num_threads(args.threads)
    overrides = {"depth": args.depth} if args.depth else {}
    model, data = make_workload(args.workload, args.preset, **overrides)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    regions = VARIANTS[args.variant]
    compiled = None if regions == "eager" else compile_regions(model, regions, strict=True)
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
    }


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
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
        print(
            f"  {variant:7s} first step {first:6.1f} s  steady {steady * 1e3:7.1f} ms  speed-up {eager / steady:.2f}x"
        )


if __name__ == "__main__":
    main()
