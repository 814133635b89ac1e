"""Attention swap on the ``lm`` reference workload: what is swapped for which kernel, and a rough timing.

The demo language model computes causal attention by hand (``softmax(q @ k^T * scale + mask) @ v``). This script

1. trains a few steps with :class:`~lightning_perf.callbacks.FlashAttentionCallback` and prints its decision for
   each attention module (the kernel and why: flash-attn 2 on an Ampere+ GPU in bf16/fp16, else PyTorch's SDPA);
2. with ``--adapter``, does the same through an adapter registered for the demo's attention class, the way you would
   for an attention module of your own (the built-in detection finds this one without it);
3. times one forward + backward of the eager and the swapped network at a few sequence lengths (rough: a handful of
   interleaved repeats; ``lightning-perf bench --workload lm --configs baseline,flash_attention`` measures properly).

Usage::

    python examples/attention_swap_lm.py                        # tiny preset, a few seconds
    python examples/attention_swap_lm.py --adapter --seq-lens 128,512,1024
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_perf.callbacks import FlashAttentionCallback
from lightning_perf.demos import make_workload
from lightning_perf.demos.lm import CausalSelfAttention
from lightning_perf.functional.attention.swap import (
    AttentionAdapter,
    FusedQKVAttention,
    FusedQKVSpec,
    swap_attention,
)


class DemoAttentionAdapter(AttentionAdapter):
    """The demo's attention spelled out: fused ``qkv``, output ``proj``, causal, q/k/v laid out as ``[q | k | v]``."""

    def matches(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, CausalSelfAttention)

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        assert isinstance(module, CausalSelfAttention)
        spec = FusedQKVSpec(qkv="qkv", out="proj", num_heads=module.num_heads, causal=True, layout="qkv")
        return FusedQKVAttention.from_module(module, spec, kernel)


def step_seconds(net: nn.Module, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    net(tokens).float().logsumexp(-1).mean().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "default"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--adapter", action="store_true", help="swap through an explicitly registered adapter")
    parser.add_argument("--seq-lens", default="32,128", help="comma-separated sequence lengths to time")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model, data = make_workload("lm", args.preset, seed=0)
    adapters = [DemoAttentionAdapter()] if args.adapter else []
    callback = FlashAttentionCallback(adapters=adapters)
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
    for name, decision in callback.decisions.items():
        print(f"{name}: {decision.action}, {decision.kernel} ({decision.reason})")
    if callback.fallbacks:
        print(f"calls that ran the original attention code: {callback.fallbacks}")

    # Timing on the bare network, at sequence lengths beyond the preset's (positions and mask sized to fit).
    vocab = model.vocab_size
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        eager, _ = make_workload("lm", args.preset, seed=0, seq_len=seq_len)
        swapped = copy.deepcopy(eager)
        swap_attention(swapped, adapters=adapters)
        tokens = torch.randint(0, vocab, (data.batch_size, seq_len))
        times: dict[str, list[float]] = {"eager": [], "swapped": []}
        for _ in range(args.repeats + 1):  # the first round warms up, interleaved so drift cancels
            for label, net in (("eager", eager), ("swapped", swapped)):
                times[label].append(step_seconds(net, tokens))
        eager_s, swapped_s = (statistics.median(t[1:]) for t in times.values())
        print(
            f"seq {seq_len:5d}: eager {eager_s * 1e3:8.1f} ms, swapped {swapped_s * 1e3:8.1f} ms "
            f"(speed-up {eager_s / swapped_s:.2f}x, rough)"
        )


if __name__ == "__main__":
    main()
