"""How fast MemoryProfilerCallback flags a leak, and whether it ever flags a clean model: fresh-process fits.

Each fit runs in a fresh process (as a user's training does: no heap of earlier fits), with the callback's defaults.
Kinds: ``mlp-long`` (a user-style MLP, one epoch of ``--steps`` steps: no epoch end to help), ``mlp-short`` (the same
in epochs of 64 steps), ``convnet`` and ``lm`` (the demos' ``tiny`` presets), each clean; ``leak-256k`` and
``leak-4k`` (the MLP keeping that many bytes a step, one long epoch). Printed and written (``--output``): per fit the
verdict, the step at which the leak was reported, the screens and confirmations; the command and the machine. Usage::

    python benchmarks/leak_detection.py --fits 5 --output docs/bench/leak-detection-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lightning_perf.profiling import write_json
from lightning_perf.profiling.machine import describe_machine

_FIT = """
import json, sys, tempfile, warnings
from pathlib import Path
import lightning.pytorch as pl, torch
from torch import nn
from torch.utils.data import DataLoader
from lightning_perf import MeasurementWarning
from lightning_perf.callbacks import MemoryProfilerCallback
from lightning_perf.demos import make_workload

kind, steps, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)

class MLP(pl.LightningModule):
    def __init__(self, keep=0):
        super().__init__()
        self.net, self.keep, self.kept = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), keep, []
    def training_step(self, batch, i):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        if self.keep:
            self.kept.append(torch.full((self.keep // 4,), loss.item()))
        return loss
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

pl.seed_everything(seed, verbose=False)
n = steps if kind != "mlp-short" else 64
x, y = torch.randn(n * 16, 64), torch.randint(0, 10, (n * 16,))
data = DataLoader(list(zip(x, y)), batch_size=16, shuffle=True)
if kind in ("convnet", "lm"):
    model, data = make_workload(kind, "tiny", seed=seed)
else:
    model = MLP({"leak-256k": 256 << 10, "leak-4k": 4 << 10}.get(kind, 0))
callback = MemoryProfilerCallback(verbose=False)
with tempfile.TemporaryDirectory() as root, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = pl.Trainer(default_root_dir=root, max_steps=steps, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, datamodule=data) if kind in ("convnet", "lm") else trainer.fit(model, data)
leaks = callback.report["leaks"]
print(json.dumps({"kind": kind, "seed": seed, "steps": callback.report["steps_seen"], "leaking": leaks["leaking"],
    "flagged_at_step": leaks["stopped_at_step"], "screens": leaks["screen"]["confirmations"],
    "warnings": [str(w.message)[:200] for w in caught if issubclass(w.category, MeasurementWarning)],
    "overhead_share": callback.report["overhead"]["share_of_step"]}))
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=5, help="fresh fits per kind")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kinds", default="mlp-long,mlp-short,convnet,lm,leak-256k,leak-4k")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    fits = []
    for seed in range(args.fits):
        for kind in args.kinds.split(","):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", _FIT, kind, str(args.steps), str(seed)], capture_output=True,
                                  text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            fits.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "seconds": time.perf_counter() - start})
            print(json.dumps(fits[-1])[:300], flush=True)
    clean = [f for f in fits if not f["kind"].startswith("leak")]
    leaky = [f for f in fits if f["kind"].startswith("leak")]
    summary = {
        "clean_fits": len(clean),
        "false_positives": sum(bool(f["leaking"] or f["warnings"]) for f in clean),
        "clean_confirmations_opened": sum(len(f["screens"]) for f in clean),
        "leak_fits": len(leaky),
        "leaks_missed": sum(not f["leaking"] for f in leaky),
        "flagged_at_step_max": max((f["flagged_at_step"] or 10**9 for f in leaky), default=None),
    }
    print(json.dumps(summary))
    result = {"command": "python " + " ".join(sys.argv), "machine": describe_machine(), "summary": summary,
              "fits": fits}  # fmt: skip
    if args.output:
        write_json(result, args.output)
    return result


if __name__ == "__main__":
    main()
