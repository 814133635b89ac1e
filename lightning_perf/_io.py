"""Atomic file writes, safe checkpoint reads and the per-machine decision cache (DESIGN.md, Errors and safety).

A reader never sees a half-written file under its final name (:func:`atomic_path`, :func:`atomic_write_bytes`,
:func:`atomic_write_text`); :func:`load_checkpoint` reads with ``torch.load(weights_only=True)`` only and raises
:class:`NotACheckpointError` for a file that is not a checkpoint. Sets of files go through
:mod:`lightning_perf.deploy.artifacts`. Design notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import secrets
import struct
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "checkpoint_problem",
    "load_checkpoint",
]


def _temporary_sibling(path: Path) -> Path:
    # Hidden and unmistakable, so a crash leaves something a user recognizes as debris, never a real artifact.
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")


def _fsync_file(path: Path) -> None:
    # Flush the data before the rename, so after a power loss the final name holds either the old or the new content.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        # Some platforms (Windows) refuse fsync on a read-only descriptor; the rename is still atomic.
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write to; on success it is renamed to ``path``, on failure it is removed.

    The temporary file is ``.<name>.tmp-<random>`` next to ``path``; parent directories are created. Writers that
    add sibling files themselves (e.g. ONNX external weights named after the file) must name those separately.

    Args:
        path: the final destination. An existing file there is replaced only once the new one is complete.
        fsync: flush the new file to disk before the rename (cheap for reports; turn off for huge scratch files).

    Raises:
        FileNotFoundError: if the body finished without writing the temporary file.

    Example::

        with atomic_path("out/model.pt") as tmp:
            torch.save(model.state_dict(), tmp)
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_sibling(final)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"Nothing was written to the temporary file {str(tmp)!r} for {str(final)!r}.")
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        # BaseException too: a Ctrl-C halfway through a write must not leave the debris behind either.
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`) and return ``path`` as a :class:`Path`."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def numbered_path(path: Path, files: Callable[[Path], Iterable[Path]], force: bool = False) -> Path:
    """``path``, or with the first run number (``name-2.ext``, ``name-3.ext``...) none of whose ``files`` exists;
    ``path`` as is with ``force`` (its files are overwritten)."""
    candidate, number = path, 2
    while not force and any(p.exists() for p in files(candidate)):
        candidate, number = path.with_name(f"{path.stem}-{number}{path.suffix}"), number + 1
    return candidate


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically, byte for byte (no newline translation), and return it as a Path."""
    return atomic_write_bytes(path, text.encode(encoding))


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a global that ``torch.load(weights_only=True)`` does not allow; it was not loaded."""


class NotACheckpointError(ValueError):
    """A file is not a PyTorch checkpoint (text, random bytes, a truncated or corrupt archive); nothing was loaded."""


_PICKLE_PROTO = 0x80  # the first opcode of a pickle of protocol 2 and later: torch.save's legacy format starts with it


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:  # a multi-byte character cut at the end of `head` is still text
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return all(ch.isprintable() or ch in "\t\r\n\f" for ch in text)


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the file at ``path`` cannot be a ``torch.save`` checkpoint, read from its bytes alone (no torch, no
    unpickling), or ``None`` when it has the form of one (a zip archive holding ``data.pkl``, or a legacy pickle).

    Raises:
        OSError: if the file cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "the file is empty"
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            return f"truncated or corrupt zip archive ({exc})"
        if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
            held = ", ".join(names[:3]) or "nothing"
            return f"a zip archive without the data.pkl that torch.save writes (it holds {held})"
        return None
    if head[0] == _PICKLE_PROTO and len(head) > 1 and 2 <= head[1] <= 5:
        return None
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1:
        return "a safetensors file (load it with safetensors.torch.load_file)"
    if _looks_like_text(head):
        first = head.decode("utf-8", errors="replace").strip().splitlines()
        return f"a text file (it starts with {first[0][:40]!r})" if first else "a text file of blank lines"
    return (
        f"it starts with the bytes {head[:8].hex(' ')}: neither a zip archive (what torch.save writes) nor a pickle "
        "(its legacy format)"
    )


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", what: str = "the file") -> Any:
    """``torch.load(path, map_location=..., weights_only=True)``, with no fallback to a full unpickling.

    Raises:
        NotACheckpointError: if the file is not a PyTorch checkpoint (empty, text, random bytes, a truncated or corrupt
            zip archive, a corrupt pickle); the message says which.
        UnsafeCheckpointError: if the file is a checkpoint that needs a global outside torch's allow-list; the message
            names the global met (e.g. a hyperparameter's class) and how to allow it with
            ``torch.serialization.add_safe_globals`` after checking that the file comes from a trusted source.
    """
    import torch

    def not_a_checkpoint(problem: str) -> NotACheckpointError:
        return NotACheckpointError(f"{what} {str(path)!r} is not a PyTorch checkpoint: {problem}")

    problem = checkpoint_problem(path)
    if problem is not None:
        raise not_a_checkpoint(problem)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # the unpickler met bytes that are no pickle of torch's: corrupt, not unsafe
            detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:Check the documentation|$)", str(exc), re.S)
            said = " ".join(detail.group(1).split())[:160] if detail else failure_reason(exc, 160)
            raise not_a_checkpoint(
                f"its pickle is truncated or corrupt, or was not written by torch.save ({said})"
            ) from None
        name = found.group(1)
        raise UnsafeCheckpointError(
            f"{what} {str(path)!r} was not loaded: it holds {name}, which torch.load(weights_only=True) does not allow "
            "(loading it could run code from the file). If you trust the file, allow that class before loading: "
            f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1]}])."
        ) from None
    except RuntimeError as exc:
        if "PytorchStreamReader" in str(exc) or "inline_container" in str(exc):
            raise not_a_checkpoint(f"truncated or corrupt zip archive ({failure_reason(exc, 160)})") from None
        raise
    except (EOFError, IndexError, KeyError, struct.error, UnicodeDecodeError) as exc:
        # The legacy pickle path meeting bytes that end early or decode to nothing torch wrote.
        raise not_a_checkpoint(f"its contents are truncated or corrupt ({failure_reason(exc, 160)})") from None


def failure_reason(exc: BaseException, limit: int = 500) -> str:
    """``"<ExceptionType>: <first line of its message>"`` (at most ``limit`` characters of it), for reports."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(exc).__name__}: {first[:limit]}" if first else type(exc).__name__


# ------------------------------------------------------------------------------------ caches of measured decisions

CACHE_ENV = "LIGHTNING_PERF_CACHE"


def cache_file(name: str) -> Path:
    """``$LIGHTNING_PERF_CACHE/<name>``, else ``$XDG_CACHE_HOME/lightning_perf/<name>``, else
    ``~/.cache/lightning_perf/<name>``: where measured decisions (and the compile caches' signing key) are kept."""
    folder = os.environ.get(CACHE_ENV)
    if folder:
        return Path(folder).expanduser() / name
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "lightning_perf" / name


@dataclass(frozen=True)
class DecisionCache:
    """A JSON file of measured decisions, ``{"schema": n, "entries": {key: {...}}}``, each entry under a key naming
    all that decides it (:func:`lightning_perf.profiling.machine.decision_key`). JSON only: nothing in it runs.

    A missing file is empty; an unreadable or invalid one warns (``MeasurementWarning``) and counts as empty, so the
    caller measures again and rewrites it. A store re-reads the file, keeping what another process stored meanwhile,
    and writes it atomically; a failure to write warns (the decision stays valid for this run).

    Attributes:
        name: the file's name in the user's cache folder (:func:`cache_file`).
        what: the cache in words, for the warnings.
        schema: the layout's version; a file of another version counts as invalid.
    """

    name: str
    what: str
    schema: int = 1

    def path(self, given: str | os.PathLike[str] | None = None) -> Path:
        """``given``, else the file in the user's cache folder."""
        return Path(given) if given is not None else cache_file(self.name)

    def entry(self, path: Path, key: str) -> dict[str, Any]:
        """A copy of the entry under ``key`` (``{}``: none, or not an object)."""
        found = self._entries(path).get(key)
        return dict(found) if isinstance(found, dict) else {}

    def store(self, path: Path, key: str, values: dict[str, Any]) -> None:
        """Merge ``values`` into the entry under ``key`` and write the file."""
        from lightning_perf._warnings import MeasurementWarning

        entries = self._entries(path, quiet=True)
        entries[key] = {**(entries[key] if isinstance(entries.get(key), dict) else {}), **values}
        try:
            atomic_write_text(path, json.dumps({"schema": self.schema, "entries": entries}, indent=2) + "\n")
        except OSError as exc:
            warnings.warn(f"Could not write the {self.what} {str(path)!r}: {exc}.", MeasurementWarning, stacklevel=4)

    def _entries(self, path: Path, quiet: bool = False) -> dict[str, Any]:
        from lightning_perf._warnings import MeasurementWarning

        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            entries = data.get("entries") if isinstance(data, dict) and data.get("schema") == self.schema else None
            if isinstance(entries, dict):
                return entries
            problem = f"expected an object with 'schema': {self.schema} and 'entries'"
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
            problem = str(exc)
        if not quiet:
            message = f"The {self.what} {str(path)!r} is not valid or readable ({problem}); measuring again"
            warnings.warn(message + " and rewriting it.", MeasurementWarning, stacklevel=5)
        return {}
