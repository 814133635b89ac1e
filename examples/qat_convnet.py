"""Quantization-aware training of the ``convnet`` reference workload: accuracy, int8 speed, training overhead.

This script trains the same ResNet-style classifier twice from the same seed, on the same batches:

1. in fp32 (the baseline), and
2. with :class:`~lightning_perf.callbacks.QATCallback` (x86 PT2E: fake quantization during training; batch-norm
   statistics and observers frozen for the last epoch), which at the end converts the model to int8, validates it on
   the whole validation split, saves it (the artifact set ``<out>/model_int8/``, holding ``model_int8.pt2``) and
   times it against the fp32 model, both compiled by inductor with weight freezing, at batch 1 and 32.

It prints the validation accuracy of the fp32 model, of the fake-quantized model and of the int8 model (the gaps
in percentage points), the int8 latency against fp32 (each speed-up with its 95% interval and verdict), and the
median training step of both runs (the cost of fake quantization; ``lightning-perf bench --workload convnet
--configs baseline,qat`` measures that properly, in fresh processes with interleaved repeats). Timings on a shared
CPU swing: read the ratios, not the milliseconds.

Usage::

    python examples/qat_convnet.py                           # default preset, 4 epochs: several minutes on 2 cores
    python examples/qat_convnet.py --preset tiny --epochs 2  # a quick look
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_perf.callbacks import QATCallback
from lightning_perf.demos import make_workload
from lightning_perf.profiling import PhaseTimer, format_seconds


class StepClock(pl.Callback):
    """Median training step (forward, backward, optimizer) after ``warmup`` steps, on the host clock."""

    def __init__(self, warmup: int = 5) -> None:
        self.timer = PhaseTimer("cpu", warmup_steps=warmup)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self.timer.start("step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.timer.stop("step")
        self.timer.end_step()

    @property
    def median_s(self) -> float:
        return self.timer.summary()["step"].median


def fit(preset: str, epochs: int, callbacks: list[pl.Callback], root: Path) -> tuple[pl.LightningModule, float]:
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", preset, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(model, datamodule=data)
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)
    return model, float(metrics["val_acc"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default", choices=("tiny", "default"))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("qat-convnet"))
    args = parser.parse_args()
    last = max(args.epochs - 1, 1)

    fp32_clock = StepClock()
    _, fp32_accuracy = fit(args.preset, args.epochs, [fp32_clock], args.out / "fp32")

    qat_clock = StepClock()
    callback = QATCallback(
        freeze_bn_after=last,
        disable_observers_after=last,
        validation_batches=None,  # the whole validation split
        dirpath=args.out,
    )
    _, fake_quant_accuracy = fit(args.preset, args.epochs, [callback, qat_clock], args.out / "qat")

    report = callback.report
    if report is None or not report.ok or report.validation is None:
        raise SystemExit(f"No int8 model: {report.problems if report else 'the callback did not run'}")
    validation = report.validation
    int8_accuracy = validation.quantized_accuracy or 0.0
    print(f"\nconvnet/{args.preset}, {args.epochs} epochs, validation split ({validation.samples} samples):")
    print(f"  fp32 model                 {100 * fp32_accuracy:6.2f}%")
    print(f"  fake-quantized (QAT) model {100 * fake_quant_accuracy:6.2f}%")
    print(
        f"  int8 model                 {100 * int8_accuracy:6.2f}%   (fp32 - int8: "
        f"{100 * (fp32_accuracy - int8_accuracy):+.2f} pp; fake-quantized - int8: {validation.accuracy_gap:+.2f} pp; "
        f"cosine to the fake-quantized outputs {validation.cosine:.5f})"
    )
    print("int8 vs fp32 latency, both compiled with inductor + freezing:")
    for row in report.latency:
        print(
            f"  batch {row.batch_size:>3}: fp32 {format_seconds(row.float_median_s):>9}, int8 "
            f"{format_seconds(row.quantized_median_s):>9}: speed-up {row.format_speedup()} (95% interval)"
        )
    print(
        f"training step (median): fp32 {format_seconds(fp32_clock.median_s)}, "
        f"QAT {format_seconds(qat_clock.median_s)}: "
        f"fake quantization costs {qat_clock.median_s / fp32_clock.median_s:.2f}x"
    )
    print(f"int8 model: {report.artifact}; report: {report.report_path}")


if __name__ == "__main__":
    main()
