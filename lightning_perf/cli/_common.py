"""Pieces every ``lightning-perf`` command shares: the parser class and the argument validators.

Stdlib only (and :mod:`lightning_perf.benchmark.tasks`' ``one_line``), so that building every parser (and answering
``--help``) imports neither torch nor Lightning.

A validator is an argparse ``type=`` callable: it returns the parsed value or raises ``argparse.ArgumentTypeError``
whose message names the value and what is expected; argparse prefixes the option, and :class:`CliParser` prints the
result as one line on stderr and exits with status 2::

    lightning-perf bench: error: argument --steps: '0' is not valid. Expected an integer >= 1.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from lightning_perf.benchmark.spec import SpecError, parse_setting
from lightning_perf.benchmark.tasks import one_line  # the one definition, shared with the task session

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+|mps)$")


class UsageError(ValueError):
    """A bad command-line value found after parsing (e.g. a class that does not import); the CLI exits 2 with it."""


def invalid(text: str, expected: str) -> argparse.ArgumentTypeError:
    """The error of a validator: ``'<text>' is not valid. Expected <expected>.``"""
    return argparse.ArgumentTypeError(f"{text!r} is not valid. Expected {expected}.")


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit 2) and that never abbreviates long options.

    Sub-parsers made through ``add_subparsers().add_parser`` are of this class too (argparse uses the parent's class).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)


def fail(parser: argparse.ArgumentParser, option: str, value: Any, expected: str) -> NoReturn:
    """Exit 2 with one line naming ``option``, ``value`` and what is expected (for checks made after parsing)."""
    parser.error(f"argument {option}: {value!r} is not valid. Expected {one_line(expected)}.")


def spec_error(parser: argparse.ArgumentParser, exc: Any) -> NoReturn:
    """Exit 2 with the one line of a ``SpecError`` (:mod:`lightning_perf.benchmark.spec`): its option, the value as
    given and what is expected."""
    fail(parser, exc.option, exc.value, exc.expected)


def check_source_options(parser: argparse.ArgumentParser, args: argparse.Namespace, workload_config: str) -> None:
    """The model options of ``bench`` and ``autotune`` that contradict each other, refused before any import: a
    ``--model`` without its ``--datamodule`` (and no ``--config`` to give one), a ``--workload`` with ``--config``
    (``workload_config`` says what to use instead), a datamodule or arguments with neither ``--model`` nor
    ``--config``."""
    if args.model is not None and args.datamodule is None and not args.config:
        fail(parser, "--model", args.model, "--datamodule as well (the LightningDataModule class, pkg.mod:Class)")
    if args.workload is not None and args.config:
        fail(parser, "--config", str(args.config[0]), f"no --config with --workload ({workload_config})")
    for option in ("--datamodule", "--model-args", "--datamodule-args"):
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and args.model is None and not args.config:
            fail(parser, option, value, f"{option} together with --model or --config")


def check_output(parser: argparse.ArgumentParser, option: str, output: Path | None, what: str) -> None:
    """Exit 2 unless ``output`` can be written: not a directory, and its folder exists and is writable or can be
    created. Checked by creating (and removing) a scratch folder in the nearest existing parent, so that a run never
    ends in an error about its output after the work is done."""
    import tempfile

    if output is None:
        return
    if output.is_dir():
        fail(parser, option, str(output), f"a file path for {what}, not a directory")
    parent = output.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        fail(parser, option, str(output), "a path whose existing parent is a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".lightning-perf-check-", dir=parent)).rmdir()
    except OSError as exc:
        fail(parser, option, str(output), f"a path in a folder that can be written ({parent}: {exc.strerror})")


def load_user_source(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The model source of ``--model``/``--datamodule`` (JSON arguments) and/or ``--config`` files, built once here
    so that a class that does not import, a constructor that refuses its arguments or a file LightningCLI refuses is
    a usage error (exit 2, one line) before any measurement: ``(source, model, datamodule)``.

    The working directory goes on the import path first (as ``python -m`` and ``python train.py`` from the project
    root have it), so ``my_project.models:Net`` imports from there; worker processes inherit the path.
    """
    import os

    from lightning_perf.benchmark.sources import ConfigSource, ImportClassError, ImportSource

    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    configs = [str(path) for path in (getattr(args, "config", None) or [])]
    if configs:
        source: Any = ConfigSource(
            configs, args.model, args.datamodule, args.model_args or {}, args.datamodule_args or {}, seed=args.seed
        )
        try:
            model, datamodule = source.load()
        except Exception as exc:  # LightningCLI's refusal, or the user's __init__ raising
            raise UsageError(f"argument --config: {one_line(str(exc))}") from None
        return source, model, datamodule
    source = ImportSource(args.model, args.datamodule, args.model_args or {}, args.datamodule_args or {})
    try:
        model, datamodule = source.load()
    except ImportClassError as exc:
        option = "--model" if str(exc).startswith("model=") else "--datamodule"
        raise UsageError(f"argument {option}: {exc}") from None
    except Exception as exc:  # the user's __init__ refused the arguments given
        raise UsageError(
            f"argument --model-args/--datamodule-args: {args.model} or {args.datamodule} could not be built "
            f"from {args.model_args or {}!r} and {args.datamodule_args or {}!r}: {type(exc).__name__}: "
            f"{one_line(str(exc))}"
        ) from None
    return source, model, datamodule


