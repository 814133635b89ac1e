"""Checks the ONNX export's latency verdict from outside: the same file timed against eager torch at equal threads.

Exports a reference workload with :func:`lightning_perf.deploy.export_model` (``backends=["onnx"]``), reads its
report's latency table (eager vs onnxruntime, speed-up with its 95% interval and verdict, the thread count of each
side), then times the same ``.onnx`` file again with code of its own, not the export's: a plain onnxruntime session
with as many intra-op threads as torch, one inter-op thread and no spin-waiting, against the eager model, one call
each per round in alternating order, the speed-up the median of the per-round ratios with a bootstrap 95% interval.
Prints both verdicts side by side and whether they agree. A busy machine moves every figure: read several runs.
Usage::

    python examples/export_latency_check.py                       # convnet, batch 1 and 32, torch's threads
    python examples/export_latency_check.py --threads 1 --rounds 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import numpy as np


def outside_speedup(eager: Any, session: Any, x: Any, rounds: int, warmup: int = 3) -> tuple[float, float, float]:
    """Eager time over onnxruntime time: median of per-round ratios and its bootstrap 95% interval."""
    import torch

    feed = {session.get_inputs()[0].name: x.numpy()}
    calls = (lambda: eager(x), lambda: session.run(None, feed))
    with torch.no_grad():
        for _ in range(warmup):
            calls[0](), calls[1]()
        ratios = []
        for round_ in range(rounds):
            seconds = [0.0, 0.0]
            for side in (0, 1) if round_ % 2 == 0 else (1, 0):
                began = time.perf_counter()
                calls[side]()
                seconds[side] = time.perf_counter() - began
            ratios.append(seconds[0] / seconds[1])
    samples = np.random.default_rng(0).choice(ratios, size=(2000, len(ratios)))
    low, high = np.percentile(np.median(samples, axis=1), [2.5, 97.5])
    return statistics.median(ratios), float(low), float(high)


def verdict(low: float, high: float) -> str:
    return "faster" if low > 1 else "slower" if high < 1 else "no clear difference"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="convnet")
    parser.add_argument("--preset", default="default", choices=("tiny", "default"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=None, help="torch's (and so onnxruntime's) threads")
    parser.add_argument("--rounds", type=int, default=40, help="outside timing: paired calls per batch size")
    parser.add_argument("--iterations", type=int, default=20, help="the export's own latency_iterations")
    args = parser.parse_args(argv)

    import onnxruntime as ort
    import torch

    from lightning_perf.demos import make_workload
    from lightning_perf.deploy import export_model

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model, _ = make_workload(args.workload, args.preset, seed=0)
    model.eval()
    example = model.example_input_array
    if not isinstance(example, torch.Tensor):
        raise SystemExit(f"the {args.workload} workload has no single-tensor example input")
    sizes = sorted(args.batch_sizes)
    with tempfile.TemporaryDirectory(prefix="export-latency-") as folder:
        report = export_model(
            model,
            example,
            backends=["onnx"],
            dirpath=folder,
            batch_range=(sizes[0], sizes[len(sizes) // 2], sizes[-1]),
            validation_batch_sizes=sizes,
            latency_iterations=args.iterations,
        )
        attempt = report.attempt
        if attempt is None:
            raise SystemExit(f"the export failed: {json.dumps([a.to_dict() for a in report.attempts])[:500]}")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(attempt.files[-1]), options, providers=["CPUExecutionProvider"])
        print(f"{args.workload} ({args.preset}): report threads torch={report.torch_threads} onnxruntime="
              f"{attempt.threads}; outside threads {threads} each side")  # fmt: skip
        for row in attempt.latency:
            x = example[:1].repeat(row.batch_size, *[1] * (example.dim() - 1))
            median, low, high = outside_speedup(model, session, x, args.rounds)
            ci = "" if row.speedup_ci95 is None else " [{:.2f}, {:.2f}]".format(*row.speedup_ci95)
            said = f"{row.speedup:.2f}x{ci}, {row.speedup_verdict}"
            found = f"{median:.2f}x [{low:.2f}, {high:.2f}], {verdict(low, high)}"
            agree = "agree" if verdict(low, high) == row.speedup_verdict else "DIFFER"
            print(f"  batch {row.batch_size}: report {said}; outside {found}: {agree}")


if __name__ == "__main__":
    main()
