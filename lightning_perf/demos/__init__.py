"""Reference workloads on synthetic data (no downloads) that the CLI, the benchmarks, the examples and the tests run.

Entry point: :func:`make_workload` (a ``LightningModule`` and a ``LightningDataModule``, in the sizes ``tiny``,
``default`` and ``gpu``). The sizes and an example: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_perf._validation import check_choice
from lightning_perf.demos._base import PRESETS, EpochSeededRandomSampler, SyntheticDataModule
from lightning_perf.demos.convnet import ConvNetDataModule, ConvNetModule
from lightning_perf.demos.lm import LMDataModule, LMModule
from lightning_perf.demos.unet3d import UNet3DDataModule, UNet3DModule
from lightning_perf.demos.vit import ViTDataModule, ViTModule

__all__ = [
    "PRESETS",
    "WORKLOADS",
    "ConvNetDataModule",
    "ConvNetModule",
    "EpochSeededRandomSampler",
    "LMDataModule",
    "LMModule",
    "UNet3DDataModule",
    "UNet3DModule",
    "ViTDataModule",
    "ViTModule",
    "Workload",
    "make_workload",
    "workload_names",
]


@dataclass(frozen=True)
class Workload:
    """One reference workload: its model and data classes and what it exercises.

    Args:
        name: the name :func:`make_workload` and the CLI take.
        module_cls: the ``LightningModule`` class (``preset`` is its first argument).
        datamodule_cls: the ``LightningDataModule`` class (``preset`` is its first argument).
        description: one line on what it is and what it stresses.
        task: ``"classification"``, ``"segmentation"`` or ``"language-modeling"``.
    """

    name: str
    module_cls: type[pl.LightningModule]
    datamodule_cls: type[SyntheticDataModule]
    description: str
    task: str


WORKLOADS: dict[str, Workload] = {
    workload.name: workload
    for workload in (
        Workload(
            "convnet",
            ConvNetModule,
            ConvNetDataModule,
            "ResNet-style 2D CNN with BatchNorm on 3-channel images, 10 classes (convolution-bound)",
            "classification",
        ),
        Workload(
            "unet3d",
            UNet3DModule,
            UNet3DDataModule,
            "small 3D U-Net on 1-channel volumes, binary masks (Conv3d, activation-memory heavy)",
            "segmentation",
        ),
        Workload(
            "vit",
            ViTModule,
            ViTDataModule,
            "Vision Transformer with nn.MultiheadAttention blocks, 10 classes (matmul-bound, repeated blocks)",
            "classification",
        ),
        Workload(
            "lm",
            LMModule,
            LMDataModule,
            "decoder-only transformer LM with eager causal attention on Markov-chain tokens",
            "language-modeling",
        ),
    )
}


def workload_names() -> list[str]:
    """Names of the reference workloads, in registry order."""
    return list(WORKLOADS)


def make_workload(
    name: str,
    preset: str = "default",
    *,
    batch_size: int | None = None,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    **model_overrides: Any,
) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """Build a reference workload's model and data module.

    The model's initial weights are drawn from ``seed`` without touching the global RNG, so the same arguments give
    the same model and the same batches. Overrides that fix the data's shape (``image_size``, ``num_classes``,
    ``seq_len``, ``vocab_size``, ``volume_size``) go to the data module as well, so the pair always fits together.

    Args:
        name: one of :func:`workload_names`.
        preset: one of :data:`PRESETS`.
        batch_size: samples per batch; ``None`` takes the preset's.
        seed: seeds the model's initialization and selects the data samples and their order.
        num_workers: ``DataLoader`` worker processes.
        pin_memory: passed to every ``DataLoader``.
        persistent_workers: keep workers alive between epochs (only used when ``num_workers > 0``).
        **model_overrides: model hyperparameters replacing the preset's (e.g. ``depth=4``, ``lr=1e-3``).

    Returns:
        ``(module, datamodule)``.

    Raises:
        ValueError: if ``name`` or ``preset`` is unknown, or an argument is out of range.
        TypeError: if an override is not an argument of the workload's module.

    Example::

        model, data = make_workload("lm", "tiny", batch_size=8, depth=1)
    """
    check_choice("make_workload", "name", name, tuple(WORKLOADS))
    check_choice("make_workload", "preset", preset, PRESETS)
    workload = WORKLOADS[name]
    shape = {key: model_overrides[key] for key in workload.datamodule_cls.SHAPE_KEYS if key in model_overrides}
    datamodule = workload.datamodule_cls(  # type: ignore[call-arg]  # preset: an argument of each subclass
        preset=preset,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        seed=seed,
        **shape,
    )
    # Only the CPU generator is forked and seeded: initialization runs on the CPU, and CUDA RNGs stay untouched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        module = workload.module_cls(preset, **model_overrides)
    return module, datamodule
