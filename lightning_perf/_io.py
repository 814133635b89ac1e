"""Atomic file writes and safe checkpoint reads (DESIGN.md, Errors and safety).

A reader never sees a half-written file under its final name; a set of files that must change together goes through
:mod:`lightning_perf.deploy.artifacts`. :func:`load_checkpoint` reads a file with ``torch.load(weights_only=True)``
and nothing else: a file never runs code, and a file that needs more globals fails with an error naming the global
and ``torch.serialization.add_safe_globals``.

Everything is first written to a hidden temporary file in the destination's own directory (so the final
``os.replace`` is a rename within one file system, which POSIX and Windows make atomic) and moved into place only
once the writer has finished without an exception.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["UnsafeCheckpointError", "atomic_path", "atomic_write_bytes", "atomic_write_text", "load_checkpoint"]


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


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically, byte for byte (no newline translation), and return it as a Path."""
    return atomic_write_bytes(path, text.encode(encoding))


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a global that ``torch.load(weights_only=True)`` does not allow; it was not loaded."""


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", what: str = "the checkpoint") -> Any:
    """``torch.load(path, map_location=..., weights_only=True)``, with no fallback to a full unpickling.

    Raises:
        UnsafeCheckpointError: if the file needs a global outside torch's allow-list; the message names the global
            met (e.g. a hyperparameter's class) and how to allow it with ``torch.serialization.add_safe_globals``
            after checking that the file comes from a trusted source.
    """
    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        name = found.group(1) if found else "a global outside torch's allow-list"
        raise UnsafeCheckpointError(
            f"{what} {str(path)!r} was not loaded: it holds {name}, which torch.load(weights_only=True) does not allow "
            "(loading it could run code from the file). If you trust the file, allow that class before loading: "
            f"torch.serialization.add_safe_globals([{name.rsplit('.', 1)[-1] if found else '...'}])."
        ) from None
