"""Catch a memory leak while training runs: ``MemoryProfilerCallback`` on a clean and on a leaking ``convnet``.

The leaking module keeps the output of an extra forward pass in a list, with its autograd graph and every
activation that graph saved: the classic "appended the loss/outputs without ``.detach()``". Memory read at the
same point of each step then climbs by the same amount every step; the callback fits a robust (Theil-Sen) trend with
its 95% interval and warns ("memory leak: ...") when the growth is significant, steady and above the readings' noise
floor, naming the phase of the step that grows and the rate in KiB/step with its interval. The clean run is not
flagged, whatever its allocator does. Each run prints the snapshot table
(``snapshot | time | allocated | reserved | peak | trend``), writes ``memory_profile.json`` / ``.png`` (numbered,
never over an earlier run's) and says where. Usage::

    python examples/memory_profiler_leak.py                     # tiny preset, CPU, a few seconds
    python examples/memory_profiler_leak.py --accelerator gpu --record-history   # + a memory_viz history file
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_perf import MeasurementWarning
from lightning_perf.callbacks import MemoryProfilerCallback
from lightning_perf.demos import ConvNetModule, make_workload
from lightning_perf.profiling import format_bytes


class LeakyConvNet(ConvNetModule):
    """A convnet that keeps, every step, an output that still holds its autograd graph."""

    def __init__(self, preset: str = "tiny") -> None:
        super().__init__(preset)
        self.history: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.history.append(self(batch[0]))  # the bug: should be self(batch[0]).detach(), or not kept at all
        return super().training_step(batch, batch_idx)


def run(name: str, model: pl.LightningModule, args: argparse.Namespace, output: Path) -> MemoryProfilerCallback:
    _, data = make_workload("convnet", args.preset, seed=0)
    callback = MemoryProfilerCallback(every_n_steps=5, record_history=args.record_history, plot=True)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator=args.accelerator,
        devices=1,
        callbacks=[callback],
        default_root_dir=output / name,
        logger=False,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    print(f"\n=== {name} ===")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MeasurementWarning)
        trainer.fit(model, datamodule=data)
    for warning in caught:
        if issubclass(warning.category, MeasurementWarning):
            print(f"WARNING: {warning.message}")
    return callback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=100, help="training steps (the first epoch is warm-up)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--record-history", action="store_true", help="CUDA only: write an allocation history")
    parser.add_argument("--output", type=Path, default=None, help="report directory (default: a temporary one)")
    args = parser.parse_args(argv)
    output = args.output or Path(tempfile.mkdtemp(prefix="memory-profiler-"))

    pl.seed_everything(0, verbose=False)
    clean = run("clean", make_workload("convnet", args.preset, seed=0)[0], args, output)
    leaky = run("leaking", LeakyConvNet(args.preset), args, output)
    for name, callback in (("clean", clean), ("leaking", leaky)):
        assert callback.report is not None
        trend = callback.report["leaks"]["trends"]["after_optimizer"]
        print(
            f"{name:8s} growth after the optimizer step: {format_bytes(trend.slope)}/step "
            f"(95% interval {format_bytes(trend.slope_low)} to {format_bytes(trend.slope_high)}), noise floor "
            f"{format_bytes(trend.noise_floor)}; leaking points: {callback.report['leaks']['leaking'] or 'none'}; "
            f"report: {callback.report['json']}"
        )


if __name__ == "__main__":
    main()
