"""Reference workload ``lm``: a small decoder-only transformer language model on a synthetic Markov chain.

The attention is written out eagerly (``softmax(q @ k^T * scale + causal mask) @ v``) in a module of its own,
:class:`CausalSelfAttention`, and deliberately does not call ``scaled_dot_product_attention``: an attention-swap
optimization has something to replace, and the benchmark measures what it gains.

The tokens follow a fixed random sparse Markov chain: each token has a few likely successors, so the best possible
next-token loss (about 1.1 nats) is far below the ``ln(vocab_size)`` of a model that has learned nothing.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_perf.demos._base import (
    SPLITS,
    DemoModule,
    SeededDataset,
    SyntheticDataModule,
    build_from,
    data_sizes,
    generator_for,
    model_presets,
)

# The chain is part of the task's definition, not of the data seed.
_CHAIN_SEED = 2_000_003
SUCCESSOR_PROBS: tuple[float, ...] = (0.55, 0.25, 0.12, 0.08)
"""Transition probabilities to each token's successors, most likely first (entropy ~1.13 nats)."""


def markov_successors(vocab_size: int, num_successors: int = len(SUCCESSOR_PROBS)) -> Tensor:
    """Fixed random successors of each token: a long tensor ``(vocab_size, num_successors)``, distinct per row."""
    return _markov_successors(vocab_size, num_successors).clone()


@functools.lru_cache(maxsize=4)
def _markov_successors(vocab_size: int, num_successors: int) -> Tensor:
    # One permutation per token: seconds at the gpu preset's 8192 tokens, so each split's dataset shares one chain.
    g = generator_for(_CHAIN_SEED, vocab_size)
    return torch.stack([torch.randperm(vocab_size, generator=g)[:num_successors] for _ in range(vocab_size)])


class MarkovTokenDataset(SeededDataset):
    """Sample ``i`` is ``{"input_ids", "labels"}``: a walk on the Markov chain generated from ``(seed, i)``.

    ``labels`` is ``input_ids`` shifted left by one, i.e. the next token at every position.

    Args:
        num_samples: dataset length.
        seq_len: tokens per sample.
        vocab_size: vocabulary size (at least the number of successors per token).
        seed: data seed.
        split: a tag mixed into every sample's seed so the splits do not share samples.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0, split: int = 0) -> None:
        if vocab_size < len(SUCCESSOR_PROBS):
            raise ValueError(f"vocab_size={vocab_size!r} is too small. Expected at least {len(SUCCESSOR_PROBS)}.")
        super().__init__(num_samples, seed, split)
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self._successors: list[list[int]] = markov_successors(vocab_size).tolist()
        self._cdf = list(accumulate(SUCCESSOR_PROBS))

    @override
    def sample(self, g: torch.Generator) -> dict[str, Tensor]:
        token = int(torch.randint(self.vocab_size, (), generator=g))
        last = len(self._cdf) - 1
        tokens = [token]
        # A Python walk: each step depends on the last, and plain lists beat per-step tensor ops at this size.
        for u in torch.rand(self.seq_len, generator=g).tolist():
            token = self._successors[token][min(bisect.bisect_right(self._cdf, u), last)]
            tokens.append(token)
        sequence = torch.tensor(tokens)
        return {"input_ids": sequence[:-1], "labels": sequence[1:]}


_DATA_SIZES: dict[str, dict[str, int]] = {
    "tiny": data_sizes(32, 512, 128, 128, 64, seq_len=32, vocab_size=64),
    "default": data_sizes(16, 2048, 256, 256, 256, seq_len=128, vocab_size=512),
    # GPT-2 small's context of 512 tokens at the batch of 16 sequences; a vocabulary of 8192 (GPT-2: 50257) keeps
    # the synthetic chain quick to build and the head a sixth of the model instead of a third.
    "gpu": data_sizes(16, 2048, 128, 128, 128, seq_len=512, vocab_size=8192),
}

_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 4, "lr": 3e-3},
    "default": {"dim": 128, "depth": 6, "num_heads": 4, "mlp_ratio": 4, "lr": 1e-3},
    # GPT-2 small: 12 blocks of width 768 with 12 heads (85M parameters in the blocks, 98M with the embeddings and
    # the untied head at vocabulary 8192; 51.5 GMACs per 512-token sequence forward).
    "gpu": {"dim": 768, "depth": 12, "num_heads": 12, "mlp_ratio": 4, "lr": 3e-4, "weight_decay": 0.1},
}


class LMDataModule(SyntheticDataModule):
    """Markov-chain token sequences for :class:`LMModule`.

    ``tiny``: 32 tokens over a 64-token vocabulary. ``default``: 128 tokens over 512. ``gpu``: 512 tokens over 8192,
    batch 16. Batches are dicts
    ``{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`` with ``labels`` the next tokens.

    Args:
        preset: one of :data:`~lightning_perf.demos._base.PRESETS`.
        **kwargs: ``batch_size``, ``num_workers``, ``pin_memory``, ``persistent_workers``, ``seed``: as for
            :class:`SyntheticDataModule`.
        seq_len: tokens per sequence; ``None`` takes the preset's.
        vocab_size: vocabulary size; ``None`` takes the preset's.

    Example::

        data = LMDataModule("tiny", seed=0)
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))  # batch["input_ids"].shape == (32, 32)
    """

    SIZES = _DATA_SIZES
    SHAPE_KEYS = ("seq_len", "vocab_size")
    seq_len: int
    vocab_size: int

    def __init__(
        self,
        preset: str = "default",
        seq_len: int | None = None,
        vocab_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def make_dataset(self, split: str, num_samples: int) -> Dataset:
        return MarkovTokenDataset(num_samples, self.seq_len, self.vocab_size, seed=self.seed, split=SPLITS.index(split))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention computed eagerly, with one fused ``qkv`` projection and an output ``proj``.

    Args:
        dim: embedding width.
        num_heads: attention heads (must divide ``dim``).
        max_seq_len: longest sequence the causal mask covers.
    """

    future_mask: Tensor

    def __init__(self, dim: int, num_heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        # True above the diagonal: the future positions a token may not attend to. Not a parameter, not saved.
        future = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("future_mask", future, persistent=False)

    @override
    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, heads, T, T)
        scores = scores.masked_fill(self.future_mask[:seq_len, :seq_len], float("-inf"))
        out = scores.softmax(dim=-1) @ v  # (B, heads, T, head_dim)
        return self.proj(out.transpose(1, 2).reshape(batch, seq_len, dim))


