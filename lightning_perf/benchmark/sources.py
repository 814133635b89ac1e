"""The one model source: builds a model and data module for bench, autotune and export, and applies data settings.

A source builds the pair from a reference workload name (:class:`WorkloadSource`), from classes named
``package.module:Class`` plus JSON arguments (:class:`ImportSource`, with :func:`import_class`), from LightningCLI
configuration files (:class:`ConfigSource`, whose ``trainer:`` settings come with it), or from the user's own
objects (:class:`ObjectSource`). :meth:`ModelSource.to_dict` and :func:`source_from_dict` carry a source as plain JSON
(the bench's ``RunSpec.source``), so a worker process rebuilds the user's objects itself.
The tuner pickles a source once and every trial loads it in its own process, so each
trial starts from the user's untouched objects.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from lightning_perf._validation import is_int

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

__all__ = [
    "LOADER_SETTINGS",
    "ConfigSource",
    "ImportClassError",
    "ImportSource",
    "ModelSource",
    "ObjectSource",
    "WorkloadSource",
    "apply_data_settings",
    "batch_size_holder",
    "import_class",
    "import_object",
    "init_parameters",
    "rebuild_loader",
    "source_from_dict",
]

LOADER_SETTINGS = ("num_workers", "pin_memory", "persistent_workers")


class ImportClassError(ValueError):
    """A ``module:Class`` spec that is malformed, does not import, or names the wrong kind of object (one line)."""


class DataSettings(Protocol):
    """What :meth:`ModelSource.build` reads from a run's spec (e.g. the bench worker's ``RunSpec``)."""

    batch_size: int | None
    loader_overrides: dict[str, Any]


def _one_line(text: object) -> str:
    return " ".join(str(text).split())  # benchmark.tasks.one_line, which this module cannot import (a cycle)


def import_object(path: str, what: str) -> Any:
    """``module:Name`` or ``module.Name`` to the object; :class:`ImportClassError` names ``what``, the path and why."""
    if not isinstance(path, str):
        raise ImportClassError(f"{what}={path!r} is not valid. Expected a string 'package.module:ClassName'.")
    module_name, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not name:
        raise ImportClassError(f"{what}={path!r} is not an import path. Expected 'package.module:ClassName'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the user's module raises while it is imported
        raise ImportClassError(
            f"{what}={path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {_one_line(exc)})."
        ) from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ImportClassError(f"{what}={path!r}: module {module_name!r} has no attribute {name!r}.") from None


def import_class(spec: str, base: type | None = None, what: str = "class") -> type:
    """The class named by ``spec`` (``package.module:Class``), checked to be a subclass of ``base`` when given.

    Raises:
        ImportClassError: a ``ValueError`` with a one-line message naming ``what``, the spec and the reason.
    """
    obj = import_object(spec, what)
    if not isinstance(obj, type):
        raise ImportClassError(f"{what}={spec!r} is a {type(obj).__name__}, not a class. Expected a class.")
    if base is not None and not issubclass(obj, base):
        raise ImportClassError(f"{what}={spec!r} is not a subclass of {base.__name__}. Expected a {base.__name__}.")
    return obj


@dataclass
class ModelSource:
    """Builds a fresh ``(model, datamodule)`` pair for a trial. Subclasses say where it comes from."""

    kind: ClassVar[str] = ""
    """The name :meth:`to_dict` writes and :func:`source_from_dict` reads (``""``: it cannot travel as JSON)."""

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def trainer_settings(self) -> dict[str, Any]:
        """Trainer keyword arguments that come with the model (a LightningCLI file's ``trainer:``), read after
        :meth:`load`; empty for a source without any."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """The source as plain JSON (``kind`` and its fields), for :func:`source_from_dict` in another process."""
        if not self.kind:
            raise TypeError(f"A {type(self).__name__} cannot travel as JSON.")
        data = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.init}
        if "configs" in data:
            data["configs"] = [str(c) for c in data["configs"]]
        return {"kind": self.kind, **data}

    def build(self, spec: DataSettings) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        """The pair with ``spec``'s batch size and loader overrides applied (the worker's builder interface)."""
        model, datamodule = self.load()
        apply_data_settings(model, datamodule, spec.batch_size, spec.loader_overrides)
        return model, datamodule


@dataclass
class WorkloadSource(ModelSource):
    """A reference workload of :mod:`lightning_perf.demos`."""

    kind: ClassVar[str] = "workload"

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

    kind: ClassVar[str] = "import"

    model: str
    datamodule: str
    model_args: dict[str, Any] = field(default_factory=dict)
    datamodule_args: dict[str, Any] = field(default_factory=dict)

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        import lightning.pytorch as pl

        model_cls = import_class(self.model, pl.LightningModule, "model")
        data_cls = import_class(self.datamodule, pl.LightningDataModule, "datamodule")
        return model_cls(**self.model_args), data_cls(**self.datamodule_args)

    def describe(self) -> str:
        return f"{self.model} on {self.datamodule}"


@dataclass
class ConfigSource(ModelSource):
    """LightningCLI configuration files (``--config``, merged in order), optionally after classes named on the command
    line (their ``model:``/``data:`` sections then only set arguments, as the auto-tuner's YAML does).

    Parsed by LightningCLI itself (:mod:`lightning_perf.benchmark.lightning_config`), so the objects are those
    ``python train.py fit --config ...`` builds; :meth:`trainer_settings` gives the files' ``trainer:`` settings.
    """

    kind: ClassVar[str] = "config"

    configs: list[str]
    model: str | None = None
    datamodule: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    datamodule_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    _trainer: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _ignored: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        from lightning_perf.benchmark.lightning_config import load_lightning_config

        given = {name: getattr(self, name) for name in ("model", "model_args", "datamodule", "datamodule_args", "seed")}
        loaded = load_lightning_config(self.configs, **given)
        if loaded.datamodule is None:
            raise ValueError(
                f"{', '.join(self.configs)} builds no data module: expected a `data:` section with a class_path, "
                "or --datamodule."
            )
        self._trainer, self._ignored = loaded.trainer_kwargs, loaded.ignored
        return loaded.model, loaded.datamodule

    def trainer_settings(self) -> dict[str, Any]:
        return dict(self._trainer)

    def ignored_trainer_settings(self) -> dict[str, Any]:
        """The files' ``trainer:`` settings that the bench decides itself (device, step counts, logging)."""
        return dict(self._ignored)

    def describe(self) -> str:
        classes = f"{self.model} on {self.datamodule} with " if self.model else ""
        return f"{classes}{' + '.join(self.configs)}"


def source_from_dict(data: dict[str, Any]) -> ModelSource:
    """The source :meth:`ModelSource.to_dict` described.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    fields = {k: v for k, v in data.items() if k != "kind"}
    kinds: dict[str, type[ModelSource]] = {c.kind: c for c in (WorkloadSource, ImportSource, ConfigSource)}
    kind = data.get("kind")
    if kind not in kinds:
        raise ValueError(f"source kind={kind!r} is not valid. Expected one of {', '.join(kinds)}.")
    return kinds[kind](**fields)


@dataclass
class ObjectSource(ModelSource):
    """A snapshot of the user's own objects: every load is an independent copy, the originals are never touched.

    The snapshot travels to a trial's process the way ``multiprocessing`` sends arguments; nothing here unpickles.
    """

    snapshot: tuple[Any, Any]
    name: str
    defined_in_main: bool = False  # classes of a notebook or REPL cannot be re-imported by a fresh process

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
        return cls(
            snapshot=copy.deepcopy((model, datamodule)),
            name=f"{type(model).__name__} on {type(datamodule).__name__}",
            defined_in_main=b"__main__" in payload,
        )

    def load(self) -> tuple[pl.LightningModule, pl.LightningDataModule]:
        model, datamodule = copy.deepcopy(self.snapshot)
        return model, datamodule

    def describe(self) -> str:
        return self.name


@contextlib.contextmanager
def _datamodule_attached(model: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> Iterator[None]:
    """Lightning's attribute lookup finds the data module through ``model.trainer``: give it one for the lookup."""
    previous = model._trainer
    model._trainer = SimpleNamespace(datamodule=datamodule)  # type: ignore[assignment]
    try:
        yield
    finally:
        model._trainer = previous


def batch_size_holder(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> tuple[str, int] | None:
    """Where the batch size lives (``"datamodule"``, ``"model"`` or ``"hparams"``) and its value, found as Lightning's
    ``BatchSizeFinder`` finds it (``lightning_getattr``: the model, its hparams, the data module and its hparams; the
    last of them wins); ``None`` when none holds an integer ``batch_size``."""
    from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr

    def where(value: Any) -> tuple[str, int] | None:
        # Lightning's holders, last first (the last one wins, as in lightning_getattr).
        dm_hparams = getattr(datamodule, "hparams", {}) if datamodule is not None else {}
        model_hparams = getattr(model, "hparams", {})
        for name, held in (
            ("datamodule", dm_hparams.get("batch_size") if "batch_size" in dm_hparams else None),
            ("datamodule", getattr(datamodule, "batch_size", None) if datamodule is not None else None),
            ("hparams", model_hparams.get("batch_size") if "batch_size" in model_hparams else None),
            ("model", getattr(model, "batch_size", None)),
        ):
            if is_int(held) and (value is None or held == value):
                return name, int(held)  # type: ignore[arg-type]  # is_int() checked it
        return None

    with _datamodule_attached(model, datamodule):
        value = lightning_getattr(model, "batch_size") if lightning_hasattr(model, "batch_size") else None
    # A holder left at None (e.g. a `batch_size=None` init argument saved in hparams) yields to one with a value.
    return where(value if is_int(value) else None)


def init_parameters(obj: Any) -> set[str]:
    """The keyword parameters of ``type(obj).__init__`` (what a LightningCLI config can set), following ``**kwargs``
    up the class hierarchy to the parents' parameters (as jsonargparse does for ``super().__init__(**kwargs)``)."""
    names: set[str] = set()
    for cls in type(obj).__mro__:
        if "__init__" not in cls.__dict__:
            continue
        try:
            params = inspect.signature(cls.__dict__["__init__"]).parameters.values()
        except (TypeError, ValueError):
            break
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def apply_data_settings(
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    batch_size: int | None,
    loader: dict[str, Any] | None,
) -> None:
    """Give a trial's copy of the objects its batch size and DataLoader settings (``None``/empty: leave as is).

    The batch size goes everywhere Lightning's ``lightning_setattr`` puts it (as ``BatchSizeFinder`` does). A loader
    setting goes to the data module's attribute of that name when it has one (the usual ``self.num_workers`` pattern);
    otherwise the training loader the data module returns is rebuilt with the setting, keeping its dataset, sampler
    and collate function.
    """
    if batch_size is not None:
        from lightning.pytorch.utilities.parsing import lightning_setattr

        if batch_size_holder(model, datamodule) is None:
            raise ValueError(
                "Cannot set the batch size: neither the model, its hparams, the data module nor its hparams has an "
                "integer `batch_size`."
            )
        with _datamodule_attached(model, datamodule):
            lightning_setattr(model, "batch_size", batch_size)
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
    kept = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "generator", "persistent_workers")
    kwargs: dict[str, Any] = {name: getattr(loader, name) for name in kept}
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
