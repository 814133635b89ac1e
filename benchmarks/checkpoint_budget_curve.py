"""The (activation memory, step time) curve of eager activation checkpointing on a reference workload.

Variants, all eager: ``none``; ``none-again`` (a second plain model: the A/A check, whose interval must cover 1);
``budget-0.25`` / ``budget-0.5`` / ``budget-0.75`` (the planner of :mod:`lightning_perf.functional.checkpoint.budget`,
profiled on a warm step of the plain model, as ``GradCheckpointCallback(memory_budget=...)`` does); ``full`` (every
``"auto"`` block checkpointed); ``per-op`` (torchtitan's selective policy on every block: keep the matmul, convolution
and attention outputs, recompute the rest).

How step time is measured (a shared, busy machine shifts between speed regimes that last hundreds of steps, so
separate fits or processes compare badly): in one process, one model per variant (copies of the same model: same
weights), each with its checkpointing applied by the library's own functions (``plan_checkpointing`` / ``apply_plan``
for a budget, ``apply_activation_checkpointing`` for ``full`` and ``per-op``: what the callback runs) and its own AdamW.
The variants then take turns in short blocks (``--steps`` steps each, the order rotated every round, on the same
batches), every step timed with ``time.thread_time_ns`` and ``time.perf_counter_ns``. Each variant's step time is a
ratio, round by round, to the plain models' in the same round (median of its steps over the geometric mean of the
medians of ``none`` and ``none-again``: two identical models at different places in the turn, see :func:`ratios`), and
the rounds' ratios give a 95% interval (:func:`lightning_perf.profiling.intervals.paired_ratio`: a t interval on their
logarithms from 5 rounds on). ``none-again`` over ``none`` is the A/A check. The thread clock is the primary one with
one thread (other processes do not inflate it); ``--clock wall`` for wall time. Both are printed.

Per variant also the activation memory kept for backward (the allocator's growth over the forward, glibc
``mallinfo2`` on CPU, gradients freed before, as :class:`~lightning_perf.profiling.memory.MemoryProbe` reads it), as a
ratio to ``none``.

``--explain`` prints, per block, every option the planner weighs (memory kept, recompute time, MiB freed per ms) and
the plan at each budget.

Usage::

    python benchmarks/checkpoint_budget_curve.py --workload vit --rounds 40 --steps 1
    python benchmarks/checkpoint_budget_curve.py --workload lm --rounds 40 --steps 1 --explain
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

BUDGETS = (0.25, 0.5, 0.75)
VARIANTS = ("none", "none-again", *(f"budget-{b:g}" for b in BUDGETS), "full", "per-op")
PLAIN = ("none", "none-again")


@dataclass
class Runner:
    """One variant: its model (checkpointing applied), its optimizer, and what it measured."""

    name: str
    model: Any
    optimizer: Any
    description: str
    thread_ns: list[list[int]] = field(default_factory=list)  # per round, its steps
    wall_ns: list[list[int]] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)

    def step(self, batch: Any) -> tuple[int, int]:
        """One training step (zero_grad, forward, backward, AdamW step): (thread ns, wall ns)."""
        wall, thread = time.perf_counter_ns(), time.thread_time_ns()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.compute(batch)[0].backward()
        self.optimizer.step()
        return time.thread_time_ns() - thread, time.perf_counter_ns() - wall

    def kept(self, batch: Any, probe: Any) -> int:
        """The allocator's growth over one forward (the activations kept for backward plus the loss)."""
        self.optimizer.zero_grad(set_to_none=True)
        before = probe.allocated()
        loss = self.model.compute(batch)[0]
        grown = int(probe.allocated() - before)
        loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        return grown


def plan_on_warm_step(
    model: Any, batch: Any, budgets: tuple[float, ...], warmup: int = 2
) -> tuple[Any, dict[str, Any]]:
    """Profile the plain ``model`` on a warm step (after ``warmup`` plain steps) and plan each budget.

    Returns the profile and ``{"budget-B": plan}``. No optimizer step: the weights are left as they were.
    """
    from lightning_perf.functional.checkpoint.apply import select_blocks
    from lightning_perf.functional.checkpoint.budget import plan_checkpointing, profile_activations

    blocks = select_blocks(model)
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        model.compute(batch)[0].backward()
    model.zero_grad(set_to_none=True)
    profile, loss = profile_activations(model, blocks, lambda: model.compute(batch)[0])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return profile, {f"budget-{b:g}": plan_checkpointing(profile, b) for b in budgets}


