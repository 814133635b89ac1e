"""Reference workload ``unet3d``: a small 3D U-Net segmenting synthetic volumes (binary foreground masks).

A volume holds a few random spheres brighter than the background, plus Gaussian noise; the mask is the union of
the spheres. This is the memory- and convolution-heavy workload (Conv3d, BatchNorm3d, transposed convolutions).

The network trains, validates and tests on patches (``volume_size``, 32^3 by default) and predicts whole volumes
(``predict_volume_size``, 64^3 by default) whose spheres have the training sizes: a predict run either feeds the whole
volume to the fully convolutional network at once, or runs it window by window with
:class:`~lightning_perf.callbacks.SlidingWindowInferenceCallback` (``roi_size="model"`` reads the module's
``roi_size``, the patch it trained on).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchmetrics import Metric
from torchmetrics.classification import BinaryF1Score
from typing_extensions import override

from lightning_perf.demos._base import (
    SPLITS,
    DemoModule,
    SeededDataset,
    SyntheticDataModule,
    build_from,
    data_sizes,
    model_presets,
)

NOISE_STD = 0.5
"""Standard deviation of the voxel noise; the spheres are 0.6 to 1.2 brighter than the background."""
RADIUS_RANGE = (0.15, 0.3)
"""Smallest and largest sphere radius as fractions of the volume side."""


class SphereVolumeDataset(SeededDataset):
    """Sample ``i`` is ``(volume, mask)`` generated from ``(seed, i)``: float ``(1, S, S, S)``, long ``(1, S, S, S)``.

    Args:
        num_samples: dataset length.
        volume_size: side of the cubic volumes.
        seed: data seed.
        split: a tag mixed into every sample's seed so the splits do not share samples.
        max_spheres: spheres per volume are drawn from 1 to this.
        noise_std: standard deviation of the added Gaussian noise.
        radius_range: smallest and largest sphere radius as fractions of ``volume_size``.
    """

    def __init__(
        self,
        num_samples: int,
        volume_size: int,
        seed: int = 0,
        split: int = 0,
        max_spheres: int = 4,
        noise_std: float = NOISE_STD,
        radius_range: tuple[float, float] = RADIUS_RANGE,
    ) -> None:
        super().__init__(num_samples, seed, split)
        self.volume_size, self.max_spheres = volume_size, max_spheres
        self.noise_std, self.radius_range = noise_std, radius_range

    @override
    def sample(self, g: torch.Generator) -> tuple[Tensor, Tensor]:
        size = self.volume_size
        axis = torch.arange(size, dtype=torch.float32)
        z, y, x = axis.view(-1, 1, 1), axis.view(1, -1, 1), axis.view(1, 1, -1)
        volume = torch.zeros(size, size, size)
        mask = torch.zeros(size, size, size, dtype=torch.bool)
        num_spheres = int(torch.randint(1, self.max_spheres + 1, (), generator=g))
        for _ in range(num_spheres):
            low, high = self.radius_range
            radius = float(size * (low + (high - low) * torch.rand((), generator=g)))
            cz, cy, cx = (radius + (size - 2 * radius) * torch.rand(3, generator=g)).tolist()
            brightness = float(0.6 + 0.6 * torch.rand((), generator=g))
            inside = (z - cz) ** 2 + (y - cy) ** 2 + (x - cx) ** 2 <= radius**2
            volume = torch.where(inside, volume.clamp(min=brightness), volume)
            mask |= inside
        volume = volume + self.noise_std * torch.randn(volume.shape, generator=g)
        return volume.unsqueeze(0), mask.long().unsqueeze(0)


_DATA_SIZES: dict[str, dict[str, int]] = {
    "tiny": data_sizes(4, 128, 32, 32, 16, volume_size=16, predict_volume_size=32),
    "default": data_sizes(4, 256, 32, 32, 32, volume_size=32, predict_volume_size=64),
    # 128^3 patches at batch 2 (476 GMACs per patch forward; roughly 10-15 GB of float32 activations by estimate,
    # far below an 80 GB GPU); whole 192^3 volumes to predict (3.4 patches: sliding-window inference has to tile).
    "gpu": data_sizes(2, 128, 8, 8, 8, volume_size=128, predict_volume_size=192),
}

_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"width": 8, "levels": 3, "lr": 1e-2},
    "default": {"width": 16, "levels": 3, "lr": 1e-3},
    # The 3D U-Net of medical segmentation (widths 32 to 512 over 5 levels, 22.6M parameters).
    "gpu": {"width": 32, "levels": 5, "lr": 1e-3},
}


class UNet3DDataModule(SyntheticDataModule):
    """Sphere volumes and masks for :class:`UNet3DModule`: 16^3 (``tiny``) or 32^3 (``default``) at batch 4, or 128^3
    at batch 2 (``gpu``).

    Batches are ``(volumes, masks)``: float ``(B, 1, S, S, S)`` and long ``(B, 1, S, S, S)`` with values 0/1. The
    train, validation and test splits are patches of side ``volume_size``; the predict split holds whole volumes of
    side ``predict_volume_size`` (32^3 ``tiny``, 64^3 ``default``: 8 times a patch, which keeps the default bench's
    inference timing to a few seconds a batch on a 2-core CPU; 192^3 ``gpu``) with spheres of the same sizes as in
    training (their number grows with the volume's cross-section), for sliding-window inference.

    Args:
        preset: one of :data:`~lightning_perf.demos._base.PRESETS`.
        **kwargs: ``batch_size``, ``num_workers``, ``pin_memory``, ``persistent_workers``, ``seed``: as for
            :class:`SyntheticDataModule`.
        volume_size: side of the cubic volumes of the train, validation and test splits; ``None`` takes the preset's.
        predict_volume_size: side of the predict split's whole volumes; ``None`` takes the preset's.
    """

    SIZES = _DATA_SIZES
    SHAPE_KEYS = ("volume_size",)
    volume_size: int
    predict_volume_size: int

    def __init__(
        self,
        preset: str = "default",
        volume_size: int | None = None,
        predict_volume_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def make_dataset(self, split: str, num_samples: int) -> Dataset:
        if split != "predict":
            return SphereVolumeDataset(num_samples, self.volume_size, seed=self.seed, split=SPLITS.index(split))
        # Whole volumes: the spheres keep their training sizes (radii scaled back by the size ratio), and there are
        # more of them, in proportion to the cross-section, so that foreground stays common.
        scale = self.volume_size / self.predict_volume_size
        low, high = RADIUS_RANGE
        return SphereVolumeDataset(
            num_samples,
            self.predict_volume_size,
            seed=self.seed,
            split=SPLITS.index(split),
            max_spheres=max(4, round(4 / scale**2)),
            radius_range=(low * scale, high * scale),
        )


class ConvBlock3d(nn.Sequential):
    """Two ``Conv3d(3x3x3)-BatchNorm3d-ReLU`` layers."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv3d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm3d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv3d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm3d(out_channels),
            nn.ReLU(inplace=True),
        )


