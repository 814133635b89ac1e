"""The (activation memory, step time) curve of eager activation checkpointing on a reference workload.

Variants, all eager, on one model in one process, interleaved round by round so that a load change on a shared machine
hits all of them alike: ``none``; ``budget-0.25`` / ``budget-0.5`` / ``budget-0.75`` (the planner of
:mod:`lightning_perf.functional.checkpoint_budget`, profiled once on the plain model); ``full`` (every ``"auto"``
block checkpointed); ``per-op`` (torchtitan's selective policy on every block: keep the matmul, convolution and
attention outputs, recompute the rest).

Per variant: the activation memory kept for backward (the allocator's growth over the forward, glibc ``mallinfo2`` on
CPU or ``memory_allocated`` on CUDA, gradients freed before, as :class:`~lightning_perf.profiling.memory.MemoryProbe`
reads it), as a ratio to ``none``; and the step time (forward, backward, AdamW step) as a ratio to ``none`` in the same
round: median over rounds with the lowest and highest round. On CPU with one thread the clock is the thread's CPU time,
which other processes do not inflate (``--clock wall`` for wall time).

Usage::

    python benchmarks/checkpoint_budget_curve.py --workload lm --rounds 5
    python benchmarks/checkpoint_budget_curve.py --workload vit --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

BUDGETS = (0.25, 0.5, 0.75)
VARIANTS = ("none", *(f"budget-{b:g}" for b in BUDGETS), "full", "per-op")


def _setups(model: Any, batch: Any, plans: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Per variant, a function that puts it in place on ``model`` (from the plain model) and returns its description;
    the budget variants' plans are put in ``plans``."""
    from lightning_perf.functional.checkpoint_budget import (
        plan_checkpointing,
        profile_activations,
        selective_context_fn,
    )
    from lightning_perf.functional.grad_checkpoint import apply_activation_checkpointing, select_blocks

    blocks = select_blocks(model)
    model.zero_grad(set_to_none=True)
    profile, loss = profile_activations(model, blocks, lambda: model.compute(batch)[0])
    loss.backward()
    plans.update({f"budget-{b:g}": plan_checkpointing(profile, b) for b in BUDGETS})
    setups: dict[str, Callable[[], Any]] = {"none": lambda: "no checkpointing"}
    for name, plan in plans.items():
        setups[name] = functools.partial(_apply_and_describe, model, plan)
    setups["full"] = lambda: f"full, {len(apply_activation_checkpointing(model))} blocks"
    keep_expensive = selective_context_fn(["matmul", "conv", "attention"])
    setups["per-op"] = lambda: f"per-op, {len(apply_activation_checkpointing(model, context_fn=keep_expensive))} blocks"
    return setups


def _apply_and_describe(model: Any, plan: Any) -> str:
    from lightning_perf.functional.checkpoint_budget import apply_plan

    apply_plan(model, plan)
    return str(plan.describe())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (the preset's by default)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("thread", "wall"), default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--verbose", action="store_true", help="print each plan")
    args = parser.parse_args(argv)

    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.functional.grad_checkpoint import remove_activation_checkpointing
    from lightning_perf.profiling.memory import MemoryProbe

    torch.set_num_threads(args.threads)
    overrides = {"depth": args.depth} if args.depth else {}
    model: Any
    model, data = make_workload(args.workload, args.preset, batch_size=args.batch_size, **overrides)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clock = args.clock or ("thread" if args.threads == 1 else "wall")
    now = time.thread_time if clock == "thread" else time.perf_counter
    probe = MemoryProbe("cpu")
    variants = args.variants.split(",")
    plans: dict[str, Any] = {}
    setups = _setups(model, batch, plans)

    def step() -> float:
        began = now()
        optimizer.zero_grad(set_to_none=True)
        model.compute(batch)[0].backward()
        optimizer.step()
        return now() - began

    def kept() -> int:
        optimizer.zero_grad(set_to_none=True)
        before = probe.allocated()
        loss = model.compute(batch)[0]
        grown = probe.allocated() - before
        loss.backward()
        return grown

    memory: dict[str, list[int]] = {v: [] for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]  # rotate the order
        for variant in order:
            described = setups[variant]()
            if args.verbose and round_ == 0:
                print(f"{variant}: {described}", flush=True)
            step()  # warm-up
            memory[variant].append(kept())
            times[variant].append(statistics.median(step() for _ in range(args.steps)))
            remove_activation_checkpointing(model)
        print(f"round {round_ + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
    _table(args, clock, variants, memory, times, plans)


def _table(
    args: argparse.Namespace,
    clock: str,
    variants: list[str],
    memory: dict[str, list[int]],
    times: dict[str, list[float]],
    plans: dict[str, Any],
) -> None:
    base_memory = statistics.median(memory["none"]) if "none" in memory else float("nan")
    print(
        f"\n{args.workload} ({args.preset}{f', depth {args.depth}' if args.depth else ''}), {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.steps} steps, {clock} clock, load now {os.getloadavg()[0]:.1f}"
    )
    print(
        "| variant | activations (MiB) | x none | expected x none | expected recompute (% of blocks' forward) "
        "| step (ms) | step x none: median [min, max] over rounds |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant in variants:
        kept = statistics.median(memory[variant])
        step_ms = statistics.median(times[variant]) * 1e3
        if "none" in times:
            ratios = [t / n for t, n in zip(times[variant], times["none"])]
            spread = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        else:
            spread = "-"
        plan = plans.get(variant)
        expected = f"{plan.expected_ratio:.2f}" if plan else "-"
        recompute = f"{plan.expected_recompute_s / plan.forward_s:.0%}" if plan and plan.forward_s else "-"
        print(
            f"| {variant} | {kept / 2**20:.1f} | {kept / base_memory:.2f} | {expected} | {recompute} | {step_ms:.1f} "
            f"| {spread} |"
        )


if __name__ == "__main__":
    main()
