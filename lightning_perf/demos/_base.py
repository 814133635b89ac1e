"""Shared pieces of the reference workloads: presets, deterministic seeding and sampling, and the base classes.

Every workload's data is synthetic and a pure function of ``(seed, split, index)``, and its training order a pure
function of ``(seed, epoch)``: two data modules built with the same seed yield identical batches, and a run resumed
from a checkpoint at an epoch boundary sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from torchmetrics import Metric
from typing_extensions import override

from lightning_perf._validation import check_choice, check_int, check_number, is_int

PRESETS: tuple[str, ...] = ("tiny", "default", "gpu")
"""Size presets every workload offers: ``tiny`` for tests (milliseconds per step), ``default`` for benchmarks on a
CPU (tens to hundreds of milliseconds per step), ``gpu`` for benchmarks on one data-center GPU (models of the size
people train there: ResNet-50, GPT-2 small, ViT-B/16 and a 3D U-Net at 128^3; too large for a CPU)."""

SPLITS: tuple[str, ...] = ("train", "val", "test", "predict")

SCHEDULE_EPOCHS = 100
"""Default length of the per-epoch cosine learning-rate schedule. A fixed hyperparameter rather than the trainer's
``max_epochs``: a run resumed under another epoch limit (or a max_steps-only run) follows the same schedule."""

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def mix_seed(*parts: int) -> int:
    """Combine integers into one well-spread 63-bit seed; the same parts always give the same seed.

    Unlike ``seed * K + index``, distinct tuples do not collide in practice, and the result does not depend on the
    platform or on Python's hash randomization.
    """
    state = 0
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state >> 1  # torch.Generator.manual_seed takes any int, but a non-negative 63-bit one is portable


def build_from(cls: Callable[..., Any], config: Mapping[str, Any]) -> Any:
    """``cls`` built from the settings of a resolved preset that its constructor takes (by name)."""
    return cls(**{key: config[key] for key in inspect.signature(cls).parameters if key in config})


def data_sizes(batch_size: int, train: int, val: int, test: int, predict: int, **shape: int) -> dict[str, int]:
    """One preset's :attr:`SyntheticDataModule.SIZES` entry: the batch size, the samples of each split, the shape."""
    return {"batch_size": batch_size, "train": train, "val": val, "test": test, "predict": predict, **shape}


def check_seed(owner: str, seed: Any) -> int:
    """Return ``seed`` if it is an integer (any sign: :func:`mix_seed` takes it), else raise ``ValueError``."""
    if not is_int(seed):
        raise ValueError(f"`{owner}(seed={seed!r})` is not valid. Expected an integer.")
    return int(seed)


def generator_for(*parts: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from ``mix_seed(*parts)``."""
    return torch.Generator().manual_seed(mix_seed(*parts))


def resolve_preset(
    table: Mapping[str, Mapping[str, Any]], preset: str, overrides: Mapping[str, Any], owner: str
) -> dict[str, Any]:
    """The preset's settings with every override that is not ``None`` put on top.

    Args:
        table: preset name -> settings.
        preset: which preset to start from.
        overrides: constructor arguments; ``None`` means "take the preset's value".
        owner: the class name, for error messages.

    Raises:
        ValueError: if ``preset`` is unknown, or an integer setting is not a positive integer, or a float is negative.
    """
    config = dict(table[check_choice(owner, "preset", preset, PRESETS)])
    for key, value in overrides.items():
        if isinstance(config[key], int):
            check_int(owner, key, value, 1, allow_none=True)
        elif isinstance(config[key], float) and value is not None:
            check_number(owner, key, value, 0)
        config[key] = config[key] if value is None else value
    return config


class SeededDataset(Dataset):
    """A dataset of ``num_samples`` whose sample ``i`` is :meth:`sample` of a generator seeded from
    ``(seed, split, i)`` alone (``split``: a tag mixed in so that the splits do not share samples)."""

    def __init__(self, num_samples: int, seed: int = 0, split: int = 0) -> None:
        self.num_samples, self.seed, self.split = num_samples, seed, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} is out of range for a dataset of {self.num_samples} samples")
        return self.sample(generator_for(self.seed, self.split, index))

    def sample(self, g: torch.Generator) -> Any:
        """One sample, drawn from ``g`` only."""
        raise NotImplementedError


class EpochSeededRandomSampler(Sampler[int]):
    """A random permutation of ``range(num_samples)`` that depends only on ``(seed, epoch)``.

    Lightning calls :meth:`set_epoch` at the start of every training epoch (also through its distributed sampler
    wrapper), so the order of epoch ``e`` is the same whether the run went straight through or was resumed from a
    checkpoint at an epoch boundary; no global RNG state is read.

    Args:
        num_samples: dataset length.
        seed: base seed of every epoch's permutation.

    Raises:
        ValueError: if ``num_samples`` is not a positive integer or ``seed`` not an integer.

    Example::

        sampler = EpochSeededRandomSampler(8, seed=0)
        sampler.set_epoch(1)
        order = list(sampler)  # the same list every time for (seed=0, epoch=1)
    """

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        self.num_samples = check_int("EpochSeededRandomSampler", "num_samples", num_samples, 1)
        self.seed = check_seed("EpochSeededRandomSampler", seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` for the next iteration."""
        self.epoch = int(epoch)

    @override
    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.num_samples, generator=generator_for(self.seed, self.epoch))
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.num_samples


