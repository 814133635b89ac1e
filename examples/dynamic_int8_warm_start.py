"""Warm starts for dynamic int8: what ``QATCallback(mode="dynamic")`` adds to a ``trainer.predict`` in a new process.

Runs fresh processes in a row, each predicting 6 batches of 32 with a Linear-heavy module (two MLP blocks
1024->4096->1024 and a head): a plain predict; a first dynamic-int8 predict with an empty cache folder (it measures
the back-ends, caches the choice and, for onnxruntime, the int8 ONNX model); a second one with the same folder (it
loads the chosen back-end's int8 model and times nothing). Prints each predict's wall time, the extra time of the
two dynamic runs over the plain one, and their ratio (the goal: the second's extra time at most half the first's).
The machine's load changes every figure: run it on a quiet machine, and read several runs. Usage::

    python examples/dynamic_int8_warm_start.py
    python examples/dynamic_int8_warm_start.py --backend onnxruntime --repeats 2
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

BATCHES, BATCH_SIZE, WIDTH, HIDDEN = 6, 32, 1024, 4096


def run_once(args: argparse.Namespace) -> None:
    """One predict in this process: print its wall time and the choice as one JSON line."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_perf.callbacks import QATCallback
    from lightning_perf.deploy.quantize import recipes

    spent: list[float] = []  # the seconds inside quantize_dynamic (choose or load, convert, check), apart from predict
    quantize = recipes.quantize_dynamic

    def timed(*args: object, **kwargs: object) -> object:
        began = time.perf_counter()
        try:
            return quantize(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent.append(time.perf_counter() - began)

    recipes.quantize_dynamic = timed  # type: ignore[assignment]

    class LinearHeavy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            block = [nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH), nn.ReLU()]
            self.net = nn.Sequential(*block, *[nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH)])
            self.head = nn.Linear(WIDTH, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.net(x))

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).argmax(-1)

    x = torch.randn(BATCHES * BATCH_SIZE, WIDTH, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=BATCH_SIZE)
    callback = None if args.plain else QATCallback(mode="dynamic", backend=args.backend, submodule="net")
    callbacks: list[pl.Callback] = [] if callback is None else [callback]
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, enable_progress_bar=False)
    model = LinearHeavy()
    began = time.perf_counter()
    trainer.predict(model, loader)
    seconds = time.perf_counter() - began
    choice = None if callback is None else getattr(callback._quantizer, "choice", None)  # mode "dynamic" keeps it
    result = {"predict_s": seconds, "quantize_s": sum(spent), "backend": choice and choice.backend,
              "cached": choice and choice.cached}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


def _child(args: argparse.Namespace, cache: Path, plain: bool) -> dict:
    command = [sys.executable, __file__, "--child", "--backend", args.backend] + (["--plain"] if plain else [])
    env = {**os.environ, "LIGHTNING_PERF_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "eager", "onnxruntime", "torchao"))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of plain, first, second")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_once(args)
        return
    for round_ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="lightning-perf-cache-") as folder:
            plain = _child(args, Path(folder), plain=True)
            first = _child(args, Path(folder), plain=False)
            second = _child(args, Path(folder), plain=False)
        extra_first, extra_second = first["predict_s"] - plain["predict_s"], second["predict_s"] - plain["predict_s"]
        print(
            f"round {round_ + 1}: plain {plain['predict_s']:.2f} s; first {first['predict_s']:.2f} s "
            f"({first['backend']}, cached={first['cached']}, {first['quantize_s']:.2f} s quantizing); second "
            f"{second['predict_s']:.2f} s ({second['backend']}, cached={second['cached']}, "
            f"{second['quantize_s']:.2f} s quantizing); extra time over plain, second/first "
            f"{extra_second:.2f}/{extra_first:.2f} s = "
            f"{extra_second / max(extra_first, 1e-9):.2f}"
        )


if __name__ == "__main__":
    main()
