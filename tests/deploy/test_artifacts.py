"""The artifact-set writer: a kill at any step leaves the complete old set or the complete new one; a full disk or a
read-only target gives a clear error and keeps the old set. Faults are injected, never timed."""

from __future__ import annotations

import errno
import os
import pathlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf.deploy import artifacts
from lightning_perf.deploy.artifacts import ArtifactWriteError, StagedSet, committed_set, write_set
from lightning_perf.deploy.backend import Runner
from lightning_perf.deploy.export import export_model
from lightning_perf.deploy.onnx import OnnxBackend
from lightning_perf.deploy.quantize import save as save_module
from lightning_perf.functional.quantization import qat
from tests.deploy._sets import visible_files

OLD = {"model.onnx": b"old graph", "model.onnx.data": b"old weights", "model.json": b'{"old": true}'}
NEW = {"model.onnx": b"new graph", "model.onnx.data": b"new weights " * 100, "model.json": b'{"new": true}'}


class Killed(BaseException):
    """Stands in for SIGKILL: raised from inside the write path, caught by nothing in the library."""


def _read(dirpath: Path, name: str = "model") -> dict[str, bytes] | None:
    found = committed_set(dirpath, name)
    return None if found is None else {p.name: p.read_bytes() for p in found.iterdir()}


# Every step of the write path a kill or an error can hit: directory and file creation, writes, flushes, renames.
_STEPS: list[tuple[Any, str]] = [
    *((os, f) for f in ("replace", "fsync", "symlink", "open", "mkdir")),
    (pathlib.Path, "write_bytes"),
]


def _fail_after(monkeypatch: pytest.MonkeyPatch, n: int, make: Callable[[], BaseException]) -> list[int]:
    """Make the ``n``-th call (0-based) to any write-path step raise ``make()``; returns the call counter."""
    calls = [0]
    for owner, name in _STEPS:
        original = getattr(owner, name)

        def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] - 1 == n:
                raise make()
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    return calls


def test_write_set_commits_and_readers_find_the_files(tmp_path: Path) -> None:
    pointer = write_set(tmp_path, "model", OLD)
    assert pointer == tmp_path / "model" and pointer.is_symlink()
    assert _read(tmp_path) == OLD
    assert visible_files(tmp_path) == ["model/model.json", "model/model.onnx", "model/model.onnx.data"]
    write_set(tmp_path, "model", NEW)
    assert _read(tmp_path) == NEW
    write_set(tmp_path, "model", OLD)
    # Old versions are cleaned: the committed one and the previous one stay, nothing else.
    assert len(list((tmp_path / ".model.versions").iterdir())) == 2
    assert committed_set(tmp_path, "other") is None


def test_a_kill_at_any_step_leaves_the_old_or_the_new_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_set(tmp_path, "model", OLD)
    outcomes = set()
    n = 0
    while True:
        with monkeypatch.context() as patch:
            calls = _fail_after(patch, n, Killed)
            try:
                write_set(tmp_path, "model", NEW)
                finished = True
            except Killed:
                finished = False
        seen = _read(tmp_path)
        assert seen in (OLD, NEW), f"kill at step {n}: a reader sees {seen}"
        outcomes.add("new" if seen == NEW else "old")
        if finished and calls[0] <= n:
            break  # the write never reached step n: every step was tried
        if seen == NEW:
            write_set(tmp_path, "model", OLD)  # start the next round from the old set again
        n += 1
    assert n > 10 and outcomes == {"old", "new"}
    # Debris of this (living) process is removed on failure; none is left behind.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".staging-")] == []


def test_debris_of_a_killed_writer_is_removed_by_the_next_commit(tmp_path: Path) -> None:
    dead = tmp_path / ".staging-999999999-deadbeef"  # no such process
    dead.mkdir(parents=True)
    (dead / "model.onnx").write_bytes(b"half")
    alive = tmp_path / f".staging-{os.getpid()}-cafe"  # a writer of this process may still be at work
    alive.mkdir()
    write_set(tmp_path, "model", OLD)
    assert not dead.exists() and alive.exists()


@pytest.mark.parametrize(
    ("step", "code"),
    [("fsync", errno.ENOSPC), ("replace", errno.ENOSPC), ("write_bytes", errno.ENOSPC), ("mkdir", errno.EROFS)],
)
def test_full_disk_or_read_only_target_is_a_clear_error_and_keeps_the_old_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, code: int
) -> None:
    write_set(tmp_path, "model", OLD)
    owner = pathlib.Path if step == "write_bytes" else os

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(owner, step, full)
    with pytest.raises(ArtifactWriteError) as info:
        write_set(tmp_path, "model", NEW)
    monkeypatch.undo()
    message = str(info.value)
    assert str(tmp_path) in message and "Free space there:" in message and "bytes" in message
    assert os.strerror(code) in message and info.value.errno == code
    assert _read(tmp_path) == OLD
    assert visible_files(tmp_path) == ["model/model.json", "model/model.onnx", "model/model.onnx.data"]