class UNet3D(nn.Module):
    """3D U-Net: an encoder of :class:`ConvBlock3d` with max-pooling, a mirrored decoder with transposed-conv
    upsampling and skip connections, and a 1x1x1 head.

    Args:
        width: channels at full resolution; doubled at every level below.
        levels: resolution levels (the input side must be divisible by ``2 ** (levels - 1)``).
        in_channels: input channels.
        out_channels: output channels (one foreground logit by default).
    """

    def __init__(self, width: int, levels: int, in_channels: int = 1, out_channels: int = 1) -> None:
        super().__init__()
        widths = [width * 2**level for level in range(levels)]
        self.encoders = nn.ModuleList()
        channels = in_channels
        for out in widths:
            self.encoders.append(ConvBlock3d(channels, out))
            channels = out
        self.pool = nn.MaxPool3d(2)
        self.upsamplers = nn.ModuleList(
            nn.ConvTranspose3d(widths[level + 1], widths[level], 2, stride=2) for level in reversed(range(levels - 1))
        )
        self.decoders = nn.ModuleList(
            ConvBlock3d(2 * widths[level], widths[level]) for level in reversed(range(levels - 1))
        )
        self.head = nn.Conv3d(width, out_channels, 1)

    @override
    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for index, encoder in enumerate(self.encoders):
            if index > 0:
                x = self.pool(x)
            x = encoder(x)
            skips.append(x)
        skips.pop()  # the bottleneck output is x itself
        for upsample, decoder in zip(self.upsamplers, self.decoders):
            x = decoder(torch.cat([upsample(x), skips.pop()], dim=1))
        return self.head(x)


