"""Find host-device synchronizations in a stretch of code, and the source lines that cause them.

Entry point: :class:`HostSyncRecorder` (its :class:`SyncSite` records): torch's sync debug mode on CUDA, a prediction of
what would synchronize on a GPU elsewhere. What each mode sees and costs: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_perf._device import as_device

__all__ = ["CUDA_SYNC_WARNING", "DEBUG_MODE_PROTOTYPE_WARNING", "HostSyncRecorder", "SyncSite"]

CUDA_SYNC_WARNING = "synchronizing CUDA operation"
"""Part of the warning PyTorch emits for each synchronization under ``set_sync_debug_mode("warn")``."""

DEBUG_MODE_PROTOTYPE_WARNING = "Synchronization debug mode is a prototype feature"
"""Start of the UserWarning torch emits (once per process) when the sync debug mode is set: about the mode we chose
to use, not about the user's code, so the recorder never lets it reach the caller."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
# torch's dispatch plumbing between a user's call and the mode: skipped when looking for who made the call.
_PLUMBING = frozenset(
    os.path.join(_TORCH_DIR, name) for name in ("overrides.py", "_tensor.py", "functional.py", "_jit_internal.py")
)


@dataclass(frozen=True)
class SyncSite:
    """Where host-device synchronizations happened, and how often.

    Attributes:
        kind: what synchronized: a tensor method (``"item"``, ``"tolist"``, ``"cpu"``, ``"__bool__"``...) on CPU,
            ``"cuda-sync"`` on CUDA.
        filename: source file of the call.
        lineno: line in that file.
        function: the function containing that line.
        count: number of synchronizations seen at this site.
    """

    kind: str
    filename: str
    lineno: int
    function: str
    count: int

    @property
    def where(self) -> str:
        """``"path/to/file.py:42 in training_step"``."""
        return f"{self.filename}:{self.lineno} in {self.function}"

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``where``, for JSON reports."""
        return {**asdict(self), "where": self.where}


def _sync_kinds() -> dict[Any, str]:
    """The calls that synchronize on a GPU, each with its kind: the call's own name."""
    t = torch.Tensor
    calls = (t.item, t.tolist, t.cpu, t.numpy, t.__bool__, t.__int__, t.__float__, t.nonzero, torch.nonzero, t.unique,
             torch.unique, t.masked_select, torch.masked_select)  # fmt: skip
    return {call: call.__name__ for call in calls}


def _call_site() -> tuple[str, int, str] | None:
    """Who made the tensor call: the first frame past this module and torch's dispatch plumbing, unless that frame is
    torch's own library code (then None)."""
    frame: Any = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == _THIS_FILE or frame.f_code.co_filename in _PLUMBING):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def _is_prototype_warning(record: warnings.WarningMessage) -> bool:
    return issubclass(record.category, UserWarning) and str(record.message).startswith(DEBUG_MODE_PROTOTYPE_WARNING)


def _set_sync_debug_mode(mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode`` without torch's "prototype feature" UserWarning (only that one: any other
    warning raised meanwhile goes where it would have gone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DEBUG_MODE_PROTOTYPE_WARNING, category=UserWarning)
        torch.cuda.set_sync_debug_mode(mode)


def _boolean_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _SyncCallMode(TorchFunctionMode):
    """Counts the tensor calls that would synchronize on a GPU, by call site."""

    def __init__(self, counts: Counter[tuple[str, str, int, str]]) -> None:
        super().__init__()
        self.counts = counts
        self.kinds = _sync_kinds()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = self.kinds.get(func)
        if kind is None and func is torch.Tensor.__getitem__ and len(args) > 1 and _boolean_mask(args[1]):
            kind = "boolean-mask index"
        if kind is not None:
            site = _call_site()
            if site is not None:
                self.counts[(kind, site[0], site[1], site[2])] += 1
        return func(*args, **kwargs)


class HostSyncRecorder:
    """Record the host-device synchronizations made between :meth:`start` and :meth:`stop`, by source line.

    Args:
        device: the device the watched code runs on; ``None`` means CUDA when available, else CPU.

    Example::

        recorder = HostSyncRecorder("cpu")
        recorder.start()
        try:
            loss = model(x).sum()
            print(loss.item())
        finally:
            recorder.stop()
        for site in recorder.sites():
            print(site.count, site.kind, site.where)
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = as_device(device)
        self._cuda = self.device.type == "cuda"
        self.method = "cuda-sync-debug-mode" if self._cuda else "torch-function-mode"
        self._counts: Counter[tuple[str, str, int, str]] = Counter()
        self._mode: _SyncCallMode | None = None
        self._catcher: warnings.catch_warnings | None = None
        self._caught: list[warnings.WarningMessage] | None = None
        self._previous_debug_mode = 0
        self.stretches = 0

    @property
    def active(self) -> bool:
        """Whether a stretch is being watched."""
        return self._mode is not None or self._catcher is not None

    def start(self) -> None:
        """Start watching (a no-op if already watching)."""
        if self.active:
            return
        if self._cuda:
            self._previous_debug_mode = torch.cuda.get_sync_debug_mode()
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.filterwarnings("always", message=f".*{CUDA_SYNC_WARNING}")
            _set_sync_debug_mode("warn")
        else:
            self._mode = _SyncCallMode(self._counts)
            self._mode.__enter__()

    def stop(self) -> None:
        """Stop watching and restore what :meth:`start` changed (a no-op if not watching).

        On CUDA the warnings that were not about synchronization are shown again, as they would have been.
        """
        if not self.active:
            return
        self.stretches += 1
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
            return
        _set_sync_debug_mode(self._previous_debug_mode)
        catcher, caught = self._catcher, self._caught or []
        self._catcher, self._caught = None, None
        assert catcher is not None
        catcher.__exit__(None, None, None)
        for record in caught:
            if issubclass(record.category, UserWarning) and CUDA_SYNC_WARNING in str(record.message):
                self._counts[("cuda-sync", record.filename, record.lineno, "")] += 1
            elif not _is_prototype_warning(record):
                warnings.showwarning(record.message, record.category, record.filename, record.lineno, record.file)

    def sites(self) -> list[SyncSite]:
        """Every call site seen so far, most frequent first."""
        return [
            SyncSite(kind=kind, filename=filename, lineno=lineno, function=function or "?", count=count)
            for (kind, filename, lineno, function), count in self._counts.most_common()
        ]

    @property
    def total(self) -> int:
        """Synchronizations seen so far, all sites together."""
        return sum(self._counts.values())

    def __getstate__(self) -> dict[str, Any]:
        # A live mode or warning catcher belongs to this process's call stack: a copy starts idle.
        state = self.__dict__.copy()
        state.update(_mode=None, _catcher=None, _caught=None)
        return state
