"""2-process (gloo, CPU) fits with PowerSGDDDPStrategy: ``python tests/strategies/_powersgd_ddp.py RESULT ROOT``.

Lightning's ``ddp`` launcher re-runs this script for rank 1, which then runs the same fits in the same order; the
process group stays up between fits, so one launch serves every fit below. Rank 0 writes what it measured to RESULT
(JSON); ``tests/strategies/test_powersgd.py`` makes the assertions.

Fits (convnet ``tiny``: 16 batches per epoch over 2 ranks, so 8 optimizer steps per epoch):

1. ``plain``: Lightning's DDPStrategy, 5 epochs; ``powersgd``: the same with PowerSGD at rank 4 (default start
   iteration), logging to a CSVLogger: convergence parity, compression statistics, logging.
2. ``straight``: PowerSGD, 2 epochs, small buckets, a checkpoint at the end of epoch 1 (ModelCheckpoint, during
   the fit); ``resumed``: epoch 2 from that checkpoint, from other initial weights: resume equals uninterrupted,
   per-rank residuals restored.
3. ``stacked``: gradient accumulation 2, bf16-mixed, and every convnet callback of the test registry (but
   CompileCallback, see ``_TOO_SLOW_FOR_TWO_PROCESSES``) plus CountingCallback; ``batched``: the batched hook.

Every fit runs after ``seed_everything(0)``: Lightning seeds its DistributedSampler from it.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_perf.demos import make_workload
from lightning_perf.strategies import PowerSGDDDPStrategy
from tests._trivial import CountingCallback
from tests.callback_settings import SETTINGS
from tests.callbacks._quiet import quiet_trainer

STEPS_PER_EPOCH = 8
# Compiling a DDP model splits its graph at every bucket (dynamo's DDPOptimizer): minutes per run on a 2-core machine.
_TOO_SLOW_FOR_TWO_PROCESSES = {"CompileCallback"}


def _trainer(root: Path, strategy: Any, **overrides: Any) -> pl.Trainer:
    options = {"devices": 2, "strategy": strategy, "max_epochs": -1, **overrides}
    return quiet_trainer(root, options.pop("callbacks", []), **options)


def _gather(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _params_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def _residual_checksum(strategy: PowerSGDDDPStrategy) -> float:
    assert strategy.powersgd is not None
    residuals = strategy.powersgd.state_dict()["residuals"][0]
    return float(sum(t.double().abs().sum() for t in residuals.values()))


def _val_loss(model: pl.LightningModule, data: pl.LightningDataModule) -> float:
    """Cross-entropy over the whole validation split, on this rank (the weights are the same on every rank)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            total += float(torch.nn.functional.cross_entropy(model(x), y, reduction="sum"))
            count += len(y)
    model.train()
    return total / count


def _metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("powersgd/")}


def parity(root: Path) -> dict[str, Any]:
    epochs = 5
    out: dict[str, Any] = {"steps": epochs * STEPS_PER_EPOCH}
    for name in ("plain", "powersgd"):
        pl.seed_everything(0, verbose=False)
        model, data = make_workload("convnet", "tiny", seed=0)
        if name == "plain":
            trainer = _trainer(root / name, DDPStrategy(), max_epochs=epochs)
        else:
            logger = CSVLogger(root, name="csv", version=0)
            strategy = PowerSGDDDPStrategy(matrix_approximation_rank=4)
            trainer = _trainer(root / name, strategy, max_epochs=epochs, logger=logger, log_every_n_steps=1)
        trainer.fit(model, datamodule=data)
        out[f"{name}_val_loss"] = _val_loss(model, data)
        out[f"{name}_global_step"] = trainer.global_step
        if name == "powersgd":
            hook = strategy.powersgd
            assert hook is not None
            out["start_powerSGD_iter"] = hook.state.start_powerSGD_iter
            out["iter"] = hook.state.iter
            out["synchronous"] = hook.synchronous
            out["relayouts"] = hook.relayouts
            out["metrics"] = _metrics(trainer)
            out["ranks_agree"] = len(set(_gather(_params_checksum(model)))) == 1
            if trainer.global_rank == 0:
                with open(Path(logger.log_dir) / "metrics.csv") as f:
                    rows = list(csv.DictReader(f))
                out["csv_compression_rates"] = [
                    float(r["powersgd/compression_rate"]) for r in rows if r.get("powersgd/compression_rate")
                ]
    return out


class _ResidualChecksums(Callback):
    """This rank's residual checksum when training starts (after a restore) and at the end of each epoch."""

    def __init__(self) -> None:
        self.at_start: float | None = None
        self.at_epoch_end: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = _residual_checksum(trainer.strategy)  # type: ignore[arg-type]

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs before ModelCheckpoint's save in the same hook (Lightning runs checkpoint callbacks last).
        self.at_epoch_end.append(_residual_checksum(trainer.strategy))  # type: ignore[arg-type]


