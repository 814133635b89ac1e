"""A Linear-heavy user model: transformer MLP blocks on feature vectors, for the dynamic int8 inference benchmark.

Like ``model.py``, nothing here knows about lightning_perf. The blocks are the MLP half of a transformer layer
(LayerNorm, ``width -> 4 * width`` Linear, GELU, ``4 * width -> width`` Linear, residual), the shape on which dynamic
int8 pays on CPU: large matmuls whose weights dominate the work. Measure it with::

    lightning-perf bench --model examples.own_model.mlp:MLPBlocks --datamodule examples.own_model.mlp:RandomFeatures \
        --stage predict --configs baseline,dynamic_int8 --repeats 3
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


class MLPBlock(nn.Module):
    """Pre-norm transformer MLP with a residual connection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPBlocks(pl.LightningModule):
    """``depth`` MLP blocks and a linear classifier, trained with AdamW and cross-entropy."""

    def __init__(self, width: int = 1024, depth: int = 2, num_classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        # One child holding the network: `QATCallback` quantizes one submodule (name it with `submodule=` when the
        # LightningModule has several children with parameters).
        self.net = nn.Sequential(*(MLPBlock(width) for _ in range(depth)), nn.Linear(width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class RandomFeatures(pl.LightningDataModule):
    """Random ``width``-dimensional feature vectors with random labels; the batch size is a hyperparameter."""

    def __init__(
        self, batch_size: int = 64, num_samples: int = 2048, width: int = 1024, num_classes: int = 10, seed: int = 0
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.datasets: dict[str, TensorDataset] = {}

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        for split in ("train", "val", "predict"):
            count = self.hparams.num_samples if split == "train" else self.hparams.num_samples // 2
            features = torch.randn(count, self.hparams.width, generator=generator)
            labels = torch.randint(0, self.hparams.num_classes, (count,), generator=generator)
            self.datasets[split] = TensorDataset(features, labels)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["train"], batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["val"], batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["predict"], batch_size=self.hparams.batch_size)
