"""When does PowerSGD pay? Bytes per step and step time on 2 CPU processes, and a model of 8-64 workers.

Runs four short fits of a reference workload, each in a fresh process:

- ``compute``: 1 process, no DDP: the per-worker compute time of a step;
- ``compress``: 1 process, PowerSGDDDPStrategy: compute plus the compression's own work (its all-reduces are free);
- ``ddp`` and ``powersgd``: 2 processes (gloo): bytes handed to all-reduce per step, step time, final training
  loss (PowerSGD compresses from the third step on).

Then models a step on ``n`` workers behind links of bandwidth ``B``, for plain DDP and for PowerSGD::

    ring all-reduce  = 2 (n - 1) / n * bytes / B
    plain DDP step   = compute + all-reduce(plain bytes)
    PowerSGD step    = compute + compression + all-reduce(compressed bytes)

from the measured compute time, compression time and bytes. The model ignores latency (PowerSGD makes three
all-reduce calls per bucket instead of one) and the overlap of communication with the backward pass, which hides part
of plain DDP's all-reduce; treat the break-even bandwidths it prints as upper bounds. Usage::

    python examples/powersgd_bandwidth.py                       # convnet default, rank 2
    python examples/powersgd_bandwidth.py --rank 4 --steps 30 --output powersgd.json
    python examples/powersgd_bandwidth.py --compute-speedup 50   # workers computing 50x faster (GPUs)

Each run uses one thread per process (what Lightning gives each of 2 DDP processes on this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RUNS = ("compute", "compress", "ddp", "powersgd")
WORKERS = (8, 16, 32, 64)
GBITS = (0.1, 1, 10, 100)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="convnet")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--rank", type=int, default=2, help="matrix_approximation_rank (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run, warm-up included (default 20)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the step time (default 5)")
    parser.add_argument(
        "--compute-speedup",
        type=float,
        default=1.0,
        help="model workers that compute this many times faster than one core here (e.g. 50 for a GPU); default 1",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the measurements and the model as JSON")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return parser


def worker(args: argparse.Namespace) -> None:
    """One run (both ranks of a 2-process run execute this: Lightning re-launches the script for rank 1)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_perf.demos import make_workload
    from lightning_perf.profiling import PhaseTimer
    from lightning_perf.strategies import PowerSGDDDPStrategy

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.timer = PhaseTimer(device="cpu", warmup_steps=args.warmup_steps)
            self.losses: list[float] = []

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            self.timer.start("step")

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *_: Any) -> None:
            self.timer.stop("step")
            self.timer.end_step()
            self.losses.append(float(outputs["loss"]))

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model, data = make_workload(args.workload, args.preset, seed=0)
    distributed = args.worker in ("ddp", "powersgd")
    strategy: Any = "auto"
    if args.worker in ("compress", "powersgd"):
        strategy = PowerSGDDDPStrategy(matrix_approximation_rank=args.rank, start_powerSGD_iter=2)
    elif args.worker == "ddp":
        strategy = DDPStrategy()
    clock = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if distributed else 1,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model, datamodule=data)
    if torch.distributed.is_initialized():
        # Lightning leaves the process group alive after fit; gloo's threads can then abort the interpreter's exit.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if trainer.global_rank != 0:
        return
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    result = {
        "run": args.worker,
        "step_s": clock.timer.summary()["step"].median,
        # Early in training the validation loss swings with BatchNorm's running statistics; the training loss of
        # the last quarter of the steps (rank 0's batches) is the steadier figure.
        "train_loss": sum(clock.losses[-max(1, args.steps // 4) :]) / max(1, args.steps // 4),
        "gradient_bytes": gradient_bytes,
        # Plain DDP all-reduces every gradient once per step.
        "allreduce_bytes": metrics.get("powersgd/allreduce_bytes", float(gradient_bytes)),
        "compression_rate": metrics.get("powersgd/compression_rate", 1.0),
    }
    args.result.write_text(json.dumps(result))


def model_table(measured: dict[str, dict[str, Any]], compute_speedup: float = 1.0) -> list[dict[str, Any]]:
    """Modelled step times of plain DDP and PowerSGD for each worker count and link bandwidth."""
    from lightning_perf.functional.powersgd import ring_allreduce_seconds

    compute = measured["compute"]["step_s"] / compute_speedup
    compression = max(0.0, measured["compress"]["step_s"] / compute_speedup - compute)
    plain_bytes = measured["ddp"]["allreduce_bytes"]
    compressed_bytes = measured["powersgd"]["allreduce_bytes"]
    rows = []
    for workers in WORKERS:
        for gbit in GBITS:
            bandwidth = gbit * 1e9 / 8
            plain = compute + ring_allreduce_seconds(plain_bytes, workers, bandwidth)
            powersgd = compute + compression + ring_allreduce_seconds(compressed_bytes, workers, bandwidth)
            rows.append(
                {
                    "workers": workers,
                    "gbit_s": gbit,
                    "ddp_s": plain,
                    "powersgd_s": powersgd,
                    "speedup": plain / powersgd,
                }
            )
    return rows


def main() -> None:
    args = _parser().parse_args()
    if args.worker is not None:
        worker(args)
        return
    from lightning_perf.profiling import format_bytes, format_seconds, print_table

    measured: dict[str, dict[str, Any]] = {}
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            result = Path(tmp) / f"{run}.json"
            command = [sys.executable, __file__, "--worker", run, "--result", str(result)]
            command += ["--workload", args.workload, "--preset", args.preset, "--rank", str(args.rank)]
            command += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
            print(f"running {run} ...", flush=True)
            subprocess.run(command, check=True, cwd=tmp, env=env, stdout=subprocess.DEVNULL)
            measured[run] = json.loads(result.read_text())

    ddp, powersgd = measured["ddp"], measured["powersgd"]
    print_table(
        ["run", "processes", "step (median)", "all-reduce / step", "compression", "train loss (last 25%)"],
        [
            [
                run,
                2 if run in ("ddp", "powersgd") else 1,
                format_seconds(m["step_s"]),
                format_bytes(m["allreduce_bytes"]),
                f"{m['compression_rate']:.1f}x",
                m["train_loss"],
            ]
            for run, m in measured.items()
        ],
        title=f"{args.workload} {args.preset}, rank {args.rank}, {args.steps} steps",
    )
    summary = {
        "bytes_ratio": ddp["allreduce_bytes"] / powersgd["allreduce_bytes"],
        "step_time_ratio": powersgd["step_s"] / ddp["step_s"],
        "final_loss_ratio": powersgd["train_loss"] / ddp["train_loss"],
    }
    print(
        f"PowerSGD vs DDP on 2 processes: {summary['bytes_ratio']:.1f}x fewer bytes, step time x"
        f"{summary['step_time_ratio']:.2f}, final training loss x{summary['final_loss_ratio']:.2f}"
    )
    rows = model_table(measured, args.compute_speedup)
    print_table(
        ["workers", "link", "DDP step", "PowerSGD step", "PowerSGD speed-up"],
        [
            [
                r["workers"],
                f"{r['gbit_s']} Gbit/s",
                format_seconds(r["ddp_s"]),
                format_seconds(r["powersgd_s"]),
                f"{r['speedup']:.2f}x",
            ]
            for r in rows
        ],
        title=f"Modelled step time (ring all-reduce, bandwidth only, no overlap; compute x{args.compute_speedup:g})",
    )
    if args.output is not None:
        args.output.write_text(json.dumps({"measured": measured, "summary": summary, "model": rows}, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
