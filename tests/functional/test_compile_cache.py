"""The compile cache file: what is saved, what is refused and why; torch's save/load replaced by recorders.

One slow test runs the real thing: inductor compiles in one cache folder, a fresh one is filled from the file alone.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf import NoEffectWarning
from lightning_perf.functional.compile.cache import (
    CACHE_FILE_NAME,
    KEY_FILE_NAME,
    compile_cache_key,
    compile_cache_path,
    load_compile_cache,
    save_compile_cache,
    signing_key,
    use_inductor_cache_dir,
)
from lightning_perf.functional.compile.regions import compile_regions
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
    magic, signature, header, body = path.read_bytes().split(b"\n", 3)
    meta = json.loads(header)
    extra = b"\x7fELF kernel"
    meta["sections"].append({"name": "kernel", "path": "ab/c.so", "size": len(extra),
                             "sha256": hashlib.sha256(extra).hexdigest()})  # fmt: skip
    path.write_bytes(magic + b"\n" + signature + b"\n" + json.dumps(meta).encode() + b"\n" + body + extra)


UNSIGNED = "it is not signed with your key.*trust that file as code.*trust_cache=True"


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize(
    ("damage", "key", "why", "why_trusted"),
    [
        (lambda p: p.write_bytes(b""), KEY, "not a lightning_perf torch.compile cache file", None),
        (_truncate, KEY, UNSIGNED, r"truncated or padded \(\d+ bytes of data, the header says \d+\)"),
        (_alter, KEY, UNSIGNED, r"its 'torch' section does not match its SHA-256"),
        (lambda p: p.write_bytes(b"\x80\x04pickle"), KEY, "not a lightning_perf torch.compile cache file", None),
        (lambda p: p.write_bytes(p.read_bytes()[:50] + b"{not json\n"), KEY, UNSIGNED, "its header is damaged"),
        (_smuggle, KEY, UNSIGNED, r"it holds a 'kernel' section: only torch's own artifacts are loaded"),
        (None, {**KEY, "torch": "1.0"}, r"another setup: torch \(file: '.+', now: '1.0'\)", None),
        (None, {**KEY, "options": "other"}, r"options \(file: .+, now: 'other'\)", None),
    ],
)
def test_a_bad_or_foreign_file_is_refused(
    torch_cache: dict[str, Any], tmp_path: Path, damage, key, why, why_trusted, trusted: bool
) -> None:
    """Signed with your key or named as trusted, and then intact and of this setup; the signature is checked first."""
    path = save_compile_cache(tmp_path / "cache.bin", KEY)
    assert path is not None
    if damage is not None:
        damage(path)
    why = (why_trusted or why) if trusted else why
    with pytest.warns(NoEffectWarning, match=f"cache '.*cache.bin' not used: .*{why}.*from cold"):
        assert not load_compile_cache(path, key, trusted=trusted)
    assert torch_cache["loaded"] == [] and not (tmp_path / "inductor").exists()


class _Marker:
    """Unpickled, it writes a file: what a crafted compile cache could do when torch unpickles its artifacts."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (self.path,))


def _unsigned(path: Path, artifacts: bytes) -> None:
    """A cache file in the format written before signing (no HMAC line)."""
    meta = {"name": "torch", "size": len(artifacts), "sha256": hashlib.sha256(artifacts).hexdigest()}
    header = json.dumps({"key": KEY, "sections": [meta]}).encode()
    path.write_bytes(b"lightning_perf torch.compile cache v1\n" + header + b"\n" + artifacts)


def _tampered(path: Path, artifacts: bytes) -> None:
    """A file of yours with its artifacts replaced, sizes and hashes rewritten to match (the HMAC cannot be)."""
    save_compile_cache(path, KEY)
    magic, signature, header, _ = path.read_bytes().split(b"\n", 3)
    meta = json.loads(header)
    meta["sections"][0].update(size=len(artifacts), sha256=hashlib.sha256(artifacts).hexdigest())
    path.write_bytes(magic + b"\n" + signature + b"\n" + json.dumps(meta).encode() + b"\n" + artifacts)


