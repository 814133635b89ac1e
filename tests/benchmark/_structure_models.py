"""Test-only models that are none of the demos, for the default set chosen by the model's structure.

Importable by path (``tests.benchmark._structure_models:Encoder``), as ``lightning-perf bench --model`` takes them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class _Module(pl.LightningModule):
    """Cross-entropy on ``(x, y)`` batches, SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Encoder(_Module):
    """Token classifier: an embedding, ``nn.TransformerEncoderLayer`` x2 (nn.MultiheadAttention inside), a head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class SDPAAttention(nn.Module):
    """Hand-written self-attention (one fused qkv Linear, an output Linear) that already calls SDPA."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class SDPABlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = SDPAAttention(dim, 2)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class FusedGPT(_Module):
    """A small GPT whose attention already runs on scaled_dot_product_attention."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, dim)
        self.blocks = nn.ModuleList(SDPABlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


class PlainConvNet(_Module):
    """A VGG-like stack of convolutions in one plain nn.Sequential: no repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(_Module):
    """Linear layers only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Data(pl.LightningDataModule):
    """Random inputs of one ``kind``: ``tokens`` (8 of a 32-word vocabulary), ``image`` (3x12x12) or ``vector`` (12)."""

    def __init__(self, kind: str = "tokens", batch_size: int = 4) -> None:
        super().__init__()
        self.kind, self.batch_size = kind, batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        if self.kind == "tokens":
            x = torch.randint(0, 32, (16, 8), generator=g)
        elif self.kind == "image":
            x = torch.randn(16, 3, 12, 12, generator=g)
        else:
            x = torch.randn(16, 12, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 4, (16,), generator=g)), batch_size=self.batch_size)
