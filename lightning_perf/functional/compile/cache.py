"""Warm starts for ``torch.compile``: carry a run's compiled code to the next process, keyed, in one file.

Entry points: :func:`save_compile_cache`, :func:`load_compile_cache` (only a file signed with your key
(:func:`signing_key`) is loaded unless named trusted), :func:`compile_cache_key`, :func:`use_inductor_cache_dir`. The
file format, the checks and the trust rules: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import platform
import secrets
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_perf._io import atomic_write_bytes, cache_file
from lightning_perf._warnings import NoEffectWarning, warn_once

__all__ = [
    "CACHE_FILE_NAME",
    "compile_cache_key",
    "compile_cache_path",
    "compile_cache_supported",
    "load_compile_cache",
    "save_compile_cache",
    "signing_key",
    "use_inductor_cache_dir",
]

#: The file name used when the cache path given is a folder.
CACHE_FILE_NAME = "torch_compile_cache.bin"

_MAGIC = b"lightning_perf torch.compile cache v2\n"  # then the HMAC line
_UNSIGNED_MAGIC = b"lightning_perf torch.compile cache v1\n"  # written before caches were signed
_MAX_HEADER = 16 * 2**20
#: The file in the user's cache folder (``lightning_perf._io.cache_file``) that holds the signing key.
KEY_FILE_NAME = "compile_cache.key"

log = logging.getLogger(__name__)


def compile_cache_supported() -> bool:
    """Whether this torch has ``torch.compiler.save_cache_artifacts`` and ``load_cache_artifacts``."""
    return all(hasattr(torch.compiler, name) for name in ("save_cache_artifacts", "load_cache_artifacts"))


def compile_cache_path(cache: str | os.PathLike[str]) -> Path:
    """The cache file for ``cache``: itself, or :data:`CACHE_FILE_NAME` inside it if it is a folder (or ends in /)."""
    path = Path(cache)
    return path / CACHE_FILE_NAME if path.is_dir() or str(cache).endswith(("/", os.sep)) else path


def compile_cache_key(
    modules: Iterable[tuple[str, nn.Module]], compile_kwargs: Mapping[str, Any], device: torch.device
) -> dict[str, Any]:
    """What must match for a cache file to be used: torch, Python, the device, the compiled modules, the options.

    The modules are described by their names, class names and parameter and buffer shapes and dtypes (hashed, with a
    short readable summary); the options by ``repr`` (a callable backend by its qualified name).
    """
    structure, classes = [], []
    for name, module in modules:
        classes.append(type(module).__name__)
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in (*module.named_parameters(), *module.named_buffers())]
        structure.append([name, f"{type(module).__module__}.{type(module).__qualname__}", tensors])
    digest = hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16]
    counts = {cls: classes.count(cls) for cls in dict.fromkeys(classes)}
    options = {
        key: (getattr(value, "__qualname__", type(value).__qualname__) if callable(value) else value)
        for key, value in compile_kwargs.items()
    }
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": _device_name(device),
        "modules": f"{', '.join(f'{n} x {cls}' for cls, n in counts.items())} ({digest})",
        "options": repr(sorted(options.items())),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    return device.type


# ------------------------------------------------------------------------------------------------------------ signing


def signing_key() -> bytes:
    """Your secret key for compile cache files: 32 random bytes in :data:`KEY_FILE_NAME` of your cache folder
    (``$LIGHTNING_PERF_CACHE``, else ``$XDG_CACHE_HOME/lightning_perf``, else ``~/.cache/lightning_perf``), made on
    first use with mode 0600. A cluster whose nodes share your home folder shares it; it never travels with a cache.

    Raises:
        ValueError: the key file is owned by someone else, readable or writable by others, or damaged.
        OSError: it cannot be made or read.
    """
    path = cache_file(KEY_FILE_NAME)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        with os.fdopen(os.open(made, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as file:
            file.write(secrets.token_bytes(32))
            os.fsync(file.fileno())
        try:
            os.link(made, path)  # whole or not at all; when two processes race, the first key made stays
        except FileExistsError:
            pass
        finally:
            os.unlink(made)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as file:
        info, key = os.fstat(fd), file.read(33)
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o077):
        raise ValueError(f"the signing key {os.fspath(path)!r} is not private to you (owner {info.st_uid}, mode "
                         f"{oct(info.st_mode & 0o777)}): remove it, a new one is made")  # fmt: skip
    if len(key) != 32:
        raise ValueError(f"the signing key {os.fspath(path)!r} is damaged ({len(key)} bytes): remove it")
    return key


def _signature(data: bytes) -> bytes:
    return b"hmac-sha256 " + hmac.new(signing_key(), data, "sha256").hexdigest().encode()


# ------------------------------------------------------------------------------------------------------------ saving


def save_compile_cache(path: str | os.PathLike[str], key: Mapping[str, Any]) -> Path | None:
    """Write this process's compile artifacts under ``key`` to ``path`` (see :func:`compile_cache_path`), atomically.

    Returns the file written, or ``None`` (with a warning) when torch lacks the API or has nothing to save (no
    inductor compilation ran, or its caches are disabled).
    """
    if not compile_cache_supported():
        warn_once(_unsupported(), NoEffectWarning)
        return None
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        warn_once(
            f"torch.compile cache: nothing to save to {os.fspath(path)!r}: torch recorded no compile artifacts in "
            "this process (no inductor compilation ran, or its FX-graph cache is disabled).",
            NoEffectWarning,
        )
        return None
    sections: list[tuple[dict[str, Any], bytes]] = [({"name": "torch"}, saved[0])]
    for meta, data in sections:
        meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    header = json.dumps({"key": dict(key), "sections": [meta for meta, _ in sections]}).encode() + b"\n"
    signed = b"".join([header, *(data for _, data in sections)])
    target = compile_cache_path(path)
    try:
        signature = _signature(signed)
    except (OSError, ValueError) as error:
        warn_once(f"torch.compile cache: not saved to {os.fspath(target)!r}: {error}.", NoEffectWarning)
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, b"".join([_MAGIC, signature, b"\n", signed]))
    return target


# ----------------------------------------------------------------------------------------------------------- loading


def load_compile_cache(path: str | os.PathLike[str], key: Mapping[str, Any], *, trusted: bool = False) -> bool:
    """Load the cache file at ``path`` into torch's compile caches if it is signed with your key (:func:`signing_key`),
    intact and its key equals ``key``.

    Returns whether it was loaded. A missing file (a first run) is said in the log; an unsigned, foreign, truncated or
    altered file is refused with one :class:`~lightning_perf.NoEffectWarning` saying why, before anything in it is
    parsed. Either way compilation starts from cold. ``trusted=True`` loads a file not signed with your key (another
    user's or machine's): loading **runs code from that file**; the format, hashes and key are still checked.
    """
    target = compile_cache_path(path)
    if not compile_cache_supported():
        warn_once(_unsupported(), NoEffectWarning)
        return False
    if not target.exists():  # a first run: nothing saved yet, nothing wrong
        log.info("torch.compile cache %s not found: this run compiles from cold and saves it.", os.fspath(target))
        return False
    try:
        sections, saved_key = _read(target, trusted)
    except (OSError, ValueError) as error:
        _refuse(target, str(error))
        return False
    differences = [
        f"{field} (file: {saved_key.get(field)!r}, now: {value!r})"
        for field, value in key.items()
        if saved_key.get(field) != value
    ]
    if differences:
        _refuse(target, "it was written for another setup: " + "; ".join(differences))
        return False
    artifacts = [data for meta, data in sections if meta["name"] == "torch"]
    if len(artifacts) != 1 or torch.compiler.load_cache_artifacts(artifacts[0]) is None:
        _refuse(target, "torch could not read its artifacts (see torch's log)")
        return False
    return True


def _read(target: Path, trusted: bool) -> tuple[list[tuple[dict[str, Any], bytes]], dict[str, Any]]:
    """The sections and key of a cache file; ``ValueError`` saying what is wrong with it (the signature first)."""
    if not target.is_file():
        raise ValueError("there is no such file")
    data = target.read_bytes()
    if data.startswith(_MAGIC):
        signature, _, signed = data[len(_MAGIC) :].partition(b"\n")
        mine = trusted or hmac.compare_digest(signature, _signature(signed))
    elif data.startswith(_UNSIGNED_MAGIC):
        signed, mine = data[len(_UNSIGNED_MAGIC) :], trusted
    else:
        raise ValueError("it is not a lightning_perf torch.compile cache file")
    if not mine:
        raise ValueError(
            "it is not signed with your key (another user or machine wrote it, it was altered, or it predates signed "
            "caches); torch would run the code it holds. Only if you trust that file as code, pass "
            "`CompileCallback(trust_cache=True)` (`load_compile_cache(..., trusted=True)`)"
        )
    line, _, body = signed.partition(b"\n")
    if len(line) > _MAX_HEADER:
        raise ValueError("its header is damaged (too long)")
    try:
        header = json.loads(line)
        metas = [dict(meta) for meta in header["sections"]]
        sizes = [int(meta["size"]) for meta in metas]
        key = dict(header["key"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"its header is damaged ({type(error).__name__}: {error})") from None
    if sum(sizes) != len(body):
        raise ValueError(f"it is truncated or padded ({len(body)} bytes of data, the header says {sum(sizes)})")
    sections, offset = [], 0
    for meta, size in zip(metas, sizes, strict=True):
        data = body[offset : offset + size]
        offset += size
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError(f"its {meta.get('name')!r} section does not match its SHA-256 (altered or corrupt)")
        if meta.get("name") != "torch":
            raise ValueError(f"it holds a {meta.get('name')!r} section: only torch's own artifacts are loaded")
        sections.append((meta, data))
    return sections, key


def _refuse(target: Path, why: str) -> None:
    warn_once(
        f"torch.compile cache {os.fspath(target)!r} not used: {why}. Compilation starts from cold.",
        NoEffectWarning,
    )


def _unsupported() -> str:
    return (
        f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts / load_cache_artifacts: the compile "
        "cache is neither saved nor loaded (every run compiles from cold)."
    )


# ------------------------------------------------------------------------------------- torch's own on-disk cache


def _not_private(folder: Path) -> str | None:
    """Why ``folder`` is not fit to hold native code that torch will load, or ``None`` if it is: it and every entry in
    it must be yours and writable by you alone, every parent yours or root's and not writable by others (unless
    sticky, as ``/tmp``: others cannot move a sticky folder's entries)."""
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows: no POSIX owner and mode bits to check
        return None
    uid, folder = os.getuid(), folder.resolve()
    for parent in folder.parents:
        info = parent.stat()
        if info.st_uid not in (uid, 0) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            mode = oct(info.st_mode & 0o7777)
            return f"its parent {os.fspath(parent)!r} is owned by user id {info.st_uid} or writable by others ({mode})"
    entries = [folder] + [Path(top, name) for top, dirs, files in os.walk(folder) for name in (*dirs, *files)]
    for entry in entries:
        info, what = entry.stat(), "it" if entry == folder else f"its entry {os.fspath(entry.relative_to(folder))!r}"
        if info.st_uid != uid:
            return f"{what} is owned by user id {info.st_uid}, not by this process's user ({uid})"
        if info.st_mode & 0o022:
            return f"{what} is writable by group or others (mode {oct(info.st_mode & 0o777)})"
    return None


@contextlib.contextmanager
def use_inductor_cache_dir(folder: str | os.PathLike[str]) -> Iterator[bool]:
    """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``folder`` (made, private to this user, if missing) while the block runs.

    Yields whether the folder is used: ``False``, with a :class:`~lightning_perf.NoEffectWarning`, when it cannot be
    made or is not private (see the module notes: it holds native code that torch loads). The previous setting
    is restored on exit. Torch reads the variable at each cache access, so it applies to what is compiled from then on.
    """
    target = Path(folder)
    try:
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _not_private(target)
    except OSError as error:
        problem = f"it cannot be made or checked ({error})"
    if problem is not None:
        warn_once(
            f"Inductor cache folder {os.fspath(target)!r} not used: {problem}. It would hold compiled native code that "
            "torch loads in later runs, so it must be writable by you alone. Torch's default cache folder is used.",
            NoEffectWarning,
        )
        yield False
        return
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(target)
    try:
        yield True
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