def _foreign(path: Path, artifacts: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file another user wrote, signed with their own key."""
    with monkeypatch.context() as other_user:
        other_user.setenv("LIGHTNING_PERF_CACHE", str(path.parent / "other-user"))
        other_user.setattr(torch.compiler, "save_cache_artifacts", lambda: (artifacts, object()))
        save_compile_cache(path, KEY)


@pytest.mark.parametrize("craft", [_unsigned, _tampered, _foreign])
def test_a_crafted_file_is_refused_before_anything_is_unpickled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, craft: Any
) -> None:
    marker, path = tmp_path / "ran", tmp_path / "cache.bin"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"torch artifacts", object()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: [pickle.loads(data)])  # as torch does
    artifacts = pickle.dumps(_Marker(marker))
    craft(*(path, artifacts, monkeypatch)[: craft.__code__.co_argcount])
    with pytest.warns(NoEffectWarning, match=f"not used: {UNSIGNED}"):
        assert not load_compile_cache(path, KEY)
    assert not marker.exists()
    if craft is not _tampered:  # named as trusted, it loads: that runs its code (the test can fail)
        assert load_compile_cache(path, KEY, trusted=True)
        assert marker.exists()


def test_the_signing_key_is_made_once_private_in_the_users_cache_folder(
    torch_cache: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LIGHTNING_PERF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    key_file = tmp_path / "xdg" / "lightning_perf" / KEY_FILE_NAME
    path = save_compile_cache(tmp_path / "cache.bin", KEY)
    assert path is not None and key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_bytes()) == 32
    assert signing_key() == key_file.read_bytes() and key_file.read_bytes() not in path.read_bytes()
    assert load_compile_cache(path, KEY)
    key_file.chmod(0o644)  # others could read it and sign what they like
    with pytest.warns(NoEffectWarning, match=r"signing key '.*' is not private to you \(owner \d+, mode 0o644\)"):
        assert not load_compile_cache(path, KEY)
    assert torch_cache["loaded"] == [b"torch artifacts"]


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
def test_a_fresh_inductor_cache_is_filled_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real inductor: compile cold, save; then in an empty cache folder the same model hits the cache it loaded."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import clear_caches

    def cold(folder: str) -> None:  # as a new process on a new machine: no cache in memory, an empty one on disk
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / folder))
        torch._dynamo.reset()
        clear_caches()

    def step() -> None:
        torch.manual_seed(0)
        model = Tower(2)
        compiled = compile_regions(model, "auto")
        model(torch.randn(4, 8)).sum().backward()
        compiled.remove()

    key = compile_cache_key([("layers", nn.Linear(2, 2))], {"backend": "inductor"}, torch.device("cpu"))
    cold("first")
    step()
    path = save_compile_cache(tmp_path, key)
    assert path is not None
    cold("second")
    counters.clear()
    assert load_compile_cache(path, key)
    step()
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
    assert counters["aot_autograd"]["autograd_cache_hit"] >= 1
    cold("after")


def _inductor_folder_problem(folder: Path) -> str | None:
    """The warning ``use_inductor_cache_dir`` gives for ``folder`` (``None``: used)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with use_inductor_cache_dir(folder) as used:
            pass
    assert used is (not caught)
    return str(caught[0].message) if caught else None


def test_an_inductor_cache_folder_with_anything_others_can_write_or_own_is_not_used(tmp_path: Path) -> None:
    import os

    shared = tmp_path / "shared"
    folder = shared / "run" / "inductor"
    assert _inductor_folder_problem(folder) is None  # made, private
    (folder / "ab").mkdir()
    (folder / "ab" / "kernel.so").write_bytes(b"")
    assert _inductor_folder_problem(folder) is None
    (folder / "ab" / "kernel.so").chmod(0o666)  # another user could swap the native code torch loads
    problem = _inductor_folder_problem(folder)
    assert "its entry 'ab/kernel.so' is writable by group or others (mode 0o666)" in str(problem)
    (folder / "ab" / "kernel.so").chmod(0o644)
    shared.chmod(0o777)  # a parent anyone can write: the whole folder could be moved aside and replaced
    assert f"its parent '{shared}' is owned by user id" in str(_inductor_folder_problem(folder))
    shared.chmod(0o1777)  # sticky, as /tmp: others cannot move what is yours
    assert _inductor_folder_problem(folder) is None
    if os.getuid() == 0:  # only root can give a file away
        os.chown(folder / "ab", 4242, -1)
        assert "its entry 'ab' is owned by user id 4242" in str(_inductor_folder_problem(folder))
