"""The one model source: classes by import path, and the batch-size lookup that follows Lightning's."""

from __future__ import annotations

import pytest
from lightning.pytorch import LightningDataModule, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf.benchmark.sources import (
    ImportClassError,
    ImportSource,
    WorkloadSource,
    apply_data_settings,
    batch_size_holder,
    import_class,
    init_parameters,
)
from tests.tuning._user_models import PlainDataModule, SmallConvNet


class HparamsOnlyDataModule(LightningDataModule):
    """Keeps its batch size in ``self.hparams`` only (``save_hyperparameters``), as LightningCLI users often do."""

    def __init__(self, batch_size: int = 6) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        import torch

        data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 4, (32,)))
        return DataLoader(data, batch_size=self.hparams.batch_size)


def test_batch_size_found_in_the_datamodule_hparams() -> None:
    model, data = SmallConvNet(), HparamsOnlyDataModule(batch_size=6)
    assert batch_size_holder(model, data) == ("datamodule", 6)
    apply_data_settings(model, data, 24, None)
    assert data.hparams.batch_size == 24
    assert data.train_dataloader().batch_size == 24
    assert model._trainer is None  # the lookup leaves the model as it was


def test_batch_size_set_where_lightning_sets_it() -> None:
    model, data = SmallConvNet(), PlainDataModule(batch_size=5)
    apply_data_settings(model, data, 10, None)
    assert data.batch_size == 10 and batch_size_holder(model, data) == ("datamodule", 10)


def test_import_class_returns_the_class_and_checks_the_base() -> None:
    assert import_class("tests.tuning._user_models:SmallConvNet", LightningModule) is SmallConvNet
    assert import_class("tests.tuning._user_models.PlainDataModule", LightningDataModule) is PlainDataModule


@pytest.mark.parametrize(
    ("spec", "base", "message"),
    [
        ("no_such_pkg.mod:X", None, "cannot import module 'no_such_pkg.mod' (ModuleNotFoundError"),
        ("tests.tuning._user_models:Nope", None, "has no attribute 'Nope'"),
        ("tests.tuning._user_models:SmallConvNet", LightningDataModule, "is not a subclass of LightningDataModule"),
        ("tests.tuning._user_models:annotations", None, "not a class"),
        ("NoModule", None, "is not an import path"),
        (":X", None, "is not an import path"),
        (3, None, "Expected a string"),
    ],
)
def test_import_class_errors_are_one_line_value_errors(spec: object, base: type | None, message: str) -> None:
    with pytest.raises(ImportClassError) as info:
        import_class(spec, base, "model")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert message in text and "\n" not in text and repr(spec) in text


def test_sources_build_models() -> None:
    user = "tests.tuning._user_models"
    model, data = ImportSource(f"{user}:SmallConvNet", f"{user}:PlainDataModule", {"lr": 0.1}, {"batch_size": 3}).load()
    assert isinstance(model, SmallConvNet) and model.hparams.lr == 0.1 and data.batch_size == 3
    model, data = WorkloadSource("convnet", "tiny").load()
    assert isinstance(model, LightningModule) and isinstance(data, LightningDataModule)
    with pytest.raises(ImportClassError, match="is not a subclass of LightningModule"):
        ImportSource("tests.tuning._user_models:PlainDataModule", "tests.tuning._user_models:PlainDataModule").load()


def test_init_parameters_follow_kwargs_to_the_parents_like_lightning_cli() -> None:
    """A data module that passes ``**kwargs`` to its parent can set the parent's arguments from a CLI config; one
    without ``**kwargs`` cannot, so the parent's names are not its own."""

    class Base(LightningDataModule):
        def __init__(self, batch_size: int = 8, num_workers: int = 0) -> None:
            super().__init__()

    class Forwards(Base):
        def __init__(self, size: int = 4, **kwargs: int) -> None:
            super().__init__(**kwargs)

    class Closed(Base):
        def __init__(self, size: int = 4) -> None:
            super().__init__()

    assert init_parameters(Forwards()) == {"size", "batch_size", "num_workers"}
    assert init_parameters(Closed()) == {"size"}
