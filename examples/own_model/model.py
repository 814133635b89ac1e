"""A small user-style project to benchmark: an image classifier and a data module of random images.

Nothing here knows about lightning_perf: it is written the way a Lightning user writes a model, so that
``lightning-perf bench`` can be shown on it as on your own code (see ``README.md``, "Benchmark your own model").
The data are random tensors drawn from a seeded generator, so the example needs no download; the sizes are small
enough that a bench run with ``--steps 5 --repeats 2`` takes well under a minute on a laptop CPU.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class SmallConvNet(pl.LightningModule):
    """Two convolution blocks and a linear head, trained with SGD and cross-entropy."""

    def __init__(self, channels: int = 16, num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class RandomImages(pl.LightningDataModule):
    """Random ``3 x image_size x image_size`` images with random labels; the batch size is a hyperparameter."""

    def __init__(
        self, batch_size: int = 32, num_samples: int = 512, image_size: int = 32, num_classes: int = 10, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.datasets: dict[str, TensorDataset] = {}

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        size, n = self.hparams.image_size, self.hparams.num_samples
        for split in ("train", "val", "test", "predict"):
            count = n if split == "train" else max(n // 4, self.hparams.batch_size)
            images = torch.randn(count, 3, size, size, generator=generator)
            labels = torch.randint(0, self.hparams.num_classes, (count,), generator=generator)
            self.datasets[split] = TensorDataset(images, labels)

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        return DataLoader(self.datasets[split], batch_size=self.hparams.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
