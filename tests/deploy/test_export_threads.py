"""The export's latency table compares equal threads: the onnxruntime session it times runs as many intra-op threads
as torch, without spin-waiting, and the report records the count of both sides (issue 33)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_perf._imports import is_available
from lightning_perf.demos import make_workload
from lightning_perf.deploy import onnx
from lightning_perf.deploy.export import export_model

pytestmark = pytest.mark.skipif(
    not all(map(is_available, ("onnx", "onnxscript", "onnxruntime"))), reason="needs onnx, onnxscript and onnxruntime"
)


@pytest.fixture
def one_torch_thread() -> Iterator[int]:
    """torch at 1 thread, where onnxruntime's own default would take one spinning thread per core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def test_report_records_equal_threads_for_both_timed_sessions(
    one_torch_thread: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions: list[Any] = []
    init = onnx.OnnxRunner.__init__

    def recording(self: onnx.OnnxRunner, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        sessions.append(self.session)

    monkeypatch.setattr(onnx.OnnxRunner, "__init__", recording)
    model, _ = make_workload("convnet", "tiny", seed=0)
    options = {"batch_range": (1, 2, 4), "latency_iterations": 2, "latency_warmup": 1, "device": "cpu"}
    report = export_model(model.eval(), model.example_input_array, backends=["onnx"], dirpath=tmp_path, **options)
    assert report.ok and report.attempt is not None and report.attempt.latency  # the table was timed
    assert sessions, "the export timed no onnxruntime session"
    for session in sessions:  # the session the table timed, as onnxruntime itself reports it
        options = session.get_session_options()
        assert options.intra_op_num_threads == one_torch_thread and options.inter_op_num_threads == 1
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert report.attempt.threads == report.torch_threads == one_torch_thread
    assert f"{one_torch_thread} intra-op threads" in (report.attempt.runtime or "")
    saved = json.loads(Path(report.report_path or "").read_text())
    (attempt,) = saved["attempts"]
    assert attempt["threads"] == saved["torch_threads"] == one_torch_thread
