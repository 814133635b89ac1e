"""Atomic writes: the final name holds either the old file or the complete new one, never a partial one. Safe
checkpoint reads: a file that is not a checkpoint says what is wrong with it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_perf._io import (
    DecisionCache,
    NotACheckpointError,
    UnsafeCheckpointError,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    checkpoint_problem,
    load_checkpoint,
)
from lightning_perf._warnings import MeasurementWarning


def test_write_text_creates_parents_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "report.md"
    assert atomic_write_text(target, "héllo\nworld\n") == target
    assert target.read_bytes() == "héllo\nworld\n".encode()
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.md"]


def test_write_bytes_replaces_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "blob.bin"
    target.write_bytes(b"old")
    atomic_write_bytes(target, b"\x00new\xff")
    assert target.read_bytes() == b"\x00new\xff"
    assert list(tmp_path.iterdir()) == [target]


def test_the_final_name_appears_only_on_success(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent
        assert tmp.name.startswith(".model.pt.tmp-")
        tmp.write_text("half")
        assert not target.exists()
        tmp.write_text("complete")
    assert target.read_text() == "complete"
    assert not tmp.exists()


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path, error: BaseException) -> None:
    target = tmp_path / "report.json"
    target.write_text("old and complete")
    with pytest.raises(type(error)), atomic_path(target) as tmp:
        tmp.write_text("partial")
        raise error
    assert target.read_text() == "old and complete"
    assert list(tmp_path.iterdir()) == [target]


def test_a_body_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    target = tmp_path / "nothing.txt"
    with pytest.raises(FileNotFoundError, match="Nothing was written"), atomic_path(target):
        pass
    assert list(tmp_path.iterdir()) == []


def test_temporary_names_differ(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "x") as first, atomic_path(tmp_path / "x") as second:
        first.write_text("1")
        second.write_text("2")
    assert first != second
    assert (tmp_path / "x").read_text() == "1"  # the outer one finished last


# ------------------------------------------------------------------------------------ files that are not checkpoints


def _checkpoint_bytes(tmp_path: Path) -> bytes:
    import torch

    path = tmp_path / "real.ckpt"
    torch.save({"state_dict": {"w": torch.arange(64.0)}}, path)
    return path.read_bytes()


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda real: b"", "the file is empty"),
        (lambda real: b"epoch=3 step=120\nnot a checkpoint\n", "a text file (it starts with 'epoch=3 step=120')"),
        (lambda real: real[: len(real) // 2], "truncated or corrupt zip archive"),
        (lambda real: bytes([0x13, 0x37]) + bytes(range(256)) * 8, "it starts with the bytes 13 37 00 01"),
        (lambda real: b"\x80\x02" + bytes(range(7, 256)), "truncated or corrupt"),  # a pickle header, then garbage
    ],
    ids=["empty", "text", "truncated-zip", "random-bytes", "corrupt-pickle"],
)
def test_a_file_that_is_not_a_checkpoint_says_what_is_wrong(
    tmp_path: Path, make: Callable[[bytes], bytes], problem: str
) -> None:
    path = tmp_path / "model.ckpt"
    path.write_bytes(make(_checkpoint_bytes(tmp_path)))
    with pytest.raises(NotACheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert f"the file {str(path)!r} is not a PyTorch checkpoint: " in message and problem in message, message
    assert "add_safe_globals" not in message  # no advice to lower a security guard for a corrupt file
    assert not isinstance(info.value, UnsafeCheckpointError)


def test_a_zip_that_torch_did_not_write_is_not_a_checkpoint(tmp_path: Path) -> None:
    import zipfile

    path = tmp_path / "notes.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "hello")
    assert checkpoint_problem(path) == (
        "a zip archive without the data.pkl that torch.save writes (it holds notes/readme.txt)"
    )


def test_real_checkpoints_load_and_only_a_disallowed_global_gets_the_add_safe_globals_advice(tmp_path: Path) -> None:
    import torch

    modern, legacy, unsafe = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, modern)
    torch.save({"state_dict": {"w": torch.ones(2)}}, legacy, _use_new_zipfile_serialization=False)
    torch.save({"state_dict": {}, "hyper_parameters": _Opaque()}, unsafe)
    for path in (modern, legacy):
        assert checkpoint_problem(path) is None
        assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(2))
    assert checkpoint_problem(unsafe) is None
    with pytest.raises(UnsafeCheckpointError, match=r"holds tests.test_io._Opaque.*add_safe_globals\(\[_Opaque\]\)"):
        load_checkpoint(unsafe)


class _Opaque:
    """A class torch's weights-only unpickler does not allow."""


def test_a_decision_cache_merges_what_another_process_stored_and_ignores_a_corrupt_file(tmp_path: Path) -> None:
    cache, path = DecisionCache("d.json", "test cache"), tmp_path / "d.json"
    assert cache.path() == cache.path(None) != path and cache.path(path) == path
    assert cache.entry(path, "m") == {}  # no file: empty, silently
    cache.store(path, "m", {"a": 1})
    other = DecisionCache("d.json", "test cache")  # another process, between this one's read and its store
    other.store(path, "m", {"b": 2})
    other.store(path, "n", {"c": 3})
    cache.store(path, "m", {"a": 4})
    assert cache.entry(path, "m") == {"a": 4, "b": 2} and cache.entry(path, "n") == {"c": 3}
    path.write_text("{not json")
    with pytest.warns(MeasurementWarning, match="test cache .* is not valid or readable"):
        assert cache.entry(path, "m") == {}
    cache.store(path, "m", {"a": 5})  # rewritten: the stored decision counts again
    assert cache.entry(path, "m") == {"a": 5}
