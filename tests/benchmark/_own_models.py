"""A user's own project, written the usual ways, for `lightning-perf bench --model/--config` tests.

The data module keeps its batch size in ``hparams`` (``save_hyperparameters``), the model has its own
``configure_optimizers`` and ``predict_step``; both are small enough for a run of a few steps to take a second.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Points(pl.LightningDataModule):
    """Random points; the batch size lives only in ``self.hparams``."""

    def __init__(self, batch_size: int = 4, samples: int = 64, features: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.hparams.samples, self.hparams.features, generator=generator)
        y = torch.randint(0, self.hparams.classes, (self.hparams.samples,), generator=generator)
        self.dataset = TensorDataset(x, y)

    def _loader(self, shuffle: bool = False) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class CountBatches(Callback):
    """A user's own callback, named in a YAML's ``trainer.callbacks``: it counts what it sees, in a file."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self.batches = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.batches += 1

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.batches += 1

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"{stage} {self.batches}\n")


class Broken(pl.LightningModule):
    """A model whose constructor refuses its arguments."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        raise ValueError(f"width={width} is not supported")
