"""Atomic file writes: a reader never sees a half-written file under its final name (DESIGN.md, Errors and safety).

Everything is first written to a hidden temporary file in the destination's own directory (so the final
``os.replace`` is a rename within one file system, which POSIX and Windows make atomic) and moved into place only
once the writer has finished without an exception.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_bytes", "atomic_write_text"]


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