def resume(root: Path) -> dict[str, Any]:
    def strategy() -> PowerSGDDDPStrategy:
        # Small buckets: several per step, as in the gloo deadlock of torch's own hook, and a real bucket rebuild.
        return PowerSGDDDPStrategy(matrix_approximation_rank=2, start_powerSGD_iter=2, bucket_cap_mb=0.02)

    out: dict[str, Any] = {}
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    saver = ModelCheckpoint(dirpath=root / "ckpts", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    straight_probe = _ResidualChecksums()
    straight = _trainer(
        root / "straight", strategy(), max_epochs=2, enable_checkpointing=True, callbacks=[straight_probe, saver]
    )
    straight.fit(model, datamodule=data)
    out["saved_residual_checksums"] = _gather(straight_probe.at_epoch_end[0])

    pl.seed_everything(0, verbose=False)
    resumed_model, _ = make_workload("convnet", "tiny", seed=1)  # other initial weights: the checkpoint must win
    _, resumed_data = make_workload("convnet", "tiny", seed=0)  # the seed also picks the data
    probe = _ResidualChecksums()
    resumed_strategy = strategy()
    resumed = _trainer(root / "resumed", resumed_strategy, max_epochs=2, callbacks=[probe])
    ckpt = root / "ckpts" / "epoch=0.ckpt"
    resumed.fit(resumed_model, datamodule=resumed_data, ckpt_path=ckpt)
    out["restored_residual_checksums"] = _gather(probe.at_start)
    assert resumed_strategy.powersgd is not None
    out["resumed_iter"] = resumed_strategy.powersgd.state.iter
    out["resumed_relayouts"] = resumed_strategy.powersgd.relayouts
    out["global_steps"] = [straight.global_step, resumed.global_step]
    out["max_param_diff"] = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), resumed_model.parameters())
    )

    if straight.global_rank == 0:
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)["powersgd"]
        out["checkpoint"] = {
            "world_size": saved["world_size"],
            "iter": saved["iter"],
            "q_groups": len(saved["q"]),
            "residual_checksums": [float(sum(t.double().abs().sum() for t in r.values())) for r in saved["residuals"]],
        }
    return out


def stacked(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    callbacks: list[Callback] = [CountingCallback()]
    names = ["CountingCallback"]
    for setting in SETTINGS:
        usable = setting.workload == "convnet" and setting.ddp and not setting.trainer_kwargs and not setting.marks
        usable = usable and setting.id not in _TOO_SLOW_FOR_TWO_PROCESSES
        if usable and not setting.is_strategy and not setting.test_only:
            callbacks.append(setting.build())
            names.append(setting.id)
    out["callbacks"] = names
    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    strategy = PowerSGDDDPStrategy(start_powerSGD_iter=2)
    trainer = _trainer(
        root / "stacked", strategy, max_steps=4, accumulate_grad_batches=2, precision="bf16-mixed", callbacks=callbacks
    )
    trainer.fit(model, datamodule=data)
    assert strategy.powersgd is not None
    out["global_step"] = trainer.global_step
    out["iter"] = strategy.powersgd.state.iter
    out["count"] = callbacks[0].count  # type: ignore[attr-defined]
    out["metrics"] = _metrics(trainer)
    out["train_loss"] = float(trainer.callback_metrics["train_loss"])
    out["ranks_agree"] = len(set(_gather(_params_checksum(model)))) == 1

    pl.seed_everything(0, verbose=False)
    model, data = make_workload("convnet", "tiny", seed=0)
    batched = PowerSGDDDPStrategy(hook="batched", matrix_approximation_rank=1, start_powerSGD_iter=2)
    trainer = _trainer(root / "batched", batched, max_steps=4)
    trainer.fit(model, datamodule=data)
    out["batched_metrics"] = _metrics(trainer)
    out["batched_loss"] = float(trainer.callback_metrics["train_loss"])
    out["batched_ranks_agree"] = len(set(_gather(_params_checksum(model)))) == 1
    return out


def main() -> None:
    result_path, root = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, Any] = {}
    for name, run in (("parity", parity), ("resume", resume), ("stacked", stacked)):
        start = time.perf_counter()
        result[name] = run(root)
        result[name]["wall_s"] = time.perf_counter() - start
    result["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        result_path.write_text(json.dumps(result, indent=1))
    # Lightning leaves the process group alive after fit; without this gloo's threads can abort the interpreter's exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
