"""Reference workload ``vit``: a Vision Transformer classifier on the synthetic template images of ``convnet``.

Its blocks are repeated siblings in one ``nn.ModuleList`` and use ``nn.MultiheadAttention``, which is what
activation checkpointing, per-block compilation and attention-related optimizations look for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_perf.demos._base import DemoModule, build_from, model_presets
from lightning_perf.demos.convnet import TemplateImageDataModule

_DATA_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"batch_size": 32, "train": 512, "val": 128, "test": 128, "predict": 64, "image_size": 16},
    "default": {"batch_size": 32, "train": 2048, "val": 256, "test": 256, "predict": 256, "image_size": 32},
    "gpu": {"batch_size": 64, "train": 4096, "val": 512, "test": 512, "predict": 512, "image_size": 224},
}
for _sizes in _DATA_SIZES.values():
    _sizes["num_classes"] = 10

_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"patch_size": 4, "dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 4, "lr": 3e-3},
    "default": {"patch_size": 4, "dim": 128, "depth": 8, "num_heads": 4, "mlp_ratio": 4, "lr": 1e-3},
    # ViT-B/16: 224x224 images in 16x16 patches (196 tokens), 12 blocks of width 768 with 12 heads (about 86M).
    "gpu": {
        "patch_size": 16,
        "dim": 768,
        "depth": 12,
        "num_heads": 12,
        "mlp_ratio": 4,
        "lr": 3e-4,
        "weight_decay": 0.05,
    },
}


class ViTDataModule(TemplateImageDataModule):
    """Template images for :class:`ViTModule`: 3x16x16 (``tiny``), 3x32x32 (``default``) or 3x224x224
    (``gpu``, batch 64), 10 classes.

    The same task and dataset as :class:`~lightning_perf.demos.convnet.ConvNetDataModule`, at the ViT's sizes.
    Batches are ``(images, labels)``: float ``(B, 3, S, S)`` and long ``(B,)``. Arguments: those of
    :class:`~lightning_perf.demos.convnet.TemplateImageDataModule`.
    """

    SIZES = _DATA_SIZES


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Args:
        dim: embedding width.
        num_heads: attention heads (must divide ``dim``).
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    @override
    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT classifier: conv patch embedding, class token, learned positions, :class:`ViTBlock` stack, norm, head.

    Args:
        image_size: side of the square input images (a multiple of ``patch_size``).
        patch_size: side of the square patches.
        dim: embedding width.
        depth: number of blocks.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        num_classes: outputs of the head.
        in_channels: image channels.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: int,
        num_classes: int,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, num_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    @override
    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class ViTModule(DemoModule):
    """Vision Transformer classifier of :class:`ViTDataModule` images.

    ``tiny``: 16x16 inputs, patch 4, dim 32, depth 2, 2 heads. ``default``: 32x32 inputs, patch 4, dim 128, depth 8,
    4 heads. ``gpu``: ViT-B/16 (224x224 inputs, patch 16, dim 768, depth 12, 12 heads; about 86M parameters).
    Logs ``train_loss``/``train_acc``, ``val_loss``/``val_acc``, ``test_loss``/``test_acc``.

    Args:
        preset: one of ``tiny``, ``default`` and ``gpu``; the other arguments override its values when not ``None``.
        image_size: input side length (a multiple of ``patch_size``).
        patch_size: patch side length.
        dim: embedding width.
        depth: number of transformer blocks.
        num_heads: attention heads (must divide ``dim``).
        mlp_ratio: MLP hidden width as a multiple of ``dim``.
        num_classes: number of classes.
        **kwargs: ``lr``, ``weight_decay``, ``schedule_epochs``: AdamW's settings and its schedule's length (see
            :class:`DemoModule`).

    Raises:
        ValueError: if the preset is unknown, a value out of range, ``patch_size`` does not divide ``image_size`` or
            ``num_heads`` does not divide ``dim``.

    Example::

        model = ViTModule("tiny")
        logits = model(model.example_input_array)  # (1, 10)
    """

    MODEL_PRESETS = model_presets(_MODEL_PRESETS, ViTDataModule)

    def __init__(
        self,
        preset: str = "default",
        image_size: int | None = None,
        patch_size: int | None = None,
        dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: int | None = None,
        num_classes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @override
    def check_config(self, config: Mapping[str, Any]) -> None:
        self.check_divides(config, "patch_size", "image_size", "a patch size that tiles the image")
        self.check_divides(config, "num_heads", "dim", "a divisor of dim")

    @override
    def build(self, config: Mapping[str, Any]) -> tuple[nn.Module, Callable[[], Metric], Tensor]:
        net = build_from(VisionTransformer, config)
        size = config["image_size"]
        return net, lambda: MulticlassAccuracy(config["num_classes"], average="micro"), torch.zeros(1, 3, size, size)
