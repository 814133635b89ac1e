"""CUDA memory history and out-of-memory listeners (the real thing needs a GPU)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from lightning_perf.profiling import cuda_history


def test_out_of_memory_listeners_need_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        cuda_history.on_out_of_memory(lambda *args: None)


def test_a_failing_listener_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[tuple[int, ...]] = []

    def broken(*args: int) -> None:
        raise ValueError("listener bug")

    cuda_history._listeners.extend([broken, lambda *args: seen.append(args)])
    try:
        cuda_history._dispatch(0, 10, 20, 30)
    finally:
        del cuda_history._listeners[-2:]
    assert seen == [(0, 10, 20, 30)]
    assert "listener bug" in capsys.readouterr().err


@pytest.mark.gpu
def test_history_snapshot_and_oom_listener_on_cuda(tmp_path: Path) -> None:
    calls: list[int] = []
    cuda_history.start_history(max_entries=1000)
    handle = cuda_history.on_out_of_memory(lambda device, alloc, *rest: calls.append(alloc))
    try:
        kept = torch.ones(1024, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        path = cuda_history.dump_snapshot(tmp_path / "snap.pickle")
    finally:
        handle.remove()
        handle.remove()  # idempotent
        cuda_history.stop_history()
    assert calls and calls[0] >= 1 << 50
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and any(snapshot["device_traces"])
    assert kept.sum().item() == 1024
