"""Sharded training (FSDP2) of a small language model, with the callbacks that work under it stacked.

The LightningModule shards itself the FSDP2 way: ``fully_shard`` on each transformer block, then on the model, in
``configure_model``, under Lightning's ``ModelParallelStrategy``. The callbacks meet the sharded blocks (their
parameters are DTensors) after ``configure_model`` and put their transforms inside them, in torchtitan's order:

1. ``FlashAttentionCallback`` (``setup``): the hand-written attention of each block computes through SDPA (checked on
   stand-in weights of the full shapes, then swapped holding the real shards);
2. ``GradCheckpointCallback`` (``setup``): each block's forward is checkpointed inside its FSDP2 wrapper;
3. with ``--compile``, ``CompileCallback(regions="auto")`` (``on_fit_start``, after wrapping): each block's forward,
   checkpointing included, is compiled inside its wrapper; the blocks share one compiled graph (a cold compile takes
   30-70 s per process on a 2-core CPU; a warm inductor cache a few seconds);
4. ``FusedOptimizerCallback`` (``on_fit_start``): AdamW steps with the fused kernel over the DTensor shards.

With ``--compare`` it trains the same model plainly first and prints both losses (they agree to float tolerance).

Usage::

    python examples/fsdp2_lm.py                    # 2 CPU processes (gloo), 20-40 s on 2 cores
    python examples/fsdp2_lm.py --compare --compile
    python examples/fsdp2_lm.py --accelerator gpu --devices 2 --steps 50 --width 512 --depth 8
"""

from __future__ import annotations

import argparse
import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.callbacks import (
    CompileCallback,
    FlashAttentionCallback,
    FusedOptimizerCallback,
    GradCheckpointCallback,
)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in self.qkv(x).split(width, dim=2)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        blocked = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, seq, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits, one row per token: ``(batch * seq, vocab)`` (a fresh tensor, not a view, as FSDP2 prefers)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def shard(model: Transformer, mesh: DeviceMesh) -> None:
    """FSDP2 the torchtitan way: ``fully_shard`` on each block, then on the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class ShardedLM(pl.LightningModule):
    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.model = Transformer(vocab, width, heads, depth)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):  # a second fit: already sharded
            return
        assert self.device_mesh is not None  # set by ModelParallelStrategy before configure_model
        shard(self.model, self.device_mesh["data_parallel"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens), targets.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(args: argparse.Namespace, callbacks: list[pl.Callback]) -> list[float]:
    pl.seed_everything(0, verbose=False)
    model = ShardedLM(args.vocab, args.width, args.heads, args.depth)
    tokens = torch.randint(0, args.vocab, (args.steps * args.devices * 4, args.seq + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return model.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add CompileCallback(regions='auto') (cold: +30-70 s on 2 CPUs)",
    )
    parser.add_argument("--compare", action="store_true", help="train the plain model first and compare the losses")
    args = parser.parse_args()

    plain = fit(args, []) if args.compare else None
    callbacks: list[pl.Callback] = [FlashAttentionCallback(), GradCheckpointCallback()]
    if args.compile:
        callbacks.append(CompileCallback(regions="auto"))
    callbacks.append(FusedOptimizerCallback())
    stacked = fit(args, callbacks)

    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        print("step  " + ("plain     " if plain else "") + "with callbacks")
        for step, loss in enumerate(stacked):
            print(f"{step:4d}  " + (f"{plain[step]:.6f}  " if plain else "") + f"{loss:.6f}")
        if plain:
            worst = max(abs(a - b) / abs(a) for a, b in zip(plain, stacked))
            print(f"largest relative difference: {worst:.1e}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
