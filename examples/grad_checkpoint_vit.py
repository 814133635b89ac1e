"""Activation checkpointing on the ``vit`` reference workload: which blocks are wrapped, and what it saves.

Trains a few steps with :class:`~lightning_perf.callbacks.GradCheckpointCallback` and prints the blocks it wrapped
(found by structure: the ViT's repeated encoder blocks), then counts the bytes autograd keeps for backward in one
training step, with and without checkpointing (an exact count of saved activations, parameters excluded; the
``lightning-perf bench --configs baseline,grad_checkpoint`` column "step memory" measures the process's real peak).
Usage::

    python examples/grad_checkpoint_vit.py                  # tiny preset, a few seconds
    python examples/grad_checkpoint_vit.py --preset default --fraction 0.5
    python examples/grad_checkpoint_vit.py --memory-budget 0.5 --workload lm   # plan, memory and step time

With ``--memory-budget`` it profiles one step, plans none/selective/part/full checkpointing per block to that budget
(:mod:`lightning_perf.functional.checkpoint.budget`), prints the plan, the activation memory the allocator measures
with and without it (one forward each, exact bytes), and the step time ratio of the two from paired, interleaved
repeats with its 95% interval and verdict.
"""

from __future__ import annotations

import argparse
import copy

import lightning.pytorch as pl
import torch

from lightning_perf.callbacks import GradCheckpointCallback
from lightning_perf.demos import make_workload
from lightning_perf.functional.checkpoint.apply import apply_activation_checkpointing


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


def budget_report(workload: str, preset: str, budget: float, repeats: int) -> None:
    """Plan to ``budget``; measure kept activation memory and step time against no checkpointing."""
    from lightning_perf.functional.checkpoint.apply import select_blocks
    from lightning_perf.functional.checkpoint.budget import apply_plan, plan_checkpointing, profile_activations
    from lightning_perf.profiling.intervals import paired_ratio
    from lightning_perf.profiling.latency import paired_blocks
    from lightning_perf.profiling.memory import MemoryProbe

    model, data = make_workload(workload, preset, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    plain, planned = model.train(), copy.deepcopy(model).train()

    def forward(m: pl.LightningModule) -> torch.Tensor:
        return m.compute(batch)[0]  # type: ignore[operator]  # DemoModule.compute, not a Tensor

    profile, loss = profile_activations(plain, select_blocks(plain), lambda: forward(plain))
    loss.backward()
    plan = plan_checkpointing(profile, budget)
    apply_plan(planned, plan)

    probe = MemoryProbe("cpu")

    def kept(m: pl.LightningModule) -> int:
        m.zero_grad(set_to_none=True)
        before = probe.allocated()
        out = forward(m)
        grown = probe.allocated() - before
        out.backward()
        return grown

    plain_kept, planned_kept = kept(plain), kept(planned)
    print(plan.with_measurement(planned_kept).describe())
    print(
        f"allocator, one forward: {plain_kept / 2**20:.1f} MiB without checkpointing, {planned_kept / 2**20:.1f} MiB "
        f"with the plan ({planned_kept / plain_kept:.2f}x)"
    )

    def step(m: pl.LightningModule) -> None:
        m.zero_grad(set_to_none=True)
        forward(m).backward()

    base, cand = [], []
    for _ in range(repeats):  # ABBA rounds, each two paired blocks of two steps
        b, c = paired_blocks(lambda: step(plain), lambda: step(planned), iterations=4, warmup=1)
        base += b
        cand += c
    estimate = paired_ratio(cand, base, above_one="slower", below_one="faster")  # planned time over plain time
    print(
        f"step time with the plan / without: {estimate.ratio:.2f}x (95% interval {estimate.low:.2f}-"
        f"{estimate.high:.2f}, {estimate.verdict}; {estimate.n} paired blocks)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--every-n", type=int, default=None, help="checkpoint every n-th block only")
    parser.add_argument("--fraction", type=float, default=None, help="checkpoint the first fraction of the blocks")
    parser.add_argument("--memory-budget", type=float, default=None, help="plan to this activation memory budget")
    parser.add_argument("--workload", default="vit", choices=("vit", "lm"), help="with --memory-budget")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per side, with --memory-budget")
    args = parser.parse_args()
    if args.memory_budget is not None:
        budget_report(args.workload, args.preset, args.memory_budget, args.repeats)
        return

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
