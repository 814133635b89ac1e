"""Which intra-op thread count and OpenMP wait policy keep a CPU measurement honest when another process takes a core.

Times a small convnet's training step (plain and channels-last, alternating steps in one process) in a fresh process
per setting and round: 1 or 2 intra-op threads (``OMP_NUM_THREADS`` and ``torch.set_num_threads``),
``OMP_WAIT_POLICY`` unset, passive or active; inside each process, blocks of steps alternate between the machine as
it is ("quiet") and one competing busy loop (a ``python -c 'while True: pass'`` child started and killed around the
block). The settings' order rotates from round to round.
Reported, each paired by round with a 95% interval (:func:`lightning_perf.profiling.intervals.paired_ratio`):

- the slowdown a busy loop causes to the plain step (busy / quiet), per setting;
- the configuration ratio a bench would report (plain / channels-last) quiet and busy, per setting: the setting
  whose busy ratio stays closest to its quiet one is the one a bench should use when the machine is shared;
- 2 threads against 1, quiet and busy.

``--burst-s N`` runs the other case instead: two busy loops that stop by themselves after N seconds, started just
before the default ``lightning-perf bench`` (``--bench-args`` adds to its command line). With 70 s, the bench should
say it is watching the start load, choose its threads once the burst is over, and answer as a quiet run does.

Usage::

    python examples/threads_under_load.py                  # 4 rounds x 4 settings, one process each
    python examples/threads_under_load.py --rounds 6 --output threads.json
    python examples/threads_under_load.py --burst-s 70 --bench-args="--output burst.json"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SETTINGS = ((1, "default"), (2, "default"), (1, "PASSIVE"), (2, "PASSIVE"), (2, "ACTIVE"))
"""(threads, OMP_WAIT_POLICY); ``default``: the variable unset, as a user runs."""
LOADS = ("quiet", "busy")


def _child(threads: int, steps: int, warmup: int) -> None:
    """Time plain and channels-last training steps (alternating), in blocks of ``steps``: quiet, busy, quiet, busy
    (a busy loop started and killed by this process around each busy block); print the times as JSON."""
    import torch
    from torch import nn

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def net() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip

    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    last = net().to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    variants = {"plain": (net(), x), "channels_last": (last, x.contiguous(memory_format=torch.channels_last))}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.01) for name, (model, _) in variants.items()}
    times: dict[str, dict[str, list[float]]] = {load: {name: [] for name in variants} for load in LOADS}

    def block(load: str, count: int, keep: bool) -> None:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
        try:
            if hog is not None:
                time.sleep(0.3)  # the busy loop is running before the first timed step
            for _ in range(count):
                for name, (model, data) in variants.items():
                    start = time.perf_counter()
                    loss = nn.functional.cross_entropy(model(data), y)
                    optimizers[name].zero_grad()
                    loss.backward()
                    optimizers[name].step()
                    if keep:
                        times[load][name].append(time.perf_counter() - start)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()

    block("quiet", warmup, keep=False)
    for load in (*LOADS, *LOADS):
        block(load, steps, keep=True)
    print(json.dumps({"threads": torch.get_num_threads(), **times}))


def _run_child(threads: int, policy: str, steps: int, warmup: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_NUM_THREADS": str(threads)}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    command = [sys.executable, __file__, "--child", str(threads), "--steps", str(steps), "--warmup", str(warmup)]
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load_at_start": load}


def measure(rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One process per (round, setting), the settings' order rotated each round; quiet and busy blocks inside."""
    rows = []
    for r in range(rounds):
        shift = r % len(SETTINGS)
        for threads, policy in SETTINGS[shift:] + SETTINGS[:shift]:
            row = _run_child(threads, policy, steps, warmup)
            rows.append({"round": r, "threads_asked": threads, "policy": policy, **row})
            medians = {load: 1e3 * sorted(row[load]["plain"])[len(row[load]["plain"]) // 2] for load in LOADS}
            print(f"round {r + 1}/{rounds} threads {threads} {policy:7} load {row['load_at_start']:.1f}: plain "
                  f"quiet {medians['quiet']:.1f} ms, busy {medians['busy']:.1f} ms", flush=True)  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios with 95% intervals over rounds, as lines."""
    from lightning_perf.profiling.intervals import paired_ratio

    def per_round(load: str, threads: int, policy: str, key: str) -> list[list[float]]:
        picked = [r for r in rows if (r["threads_asked"], r["policy"]) == (threads, policy)]
        return [r[load][key] for r in sorted(picked, key=lambda r: r["round"])]

    def text(estimate: Any) -> str:
        return f"{estimate.ratio:.2f}x [{estimate.low:.2f}-{estimate.high:.2f}]"

    lines = ["setting            busy/quiet (plain)   plain/cl quiet       plain/cl busy"]
    for threads, policy in SETTINGS:
        slowdown = paired_ratio(
            per_round("busy", threads, policy, "plain"), per_round("quiet", threads, policy, "plain")
        )
        quiet = paired_ratio(per_round("quiet", threads, policy, "plain"), per_round("quiet", threads, policy,
                                                                                    "channels_last"))  # fmt: skip
        busy = paired_ratio(per_round("busy", threads, policy, "plain"), per_round("busy", threads, policy,
                                                                                  "channels_last"))  # fmt: skip
        lines.append(f"{threads} thr {policy:8}     {text(slowdown):20} {text(quiet):20} {text(busy)}")
    for load in LOADS:
        for policy in ("default", "PASSIVE", "ACTIVE"):
            ratio = paired_ratio(per_round(load, 2, policy, "plain"), per_round(load, 1, "default", "plain"))
            lines.append(f"{load}: 2 threads {policy} / 1 thread, step time {text(ratio)}")
    return lines


def burst_then_bench(seconds: float, bench_args: list[str]) -> int:
    """The default bench started beside two busy loops that end after ``seconds``; its exit status."""
    loop = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    loops = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]
    bench = [sys.executable, "-c", "import sys; from lightning_perf.cli import main; sys.exit(main())", "bench"]
    try:
        return subprocess.run([*bench, *bench_args]).returncode
    finally:
        for process in loops:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--output", type=Path, help="write every run's step times as JSON")
    parser.add_argument("--burst-s", type=float, help="a burst of two busy loops this long, then the default bench")
    parser.add_argument("--bench-args", default="", help="more `lightning-perf bench` arguments (with --burst-s)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burst_s is not None:
        raise SystemExit(burst_then_bench(args.burst_s, shlex.split(args.bench_args)))
    if args.child is not None:
        _child(args.child, args.steps, args.warmup)
        return
    print(f"cpus usable: {len(os.sched_getaffinity(0))}, load at start: {os.getloadavg()[0]:.1f}", flush=True)
    rows = measure(args.rounds, args.steps, args.warmup)
    if args.output is not None:
        args.output.write_text(json.dumps(rows))
    print("\n".join(summarize(rows)))


if __name__ == "__main__":
    main()
