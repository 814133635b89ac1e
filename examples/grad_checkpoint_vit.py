"""Activation checkpointing on the ``vit`` reference workload: which blocks are wrapped, and what it saves.

Trains a few steps with :class:`~lightning_perf.callbacks.GradCheckpointCallback` and prints the blocks it wrapped
(found by structure: the ViT's repeated encoder blocks), then counts the bytes autograd keeps for backward in one
training step, with and without checkpointing (an exact count of saved activations, parameters excluded; the
``lightning-perf bench --configs baseline,grad_checkpoint`` column "step memory" measures the process's real peak).
Usage::

    python examples/grad_checkpoint_vit.py                  # tiny preset, a few seconds
    python examples/grad_checkpoint_vit.py --preset default --fraction 0.5
"""

from __future__ import annotations

import argparse
import copy

import lightning.pytorch as pl
import torch

from lightning_perf.callbacks import GradCheckpointCallback
from lightning_perf.demos import make_workload
from lightning_perf.functional.grad_checkpoint import apply_activation_checkpointing


def saved_activation_bytes(model: pl.LightningModule, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward in one step (outside checkpointed blocks)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    images, labels = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.cross_entropy(model(images), labels).backward()
    return sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--every-n", type=int, default=None, help="checkpoint every n-th block only")
    parser.add_argument("--fraction", type=float, default=None, help="checkpoint the first fraction of the blocks")
    args = parser.parse_args()

    model, data = make_workload("vit", args.preset, seed=0)
    callback = GradCheckpointCallback(every_n=args.every_n, fraction=args.fraction)
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)
    print(f"checkpointed {len(callback.wrapped)} blocks: {', '.join(callback.wrapped)}")

    batch = next(iter(data.train_dataloader()))
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, every_n=args.every_n, fraction=args.fraction)
    plain_bytes, wrapped_bytes = saved_activation_bytes(model, batch), saved_activation_bytes(wrapped, batch)
    print(
        f"activations saved for backward: {plain_bytes / 2**20:.2f} MiB plain, {wrapped_bytes / 2**20:.2f} MiB "
        f"checkpointed ({wrapped_bytes / plain_bytes:.2f}x)"
    )


if __name__ == "__main__":
    main()
