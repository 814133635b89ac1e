"""Where a tuning trial gets the user's model and data module from, and how it applies a trial's data settings.

A source is pickled once by the tuner and loaded by every trial in its own process, so each trial starts from the
user's untouched objects. The tuner never calls anything that changes the objects it was given.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_perf.benchmark.worker import RunSpec

LOADER_SETTINGS = ("num_workers", "pin_memory", "persistent_workers")


def import_object(path: str, what: str) -> Any:
    """``module:Name`` or ``module.Name`` to the object, with an error that names the argument."""
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{what}={path!r} is not an import path. Expected 'package.module:ClassName'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what}={path!r}: cannot import module {module_name!r} ({exc}).") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{what}={path!r}: module {module_name!r} has no attribute {name!r}.") from None


@dataclass
class ModelSource:
    """Builds a fresh ``(model, datamodule)`` pair for a trial. Subclasses say where it comes from."""

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def build(self, spec: RunSpec) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        """The pair with ``spec``'s batch size and loader overrides applied (the worker's builder interface)."""
        model, datamodule = self.load()
        apply_data_settings(model, datamodule, spec.batch_size, spec.loader_overrides)
        return model, datamodule


@dataclass
class WorkloadSource(ModelSource):
    """A reference workload of :mod:`lightning_perf.demos`."""

    workload: str
    preset: str = "default"
    seed: int = 0

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        from lightning_perf.demos import make_workload

        return make_workload(self.workload, self.preset, seed=self.seed)

    def describe(self) -> str:
        return f"workload {self.workload} ({self.preset} preset)"


@dataclass
class ImportSource(ModelSource):
    """Classes named by import path, built with keyword arguments (the CLI's ``--model``/``--datamodule``)."""

    model: str
    datamodule: str
    model_args: dict[str, Any] = field(default_factory=dict)
    datamodule_args: dict[str, Any] = field(default_factory=dict)

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        model_cls = import_object(self.model, "model")
        data_cls = import_object(self.datamodule, "datamodule")
        return model_cls(**self.model_args), data_cls(**self.datamodule_args)

    def describe(self) -> str:
        return f"{self.model} on {self.datamodule}"


@dataclass
class ObjectSource(ModelSource):
    """The user's own objects, pickled once: every load is an independent copy, the originals are never touched."""

    payload: bytes
    name: str

    @classmethod
    def from_objects(cls, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> ObjectSource:
        try:
            payload = pickle.dumps((model, datamodule), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # a lambda, a lock, an open file...: the tuner cannot copy the objects
            raise ValueError(
                f"AutoTuner needs to copy the model and data module for its trials, and pickling them failed: "
                f"{type(exc).__name__}: {exc}. Make them picklable, or run `lightning-perf autotune --model "
                f"module:Class --datamodule module:Class`, which builds them from their classes."
            ) from exc
        return cls(payload=payload, name=f"{type(model).__name__} on {type(datamodule).__name__}")

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        model, datamodule = pickle.loads(self.payload)
        return model, datamodule

    def describe(self) -> str:
        return self.name


def batch_size_holder(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> tuple[str, int] | None:
    """Where the batch size lives (``"datamodule"``, ``"model"`` or ``"hparams"``) and its value, as Lightning's
    ``BatchSizeFinder`` looks for it; ``None`` when neither object exposes an integer ``batch_size``."""
    hparams = getattr(model, "hparams", {})
    for where, value in (
        ("datamodule", getattr(datamodule, "batch_size", None)),
        ("model", getattr(model, "batch_size", None)),
        ("hparams", hparams.get("batch_size") if hasattr(hparams, "get") else None),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            return where, value
    return None


def init_parameters(obj: Any) -> set[str]:
    """The keyword parameters of ``type(obj).__init__`` (what a LightningCLI config can set)."""
    try:
        params = inspect.signature(type(obj).__init__).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}


def apply_data_settings(
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    batch_size: int | None,
    loader: dict[str, Any] | None,
) -> None:
    """Give a trial's copy of the objects its batch size and DataLoader settings (``None``/empty: leave as is).

    The batch size goes where :func:`batch_size_holder` finds it. A loader setting goes to the data module's attribute
    of that name when it has one (the usual ``self.num_workers`` pattern); otherwise the training loader the data module
    returns is rebuilt with the setting, keeping its dataset, sampler and collate function.
    """
    if batch_size is not None:
        holder = batch_size_holder(model, datamodule)
        if holder is None:
            raise ValueError("Cannot set the batch size: neither the model nor the data module has `batch_size`.")
        if holder[0] == "datamodule":
            datamodule.batch_size = batch_size  # type: ignore[attr-defined]
        elif holder[0] == "model":
            model.batch_size = batch_size  # type: ignore[assignment]
        else:
            model.hparams["batch_size"] = batch_size
    settings = dict(loader or {})
    if not settings:
        return
    missing = {k: v for k, v in settings.items() if not hasattr(datamodule, k)}
    for key, value in settings.items():
        if key not in missing:
            setattr(datamodule, key, value)
    if missing:
        original = datamodule.train_dataloader

        def train_dataloader() -> Any:
            return rebuild_loader(original(), **missing)

        datamodule.train_dataloader = train_dataloader  # type: ignore[method-assign]


def rebuild_loader(loader: DataLoader, **overrides: Any) -> DataLoader:
    """A copy of ``loader`` with ``overrides`` (worker count, pinning, persistence) applied."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"train_dataloader() returned a {type(loader).__name__}; the tuner can only change the loader settings "
            f"of a torch DataLoader (or of a data module with `num_workers`/`pin_memory` attributes)."
        )
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if isinstance(loader.dataset, IterableDataset):
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is None:
        kwargs["batch_sampler"] = loader.batch_sampler
    else:
        kwargs.update(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
    kwargs.update(overrides)
    if kwargs["num_workers"] == 0:
        kwargs["persistent_workers"] = False
    elif loader.num_workers > 0 and loader.prefetch_factor is not None:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs)
