"""The reference workloads: shapes, determinism of data and sampling, learnability, checkpoints, errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import SequentialSampler

from lightning_perf.demos import PRESETS, WORKLOADS, EpochSeededRandomSampler, make_workload, workload_names
from lightning_perf.demos.lm import CausalSelfAttention, LMBlock, LMModule
from lightning_perf.demos.vit import ViTBlock, ViTModule
from tests.callbacks._interrupt import LossRecorder
from tests.callbacks._quiet import quiet_trainer

NAMES = ["convnet", "unet3d", "vit", "lm"]

# Batch shapes of the tiny presets: (inputs, targets, model output).
TINY_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {
    "convnet": ((32, 3, 16, 16), (32,), (32, 10)),
    "unet3d": ((4, 1, 16, 16, 16), (4, 1, 16, 16, 16), (4, 1, 16, 16, 16)),
    "vit": ((32, 3, 16, 16), (32,), (32, 10)),
    "lm": ((32, 32), (32, 32), (32, 32, 64)),
}

# unet3d predicts whole volumes (32^3 on `tiny`) with the network that trains on 16^3 patches.
UNET3D_TINY_PREDICT_SHAPE = (4, 1, 32, 32, 32)

# Learnability after LEARN_STEPS steps on `tiny`. Observed over seeds 0-7 (the test uses seed 0): val_acc >= 0.81
# convnet, >= 0.72 vit, >= 0.52 lm (chance 1/64; the chain allows ~0.55); val_dice >= 0.77 unet3d (all-foreground
# scores ~0.22); mean of the last 5 training losses <= 0.5x the first. The thresholds keep a wide margin below that.
LEARN_STEPS = 40
MIN_METRIC = {"convnet": 0.5, "vit": 0.4, "lm": 0.3, "unet3d": 0.5}
MAX_LOSS_RATIO = 0.7


def _inputs_and_targets(name: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "lm":
        return batch["input_ids"], batch["labels"]
    return batch


def _first_batch(data: pl.LightningDataModule, split: str = "train") -> Any:
    data.setup("fit")
    return next(iter(getattr(data, f"{split}_dataloader")()))


def _assert_batches_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = list(a.values()), list(b.values())
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_registry() -> None:
    assert workload_names() == NAMES == list(WORKLOADS)
    assert PRESETS == ("tiny", "default", "gpu")
    for name, workload in WORKLOADS.items():
        assert workload.name == name
        assert workload.task in ("classification", "segmentation", "language-modeling")
        assert issubclass(workload.module_cls, pl.LightningModule)
        assert issubclass(workload.datamodule_cls, pl.LightningDataModule)
        assert workload.description


@pytest.mark.parametrize("name", NAMES)
def test_tiny_shapes_and_single_parameter_child(name: str) -> None:
    model, data = make_workload(name, "tiny")
    inputs, targets = _inputs_and_targets(name, _first_batch(data))
    in_shape, target_shape, out_shape = TINY_SHAPES[name]
    assert tuple(inputs.shape) == in_shape
    assert tuple(targets.shape) == target_shape
    assert targets.dtype == torch.long
    assert data.batch_size == in_shape[0]
    with torch.no_grad():
        assert tuple(model(inputs).shape) == out_shape
        predict_shape = UNET3D_TINY_PREDICT_SHAPE if name == "unet3d" else out_shape
        assert tuple(model.predict_step(_first_batch(data, "predict"), 0).shape) == predict_shape
        example = model(model.example_input_array)
    assert tuple(example.shape) == (1, *out_shape[1:])
    # Tools find "the single child module that holds the parameters".
    holders = [child for child in model.children() if any(True for _ in child.parameters())]
    assert holders == [model.net]
    assert not any(isinstance(module, nn.Dropout) for module in model.modules())


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_data_and_model_and_the_global_rng_left_alone(name: str) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    model_a, data_a = make_workload(name, "tiny", seed=0)
    assert torch.equal(torch.rand(4), expected)
    model_b, data_b = make_workload(name, "tiny", seed=0)
    _assert_batches_equal(_first_batch(data_a), _first_batch(data_b))
    _assert_batches_equal(_first_batch(data_a, "val"), _first_batch(data_b, "val"))
    for key, value in model_a.state_dict().items():
        assert torch.equal(value, model_b.state_dict()[key]), key

    model_c, data_c = make_workload(name, "tiny", seed=1)
    inputs_a, _ = _inputs_and_targets(name, _first_batch(data_a))
    inputs_c, _ = _inputs_and_targets(name, _first_batch(data_c))
    assert not torch.equal(inputs_a, inputs_c)
    assert not all(torch.equal(v, model_c.state_dict()[k]) for k, v in model_a.state_dict().items())


def test_sampler_order_depends_only_on_seed_and_epoch_and_its_length_is_checked() -> None:
    straight = EpochSeededRandomSampler(50, seed=3)
    orders = []
    for epoch in range(3):
        straight.set_epoch(epoch)
        orders.append(list(straight))
    assert all(sorted(order) == list(range(50)) for order in orders)
    assert orders[0] != orders[1] != orders[2]

    torch.manual_seed(999)  # the global RNG plays no part
    fresh = EpochSeededRandomSampler(50, seed=3)
    fresh.set_epoch(2)
    assert list(fresh) == orders[2]
    assert list(fresh) == orders[2]  # iterating twice in one epoch repeats the order

    other_seed = EpochSeededRandomSampler(50, seed=4)
    other_seed.set_epoch(2)
    assert list(other_seed) != orders[2]
    assert len(fresh) == 50
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"num_samples={bad!r}"):
            EpochSeededRandomSampler(bad)


def test_loaders_shuffle_train_only_and_pass_worker_options() -> None:
    _, data = make_workload("convnet", "tiny", seed=0, pin_memory=True, persistent_workers=True)
    data.setup("fit")
    train = data.train_dataloader()
    assert isinstance(train.sampler, EpochSeededRandomSampler)
    assert train.drop_last
    assert train.pin_memory
    assert not train.persistent_workers  # only meaningful with workers
    for split in ("val", "test", "predict"):
        assert isinstance(getattr(data, f"{split}_dataloader")().sampler, SequentialSampler)

    _, workers = make_workload("convnet", "tiny", num_workers=2, persistent_workers=True)
    workers.setup("fit")
    assert workers.train_dataloader().persistent_workers


def test_checkpointed_data_seed_wins() -> None:
    """A resumed run continues on the data of the checkpoint, whatever seed the fresh data module was given."""
    _, original = make_workload("lm", "tiny", seed=0)
    _, fresh = make_workload("lm", "tiny", seed=7)
    fresh.setup("fit")
    fresh.load_state_dict(original.state_dict())
    assert fresh.hparams["seed"] == 0
    _assert_batches_equal(_first_batch(fresh), _first_batch(original))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_is_learnable(name: str, tmp_path: Path) -> None:
    model, data = make_workload(name, "tiny", seed=0)
    recorder = LossRecorder()
    quiet_trainer(tmp_path, [recorder], max_steps=LEARN_STEPS).fit(model, datamodule=data)
    assert len(recorder.losses) == LEARN_STEPS
    assert sum(recorder.losses[-5:]) / 5 < MAX_LOSS_RATIO * recorder.losses[0], recorder.losses

    (metrics,) = quiet_trainer(tmp_path, [], limit_val_batches=1.0).validate(model, datamodule=data, verbose=False)
    metric_name = "val_dice" if name == "unet3d" else "val_acc"
    assert metrics[metric_name] > MIN_METRIC[name], metrics
    if name == "lm":
        assert recorder.losses[0] == pytest.approx(math.log(64), rel=0.05)  # an untrained model knows nothing
        assert metrics["val_loss"] < 0.6 * math.log(64), metrics


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_loads_and_resumes_at_epoch_boundary_bit_identical(name: str, tmp_path: Path) -> None:
    """One epoch, a checkpoint (it loads as module and data module), a resumed second epoch (fresh objects, other
    seed) equal two epochs in one go."""
    limits = {"limit_train_batches": 2, "limit_val_batches": 1, "max_epochs": 2}
    straight_model, straight_data = make_workload(name, "tiny", seed=0, lr=2e-3)
    quiet_trainer(tmp_path, [], **limits).fit(straight_model, datamodule=straight_data)

    model, data = make_workload(name, "tiny", seed=0, lr=2e-3)
    first = quiet_trainer(tmp_path, [], **{**limits, "max_epochs": 1})
    first.fit(model, datamodule=data)
    first.save_checkpoint(path := tmp_path / "epoch1.ckpt")
    workload = WORKLOADS[name]
    loaded = workload.module_cls.load_from_checkpoint(path, map_location="cpu")
    assert loaded.hparams["preset"] == "tiny" and loaded.hparams["lr"] == 2e-3
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(model.example_input_array), model(model.example_input_array))
    loaded_data = workload.datamodule_cls.load_from_checkpoint(path)
    assert loaded_data.hparams["preset"] == "tiny" and loaded_data.batch_size == data.batch_size

    resumed_model, resumed_data = make_workload(name, "tiny", seed=1, lr=2e-3)  # the checkpoint's weights, data seed
    resumed = quiet_trainer(tmp_path, [], **limits)
    resumed.fit(resumed_model, datamodule=resumed_data, ckpt_path=path)
    assert resumed.global_step == 4
    expected = straight_model.state_dict()
    for key, value in resumed_model.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_and_epoch_cosine_schedule(name: str) -> None:
    model, _ = make_workload(name, "tiny", weight_decay=0.05, schedule_epochs=4)
    config = model.configure_optimizers()
    optimizer = config["optimizer"]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["weight_decay"] == 0.05
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in model.parameters()}
    scheduler = config["lr_scheduler"]
    assert scheduler["interval"] == "epoch"
    assert isinstance(scheduler["scheduler"], torch.optim.lr_scheduler.CosineAnnealingLR)
    # A fixed length, not the trainer's max_epochs: an interrupted run and a straight one share the schedule.
    assert scheduler["scheduler"].T_max == 4


def test_transformer_blocks_are_repeated_siblings() -> None:
    vit, _ = make_workload("vit", "tiny", depth=3)
    assert isinstance(vit, ViTModule)
    blocks = vit.net.blocks
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == 3
    assert all(type(block) is ViTBlock for block in blocks)
    assert all(isinstance(block.attn, nn.MultiheadAttention) and block.attn.batch_first for block in blocks)

    lm, _ = make_workload("lm", "tiny")
    assert isinstance(lm, LMModule)
    assert all(type(block) is LMBlock and type(block.attn) is CausalSelfAttention for block in lm.net.blocks)


def test_lm_attention_is_eager_and_causal(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the LM must not call scaled_dot_product_attention")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", forbidden)
    model, data = make_workload("lm", "tiny")
    model.eval()
    input_ids = _first_batch(data)["input_ids"][:2]
    changed = input_ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 64
    with torch.no_grad():
        before, after = model(input_ids), model(changed)
    torch.testing.assert_close(after[:, :20], before[:, :20])  # the past does not see the future
    assert not torch.allclose(after[:, 20:], before[:, 20:])
    assert not any("future_mask" in key for key in model.state_dict())  # a non-persistent buffer


def test_shape_overrides_reach_the_data_module() -> None:
    model, data = make_workload("vit", "tiny", image_size=8, patch_size=4, num_classes=3, batch_size=5)
    images, labels = _first_batch(data)
    assert tuple(images.shape) == (5, 3, 8, 8)
    assert int(labels.max()) < 3
    with torch.no_grad():
        assert tuple(model(images).shape) == (5, 3)


def test_unknown_workload_and_preset() -> None:
    with pytest.raises(ValueError, match=r"name='resnet9'.*Expected one of 'convnet', 'unet3d', 'vit', 'lm'"):
        make_workload("resnet9")
    with pytest.raises(ValueError, match=r"preset='huge'.*Expected one of 'tiny', 'default'"):
        make_workload("convnet", "huge")
    for workload in WORKLOADS.values():
        with pytest.raises(ValueError, match=rf"{workload.module_cls.__name__}\(preset='huge'\).*'tiny', 'default'"):
            workload.module_cls("huge")
        with pytest.raises(ValueError, match=rf"{workload.datamodule_cls.__name__}\(preset='huge'\).*'tiny'"):
            workload.datamodule_cls("huge")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": 0}, r"ViTModule\(depth=0\).*integer >= 1"),
        ({"lr": -1.0}, r"ViTModule\(lr=-1.0\).*number >= 0"),
        ({"num_heads": 3}, r"ViTModule\(num_heads=3\).*divide"),
        ({"batch_size": 0}, r"ViTDataModule\(batch_size=0\).*integer >= 1"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_workload("vit", "tiny", **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_built_by_lightning_cli(name: str) -> None:
    from lightning.pytorch.cli import LightningCLI

    workload = WORKLOADS[name]
    args = [f"--{arg}" for arg in ("model.preset=tiny", "model.lr=0.01", "data.preset=tiny", "data.batch_size=3")]
    args.append("--trainer.logger=false")
    cli = LightningCLI(workload.module_cls, workload.datamodule_cls, run=False, args=args, save_config_callback=None)
    assert isinstance(cli.model, workload.module_cls) and cli.model.hparams["lr"] == 0.01
    assert isinstance(cli.datamodule, workload.datamodule_cls) and cli.datamodule.batch_size == 3


def test_unet3d_trains_on_patches_and_predicts_whole_volumes() -> None:
    model, data = make_workload("unet3d", "tiny", seed=0)
    assert model.roi_size == (16, 16, 16) == tuple(model.example_input_array.shape[2:])
    train_volumes, _ = _first_batch(data)
    predict_volumes, predict_masks = _first_batch(data, "predict")
    assert tuple(train_volumes.shape[2:]) == (16, 16, 16)
    assert tuple(predict_volumes.shape[2:]) == (32, 32, 32) == tuple(predict_masks.shape[2:])
    # Spheres of the training sizes, more of them: the foreground share stays of the same order as in training.
    train_share = float(_first_batch(data)[1].float().mean())
    predict_share = float(predict_masks.float().mean())
    assert 0.25 * train_share < predict_share < 4 * train_share, (train_share, predict_share)

    _, default = make_workload("unet3d", "default")
    assert (default.volume_size, default.predict_volume_size) == (32, 64)
    _, custom = make_workload("unet3d", "tiny", batch_size=1)
    custom_data = type(custom)("tiny", batch_size=1, predict_volume_size=24)
    assert tuple(_first_batch(custom_data, "predict")[0].shape) == (1, 1, 24, 24, 24)
    with pytest.raises(ValueError, match=r"predict_volume_size=0.*integer >= 1"):
        type(custom)("tiny", predict_volume_size=0)


# ------------------------------------------------------------------------------------------------ the gpu preset

# Parameters (millions) and the shape of one example input of each ``gpu`` preset: the scale of the model people train
# on one GPU (ResNet-50 25.6M, ViT-B/16 86M, GPT-2 small 124M with its 50257-token vocabulary).
GPU_SCALE: dict[str, tuple[float, float, tuple[int, ...], int]] = {
    "convnet": (20.0, 30.0, (1, 3, 224, 224), 128),
    "unet3d": (15.0, 30.0, (1, 1, 128, 128, 128), 2),
    "vit": (80.0, 90.0, (1, 3, 224, 224), 64),
    "lm": (90.0, 130.0, (1, 512), 16),
}


@pytest.mark.parametrize("name", NAMES)
def test_gpu_preset_has_the_scale_it_names(name: str) -> None:
    low, high, example_shape, batch_size = GPU_SCALE[name]
    with torch.device("meta"):  # the real sizes without allocating them
        model, data = make_workload(name, "gpu")
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert low <= millions <= high, f"{name}: {millions:.1f}M parameters"
    assert tuple(model.example_input_array.shape) == example_shape
    assert data.batch_size == batch_size
    assert model.hparams["preset"] == data.hparams["preset"] == "gpu"
    holders = [child for child in model.children() if any(True for _ in child.parameters())]
    assert holders == [model.net]


def test_gpu_preset_shapes_of_each_network() -> None:
    with torch.device("meta"):
        lm, lm_data = make_workload("lm", "gpu")
        vit, _ = make_workload("vit", "gpu")
        unet, unet_data = make_workload("unet3d", "gpu")
    assert (len(lm.net.blocks), lm.net.tok_embed.embedding_dim, lm_data.seq_len) == (12, 768, 512)
    assert len(vit.net.blocks) == 12 and vit.hparams_initial["preset"] == "gpu"
    assert unet_data.volume_size == 128 and unet_data.predict_volume_size % 16 == 0
    assert len(unet.net.encoders) == 5


def test_the_convnet_gpu_preset_has_the_imagenet_stem() -> None:
    with torch.device("meta"):
        model, _ = make_workload("convnet", "gpu")
        small, _ = make_workload("convnet", "tiny")
        out = model(model.example_input_array)
    assert isinstance(model.net.stem[-1], nn.MaxPool2d) and model.net.stem[0].stride == (2, 2)
    assert model.net.stages[0][0].conv1.stride == (1, 1)  # the first stage keeps the stem's 56x56
    assert small.net.stem[0].kernel_size == (3, 3) and small.net.stages[0][0].conv1.stride == (2, 2)
    assert tuple(out.shape) == (1, 10)
    with pytest.raises(ValueError, match=r"ConvNetModule\(stem_stride=2\)` is not valid. Expected one of 1, 4"):
        make_workload("convnet", "tiny", stem_stride=2)


def test_a_subclass_of_a_workload_module_saves_its_own_arguments_too() -> None:
    from lightning_perf.demos import ConvNetModule

    class Wider(ConvNetModule):
        def __init__(self, preset: str = "tiny", extra: int = 3, width: int | None = 12) -> None:
            super().__init__(preset, width=width)
            self.extra = extra

    model = Wider(extra=5)
    assert model.hparams["extra"] == 5 and model.hparams["width"] == 12 and model.hparams["preset"] == "tiny"
    assert model.net.stem[0].out_channels == 12