def build_runner(name: str, base: Any, plans: dict[str, Any], lr: float = 1e-4) -> Runner:
    """A copy of the plain ``base`` model with variant ``name``'s checkpointing applied, and its own AdamW."""
    import torch

    from lightning_perf.functional.checkpoint.apply import apply_activation_checkpointing
    from lightning_perf.functional.checkpoint.budget import apply_plan, selective_context_fn

    model = copy.deepcopy(base)
    if name in PLAIN:
        description = "no checkpointing"
    elif name in plans:
        apply_plan(model, plans[name])
        description = plans[name].describe()
    elif name == "full":
        description = f"full, {len(apply_activation_checkpointing(model))} blocks"
    elif name == "per-op":
        keep_expensive = selective_context_fn(["matmul", "conv", "attention"])
        description = f"per-op, {len(apply_activation_checkpointing(model, context_fn=keep_expensive))} blocks"
    else:
        raise ValueError(f"Unknown variant {name!r}. Expected some of {list(VARIANTS)}.")
    return Runner(name, model, torch.optim.AdamW(model.parameters(), lr=lr), description)


def run_rounds(runners: list[Runner], batches: list[Any], rounds: int, steps: int, log: bool = True) -> None:
    """Let the runners take turns: per round, each runs ``steps`` timed steps on the round's batches, the order
    rotated by one every round (so that no variant always follows the same one)."""
    for round_ in range(rounds):
        shift = round_ % len(runners)
        order = runners[shift:] + runners[:shift]
        chosen = [batches[(round_ * steps + i) % len(batches)] for i in range(steps)]
        for runner in order:
            samples = [runner.step(batch) for batch in chosen]
            runner.thread_ns.append([s[0] for s in samples])
            runner.wall_ns.append([s[1] for s in samples])
        if log and (round_ + 1) % max(1, rounds // 10) == 0:
            print(f"round {round_ + 1}/{rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)


def ratios(runners: list[Runner], clock: str) -> dict[str, Any]:
    """Per variant, its step time over the plain models', round by round: a
    :class:`~lightning_perf.profiling.intervals.RatioEstimate` (``None`` for ``none`` itself or without it).

    The baseline of a round is the geometric mean of the medians of ``none`` and ``none-again`` (of ``none`` alone
    when ``none-again`` is not run): two identical models at different places in the turn, so that neither one's
    place nor its copy of the weights in memory biases every ratio. ``none-again`` itself is compared with ``none``
    alone: the A/A check.
    """
    from lightning_perf.profiling.intervals import paired_ratio

    by_name = {r.name: r for r in runners}
    if "none" not in by_name:
        return {r.name: None for r in runners}
    plain = [getattr(by_name[n], f"{clock}_ns") for n in PLAIN if n in by_name]
    base = [statistics.geometric_mean(statistics.median(p[i]) for p in plain) for i in range(len(plain[0]))]
    estimates: dict[str, Any] = {"none": None}
    for r in runners:
        if r.name == "none":
            continue
        samples = getattr(r, f"{clock}_ns")
        if r.name == "none-again":
            estimates[r.name] = paired_ratio(samples, plain[0], above_one="slower", below_one="faster")
        else:
            mine = [float(statistics.median(round_)) for round_ in samples]
            estimates[r.name] = paired_ratio(mine, base, above_one="slower", below_one="faster")
    return estimates


def explain(profile: Any, plans: dict[str, Any]) -> str:
    """Per block, each option the planner weighs (memory kept, recompute ms, MiB freed per ms) and each plan's
    choice for it."""
    from lightning_perf.functional.checkpoint.plan import _block_options, pool_identical_blocks

    lines = [
        f"profile: {profile.total_saved_bytes / 2**20:.1f} MiB saved for backward, "
        f"{profile.outside_bytes / 2**20:.1f} outside the blocks"
    ]
    for index, block in enumerate(pool_identical_blocks(profile.blocks)):  # the times the planner uses
        chosen = {name: plan.choices[index] for name, plan in plans.items()}
        picks = ", ".join(
            f"{name}: {_choice_label(block.name, c.mode, c.kept_ops, c.parts, c.recomputed)}"
            for name, c in chosen.items()
        )
        lines.append(
            f"{block.name}: saves {block.saved_bytes / 2**20:.2f} MiB, forward {block.forward_s * 1e3:.1f} ms; {picks}"
        )
        for seconds, kept, mode, ops, cheap in sorted(_block_options(block), key=lambda o: (-o[1], o[0])):
            freed = (block.saved_bytes - kept) / 2**20
            rate = f"{freed / (seconds * 1e3):.2f}" if seconds > 0 else "-"
            lines.append(
                f"    {_choice_label(block.name, mode, ops, ops, cheap):<44} keeps {kept / 2**20:6.2f} MiB, recompute "
                f"{seconds * 1e3:6.2f} ms, {rate} MiB freed per ms"
            )
    return "\n".join(lines)


def _choice_label(block: str, mode: str, ops: tuple[str, ...], parts: tuple[str, ...], cheap: tuple[str, ...]) -> str:
    def short(names: tuple[str, ...]) -> str:
        return "+".join(n[len(block) + 1 :] if n.startswith(block + ".") else n for n in names)

    label = {"selective": f"selective keep {'/'.join(ops)}", "parts": f"parts {short(parts)}"}.get(mode, mode)
    return label + (f" (recompute {short(cheap)})" if cheap else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", default="lm")
    parser.add_argument("--preset", default="default")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks (the preset's by default)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=40, help="rounds of turns (the repeats of the interval)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("thread", "wall"), default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print each plan")
    parser.add_argument("--explain", action="store_true", help="print every block's options and the plans' choices")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"Unknown variants {unknown} (expected some of {list(VARIANTS)}), or a count below 1.")

    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.profiling.memory import MemoryProbe

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    overrides = {"depth": args.depth} if args.depth else {}
    base: Any
    base, data = make_workload(args.workload, args.preset, batch_size=args.batch_size, seed=args.seed, **overrides)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(min(4, len(data.train_dataloader())))]
    profile, plans = plan_on_warm_step(base, batches[0], BUDGETS)
    if args.explain:
        print(explain(profile, plans), flush=True)
    runners = [build_runner(name, base, plans) for name in variants]
    probe = MemoryProbe("cpu")
    try:
        for runner in runners:
            for _ in range(args.warmup):
                runner.step(batches[0])
            runner.memory.extend(runner.kept(batches[0], probe) for _ in range(2))
            if args.verbose:
                print(f"{runner.name}: {runner.description}", flush=True)
    finally:
        probe.close()
    gc.collect()
    run_rounds(runners, batches, args.rounds, args.steps)
    clock = args.clock or ("thread" if args.threads == 1 else "wall")
    return _report(args, clock, runners, plans)


def _report(args: argparse.Namespace, clock: str, runners: list[Runner], plans: dict[str, Any]) -> dict[str, Any]:
    primary, wall = ratios(runners, clock), ratios(runners, "wall")
    base_memory = next((statistics.median(r.memory) for r in runners if r.name == "none"), float("nan"))
    print(
        f"\n{args.workload} ({args.preset}{f', depth {args.depth}' if args.depth else ''}), {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.steps} steps per variant, interleaved in one process; {clock} clock "
        f"(95% interval over rounds); load now {os.getloadavg()[0]:.1f}"
    )
    print(
        "| variant | activations (MiB) | x none | expected x none | expected recompute (% of blocks' forward) "
        f"| step (ms, {clock}) | step x none [95%] | wall x none [95%] |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results: dict[str, Any] = {}
    for r in runners:
        kept = statistics.median(r.memory)
        steps = [t for round_ in getattr(r, f"{clock}_ns") for t in round_]
        plan = plans.get(r.name)
        est, wall_est = primary[r.name], wall[r.name]
        results[r.name] = {
            "activations_bytes": kept,
            "activations_x_none": kept / base_memory,
            "step_ms": statistics.median(steps) / 1e6,
            "step_x_none": None if est is None else [est.ratio, est.low, est.high],
            "wall_x_none": None if wall_est is None else [wall_est.ratio, wall_est.low, wall_est.high],
            "expected_x_none": plan.expected_ratio if plan else None,
            "thread_ns": r.thread_ns,
            "wall_ns": r.wall_ns,
        }
        expected = f"{plan.expected_ratio:.2f}" if plan else "-"
        recompute = f"{plan.expected_recompute_s / plan.forward_s:.0%}" if plan and plan.forward_s else "-"
        print(
            f"| {r.name} | {kept / 2**20:.1f} | {kept / base_memory:.2f} | {expected} | {recompute} "
            f"| {statistics.median(steps) / 1e6:.1f} | {_fmt(est)} | {_fmt(wall_est)} |"
        )
    check = primary.get("none-again")
    if check is not None:
        covered = "covers 1: the method is sound here" if check.low <= 1 <= check.high else "MISSES 1: do not trust"
        print(f"A/A check (none-again / none, {clock} clock): {_fmt(check)}, {covered}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "clock": clock, "variants": results}, f, indent=2)
    return results


def _fmt(est: Any) -> str:
    return "-" if est is None else f"{est.ratio:.3f} [{est.low:.3f}, {est.high:.3f}]"


if __name__ == "__main__":
    main()
