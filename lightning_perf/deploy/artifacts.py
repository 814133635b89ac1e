"""The one atomic writer of artifact sets: a model file, its external weights, engine, JSON report and sidecars become
visible together, in one atomic step, or not at all.

Entry points: :class:`StagedSet` (committed with :meth:`StagedSet.commit`), :func:`write_set`,
:func:`committed_set`; a failed write raises :class:`ArtifactWriteError` and leaves the old set as it was. POSIX only.
The on-disk layout and the commit protocol: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from lightning_perf._validation import check_file_stem

__all__ = ["ArtifactWriteError", "StagedSet", "committed_set", "write_set"]

_STAGING_PREFIX = ".staging-"
_SPACE_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, getattr(errno, "EDQUOT", errno.ENOSPC)}


class ArtifactWriteError(OSError):
    """An artifact set could not be written (full disk, quota, read-only or forbidden target); the old set is intact."""


def _free_space(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "unknown"
    return f"{free} bytes ({free / 2**20:.1f} MiB)"


def _write_error(exc: OSError, dirpath: Path, what: str) -> ArtifactWriteError:
    code = exc.errno if exc.errno is not None else errno.EIO
    where = exc.filename if exc.filename else dirpath
    return ArtifactWriteError(
        code,
        f"Could not write {what} in {str(dirpath)!r} ({str(where)!r}: {exc.strerror or exc}). Free space there: "
        f"{_free_space(dirpath)}. The previously committed set, if any, is unchanged.",
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but is not ours to signal
        return True
    return True


def _versions_dir(dirpath: Path, name: str) -> Path:
    return dirpath / f".{name}.versions"


def committed_set(dirpath: str | os.PathLike[str], name: str) -> Path | None:
    """The directory of the committed set ``name`` in ``dirpath`` (its version, resolved once, so every file a reader
    opens there belongs to the same set), or ``None`` when no set was committed."""
    pointer = Path(dirpath) / name
    if not pointer.is_symlink():
        return None
    target = Path(os.path.realpath(pointer))
    return target if target.is_dir() else None


class StagedSet:
    """A set of files being written in a staging directory of ``dirpath``; see the module notes.

    Use as a context manager: files are written under :attr:`path` (by name, flat), :meth:`commit` makes them visible
    as one set; leaving the block without a commit (or with an exception) removes the staging directory. An
    ``OSError`` for a full disk or read-only target raised inside the block becomes :class:`ArtifactWriteError`.

    Example::

        with StagedSet("deploy") as staged:
            torch.save(state, staged.file("model.pt"))
            staged.write_json("model.json", {"ok": True})
            staged.commit("model")  # deploy/model/model.pt and deploy/model/model.json, together
    """

    def __init__(self, dirpath: str | os.PathLike[str]) -> None:
        self.dirpath = Path(dirpath)
        self.committed: Path | None = None
        try:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            self.path = self.dirpath / f"{_STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            self.path.mkdir()
        except OSError as exc:
            if exc.errno in _SPACE_ERRORS:
                raise _write_error(exc, self.dirpath, "an artifact set") from exc
            raise

    def file(self, filename: str) -> Path:
        """Where to write ``filename`` of the set."""
        check_file_stem("StagedSet.file", "filename", filename)
        return self.path / filename

    def write_bytes(self, filename: str, data: bytes) -> Path:
        target = self.file(filename)
        target.write_bytes(data)
        return target

    def write_json(self, filename: str, report: Mapping[str, Any]) -> Path:
        """A JSON report in the set (written by :func:`lightning_perf.profiling.write_json`)."""
        from lightning_perf.profiling.report import write_json

        return write_json(report, self.file(filename))

    def discard(self) -> None:
        """Remove the staging directory and what it holds (the committed set, if any, is not touched)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def commit(self, name: str) -> Path:
        """Make the staged files the set ``name``, atomically; returns the set's pointer path ``<dirpath>/<name>``.

        Raises:
            ArtifactWriteError: for a full disk, quota or read-only target (the old set stays).
            FileExistsError: if ``<dirpath>/<name>`` exists and is not a set pointer (it is never overwritten).
        """
        check_file_stem("StagedSet.commit", "name", name)
        if self.committed is not None:
            raise RuntimeError(f"This staged set was already committed as {str(self.committed)!r}.")
        pointer = self.dirpath / name
        if pointer.exists() and not pointer.is_symlink():
            raise FileExistsError(
                f"{str(pointer)!r} exists and is not an artifact-set pointer (a symlink to .{name}.versions/...): "
                "it was not overwritten. Move it away or choose another name."
            )
        versions = _versions_dir(self.dirpath, name)
        previous = committed_set(self.dirpath, name)
        version: Path | None = None
        link: Path | None = None
        try:
            for item in self.path.iterdir():
                _fsync(item)
            _fsync(self.path)
            versions.mkdir(exist_ok=True)
            numbers = [int(p.name) for p in versions.iterdir() if p.name.isdigit()]
            version = versions / f"{max(numbers, default=0) + 1:06d}"
            os.replace(self.path, version)
            _fsync(versions)
            link = self.dirpath / f".{name}.link-{secrets.token_hex(6)}"
            os.symlink(os.path.join(versions.name, version.name), link)
            os.replace(link, pointer)  # the one step that switches readers to the new set
        except BaseException as exc:
            with contextlib.suppress(OSError):
                if link is not None and link.is_symlink():
                    link.unlink()
            if version is not None and version.exists() and committed_set(self.dirpath, name) != version.resolve():
                shutil.rmtree(version, ignore_errors=True)
            self.discard()
            if isinstance(exc, OSError) and exc.errno in _SPACE_ERRORS:
                raise _write_error(exc, self.dirpath, f"the artifact set {name!r}") from exc
            raise
        self.committed = pointer
        with contextlib.suppress(OSError):
            _fsync(self.dirpath)
        _clean(self.dirpath, name, keep={version.name, previous.name if previous is not None else ""})
        return pointer

    def __enter__(self) -> StagedSet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.committed is None:
            self.discard()
        if isinstance(exc, OSError) and not isinstance(exc, ArtifactWriteError) and exc.errno in _SPACE_ERRORS:
            raise _write_error(exc, self.dirpath, "an artifact set") from exc


def _clean(dirpath: Path, name: str, keep: set[str]) -> None:
    """Remove old versions of ``name``, stray temporary links, and staging directories of dead processes."""
    with contextlib.suppress(OSError):
        for old in _versions_dir(dirpath, name).iterdir():
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        for entry in dirpath.iterdir():
            if entry.name.startswith(f".{name}.link-") and entry.is_symlink():
                entry.unlink()
            elif entry.name.startswith(_STAGING_PREFIX) and entry.is_dir():
                pid = entry.name[len(_STAGING_PREFIX) :].split("-", 1)[0]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    shutil.rmtree(entry, ignore_errors=True)


def write_set(dirpath: str | os.PathLike[str], name: str, files: Mapping[str, bytes | str]) -> Path:
    """Write ``files`` (file name -> content; text is UTF-8) as the set ``name`` in ``dirpath``; returns its pointer."""
    with StagedSet(dirpath) as staged:
        for filename, content in files.items():
            staged.write_bytes(filename, content.encode() if isinstance(content, str) else content)
        return staged.commit(name)