class LMBlock(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        dim: embedding width.
        num_heads: attention heads.
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        max_seq_len: longest sequence the causal mask covers.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, max_seq_len: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    """Decoder-only transformer: token and learned position embeddings, :class:`LMBlock` stack, norm, untied head.

    Args:
        vocab_size: vocabulary size.
        seq_len: longest input sequence.
        dim: embedding width.
        depth: number of blocks.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
    """

    def __init__(self, vocab_size: int, seq_len: int, dim: int, depth: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(LMBlock(dim, num_heads, mlp_ratio, seq_len) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual-branch output projections so the residual stream does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_embed(input_ids) + self.pos_embed(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class LMModule(DemoModule):
    """Next-token language model of :class:`LMDataModule` sequences.

    ``tiny``: vocabulary 64, 32 tokens, dim 32, depth 2, 2 heads. ``default``: vocabulary 512, 128 tokens, dim 128,
    depth 6, 4 heads. ``gpu``: GPT-2 small's blocks (512 tokens, dim 768, depth 12, 12 heads) over vocabulary 8192.
    ``forward(input_ids)`` returns logits ``(B, T, vocab_size)``. Logs ``train_loss``/``train_acc``,
    ``val_loss``/``val_acc``, ``test_loss``/``test_acc`` (next-token accuracy).

    Args:
        preset: one of ``tiny``, ``default`` and ``gpu``; the other arguments override its values when not ``None``.
        vocab_size: vocabulary size.
        seq_len: longest sequence (sets the position table and the causal mask).
        dim: embedding width.
        depth: number of blocks.
        num_heads: attention heads (must divide ``dim``).
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        **kwargs: ``lr``, ``weight_decay``, ``schedule_epochs``: AdamW's settings and its schedule's length (see
            :class:`DemoModule`).

    Raises:
        ValueError: if the preset is unknown, a value out of range or ``num_heads`` does not divide ``dim``.

    Example::

        model = LMModule("tiny")
        logits = model(model.example_input_array)  # (1, 32, 64)
    """

    MODEL_PRESETS = model_presets(_MODEL_PRESETS, LMDataModule)

    def __init__(
        self,
        preset: str = "default",
        vocab_size: int | None = None,
        seq_len: int | None = None,
        dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def check_config(self, config: Mapping[str, Any]) -> None:
        self.check_divides(config, "num_heads", "dim", "a divisor of dim")

    @override
    def build(self, config: Mapping[str, Any]) -> tuple[nn.Module, Callable[[], Metric], Tensor]:
        self.vocab_size: int = config["vocab_size"]
        net = build_from(TransformerLM, config)
        example = torch.zeros(1, config["seq_len"], dtype=torch.long)
        return net, lambda: MulticlassAccuracy(config["vocab_size"], average="micro"), example

    @override
    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        return batch["input_ids"], batch["labels"]

    @override
    def compute(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        input_ids, labels = self.split_batch(batch)
        logits = self(input_ids).flatten(0, 1)  # (B*T, vocab)
        labels = labels.flatten()
        return F.cross_entropy(logits, labels), logits.detach(), labels
