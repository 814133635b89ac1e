"""Surgery placement: after `configure_model`, before optimizers exist, leaving the module as it was."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_perf.callbacks._model_hooks import discard_pending_surgery, run_after_configure_model
from tests._models import trainer as make_trainer


class Eager(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class Deferred(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer: nn.Module | None = None
        self.calls = 0

    def configure_model(self) -> None:
        self.calls += 1
        if self.layer is None:
            self.layer = nn.Linear(2, 2)


def test_runs_at_once_without_configure_model() -> None:
    module, seen = Eager(), []
    run_after_configure_model(module, lambda m: seen.append(type(m.layer)))
    assert seen == [nn.Linear]
    assert "configure_model" not in module.__dict__


def test_runs_after_configure_model_in_order_and_unshadows() -> None:
    module, seen = Deferred(), []
    run_after_configure_model(module, lambda m: seen.append(("first", m.layer is not None)))
    run_after_configure_model(module, lambda m: seen.append(("second", m.layer is not None)))
    assert seen == []
    module.configure_model()  # what Lightning calls between Callback.setup and strategy.setup
    assert seen == [("first", True), ("second", True)]
    assert module.calls == 1
    assert "configure_model" not in module.__dict__  # the class's hook is back
    module.configure_model()
    assert seen == [("first", True), ("second", True)] and module.calls == 2


def test_surgery_sees_layers_built_in_configure_model_during_fit(tmp_path) -> None:
    class Model(Deferred):
        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: list[object] = []

    class Surgery(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            run_after_configure_model(pl_module, lambda m: seen.append(m.layer))

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = make_trainer(tmp_path, max_steps=1, callbacks=[Surgery()], limit_val_batches=1.0, num_sanity_val_steps=2)
    model = Model()
    trainer.fit(model, data)
    assert len(seen) == 1 and isinstance(seen[0], nn.Linear) and seen[0] is model.layer


def test_discard_removes_a_pending_wrapper() -> None:
    module = Deferred()
    run_after_configure_model(module, lambda m: None)
    assert "configure_model" in module.__dict__
    discard_pending_surgery(module)
    assert "configure_model" not in module.__dict__


class Shifted(pl.LightningModule):
    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch + 1


def test_batch_transforms_chain_after_the_module_hook_and_come_off() -> None:
    import pickle

    from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform

    module = Shifted()
    add_batch_transform(module, lambda b: b * 10)
    first = module.__dict__["_lightning_perf_batch_transforms"][0]
    add_batch_transform(module, first)  # same transform twice: once
    assert module.on_after_batch_transfer(torch.tensor(1.0), 0).item() == 20.0  # (1 + 1) * 10
    remove_batch_transform(module, first)
    assert "on_after_batch_transfer" not in module.__dict__
    assert module.on_after_batch_transfer(torch.tensor(1.0), 0).item() == 2.0
    add_batch_transform(module, torch.neg)
    clone = pickle.loads(pickle.dumps(module))
    assert clone.on_after_batch_transfer(torch.tensor(1.0), 0).item() == -2.0


def test_batch_transform_keeps_lightnings_view_of_which_hook_is_overridden(tmp_path) -> None:
    """Lightning asks `is_overridden` to pick the module's or the datamodule's hook (and warns when both exist): the
    stand-in must not change that answer, and rides on the datamodule's hook when that is the one Lightning calls."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform

    plain = Eager()
    add_batch_transform(plain, torch.neg)
    assert not is_overridden("on_after_batch_transfer", plain)
    shifted = Shifted()
    add_batch_transform(shifted, torch.neg)
    assert is_overridden("on_after_batch_transfer", shifted)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return [batch[0] + 1]

    seen: list[torch.Tensor] = []

    class Model(Eager):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0])
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def times_ten(batch):
        return [batch[0] * 10]

    class Transform(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            add_batch_transform(pl_module, times_ten)

        def teardown(self, trainer, pl_module, stage):
            remove_batch_transform(pl_module, times_ten)

    data = Data()
    trainer = make_trainer(
        tmp_path, max_steps=1, callbacks=[Transform()], limit_val_batches=1.0, num_sanity_val_steps=2
    )
    trainer.fit(Model(), datamodule=data)
    assert torch.equal(seen[0], torch.full((2, 2), 20.0))  # the datamodule's hook first, then the transform
    assert "on_after_batch_transfer" not in data.__dict__


class Doubled(pl.LightningModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch * 2


def test_before_transfer_transforms_see_the_host_batch_after_the_users_hook() -> None:
    import pickle

    import pytest

    from lightning_perf.callbacks._model_hooks import add_batch_transform, remove_batch_transform

    module = Doubled()
    add_batch_transform(module, torch.neg, hook="on_before_batch_transfer")
    add_batch_transform(module, torch.abs)  # the after-transfer chain is separate
    assert module.on_before_batch_transfer(torch.tensor(3.0), 0).item() == -6.0  # the user's hook first
    assert module.on_after_batch_transfer(torch.tensor(-1.0), 0).item() == 1.0
    clone = pickle.loads(pickle.dumps(module))
    assert clone.on_before_batch_transfer(torch.tensor(1.0), 0).item() == -2.0
    remove_batch_transform(module, torch.neg, hook="on_before_batch_transfer")
    assert "on_before_batch_transfer" not in module.__dict__ and "on_after_batch_transfer" in module.__dict__
    with pytest.raises(ValueError, match="not a batch-transfer hook"):
        add_batch_transform(module, torch.neg, hook="on_train_batch_start")
