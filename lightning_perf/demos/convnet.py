"""Reference workload ``convnet``: a ResNet-style image classifier on synthetic template images.

The task (shared with :mod:`lightning_perf.demos.vit`): each of the classes has a fixed random smooth pattern; a
sample is its class's pattern shifted by a few pixels plus Gaussian noise. The patterns are the same for every data
seed, so a model trained on one seed's samples is evaluated fairly on another's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_perf._validation import check_choice
from lightning_perf.demos._base import (
    SPLITS,
    DemoModule,
    SeededDataset,
    SyntheticDataModule,
    build_from,
    generator_for,
    model_presets,
)

# The patterns are part of the task's definition, not of the data seed.
_TEMPLATE_SEED = 1_000_003
_TEMPLATE_GRID = 5  # random values per side before upsampling: sets how smooth a pattern is
NOISE_STD = 1.0
"""Standard deviation of the per-pixel Gaussian noise; the patterns have unit standard deviation."""


def class_templates(num_classes: int, channels: int, size: int) -> Tensor:
    """Fixed smooth random patterns, one per class, each with zero mean and unit standard deviation.

    Args:
        num_classes: number of patterns.
        channels: image channels.
        size: side length of each (square) pattern.

    Returns:
        A float tensor of shape ``(num_classes, channels, size, size)``; the same for the same arguments.
    """
    coarse = torch.randn(num_classes, channels, _TEMPLATE_GRID, _TEMPLATE_GRID, generator=generator_for(_TEMPLATE_SEED))
    fine = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    flat = fine.flatten(1)
    flat = (flat - flat.mean(dim=1, keepdim=True)) / flat.std(dim=1, keepdim=True)
    return flat.view_as(fine).contiguous()


class TemplateImageDataset(SeededDataset):
    """Sample ``i`` is ``(image, label)``: a shifted, noisy copy of a class pattern, generated from ``(seed, i)``.

    Args:
        num_samples: dataset length.
        image_size: side length of the square images.
        num_classes: number of classes (patterns).
        seed: data seed.
        split: a tag mixed into every sample's seed so the splits do not share samples.
        channels: image channels.
        max_shift: largest shift in pixels along each axis; default ``image_size // 8``.
        noise_std: standard deviation of the added Gaussian noise.
    """

    def __init__(
        self,
        num_samples: int,
        image_size: int,
        num_classes: int,
        seed: int = 0,
        split: int = 0,
        channels: int = 3,
        max_shift: int | None = None,
        noise_std: float = NOISE_STD,
    ) -> None:
        super().__init__(num_samples, seed, split)
        self.image_size, self.num_classes, self.channels = image_size, num_classes, channels
        self.max_shift = image_size // 8 if max_shift is None else max_shift
        self.noise_std = noise_std
        # Patterns are drawn on a larger canvas; a shift is a crop at an offset, so no wrap-around seams appear.
        self.templates = class_templates(num_classes, channels, image_size + 2 * self.max_shift)

    @override
    def sample(self, g: torch.Generator) -> tuple[Tensor, Tensor]:
        label = int(torch.randint(self.num_classes, (), generator=g))
        dy, dx = torch.randint(2 * self.max_shift + 1, (2,), generator=g).tolist()
        size = self.image_size
        image = self.templates[label, :, dy : dy + size, dx : dx + size]
        image = image + self.noise_std * torch.randn(image.shape, generator=g)
        return image, torch.tensor(label)


class TemplateImageDataModule(SyntheticDataModule):
    """Data module of the template-image classification task; :class:`ConvNetDataModule` and the ViT's share it.

    Args:
        preset: one of :data:`~lightning_perf.demos._base.PRESETS`.
        **kwargs: ``batch_size``, ``num_workers``, ``pin_memory``, ``persistent_workers``, ``seed``: as for
            :class:`SyntheticDataModule`.
        image_size: side of the square images; ``None`` takes the preset's.
        num_classes: number of classes; ``None`` takes the preset's.
    """

    SIZES: ClassVar[Mapping[str, Mapping[str, int]]] = {}
    SHAPE_KEYS: ClassVar[tuple[str, ...]] = ("image_size", "num_classes")
    image_size: int
    num_classes: int

    def __init__(
        self,
        preset: str = "default",
        image_size: int | None = None,
        num_classes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def make_dataset(self, split: str, num_samples: int) -> Dataset:
        return TemplateImageDataset(
            num_samples, self.image_size, self.num_classes, seed=self.seed, split=SPLITS.index(split)
        )


_DATA_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"batch_size": 32, "train": 512, "val": 128, "test": 128, "predict": 64, "image_size": 16},
    "default": {"batch_size": 32, "train": 2048, "val": 256, "test": 256, "predict": 256, "image_size": 64},
    # ImageNet-sized images at the batch of the usual ResNet-50 benchmarks.
    "gpu": {"batch_size": 128, "train": 4096, "val": 512, "test": 512, "predict": 512, "image_size": 224},
}
for _sizes in _DATA_SIZES.values():
    _sizes["num_classes"] = 10

_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"width": 8, "num_stages": 3, "blocks_per_stage": 1, "stem_stride": 1, "lr": 3e-3},
    "default": {"width": 32, "num_stages": 3, "blocks_per_stage": 2, "stem_stride": 1, "lr": 1e-3},
    # ResNet-50's scale (23.7M parameters, 3.7 GMACs per 224x224 image forward; ResNet-50: 25.6M, 4.1) with its
    # ImageNet stem and four stages of 64 to 512 channels, in basic blocks.
    "gpu": {"width": 64, "num_stages": 4, "blocks_per_stage": 4, "stem_stride": 4, "lr": 1e-3},
}
STEM_STRIDES = (1, 4)
"""``1``: a 3x3 convolution at full resolution (small images); ``4``: ImageNet's 7x7 stride-2 convolution and 3x3
stride-2 max-pool, the first stage then keeping the stem's resolution (as in torchvision's ResNets)."""


class ConvNetDataModule(TemplateImageDataModule):
    """Template images for :class:`ConvNetModule`: 3x16x16 (``tiny``), 3x64x64 (``default``) or 3x224x224
    (``gpu``, batch 128), 10 classes.

    Batches are ``(images, labels)``: float ``(B, 3, S, S)`` and long ``(B,)``. Arguments: those of
    :class:`TemplateImageDataModule`.

    Example::

        data = ConvNetDataModule("tiny", seed=0)
        data.setup("fit")
        images, labels = next(iter(data.train_dataloader()))
    """

    SIZES = _DATA_SIZES


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN layers with an identity (or 1x1 conv-BN projection) shortcut.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: stride of the first convolution (2 halves the resolution).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: conv-BN-ReLU stem, stages of :class:`BasicBlock` (each halving the resolution), pool, head.

    Args:
        num_classes: outputs of the linear head.
        width: channels of the stem and the first stage; each further stage doubles them.
        num_stages: number of stages.
        blocks_per_stage: basic blocks per stage.
        in_channels: image channels.
        stem_stride: one of :data:`STEM_STRIDES`.
    """

    def __init__(
        self,
        num_classes: int,
        width: int,
        num_stages: int,
        blocks_per_stage: int,
        in_channels: int = 3,
        stem_stride: int = 1,
    ) -> None:
        super().__init__()
        if stem_stride == 1:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        stages = []
        channels = width
        for index in range(num_stages):
            out = width * 2**index
            blocks = [BasicBlock(channels, out, stride=1 if index == 0 and stem_stride > 1 else 2)]
            blocks += [BasicBlock(out, out) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            channels = out
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


class ConvNetModule(DemoModule):
    """ResNet-style classifier of :class:`ConvNetDataModule` images.

    ``tiny``: widths 8/16/32, one block per stage, 16x16 inputs. ``default``: widths 32/64/128, two blocks per stage,
    64x64 inputs. ``gpu``: ImageNet stem, widths 64/128/256/512, four blocks per stage, 224x224 inputs (about 23M
    parameters: ResNet-50's scale). Logs ``train_loss``/``train_acc``, ``val_loss``/``val_acc``,
    ``test_loss``/``test_acc``.

    Args:
        preset: one of ``tiny``, ``default`` and ``gpu``; the other arguments override its values when not ``None``.
        width: channels of the first stage (doubled per stage).
        num_stages: number of stages, each halving the resolution.
        blocks_per_stage: basic blocks per stage.
        image_size: input side length (sets ``example_input_array``; the network itself takes any size).
        num_classes: number of classes.
        **kwargs: ``lr``, ``weight_decay``, ``schedule_epochs``: AdamW's settings and its schedule's length (see
            :class:`DemoModule`).
        stem_stride: one of :data:`STEM_STRIDES` (1: small-image stem; 4: ImageNet stem).

    Raises:
        ValueError: if the preset is unknown or a value out of range.

    Example::

        model = ConvNetModule("tiny")
        logits = model(model.example_input_array)  # (1, 10)
    """

    MODEL_PRESETS = model_presets(_MODEL_PRESETS, ConvNetDataModule)

    def __init__(
        self,
        preset: str = "default",
        width: int | None = None,
        num_stages: int | None = None,
        blocks_per_stage: int | None = None,
        image_size: int | None = None,
        num_classes: int | None = None,
        stem_stride: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def check_config(self, config: Mapping[str, Any]) -> None:
        check_choice("ConvNetModule", "stem_stride", config["stem_stride"], STEM_STRIDES)

    @override
    def build(self, config: Mapping[str, Any]) -> tuple[nn.Module, Callable[[], Metric], Tensor]:
        net = build_from(ResNet, config)
        size = config["image_size"]
        return net, lambda: MulticlassAccuracy(config["num_classes"], average="micro"), torch.zeros(1, 3, size, size)