def positive_ints(text: str, expected: str, separator: str = ",", distinct: bool = False) -> list[int]:
    """The integers >= 1 that ``separator`` separates in ``text``, in the order given (with ``distinct``, each once);
    :func:`invalid` with ``expected`` otherwise."""
    try:
        values = [int(item) for item in text.split(separator)]
    except ValueError:
        values = []
    if not values or min(values) < 1 or (distinct and len(set(values)) < len(values)):
        raise invalid(text, expected)
    return values


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of distinct integers >= 1, e.g. ``1,8,32`` (kept in the order given)."""
    return positive_ints(text, "comma-separated distinct integers >= 1, e.g. 1,8,32", distinct=True)


def setting(name: str) -> Callable[[str], Any]:
    """The validator of the bench setting ``name``: :func:`~lightning_perf.benchmark.spec.parse_setting`, whose
    :class:`~lightning_perf.benchmark.spec.SpecError` becomes argparse's one-line error."""

    def parse(text: str) -> Any:
        try:
            return parse_setting(name, text)
        except SpecError as exc:
            raise invalid(text, exc.expected) from None

    parse.__name__ = name
    return parse


json_object = setting("model_args")
"""A JSON object, e.g. ``'{"depth": 4}'``."""
module_class_spec = setting("model")
"""``package.module:ClassName`` (the syntax only; nothing is imported); ``package.module.ClassName`` is accepted."""


def existing_file(text: str) -> Path:
    """The path of a file that exists."""
    path = Path(text)
    if not text or not path.is_file():
        what = "a directory" if path.is_dir() else "missing"
        raise invalid(text, f"the path of an existing file ({what})")
    return path


def device(text: str) -> str:
    """``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` (the syntax only; whether the device exists is checked
    later)."""
    if not _DEVICE.match(text.strip()):
        raise invalid(text, "auto, cpu, cuda, cuda:N or mps")
    return text.strip()


def comma_names(text: str) -> list[str]:
    """A non-empty comma-separated list of names (blanks dropped)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise invalid(text, "one or more comma-separated names")
    return names


def choice_list(
    choices: Iterable[str], *, extra: Iterable[str] = (), what: str = "names", allow_empty: bool = False
) -> Callable[[str], list[str]]:
    """A validator of a comma-separated list whose every item is one of ``choices``; a name in ``extra`` (e.g.
    ``all``) is accepted alone; an empty string gives ``[]`` when ``allow_empty``."""
    allowed = tuple(choices)
    special = tuple(extra)

    def parse(text: str) -> list[str]:
        if allow_empty and not text.strip():
            return []
        names = comma_names(text)
        if len(names) == 1 and names[0] in special:
            return names
        unknown = [name for name in names if name not in allowed]
        if unknown:
            valid = ", ".join((*special, *allowed))
            raise argparse.ArgumentTypeError(f"{text!r} is not valid: unknown {what} {unknown}. Expected {valid}.")
        return names

    parse.__name__ = f"{what} list"
    return parse


def at_least(minimum: float, kind: Callable[[str], float] = int, above: bool = False) -> Callable[[str], Any]:
    """A validator of a finite number (``kind``: ``int`` or ``float``) >= ``minimum`` (> with ``above``)."""
    expected = f"{'an integer' if kind is int else 'a finite number'} {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise invalid(text, expected) from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise invalid(text, expected)
        return value

    parse.__name__ = expected
    return parse


non_negative_int = at_least(0)


# Names the parsers offer without importing the registries behind them (which import torch and Lightning);
# tests/cli/test_names.py checks them against the real registries.
WORKLOAD_NAMES: tuple[str, ...] = ("convnet", "unet3d", "vit", "lm")
"""The reference workloads of :mod:`lightning_perf.demos` (``workload_names()``)."""

PRESET_NAMES: tuple[str, ...] = ("tiny", "default", "gpu")
"""The workload sizes named in ``--help`` (:mod:`lightning_perf.demos` ``PRESETS``, read at run time, is the check;
``gpu``: the GPU-sized preset, the default on a CUDA device)."""


def add_source_arguments(parser: argparse.ArgumentParser, what_runs: str, workload_help: str) -> None:
    """The options that name the model a command measures, shared by ``bench`` and ``autotune``: ``--workload`` (a
    reference workload) or ``--model``/``--datamodule`` with JSON arguments (exclusive), and ``--config`` (LightningCLI
    files, repeatable, merged in order; their trainer settings apply to every ``what_runs``)."""
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--workload", metavar="{" + ",".join(WORKLOAD_NAMES) + "}", help=workload_help
    )  # checked with the other names of the run (a misspelling gets a suggestion)
    what.add_argument(
        "--model",
        type=module_class_spec,
        metavar="MODULE:CLASS",
        help="your LightningModule class, e.g. my_pkg.models:Net (with --datamodule)",
    )
    parser.add_argument("--model-args", type=json_object, help="JSON object of the model's keyword arguments")
    parser.add_argument(
        "--datamodule", type=module_class_spec, metavar="MODULE:CLASS", help="your LightningDataModule class"
    )
    parser.add_argument("--datamodule-args", type=json_object, help="JSON object of its arguments")
    parser.add_argument(
        "--config",
        type=existing_file,
        action="append",
        metavar="YAML",
        help="a LightningCLI config (model:, data:, trainer:), repeatable, merged in order as LightningCLI does; its "
        f"trainer settings apply to every {what_runs} (the YAML autotune writes is accepted, with "
        "--model/--datamodule)",
    )


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """``--preset``: the reference workload's size (``bench`` and ``autotune``)."""
    parser.add_argument(
        "--preset",
        metavar="PRESET",
        help=f"workload size, one of {', '.join(PRESET_NAMES)}"
        " (default: gpu on a CUDA device where the workload has it, else default)",
    )


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` (``bench`` and ``autotune``); whether the device exists is checked by the run."""
    parser.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda or cuda:N (default: auto: CUDA when a CUDA device is visible; the output says which)",
    )
