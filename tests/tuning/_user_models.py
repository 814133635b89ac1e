"""A model and data module written the way a user would, not from our demos: the tuner's trials import them."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class PlainDataModule(pl.LightningDataModule):
    """Random images; ``batch_size`` is an init argument, the loader settings are not (hard-coded defaults)."""

    def __init__(self, batch_size: int = 8, samples: int = 256, image_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 3, image_size, image_size, generator=generator)
        self.y = torch.randint(0, 4, (samples,), generator=generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=True, drop_last=True)


class SmallConvNet(pl.LightningModule):
    def __init__(self, lr: float = 0.05, fail_at_step: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        conv = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        self.net = nn.Sequential(*conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hparams.fail_at_step is not None and batch_idx >= self.hparams.fail_at_step:
            raise ValueError("the user's own bug in training_step")
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class SmallMLP(pl.LightningModule):
    """No convolution and no attention: channels-last and the attention swap have nothing to act on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SmallAttentionNet(SmallMLP):
    """One ``nn.MultiheadAttention``: the attention swap applies."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)


class PredictDataModule(PlainDataModule):
    """:class:`PlainDataModule` with a predict split: batches of images alone, which the default ``predict_step``
    feeds to ``forward``."""

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.x, batch_size=self.batch_size)  # type: ignore[arg-type]
