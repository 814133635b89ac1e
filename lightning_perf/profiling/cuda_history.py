"""CUDA memory history and out-of-memory snapshots, viewable in PyTorch's memory visualizer (pytorch.org/memory_viz).

Thin, safe wrappers over PyTorch's private allocator API, no Lightning: :func:`start_history`, :func:`stop_history`,
:func:`dump_snapshot` and :func:`on_out_of_memory`. Why one dispatcher per process and CUDA initialized first:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_perf._io import atomic_path

__all__ = ["CudaRecording", "OomListener", "dump_snapshot", "on_out_of_memory", "start_history", "stop_history"]

OomListener = Callable[[int, int, int, int], None]
"""``listener(device, bytes_requested, bytes_allocated_on_device, bytes_free_on_device)``."""

_listeners: list[OomListener] = []
_attached = False


def start_history(max_entries: int = 100_000) -> None:
    """Start recording allocations and frees with Python and C++ stacks (keeps the last ``max_entries``)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_history() -> None:
    """Stop recording (the history recorded so far is dropped with the next :func:`start_history`)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_snapshot(path: str | Path) -> Path:
    """Write the allocator's state (and the recorded history, if any) as a pickle, atomically; returns ``path``."""
    snapshot = torch.cuda.memory._snapshot()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump(snapshot, f)
    return Path(path)


def _dispatch(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    for listener in list(_listeners):
        try:
            listener(device, alloc, device_alloc, device_free)
        except Exception as err:  # never raise inside the allocator: the OOM error must reach the user intact
            print(f"lightning_perf: an out-of-memory listener failed: {err!r}", file=sys.stderr)


class _Handle:
    def __init__(self, listener: OomListener) -> None:
        self.listener = listener

    def remove(self) -> None:
        """Stop calling the listener (idempotent)."""
        if self.listener in _listeners:
            _listeners.remove(self.listener)


def on_out_of_memory(listener: OomListener) -> Any:
    """Call ``listener`` each time the CUDA allocator runs out of memory; returns a handle with ``remove()``.

    The allocator may call it more than once for one failed operation (a convolution retrying with a smaller
    workspace).

    Raises:
        RuntimeError: if CUDA is not available.
    """
    global _attached
    if not torch.cuda.is_available():
        raise RuntimeError("`on_out_of_memory()` needs CUDA: there is no CUDA allocator to observe.")
    if not _attached:
        torch.cuda.init()  # the observer must meet an initialized allocator (see the module notes)
        torch._C._cuda_attach_out_of_memory_observer(_dispatch)  # type: ignore[attr-defined]
        _attached = True
    _listeners.append(listener)
    return _Handle(listener)


class CudaRecording:
    """One run's CUDA allocation history and out-of-memory snapshots, as files in ``directory``:
    ``<stem>_history_rank<R>.pickle`` (:meth:`dump_history`) and ``<stem>_oom_rank<R>.pickle`` (written by the OOM
    listener, listed in :attr:`oom_files`). :meth:`stop` detaches both (idempotent)."""

    def __init__(self, directory: Path, stem: str, rank: int) -> None:
        self.directory, self.stem, self.rank = Path(directory), stem, rank
        self.oom_files: list[str] = []
        self.recording = False
        self._handle: Any = None

    def start(self, history_entries: int | None, oom_snapshot: bool) -> None:
        """Record the history (keeping ``history_entries``; None: no history), and listen for OOM if asked."""
        if history_entries is not None:  # before the OOM observer: it initializes the allocator too
            start_history(history_entries)
            self.recording = True
        if oom_snapshot:
            self._handle = on_out_of_memory(self._write_oom_snapshot)

    def _write_oom_snapshot(self, device: int, alloc: int, *_: int) -> None:
        path = self.directory / f"{self.stem}_oom_rank{self.rank}.pickle"
        dump_snapshot(path)
        if str(path) not in self.oom_files:
            self.oom_files.append(str(path))

    def dump_history(self) -> str | None:
        """Write the history recorded so far; None when none is recorded."""
        path = self.directory / f"{self.stem}_history_rank{self.rank}.pickle"
        return str(dump_snapshot(path)) if self.recording else None

    def stop(self) -> None:
        """Stop listening and recording."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self.recording:
            stop_history()
            self.recording = False

    @property
    def active(self) -> bool:
        """Whether a listener or a recording is still attached."""
        return self._handle is not None or self.recording
