"""The compile cache file: what is saved, what is refused and why; torch's save/load replaced by recorders.

One slow test runs the real thing: inductor compiles in one cache folder, a fresh one is filled from the file alone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf import NoEffectWarning
from lightning_perf.functional.compile import compile_regions, fresh_compile_cache
from lightning_perf.functional.compile_cache import (
    CACHE_FILE_NAME,
    compile_cache_key,
    compile_cache_path,
    load_compile_cache,
    save_compile_cache,
)
from tests._compiling import Tower

KEY = compile_cache_key([("layers.0", Tower(1).layers[0])], {"backend": "inductor", "mode": None}, torch.device("cpu"))


@pytest.fixture
def torch_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """torch's save/load replaced: saving returns fixed bytes; loading records what it got."""
    record: dict[str, Any] = {"loaded": []}
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"torch artifacts", object()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: record["loaded"].append(data) or object())
    return record


def test_saved_file_loads_its_artifacts(torch_cache: dict[str, Any], tmp_path: Path) -> None:
    written = save_compile_cache(tmp_path / "run", KEY)  # a new folder path without suffix is a file name
    assert written == tmp_path / "run" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert compile_cache_path(tmp_path) == tmp_path / CACHE_FILE_NAME
    assert load_compile_cache(written, KEY)
    assert torch_cache["loaded"] == [b"torch artifacts"]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


def _alter(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _smuggle(path: Path) -> None:
    """A crafted file that adds a native library beside torch's artifacts, hashes and sizes made to match."""
    magic, header, body = path.read_bytes().split(b"\n", 2)
    meta = json.loads(header)
    extra = b"\x7fELF kernel"
    meta["sections"].append({"name": "kernel", "path": "ab/c.so", "size": len(extra),
                             "sha256": hashlib.sha256(extra).hexdigest()})  # fmt: skip
    path.write_bytes(magic + b"\n" + json.dumps(meta).encode() + b"\n" + body + extra)


@pytest.mark.parametrize(
    ("damage", "key", "why"),
    [
        (lambda p: p.write_bytes(b""), KEY, "not a lightning_perf torch.compile cache file"),
        (_truncate, KEY, r"truncated or padded \(\d+ bytes of data, the header says \d+\)"),
        (_alter, KEY, r"its 'torch' section does not match its SHA-256"),
        (lambda p: p.write_bytes(b"\x80\x04pickle"), KEY, "not a lightning_perf torch.compile cache file"),
        (lambda p: p.write_bytes(p.read_bytes()[:50] + b"{not json\n"), KEY, "its header is damaged"),
        (_smuggle, KEY, r"it holds a 'kernel' section: only torch's own artifacts are loaded"),
        (None, {**KEY, "torch": "1.0"}, r"another setup: torch \(file: '.+', now: '1.0'\)"),
        (None, {**KEY, "options": "other"}, r"options \(file: .+, now: 'other'\)"),
    ],
)
def test_a_bad_or_foreign_file_is_refused(torch_cache: dict[str, Any], tmp_path: Path, damage, key, why) -> None:
    path = save_compile_cache(tmp_path / "cache.bin", KEY)
    assert path is not None
    if damage is not None:
        damage(path)
    with pytest.warns(NoEffectWarning, match=f"cache '.*cache.bin' not used: .*{why}.*from cold"):
        assert not load_compile_cache(path, key)
    assert torch_cache["loaded"] == [] and not (tmp_path / "inductor").exists()


def test_nothing_to_save_or_no_api_warns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    with pytest.warns(NoEffectWarning, match="nothing to save.*no compile artifacts"):
        assert save_compile_cache(tmp_path, KEY) is None
    monkeypatch.delattr(torch.compiler, "load_cache_artifacts")
    with pytest.warns(NoEffectWarning, match="has no torch.compiler.save_cache_artifacts / load_cache_artifacts"):
        assert save_compile_cache(tmp_path, KEY) is None
        assert not load_compile_cache(tmp_path, KEY)
    assert list(tmp_path.iterdir()) == []


def test_key_follows_torch_device_modules_and_options() -> None:
    block = Tower(1).layers[0]
    key = compile_cache_key([("a", block)], {"backend": "inductor"}, torch.device("cpu"))
    assert key == compile_cache_key([("a", Tower(1).layers[0])], {"backend": "inductor"}, torch.device("cpu"))
    assert key["torch"] == torch.__version__ and key["device"].startswith("cpu ")
    assert key["modules"].startswith("1 x Block (")
    wider = compile_cache_key([("a", Tower(1, width=16).layers[0])], {"backend": "inductor"}, torch.device("cpu"))
    assert wider["modules"] != key["modules"]
    assert compile_cache_key([("a", block)], {"backend": len}, torch.device("cpu"))["options"] == "[('backend', 'len')]"


@pytest.mark.slow
def test_a_fresh_inductor_cache_is_filled_from_the_file(tmp_path: Path) -> None:
    """Real inductor: compile cold, save; then in an empty cache folder the same model hits the cache it loaded."""
    from torch._dynamo.utils import counters

    def step() -> None:
        torch.manual_seed(0)
        model = Tower(2)
        compiled = compile_regions(model, "auto")
        model(torch.randn(4, 8)).sum().backward()
        compiled.remove()

    key = compile_cache_key([("layers", nn.Linear(2, 2))], {"backend": "inductor"}, torch.device("cpu"))
    with fresh_compile_cache():
        step()
        path = save_compile_cache(tmp_path, key)
    assert path is not None
    with fresh_compile_cache():
        counters.clear()
        assert load_compile_cache(path, key)
        step()
        assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
        assert counters["aot_autograd"]["autograd_cache_hit"] >= 1
