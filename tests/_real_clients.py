"""Models nobody here wrote, as users train them, for tests/test_real_clients.py and `bench --model` (tiny sizes).

Lightning's own demo Transformer (``forward(inputs, target)``, the batch a tuple) on random tokens, a Hugging Face
T5 built from a config (no download) called with keyword arguments, and a model whose ``forward`` takes a keyword
mask and a Python scalar.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

VOCAB, LENGTH = 32, 8


class DemoTransformer(LightningTransformer):
    """Lightning's demo, as is but for its size and its data (it downloads WikiText2)."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = Transformer(vocab_size=vocab_size, ninp=16, nhead=2, nhid=16, nlayers=1, dropout=0.0)

    def prepare_data(self) -> None:
        pass


class _Tokens(Dataset):
    def __init__(self, samples: int, kind: str) -> None:
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(1, VOCAB, (samples, LENGTH + 1), generator=generator)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        row = self.data[i]
        if self.kind == "tuple":
            return row[:-1], row[1:]
        mask = (torch.arange(LENGTH) < LENGTH - int(i % 3)).long()
        if self.kind == "t5":
            return {"input_ids": row[:-1] * mask, "attention_mask": mask, "labels": row[1:]}
        return {"features": row[:-1].float() / VOCAB, "mask": mask.bool(), "label": row[-1] % 4}


class Tokens(pl.LightningDataModule):
    """Random tokens: ``(inputs, target)`` tuples (``kind="tuple"``), T5 dicts (``"t5"``) or feature dicts."""

    def __init__(self, kind: str = "tuple", batch_size: int = 4, samples: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _loader(self) -> DataLoader:
        return DataLoader(_Tokens(self.hparams.samples, self.hparams.kind), batch_size=self.hparams.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class TupleTokens(Tokens):
    def __init__(self, batch_size: int = 4, samples: int = 32) -> None:
        super().__init__("tuple", batch_size, samples)


class T5Tokens(Tokens):
    def __init__(self, batch_size: int = 4, samples: int = 32) -> None:
        super().__init__("t5", batch_size, samples)


class FeatureTokens(Tokens):
    def __init__(self, batch_size: int = 4, samples: int = 32) -> None:
        super().__init__("features", batch_size, samples)


class TinyT5(pl.LightningModule):
    """A Hugging Face encoder-decoder from a config, called with keyword arguments (``self(input_ids=...)``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, dropout_rate=0.0)
        config.decoder_start_token_id = config.pad_token_id = 0
        self.model = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor) -> Any:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
        return out.logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        decoder_input_ids = self.model._shift_right(batch["labels"])
        logits = self(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_input_ids
        )
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class MaskedPooling(pl.LightningModule):
    """``forward(features, *, mask, scale)``: a keyword tensor and a Python scalar, called with keywords only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, features: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        hidden = self.net(features.unsqueeze(-1) * scale)  # (batch, length, 4)
        return (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(features=batch["features"], mask=batch["mask"], scale=2.0), batch["label"])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)
