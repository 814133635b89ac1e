"""ChannelsLastCallback in a Trainer: formats of weights, batches and gradients, per stage, and what it leaves alone."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_perf import NoEffectWarning, PartialEffectWarning
from lightning_perf.callbacks import ChannelsLastCallback
from lightning_perf.demos import ConvNetModule, UNet3DModule, make_workload
from tests._models import trainer
from tests.callbacks._sharded import one_process_group  # noqa: F401  (a fixture)

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _trainer(tmp_path: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    defaults = {"max_steps": 2, "limit_test_batches": 1, "limit_predict_batches": 1}
    return trainer(tmp_path, callbacks=callbacks, **{**defaults, **kwargs})


class Seen(pl.Callback):
    """Records the layouts that matter, at the moments they matter."""

    def __init__(self, fmt: torch.memory_format) -> None:
        self.fmt = fmt
        self.weights_at_fit_start: list[bool] = []
        self.moved_at_fit_start: list[bool] = []
        self.grads: list[bool] = []

    def _convs(self, module: nn.Module) -> list[torch.Tensor]:
        return [m.weight for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)]

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights_at_fit_start = [w.is_contiguous(memory_format=self.fmt) for w in self._convs(pl_module)]
        self.moved_at_fit_start = [not w.is_contiguous() for w in self._convs(pl_module)]
        # The optimizer exists now and must hold the very same (converted) Parameter objects.
        held = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        assert all(id(w) in held for w in self._convs(pl_module))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.grads = [
            w.grad is not None and w.grad.is_contiguous(memory_format=self.fmt) for w in self._convs(pl_module)
        ]


class RecordingConvNet(ConvNetModule):
    """The demo ``convnet``, recording the batch each step method receives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"] = batch
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val"] = batch
        super().validation_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["test"] = batch
        super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        self.seen["predict"] = batch
        return super().predict_step(batch, batch_idx, dataloader_idx)


def test_convnet_weights_batches_and_gradients_in_channels_last(tmp_path: Path, caplog) -> None:
    _, data = make_workload("convnet", "tiny")
    model = RecordingConvNet("tiny")
    seen = Seen(CL)
    trainer = _trainer(tmp_path, [ChannelsLastCallback(), seen])
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)

    assert seen.weights_at_fit_start and all(seen.weights_at_fit_start)
    assert seen.grads and all(seen.grads)
    images, labels = model.seen["train"]
    assert images.is_contiguous(memory_format=CL) and not images.is_contiguous()
    assert labels.dtype == torch.long
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert f"ChannelsLastCallback: {convs} 2D conv layer(s) and 4D inputs in channels_last" in caplog.text

    trainer.validate(model, datamodule=data, verbose=False)
    trainer.test(model, datamodule=data, verbose=False)
    trainer.predict(model, datamodule=data)
    for stage in ("val", "test", "predict"):
        assert model.seen[stage][0].is_contiguous(memory_format=CL), stage
    # Each stage's teardown took the batch transform off again, and gave the weights back their layout.
    assert "on_after_batch_transfer" not in model.__dict__
    assert all(w.is_contiguous() for w in seen._convs(model))
    assert caplog.text.count("ChannelsLastCallback:") == 1  # reported once, not per stage