def test_a_pointer_name_taken_by_a_real_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "model").write_bytes(b"the user's own file")
    with pytest.raises(FileExistsError, match="not an artifact-set pointer"):
        write_set(tmp_path, "model", OLD)
    assert (tmp_path / "model").read_bytes() == b"the user's own file"
    assert visible_files(tmp_path) == ["model"]


def test_staged_set_is_discarded_without_a_commit_and_names_are_checked(tmp_path: Path) -> None:
    with StagedSet(tmp_path) as staged:
        staged.write_bytes("a.bin", b"x")
        staging = staged.path
    assert not staging.exists() and _read(tmp_path) is None
    with pytest.raises(ValueError, match="not valid"):
        StagedSet(tmp_path).file("../escape")
    staged = StagedSet(tmp_path)
    staged.write_bytes("a.bin", b"x")
    staged.commit("a")
    with pytest.raises(RuntimeError, match="already committed"):
        staged.commit("a")
    with pytest.raises(ValueError, match="not valid"):
        StagedSet(tmp_path).commit(".hidden")


# ----------------------------------------------------------------------------------- the writers that use it


class _FakeRunner(Runner):
    """Runs the model itself: validation passes without onnxruntime, so the test is about the files."""

    runtime = "fake"

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.output_names = ["output"]

    def run(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        return self.model(*inputs)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        return [self.model(*inputs)]


def _fake_onnx(monkeypatch: pytest.MonkeyPatch, model: nn.Module, tag: bytes) -> None:
    def save(self: Any, built: Any, path: Path, specs: Any, options: Any) -> list[Path]:
        data = path.with_name(path.name + ".data")
        data.write_bytes(tag + b" weights")
        path.write_bytes(tag + b" graph")
        return [data, path]

    monkeypatch.setattr(OnnxBackend, "check", lambda self, options: None)
    monkeypatch.setattr(OnnxBackend, "build", lambda self, *args: object())
    monkeypatch.setattr(OnnxBackend, "save", save)
    monkeypatch.setattr(OnnxBackend, "load", lambda self, path, options: _FakeRunner(model))


def test_export_re_run_killed_at_any_step_never_mixes_graph_and_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: an ONNX re-export killed at the wrong moment must not leave new graph beside old weights."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    options = {"backends": ["onnx"], "batch_range": (1, 2, 2), "latency_iterations": 0, "device": "cpu"}
    _fake_onnx(monkeypatch, model, b"old")
    export_model(model, torch.randn(2, 3), dirpath=tmp_path, **options)
    old = _read(tmp_path)
    assert old is not None and old["model.onnx"] == b"old graph" and old["model.onnx.data"] == b"old weights"
    n = 0
    while True:
        with monkeypatch.context() as patch:
            _fake_onnx(patch, model, b"new")
            calls = _fail_after(patch, n, Killed)
            try:
                export_model(model, torch.randn(2, 3), dirpath=tmp_path, **options)
                finished = True
            except Killed:
                finished = False
        seen = _read(tmp_path)
        assert seen is not None
        pair = (seen["model.onnx"], seen["model.onnx.data"])
        assert pair in ((b"old graph", b"old weights"), (b"new graph", b"new weights")), f"step {n}: {pair}"
        assert b'"ok": true' in seen["model.export.json"]
        if finished and calls[0] <= n:
            break
        n += 1
    assert n > 10


def test_export_on_a_full_disk_raises_a_clear_error_and_keeps_the_old_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Linear(3, 2)
    options = {"backends": ["onnx"], "batch_range": (1, 2, 2), "latency_iterations": 0, "device": "cpu"}
    _fake_onnx(monkeypatch, model, b"old")
    export_model(model, torch.randn(2, 3), dirpath=tmp_path, **options)
    old = _read(tmp_path)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ArtifactWriteError, match="Free space there"):
        export_model(model, torch.randn(2, 3), dirpath=tmp_path, **options)
    monkeypatch.undo()
    assert _read(tmp_path) == old


def test_quantized_save_on_a_full_disk_raises_a_clear_error_and_keeps_the_old_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    prepared = qat.prepare(model, qat.make_recipe("torchao", "qat", example_inputs=x[:1]))

    def tiny_program(quantized: nn.Module, example: Any, path: Path) -> Path:
        path.write_bytes(b"program")
        return path

    monkeypatch.setattr(save_module, "write_program", tiny_program)
    report = save_module.export_quantized(prepared, example_inputs=x, dirpath=tmp_path, benchmark=False)
    assert report.ok, report.problems
    old = _read(tmp_path, "model_int8")
    assert old is not None and set(old) == {"model_int8.pt2", "model_int8.json"}

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(artifacts.os, "fsync", full)
        with pytest.raises(ArtifactWriteError, match=r"No space left on device.*Free space there"):
            save_module.export_quantized(prepared, example_inputs=x, dirpath=tmp_path, benchmark=False)
    assert _read(tmp_path, "model_int8") == old
    assert visible_files(tmp_path) == ["model_int8/model_int8.json", "model_int8/model_int8.pt2"]
