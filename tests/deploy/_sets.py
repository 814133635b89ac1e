"""Test helper: what a reader finds in a directory of artifact sets."""

from __future__ import annotations

from pathlib import Path

from lightning_perf.deploy.artifacts import committed_set


def visible_files(path: Path) -> list[str]:
    """Plain files by name and each committed set's files as ``<set>/<file>``; staging debris fails the caller."""
    names = []
    for entry in path.iterdir():
        assert not entry.name.startswith(".staging-") and ".link-" not in entry.name, f"debris: {entry.name}"
        if entry.name.startswith("."):
            continue
        found = committed_set(path, entry.name)
        names += [f"{entry.name}/{f.name}" for f in found.iterdir()] if found is not None else [entry.name]
    return sorted(names)