def test_unet3d_uses_channels_last_3d_and_leaves_integer_masks(tmp_path: Path) -> None:
    _, data = make_workload("unet3d", "tiny")

    class Recording(UNet3DModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.batch = batch
            return super().training_step(batch, batch_idx)

    model = Recording("tiny")
    seen = Seen(CL3)
    _trainer(tmp_path, [ChannelsLastCallback(), seen]).fit(model, datamodule=data)
    assert all(seen.weights_at_fit_start) and all(seen.grads)
    volumes, masks = model.batch
    # One channel: both formats are the same order in memory, so torch keeps the tensor as it is.
    assert volumes.dim() == 5 and volumes.is_contiguous(memory_format=CL3)
    assert any(seen.moved_at_fit_start)  # the layers with several input channels moved
    assert all(w.is_contiguous() for w in seen._convs(model))  # and got their layout back at teardown
    assert masks.dtype == torch.long and masks.is_contiguous()  # integers stay as they are


# A small model of our own, with both 2D and 3D convolutions and a dataclass batch.
@dataclass
class Item:
    image: torch.Tensor
    volume: torch.Tensor
    target: torch.Tensor


class ItemDataset(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Item:
        g = torch.Generator().manual_seed(i)
        return Item(torch.randn(3, 8, 8, generator=g), torch.randn(2, 4, 4, 4, generator=g), torch.tensor(i % 2))


def _collate(items: list[Item]) -> dict[str, Any]:
    return {
        "item": Item(*(torch.stack([getattr(it, f) for it in items]) for f in ("image", "volume", "target"))),
        "meta": [len(items)],
    }


class TwoRanks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv2d = nn.Conv2d(3, 4, 3)
        self.conv3d = nn.Conv3d(2, 4, 3)
        self.head = nn.Linear(8, 2)
        self.batches: list[Any] = []

    def forward(self, image: torch.Tensor, volume: torch.Tensor) -> torch.Tensor:
        a = self.conv2d(image).mean(dim=(2, 3))
        b = self.conv3d(volume).mean(dim=(2, 3, 4))
        return self.head(torch.cat([a, b], dim=1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.batches.append(batch)
        item = batch["item"]
        return nn.functional.cross_entropy(self(item.image, item.volume), item.target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ItemDataset(), batch_size=4, collate_fn=_collate)


@pytest.mark.parametrize(
    ("dims", "image_fmt", "volume_fmt"), [("auto", CL, CL3), (2, CL, torch.contiguous_format), (3, None, CL3)]
)
def test_dataclass_batches_and_dims(tmp_path: Path, dims: Any, image_fmt: Any, volume_fmt: Any) -> None:
    model = TwoRanks()
    seen2d, seen3d = Seen(CL), Seen(CL3)
    _trainer(tmp_path, [ChannelsLastCallback(dims=dims), seen2d, seen3d], max_steps=1).fit(model)
    item = model.batches[0]["item"]
    assert isinstance(item, Item) and model.batches[0]["meta"] == [4]
    if image_fmt is None:
        assert item.image.is_contiguous()
    else:
        assert item.image.is_contiguous(memory_format=image_fmt) and not item.image.is_contiguous()
    assert item.volume.is_contiguous(memory_format=volume_fmt)
    assert seen2d.weights_at_fit_start[0] == (dims in ("auto", 2))  # conv2d comes first
    assert seen3d.weights_at_fit_start[1] == (dims in ("auto", 3))
    assert model.conv2d.weight.is_contiguous() and model.conv3d.weight.is_contiguous()  # restored at teardown
    assert item.target.dtype == torch.long


class NoConv(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.inputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.inputs.append(batch[0])
        return self.layer(batch[0].flatten(1)[:, :4]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2, 3, 3)), batch_size=2)


def test_a_model_without_conv_layers_warns_once_and_is_left_alone(tmp_path: Path) -> None:
    model = NoConv()
    callback = ChannelsLastCallback()
    with pytest.warns(NoEffectWarning, match="has no 2D or 3D convolution layers") as record:
        _trainer(tmp_path, [callback]).fit(model)
        _trainer(tmp_path, [callback]).fit(model)  # the second run says nothing new
    assert len([w for w in record if issubclass(w.category, NoEffectWarning)]) == 1
    assert all(x.is_contiguous() for x in model.inputs)  # 4D float batches not converted
    assert "on_after_batch_transfer" not in model.__dict__


def test_forced_dims_that_do_not_exist_warn(tmp_path: Path) -> None:
    class Only3D(TwoRanks):
        def __init__(self) -> None:
            super().__init__()
            self.conv2d = nn.Identity()  # type: ignore[assignment]

        def forward(self, image: torch.Tensor, volume: torch.Tensor) -> torch.Tensor:
            return self.head(torch.cat([self.conv3d(volume).mean(dim=(2, 3, 4))] * 2, dim=1))

    model = Only3D()
    with pytest.warns(NoEffectWarning, match="dims=2 was asked for but the model has only 3D convolution layers"):
        _trainer(tmp_path, [ChannelsLastCallback(dims=2)], max_steps=1).fit(model)
    assert model.conv3d.weight.is_contiguous()
    assert model.batches[0]["item"].image.is_contiguous()


@pytest.mark.parametrize("bad", ["2", 4, True, "channels_last"])
def test_dims_validation(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"ChannelsLastCallback\(dims={bad!r}\)"):
        ChannelsLastCallback(dims=bad)


def test_batches_are_converted_after_a_datamodule_hook(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """Lightning calls the datamodule's on_after_batch_transfer instead of the module's when it has one."""
    model, data = make_workload("convnet", "tiny")
    calls: list[bool] = []

    class DataWithHook(type(data)):  # type: ignore[misc]
        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(batch[0].is_contiguous())  # runs first, on the batch as transferred
            return batch[0] * 1.0, batch[1]

    data = DataWithHook("tiny")
    seen: list[torch.Tensor] = []

    class Capture(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            seen.append(batch[0])

    _trainer(tmp_path, [ChannelsLastCallback(), Capture()]).fit(model, datamodule=data)
    assert calls == [True, True]
    assert all(x.is_contiguous(memory_format=CL) for x in seen)
    assert "on_after_batch_transfer" not in data.__dict__
    assert not [w for w in recwarn if "on_after_batch_transfer" in str(w.message)]


def test_exception_takes_the_batch_transform_off(tmp_path: Path) -> None:
    class Failing(TwoRanks):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            raise RuntimeError("boom")

    model = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [ChannelsLastCallback()]).fit(model)
    assert "on_after_batch_transfer" not in model.__dict__


def _plain_net() -> nn.Module:
    torch.manual_seed(0)  # no BatchNorm: Adam then amplifies no rounding noise
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))


class SmallConvNet(pl.LightningModule):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.net = _plain_net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused or None)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(
            torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        )
        return DataLoader(data, batch_size=4)


@pytest.mark.parametrize("fused", [False, True])
def test_resume_from_a_plain_checkpoint_and_load_both_ways(tmp_path: Path, fused: bool) -> None:
    """A checkpoint written without the callback resumes with it (optimizer state takes the weights' layout) and
    matches an uninterrupted plain run; one written with it loads into a plain model."""
    limits = {"max_steps": -1, "limit_train_batches": 2}
    straight = SmallConvNet(fused)
    _trainer(tmp_path / "s", [], max_epochs=2, **limits).fit(straight)

    first = SmallConvNet(fused)
    trainer = _trainer(tmp_path / "f", [], max_epochs=1, **limits)
    trainer.fit(first)
    trainer.save_checkpoint(tmp_path / "plain.ckpt")

    resumed = SmallConvNet(fused)
    callback = ChannelsLastCallback()
    resumed_trainer = _trainer(tmp_path / "r", [callback], max_epochs=2, **limits)
    resumed_trainer.fit(resumed, ckpt_path=tmp_path / "plain.ckpt")
    state = resumed_trainer.optimizers[0].state
    for p in resumed.net.parameters():
        if p.dim() == 4:  # teardown gave the weights back their layout, and their optimizer state followed
            assert p.is_contiguous()
            assert state[p]["exp_avg"].stride() == p.stride()
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert not callback._handles  # the post-load hooks went with teardown

    resumed_trainer.save_checkpoint(tmp_path / "cl.ckpt")
    plain = SmallConvNet.load_from_checkpoint(tmp_path / "cl.ckpt")
    for (name, a), b in zip(resumed.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        assert b.is_contiguous(), name


@pytest.mark.usefixtures("one_process_group")
def test_fsdp2_sharded_weights_keep_their_layout_and_a_warning_says_so() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class ShardedConv(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

    module = ShardedConv()
    fully_shard(module.conv, mesh=init_device_mesh("cpu", (1,)))
    callback = ChannelsLastCallback()
    with pytest.warns(PartialEffectWarning, match=r"1 convolution\(s\) are FSDP2 shards and keep FSDP2's layout"):
        callback._convert(module)
    assert callback._transform is not None  # the inputs are still converted
    assert not module.conv.weight.to_local().is_contiguous(memory_format=torch.channels_last)
