"""Where does a training step's time go? ``BottleneckCallback`` on the ``convnet`` reference workload.

Trains a few dozen steps, then prints the phase table (data wait, host-to-device transfer, forward, backward,
optimizer step, the rest) with the recommendations and the evidence behind each, and writes ``bottleneck.json`` and
``bottleneck.png`` next to the CSV logs, where the live shares are logged every few steps too (and shown in the
progress bar). Run it with ``--num-workers 0`` and ``--num-workers 2`` and compare the data wait. Usage::

    python examples/bottleneck_convnet.py                       # tiny preset, CPU, a few seconds
    python examples/bottleneck_convnet.py --num-workers 2
    python examples/bottleneck_convnet.py --preset default --accelerator gpu --steps 200
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_perf.callbacks import BottleneckCallback
from lightning_perf.demos import make_workload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--output", type=Path, default=None, help="log directory (default: a temporary one)")
    args = parser.parse_args(argv)

    output = args.output or Path(tempfile.mkdtemp(prefix="bottleneck-"))
    pl.seed_everything(0, verbose=False)
    model, data = make_workload(
        "convnet", args.preset, num_workers=args.num_workers, persistent_workers=args.num_workers > 0
    )
    callback = BottleneckCallback(log_every_n_steps=10, progress_bar=True, plot=True)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator=args.accelerator,
        devices=1,
        callbacks=[callback],
        logger=CSVLogger(output, name="bottleneck"),
        limit_val_batches=2,
        val_check_interval=10,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)  # the table and the advice are printed at the end of fit
    assert callback.report is not None
    print(f"\nreport: {callback.report['json']}\nchart:  {callback.report['plot'] or callback.report['plot_note']}")


if __name__ == "__main__":
    main()
