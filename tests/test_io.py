"""Atomic writes: the final name holds either the old file or the complete new one, never a partial one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_perf._io import atomic_path, atomic_write_bytes, atomic_write_text


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