def soft_dice_loss(logits: Tensor, target: Tensor, eps: float = 1.0) -> Tensor:
    """``1 - Dice`` of the foreground probabilities against the mask, per sample, averaged over the batch."""
    probs = logits.sigmoid().flatten(1)
    target = target.flatten(1).to(probs.dtype)
    intersection = (probs * target).sum(dim=1)
    dice = (2 * intersection + eps) / (probs.sum(dim=1) + target.sum(dim=1) + eps)
    return 1 - dice.mean()


class UNet3DModule(DemoModule):
    """Binary 3D segmentation of :class:`UNet3DDataModule` volumes.

    ``tiny``: 16^3 volumes, width 8, 3 levels. ``default``: 32^3 volumes, width 16, 3 levels. ``gpu``: 128^3
    volumes, width 32, 5 levels (22.6M parameters). The loss is binary
    cross-entropy plus soft Dice; the metric is the voxel-wise F1 score, which equals the Dice coefficient.
    ``forward(volumes)`` returns foreground logits ``(B, 1, S, S, S)`` for any side ``S`` divisible by
    ``2 ** (levels - 1)``. Logs ``train_loss``/``train_dice``, ``val_loss``/``val_dice``, ``test_loss``/``test_dice``.
    ``roi_size`` is the patch it trains on, ``(volume_size,) * 3``: what
    ``SlidingWindowInferenceCallback(roi_size="model")`` reads.

    Args:
        preset: one of ``tiny``, ``default`` and ``gpu``; the other arguments override its values when not ``None``.
        width: channels at full resolution (doubled per level).
        levels: resolution levels.
        volume_size: input side length (sets ``example_input_array``).
        **kwargs: ``lr``, ``weight_decay``, ``schedule_epochs``: AdamW's settings and its schedule's length (see
            :class:`DemoModule`).

    Raises:
        ValueError: if the preset is unknown, a value out of range or ``volume_size`` not divisible by
            ``2 ** (levels - 1)``.

    Example::

        model = UNet3DModule("tiny")
        logits = model(model.example_input_array)  # (1, 1, 16, 16, 16)
    """

    metric_name = "dice"

    MODEL_PRESETS = model_presets(_MODEL_PRESETS, UNet3DDataModule)

    def __init__(
        self,
        preset: str = "default",
        width: int | None = None,
        levels: int | None = None,
        volume_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def check_config(self, config: Mapping[str, Any]) -> None:
        size, levels = config["volume_size"], config["levels"]
        if size % 2 ** (levels - 1):
            raise ValueError(
                f"`UNet3DModule(volume_size={size!r})` is not divisible by 2 ** (levels - 1) = {2 ** (levels - 1)}."
                " Expected a size every level can halve."
            )

    @override
    def build(self, config: Mapping[str, Any]) -> tuple[nn.Module, Callable[[], Metric], Tensor]:
        size = config["volume_size"]
        self.roi_size: tuple[int, int, int] = (size, size, size)
        return build_from(UNet3D, config), BinaryF1Score, torch.zeros(1, 1, size, size, size)

    @override
    def compute(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        volumes, masks = self.split_batch(batch)
        logits = self(volumes)
        loss = F.binary_cross_entropy_with_logits(logits, masks.to(logits.dtype)) + soft_dice_loss(logits, masks)
        # Probabilities, not logits: torchmetrics would read logits that happen to lie in [0, 1] as probabilities.
        return loss, logits.detach().sigmoid(), masks
