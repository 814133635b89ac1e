"""LightningCLI configuration files for the bench and the tuner: the same objects ``python train.py fit --config``
builds, parsed by LightningCLI itself (jsonargparse), never by hand.

:func:`load_lightning_config` runs ``LightningCLI(run=False)`` on ``--config`` files (several merge in order, as
LightningCLI merges them), optionally after a model and data module named on the command line, and returns the model,
the data module and the ``trainer:`` settings the files changed from Trainer's defaults. The bench applies those
settings to every configuration, except the ones it owns itself (:data:`BENCH_OWNED_TRAINER_KEYS`: device, step
counts, logging), which it records as ignored.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["BENCH_OWNED_TRAINER_KEYS", "LightningConfig", "load_lightning_config"]

BENCH_OWNED_TRAINER_KEYS: frozenset[str] = frozenset({
    "accelerator", "strategy", "devices", "num_nodes", "logger", "max_epochs", "min_epochs", "max_steps",
    "min_steps", "max_time", "limit_train_batches", "limit_val_batches", "limit_test_batches",
    "limit_predict_batches", "overfit_batches", "val_check_interval", "check_val_every_n_epoch",
    "num_sanity_val_steps", "log_every_n_steps", "enable_checkpointing", "enable_progress_bar",
    "enable_model_summary", "fast_dev_run", "default_root_dir", "profiler",
})  # fmt: skip
"""``trainer:`` keys the bench decides itself (one device, its own step counts, no logging or checkpoints)."""


@dataclass
class LightningConfig:
    """What a LightningCLI configuration builds.

    Attributes:
        model: the LightningModule (``model:``, its ``configure_optimizers`` replaced only where the file has an
            ``optimizer:``/``lr_scheduler:`` section, as LightningCLI does).
        datamodule: the LightningDataModule (``data:``), or ``None`` when the file has none.
        trainer_kwargs: the ``trainer:`` settings that differ from Trainer's defaults and that the bench applies
            (``callbacks`` instantiated, with LightningCLI's extra callback keys appended).
        ignored: the ``trainer:`` settings the bench owns, ``{key: value}``, left out of ``trainer_kwargs``.
    """

    model: pl.LightningModule
    datamodule: pl.LightningDataModule | None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, Any] = field(default_factory=dict)


def _trainer_defaults() -> dict[str, Any]:
    from lightning.pytorch import Trainer

    params = inspect.signature(Trainer.__init__).parameters
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


def load_lightning_config(
    paths: Sequence[str],
    *,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    datamodule: str | None = None,
    datamodule_args: dict[str, Any] | None = None,
    seed: int | bool = True,
) -> LightningConfig:
    """Build what ``python train.py fit --config PATH ...`` builds, without a Trainer and without running anything.

    Args:
        paths: the configuration files, merged in order.
        model: a LightningModule class (``pkg.mod:Class``) given before the files: a file's ``model:`` without a
            ``class_path`` (e.g. the auto-tuner's ``model: {batch_size: 64}``) then sets its arguments.
        model_args: its keyword arguments.
        datamodule: the same for the data module.
        datamodule_args: its keyword arguments.
        seed: ``seed_everything_default`` (the file's ``seed_everything`` wins).

    Raises:
        ValueError: a file LightningCLI refuses (unknown key, bad value, class that does not import), with its message
            on one line; a configuration with no model.
    """
    from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE, LightningCLI

    if not _JSONARGPARSE_SIGNATURES_AVAILABLE:  # before the `try` below, which would call it a refusal of the file
        raise ModuleNotFoundError(
            "reading a LightningCLI file needs `jsonargparse[signatures]`, a dependency of lightning-perf missing "
            "here: `pip install 'jsonargparse[signatures]>=4.39,<5'` (or reinstall lightning-perf with dependencies)"
        )
    captured: dict[str, Any] = {}

    class _Capture(LightningCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Any:
            captured["trainer"] = dict(self._get(self.config_init, "trainer", default={}) or {})
            captured["extra_callbacks"] = [
                self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys
            ]
            return None

    args: list[str] = []
    for key, spec, init_args in (("model", model, model_args), ("data", datamodule, datamodule_args)):
        if spec is not None:
            class_path = spec.replace(":", ".")  # jsonargparse spells pkg.mod:Class as pkg.mod.Class
            args.append(f"--{key}=" + json.dumps({"class_path": class_path, "init_args": dict(init_args or {})}))
    for path in paths:
        args += ["--config", str(path)]
    cli = _parse(_Capture, args, paths, seed)
    if cli.model is None:
        raise ValueError(f"{list(paths)} builds no model: expected a `model:` section with a class_path, or --model.")
    trainer, ignored = _trainer_settings(captured.get("trainer", {}), captured.get("extra_callbacks", []))
    return LightningConfig(cli.model, cli.datamodule, trainer, ignored)


def _parse(cli_class: Any, args: list[str], paths: Sequence[str], seed: int | bool) -> Any:
    """``cli_class(run=False, args=args)``, a refusal of the files turned into one ``ValueError``."""
    # jsonargparse parses a file from inside the file's directory: an import path found through the working directory
    # ('' on sys.path, as `python -m` and `python -c` put it) must stay found from there.
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.argv = sys.argv[:1]  # LightningCLI warns when it sees both `args` and a command line of its own
    sys.path[:] = [os.path.abspath(entry) if entry in ("", ".") else entry for entry in sys.path]
    try:
        return cli_class(run=False, args=args, save_config_callback=None, seed_everything_default=seed,
                         parser_kwargs={"exit_on_error": False})  # fmt: skip
    except SystemExit as exc:  # jsonargparse reports to stderr and exits: keep the message for the caller
        raise ValueError(f"LightningCLI refused {list(paths)}: exit status {exc.code}") from None
    except Exception as exc:
        raise ValueError(f"LightningCLI refused {list(paths)}: {' '.join(str(exc).split())}") from exc
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv


def _trainer_settings(settings: dict[str, Any], extra_callbacks: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``trainer:`` settings that differ from Trainer's defaults, split into those the bench applies (callbacks
    with LightningCLI's extra callback keys appended) and those it owns (:data:`BENCH_OWNED_TRAINER_KEYS`)."""
    defaults = _trainer_defaults()
    trainer: dict[str, Any] = {}
    ignored: dict[str, Any] = {}
    for key, value in settings.items():
        if key == "callbacks" or (key in defaults and _same(value, defaults[key])):
            continue
        (ignored if key in BENCH_OWNED_TRAINER_KEYS else trainer)[key] = value
    callbacks = settings.get("callbacks") or []
    callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), *filter(None, extra_callbacks)]
    if callbacks:
        trainer["callbacks"] = callbacks
    return trainer, ignored


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # an object whose comparison fails is a setting
        return False
