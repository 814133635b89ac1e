"""Warm starts for ``torch.compile``: a new process's first compiled step, cold and with ``CompileCallback(cache=...)``.

Runs two fresh processes in a row on a reference workload, each with its own new, empty inductor cache folder
(``TORCHINDUCTOR_CACHE_DIR``), as two jobs on two fresh machines would: the first compiles from cold and saves the
compiled code to the cache file at the end of its fit; the second loads that file before its first step. Prints the
first step (which includes compiling) of each and the time loading the file took. Usage::

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


def run_once(args: argparse.Namespace) -> None:
    """One fit in this process: print the first step's time and the cache's part as one JSON line."""
    import lightning.pytorch as pl

    from lightning_perf.callbacks import CompileCallback
    from lightning_perf.demos import make_workload

    model, data = make_workload(args.workload, args.preset)
    callback = CompileCallback(regions=args.regions, cache=args.cache, warmup_steps=1)
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
    print("RESULT " + json.dumps(figures), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm")
    parser.add_argument("--preset", default="default", choices=("tiny", "default"))
    parser.add_argument("--regions", default=None, help="None (the whole model) or 'auto'")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--cache", type=Path, default=None, help="the cache file (default: in a temporary folder)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_once(args)
        return
    cache = args.cache or Path(tempfile.mkdtemp(prefix="compile-cache-")) / "torch_compile_cache.bin"
    cache.unlink(missing_ok=True)
    results = {}
    for label in ("cold", "warm"):
        command = [sys.executable, __file__, "--child", "--cache", str(cache), "--workload", args.workload]
        command += ["--preset", args.preset, "--steps", str(args.steps), "--accelerator", args.accelerator]
        command += ["--regions", args.regions] if args.regions else []
        with tempfile.TemporaryDirectory(prefix="inductor-") as inductor:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "PYTHONWARNINGS": "ignore"}
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        line = next(line for line in output.splitlines() if line.startswith("RESULT "))
        results[label] = json.loads(line.removeprefix("RESULT "))
        print(f"{label}: {results[label]}")
    cold, warm = results["cold"]["warmup_time_s"], results["warm"]["warmup_time_s"]
    print(
        f"\n{args.workload} ({args.preset}, regions={args.regions}): first compiled step cold {cold:.1f} s, "
        f"warm {warm:.1f} s ({cold / warm:.1f}x shorter); cache file {cache.stat().st_size / 2**20:.1f} MiB; "
        f"whole fit {results['cold']['fit_s']:.1f} s vs {results['warm']['fit_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
