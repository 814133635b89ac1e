"""HostSyncRecorder: which tensor calls would synchronize with a GPU, and where they are made."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch

from lightning_perf.profiling.syncs import CUDA_SYNC_WARNING, DEBUG_MODE_PROTOTYPE_WARNING, HostSyncRecorder


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith(marker))


def test_each_kind_of_host_read_is_counted_at_its_line() -> None:
    x = torch.randn(6)
    recorder = HostSyncRecorder("cpu")
    recorder.start()
    try:
        x.sum().item()  # L-ITEM
        x.tolist()  # L-TOLIST
        x.cpu()  # L-CPU
        _ = bool(x.sum() > 0)  # L-BOOL
        torch.nonzero(x)  # L-NONZERO
        x.unique()  # L-UNIQUE
        x[x > 0]  # L-MASK
        x.to("cpu")  # a move to the training device: not counted on CPU
        y = x * 2 + 1  # plain compute: not counted
    finally:
        recorder.stop()
    found = {(s.kind, s.lineno) for s in recorder.sites()}
    assert found == {
        ("item", _line("# L-ITEM")),
        ("tolist", _line("# L-TOLIST")),
        ("cpu", _line("# L-CPU")),
        ("__bool__", _line("# L-BOOL")),
        ("nonzero", _line("# L-NONZERO")),
        ("unique", _line("# L-UNIQUE")),
        ("boolean-mask index", _line("# L-MASK")),
    }
    assert all(
        s.filename == __file__ and s.function == "test_each_kind_of_host_read_is_counted_at_its_line"
        for s in recorder.sites()
    )
    assert recorder.total == 7 and recorder.stretches == 1
    assert y.shape == x.shape


def test_torch_library_code_is_not_blamed() -> None:
    # On CPU, torch's optimizers read their step counter with .item(): host bookkeeping, not a GPU sync.
    w = torch.randn(3, requires_grad=True)
    optimizer = torch.optim.AdamW([w])
    recorder = HostSyncRecorder("cpu")
    recorder.start()
    try:
        (w * 2).sum().backward()
        optimizer.step()
    finally:
        recorder.stop()
    assert recorder.sites() == []


def test_only_the_watched_stretches_count_and_stop_restores_the_mode_stack() -> None:
    recorder = HostSyncRecorder("cpu")
    torch.ones(1).item()
    recorder.start()
    recorder.start()  # already watching: no second mode
    assert torch._C._len_torch_function_stack() == 1
    torch.ones(1).item()
    recorder.stop()
    recorder.stop()
    assert torch._C._len_torch_function_stack() == 0
    torch.ones(1).item()
    assert recorder.total == 1 and not recorder.active


def test_an_idle_copy_pickles_even_while_watching() -> None:
    recorder = HostSyncRecorder("cpu")
    recorder.start()
    try:
        torch.ones(1).item()
        clone = pickle.loads(pickle.dumps(recorder))
    finally:
        recorder.stop()
    assert not clone.active and clone.total == 1


@pytest.mark.gpu
def test_cuda_debug_mode_is_used_restored_and_other_warnings_survive() -> None:
    x = torch.randn(8, device="cuda")
    recorder = HostSyncRecorder("cuda")
    assert recorder.method == "cuda-sync-debug-mode"
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        recorder.start()
        x.sum().item()  # CUDA-ITEM
        warnings.warn("unrelated", UserWarning, stacklevel=1)
        recorder.stop()
    assert torch.cuda.get_sync_debug_mode() == 0
    assert any(s.lineno == _line("# CUDA-ITEM") and s.kind == "cuda-sync" for s in recorder.sites())
    assert [str(w.message) for w in outer] == ["unrelated"]
    assert all(CUDA_SYNC_WARNING not in str(w.message) for w in outer)


def test_torch_prototype_notice_is_dropped_and_other_warnings_survive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's warning handling, on any machine: torch's debug-mode functions replaced by fakes that warn the
    way torch does (its "prototype feature" notice when the mode is set, one warning per synchronization)."""
    modes: list[int | str] = []

    def set_mode(mode: int | str) -> None:
        warnings.warn(
            f"{DEBUG_MODE_PROTOTYPE_WARNING} and does not yet detect all synchronizing operations",
            UserWarning,
            stacklevel=2,
        )
        modes.append(mode)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    recorder = HostSyncRecorder("cuda")
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        recorder.start()
        warnings.warn(f"called a {CUDA_SYNC_WARNING}", UserWarning, stacklevel=1)
        warnings.warn("unrelated", UserWarning, stacklevel=1)
        recorder.stop()
        # Only the notice raised while the recorder sets the mode is dropped: no filter is left behind.
        warnings.warn(f"{DEBUG_MODE_PROTOTYPE_WARNING} (raised elsewhere)", UserWarning, stacklevel=1)
    assert modes == ["warn", 0]
    assert [str(w.message) for w in outer] == ["unrelated", f"{DEBUG_MODE_PROTOTYPE_WARNING} (raised elsewhere)"]
    assert recorder.total == 1 and recorder.sites()[0].kind == "cuda-sync"
