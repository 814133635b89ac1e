"""Warm starts for ``torch.compile``: a new process's first compiled step, cold and with ``CompileCallback(cache=...)``.

Runs three fresh processes in a row on a reference workload:

- ``cold``: a new, empty inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``), as a job on a fresh machine; it saves the
  compiled code to the cache file at the end of its fit;
- ``warm``: another new, empty folder plus that file, loaded before its first step, as the next job on another
  machine would (on the CPU the C++ kernels, which the file does not carry, are built again);
- ``local``: the cold run's own folder, passed as ``CompileCallback(inductor_cache_dir=...)``, and no file, as a
  resume on the same machine: torch finds its compiled kernels there and loads them itself.

Prints the first step (which includes compiling) of each, with torch's own timers for where the compile time went
(C++ builds, graph lowering and code generation, AOT autograd, dynamo's tracing). Usage::

    python examples/compile_warm_start.py                  # the default `lm`, CPU
    python examples/compile_warm_start.py --workload convnet --regions auto
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIELDS = ("warmup_time_s", "compile_time_s", "steady_step_time_s", "cache_loaded")
#: torch's compile timers (``torch._dynamo.utils.compile_times``) reported, summed over graphs, forward and backward.
PHASES = {
    "cpp_build_s": "async_compile.wait",
    "inductor_codegen_s": "GraphLowering.codegen",
    "aot_autograd_s": "create_aot_dispatcher_function",
    "dynamo_trace_s": "bytecode_tracing",
}


def compile_phases() -> dict[str, float]:
    """Seconds per compile phase in this process, from torch's own timers (0 for a phase that never ran)."""
    from torch._dynamo.utils import compile_times

    headers, values = compile_times(repr="csv", aggregate=True)
    timers = dict(zip(headers, values, strict=False))
    return {name: float(timers.get(timer, 0.0) or 0.0) for name, timer in PHASES.items()}


def run_once(args: argparse.Namespace) -> None:
    """One fit in this process: print the first step's time and the cache's part as one JSON line."""
    import lightning.pytorch as pl

    from lightning_perf.callbacks import CompileCallback
    from lightning_perf.demos import make_workload

    model, data = make_workload(args.workload, args.preset)
    callback = CompileCallback(
        regions=args.regions, cache=args.cache, inductor_cache_dir=args.inductor_cache_dir, warmup_steps=1
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        callbacks=[callback],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    began = time.perf_counter()
    trainer.fit(model, datamodule=data)
    figures = {key: callback.report[key] for key in FIELDS} | {"fit_s": time.perf_counter() - began}
    figures |= compile_phases()
    print("RESULT " + json.dumps(figures), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm")
    parser.add_argument("--preset", default="default", choices=("tiny", "default"))
    parser.add_argument("--regions", default=None, help="None (the whole model) or 'auto'")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--cache", type=Path, default=None, help="the cache file (default: in a temporary folder)")
    parser.add_argument("--inductor-cache-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_once(args)
        return
    cache = args.cache or Path(tempfile.mkdtemp(prefix="compile-cache-")) / "torch_compile_cache.bin"
    cache.unlink(missing_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as fresh, tempfile.TemporaryDirectory(prefix="run-") as run:
        own = Path(run) / "inductor"  # the cold run's own inductor folder, kept for the `local` run
        for label in ("cold", "warm", "local"):
            command = [sys.executable, __file__, "--child", "--workload", args.workload, "--preset", args.preset]
            command += ["--steps", str(args.steps), "--accelerator", args.accelerator]
            command += ["--regions", args.regions] if args.regions else []
            command += ["--cache", str(cache)] if label != "local" else []
            command += ["--inductor-cache-dir", str(own)] if label != "warm" else []
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": fresh, "PYTHONWARNINGS": "ignore"}
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            line = next(line for line in output.splitlines() if line.startswith("RESULT "))
            results[label] = json.loads(line.removeprefix("RESULT "))
            print(f"{label}: {results[label]}", flush=True)
    cold = results["cold"]["warmup_time_s"]
    print(f"\n{args.workload} ({args.preset}, regions={args.regions}): first compiled step cold {cold:.1f} s", end="")
    for label in ("warm", "local"):
        step = results[label]["warmup_time_s"]
        print(f", {label} {step:.1f} s ({cold / step:.1f}x shorter)", end="")
    print(f"; cache file {cache.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
