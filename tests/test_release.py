"""The release: the sdist and the wheel build offline, and the wheel, installed without the source tree, works."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from lightning_perf._imports import OPTIONAL_DEPENDENCIES

ROOT = Path(__file__).resolve().parents[1]

# Each build hook in a fresh interpreter, as a build front-end calls it (setuptools keeps state between builds).
_HOOK = "import sys\nfrom setuptools import build_meta\nprint(getattr(build_meta, sys.argv[1])(sys.argv[2]))"

# Every public name: `lightning_perf.__all__` and the `__all__` of each public subpackage, loaded (lazy ones too).
_IMPORT_ALL = """
import importlib, json, pkgutil
import lightning_perf
loaded = {"lightning_perf": len([getattr(lightning_perf, name) for name in lightning_perf.__all__])}
for info in pkgutil.iter_modules(lightning_perf.__path__):
    if info.ispkg and not info.name.startswith("_"):
        module = importlib.import_module(f"lightning_perf.{info.name}")
        loaded[info.name] = len([getattr(module, name) for name in module.__all__])
print(json.dumps({"file": lightning_perf.__file__, "version": lightning_perf.__version__, "loaded": loaded}))
"""


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def _build(hook: str, source: Path, out: Path) -> Path:
    return out / _run([sys.executable, "-c", _HOOK, hook, str(out)], cwd=source).strip().splitlines()[-1]


def _modules(names: list[str], prefix: str = "") -> set[str]:
    return {n.removeprefix(prefix) for n in names if n.startswith(f"{prefix}lightning_perf/") and n.endswith(".py")}


@pytest.mark.slow
def test_wheel_installed_without_the_source_tree_runs_the_cli_and_exports_every_public_name(tmp_path: Path) -> None:
    # The sdist is built from the files a clean clone would have (with their working-tree content): setuptools also
    # packs what an earlier build's `*.egg-info/SOURCES.txt` lists, which would hide a package left out.
    files = [
        f for f in _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).splitlines() if (ROOT / f).is_file()
    ]
    clone = tmp_path / "clone"
    for name in files:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, clone / name)
    source_modules = _modules(files)
    out = tmp_path / "dist"
    out.mkdir()
    sdist = _build("build_sdist", clone, out)
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
        top = sdist.name.removesuffix(".tar.gz")
        assert {f"{top}/{name}" for name in ("README.md", "LICENSE", "pyproject.toml", "PKG-INFO")} <= set(members)
        assert _modules(members, f"{top}/") == source_modules
        archive.extractall(tmp_path, filter="data")
    # The wheel is built from the unpacked sdist, as `python -m build` does: proof that the sdist is complete.
    wheel = _build("build_wheel", tmp_path / top, out)
    with zipfile.ZipFile(wheel) as archive:
        assert _modules(archive.namelist()) == source_modules
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
        assert f"{info.removesuffix('METADATA')}licenses/LICENSE" in archive.namelist()
    assert "License-Expression: Apache-2.0" in metadata
    # Every extra that an install hint names exists (plus `test` and `all`).
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.MULTILINE))
    assert {extra for _, extra in OPTIONAL_DEPENDENCIES.values()} | {"test", "all"} <= extras

    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check"]
    _run([*pip, "--target", str(site), str(wheel)], cwd=tmp_path)
    # Only the installed copy on the path, from a folder outside the repository: the source tree cannot be imported.
    env = {**os.environ, "PYTHONPATH": str(site)}
    assert "bench" in _run([str(site / "bin" / "lightning-perf"), "--help"], cwd=tmp_path, env=env)
    found = json.loads(_run([sys.executable, "-c", _IMPORT_ALL], cwd=tmp_path, env=env).strip().splitlines()[-1])
    assert Path(found["file"]).is_relative_to(site), found["file"]
    assert wheel.name.startswith(f"lightning_perf-{found['version']}-py3-none-any"), (wheel.name, found["version"])
    public = {p.parent.name for p in (ROOT / "lightning_perf").glob("[!_]*/__init__.py")}
    assert set(found["loaded"]) == {"lightning_perf"} | public
    assert all(count or name == "tuning" for name, count in found["loaded"].items()), found["loaded"]  # tuning: none
    if ".dev" not in found["version"]:
        assert f"## [{found['version']}] - " in (ROOT / "CHANGELOG.md").read_text()