class SyntheticDataModule(pl.LightningDataModule):
    """Base of the workloads' data modules: synthetic splits sized by a preset, loaders with a seeded order.

    A subclass sets :attr:`SIZES` (per preset: ``batch_size``, the ``train``/``val``/``test``/``predict`` sample
    counts and its shape settings), implements :meth:`make_dataset`, and spells out its constructor's own arguments
    (``preset``, then each shape setting as ``None`` = "the preset's"; LightningCLI reads them) and passes the rest on
    with ``super().__init__(**kwargs)``: this constructor saves them all as hyperparameters, checks them and resolves
    the shape settings into attributes of the same names.

    The data seed is saved in checkpoints (:meth:`state_dict`) so that a resumed run continues on the data it
    started with, whatever seed the fresh data module was built with.

    Args:
        preset: one of :data:`PRESETS`.
        batch_size: samples per batch; ``None`` takes the preset's.
        num_workers: ``DataLoader`` worker processes.
        pin_memory: passed to every ``DataLoader``.
        persistent_workers: keep workers alive between epochs (only used when ``num_workers > 0``).
        seed: selects the samples of every split and the training order; the task itself does not depend on it.

    Raises:
        ValueError: if an argument is out of range or the preset unknown.
    """

    SIZES: ClassVar[Mapping[str, Mapping[str, int]]] = {}
    SHAPE_KEYS: ClassVar[tuple[str, ...]] = ()
    """Constructor arguments the model must agree on (e.g. ``image_size``); ``make_workload`` passes them to both."""

    def __init__(
        self,
        batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # these and the subclasses' arguments (Lightning walks up their constructors)
        owner, preset, batch_size = type(self).__name__, self.hparams["preset"], self.hparams["batch_size"]
        num_workers, seed = self.hparams["num_workers"], self.hparams["seed"]
        sizes = self.SIZES[check_choice(owner, "preset", preset, PRESETS)]
        self.preset = preset
        check_int(owner, "batch_size", batch_size, 1, allow_none=True)
        self.batch_size: int = batch_size if batch_size is not None else int(sizes["batch_size"])
        self.num_samples: dict[str, int] = {split: int(sizes[split]) for split in SPLITS}
        self.num_workers = check_int(owner, "num_workers", num_workers, 0)
        self.pin_memory = bool(self.hparams["pin_memory"])
        self.persistent_workers = bool(self.hparams["persistent_workers"])
        self.seed = check_seed(owner, seed)
        self.datasets: dict[str, Dataset] = {}
        shape_keys = [key for key in sizes if key != "batch_size" and key not in SPLITS]
        shape = resolve_preset(self.SIZES, preset, {key: self.hparams[key] for key in shape_keys}, owner)
        for key in shape_keys:
            setattr(self, key, int(shape[key]))

    def make_dataset(self, split: str, num_samples: int) -> Dataset:
        """Build the dataset of ``split`` (one of ``train``, ``val``, ``test``, ``predict``) from ``self.seed``."""
        raise NotImplementedError

    def dataset(self, split: str) -> Dataset:
        """The dataset of ``split``, built on first use (``setup`` builds them all)."""
        if split not in self.datasets:
            self.datasets[split] = self.make_dataset(split, self.num_samples[split])
        return self.datasets[split]

    @override
    def setup(self, stage: str) -> None:
        # Samples are generated on access, so building every split is cheap whatever the stage.
        for split in SPLITS:
            self.dataset(split)

    def _loader(self, split: str, sampler: Sampler[int] | None = None, drop_last: bool = False) -> DataLoader:
        extra: dict[str, Any] = {"persistent_workers": self.persistent_workers} if self.num_workers > 0 else {}
        return DataLoader(
            self.dataset(split),
            batch_size=self.batch_size,
            sampler=sampler,
            shuffle=False,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            **extra,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        dataset = self.dataset("train")
        sampler = EpochSeededRandomSampler(len(dataset), self.seed)  # type: ignore[arg-type]
        # Full batches only: every step has the same shapes (compilers and CUDA graphs recompile on a short batch).
        return self._loader("train", sampler=sampler, drop_last=len(dataset) >= self.batch_size)  # type: ignore[arg-type]

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        seed = int(state_dict["seed"])
        if seed != self.seed:
            self.seed = seed
            self.hparams["seed"] = seed
            self.datasets = {}  # rebuilt from the restored seed on next use


def model_presets(
    models: Mapping[str, Mapping[str, Any]], data: type[SyntheticDataModule]
) -> dict[str, dict[str, Any]]:
    """Each preset of ``models`` over the optimizer's defaults (weight decay 0.01, :data:`SCHEDULE_EPOCHS`) and with
    the shape settings it shares with ``data`` (:attr:`SyntheticDataModule.SHAPE_KEYS`) taken from ``data``'s."""
    return {
        name: {"weight_decay": 0.01, "schedule_epochs": SCHEDULE_EPOCHS, **settings}
        | {key: data.SIZES[name][key] for key in data.SHAPE_KEYS}
        for name, settings in models.items()
    }


class DemoModule(pl.LightningModule):
    """Base of the workloads' modules: one network in ``self.net``, metrics per stage, AdamW with a cosine schedule.

    A subclass names its preset table in :attr:`MODEL_PRESETS`, spells out its constructor's arguments (``preset``
    first, then every network setting as ``None`` = "the preset's"; Lightning saves them as hyperparameters and
    LightningCLI reads them) and passes the optimizer's on with ``super().__init__(**kwargs)``: this constructor
    saves the hyperparameters, resolves the
    preset with the given values on top (:meth:`resolve_hparams`), lets :meth:`check_config` refuse a combination,
    takes the optimizer settings, and builds the network, the metrics and ``example_input_array`` with :meth:`build`.
    A subclass may override :meth:`split_batch` and :meth:`compute` when its batch or loss differ from
    ``(inputs, labels)`` classification.

    Every preset sets ``lr`` and ``weight_decay`` (AdamW's) and ``schedule_epochs``: the cosine schedule, stepped once
    per epoch, takes the learning rate from ``lr`` to 0 over that many epochs (see :data:`SCHEDULE_EPOCHS`).

    Args:
        lr, weight_decay, schedule_epochs: AdamW's settings and its schedule's length; ``None`` takes the preset's.
    """

    metric_name: ClassVar[str] = "acc"
    MODEL_PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    net: nn.Module
    train_metric: Metric
    val_metric: Metric
    test_metric: Metric
    lr: float
    weight_decay: float
    schedule_epochs: int

    def __init__(
        self, lr: float | None = None, weight_decay: float | None = None, schedule_epochs: int | None = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # these and the subclass's arguments (Lightning walks up the constructors)
        config = self.resolve_hparams(self.MODEL_PRESETS)
        self.check_config(config)
        self.lr, self.weight_decay = float(config["lr"]), float(config["weight_decay"])
        self.schedule_epochs = int(config["schedule_epochs"])
        self.net, metric, self.example_input_array = self.build(config)
        # Each stage its own metric.
        self.train_metric, self.val_metric, self.test_metric = metric(), metric(), metric()

    def check_config(self, config: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the argument when the resolved settings do not fit together (default: none)."""

    def build(self, config: Mapping[str, Any]) -> tuple[nn.Module, Callable[[], Metric], Tensor]:
        """The network (the single child holding every parameter), a factory of the per-stage metric, and an example
        input of batch size 1, from the resolved settings."""
        raise NotImplementedError

    def check_divides(self, config: Mapping[str, Any], divisor: str, total: str, expected: str) -> None:
        """Raise ``ValueError`` unless ``config[divisor]`` divides ``config[total]``."""
        if config[total] % config[divisor]:
            raise ValueError(
                f"`{type(self).__name__}({divisor}={config[divisor]!r})` does not divide {total}={config[total]!r}."
                f" Expected {expected}."
            )

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def resolve_hparams(self, table: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """The preset saved as ``hparams["preset"]`` with the other saved constructor arguments on top
        (:func:`resolve_preset`); only the settings the table knows count, so a subclass's own arguments stay out."""
        preset = check_choice(type(self).__name__, "preset", self.hparams["preset"], PRESETS)
        overrides = {key: self.hparams[key] for key in table[preset] if key in self.hparams}
        return resolve_preset(table, preset, overrides, type(self).__name__)

    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        """The network input and the target of a batch (default: an ``(inputs, targets)`` pair)."""
        inputs, target = batch
        return inputs, target

    def compute(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Loss, metric predictions and metric targets of a batch (default: multi-class cross-entropy on logits)."""
        inputs, target = self.split_batch(batch)
        logits = self(inputs)
        loss = nn.functional.cross_entropy(logits, target)
        return loss, logits.detach(), target

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss, preds, target = self.compute(batch)
        self.train_metric(preds, target)
        self.log("train_loss", loss, prog_bar=True)
        self.log(f"train_{self.metric_name}", self.train_metric, on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_metric)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_metric)

    def _evaluate(self, batch: Any, stage: str, metric: Metric) -> None:
        loss, preds, target = self.compute(batch)
        metric.update(preds, target)
        self.log(f"{stage}_loss", loss, prog_bar=stage == "val")
        self.log(f"{stage}_{self.metric_name}", metric, on_step=False, on_epoch=True, prog_bar=stage == "val")

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        inputs, _ = self.split_batch(batch)
        return self(inputs)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.schedule_epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch", "frequency": 1}}
