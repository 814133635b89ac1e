"""The int8 ONNX models that dynamic quantization keeps, so that a later run loads one instead of converting again.

One file per machine (torch and onnxruntime versions included), module structure, code (:func:`code_key`), input
shapes and options (the key :func:`int8_onnx_file` names it by), holding a header line (the key, a hash of the float
weights, the size and SHA-256 of the model) and the model's bytes, written atomically
(:func:`lightning_perf._io.atomic_write_bytes`). A reader checks all of it before use (:func:`read_int8_onnx`): other
weights are a plain miss; a file that is not one of these, was written for another key, or whose bytes do not match
its header is refused with one warning, and the caller converts again. The bytes are a model for onnxruntime, data
that is parsed and never executed as Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
import warnings
from pathlib import Path

import torch
from torch import nn

from lightning_perf._io import atomic_write_bytes
from lightning_perf._warnings import MeasurementWarning

__all__ = ["code_key", "int8_onnx_file", "read_int8_onnx", "weights_key", "write_int8_onnx"]

_ONNX_MAGIC = b"lightning_perf dynamic int8 onnx 1\n"
_ONNX_SUFFIX = ".int8.onnx.bin"


def weights_key(module: nn.Module) -> str:
    """A hash of ``module``'s ``state_dict``: every entry's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, value in module.state_dict().items():
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{name}:{flat.dtype}:{tuple(value.shape)}\n".encode())
            digest.update(flat.view(torch.uint8).numpy().data)
        else:
            digest.update(f"{name}:{value!r}\n".encode())
    return digest.hexdigest()[:32]


def code_key(module: nn.Module) -> str:
    """A hash of the code that runs ``module``: for each class in its tree, the bytecode, names and constants of every
    function its classes up to ``nn.Module`` define (``forward`` and what it calls on ``self``), not their line numbers.
    Two processes with the same class names, modules and weights but another ``forward`` get other keys."""
    classes = {k for m in module.modules() for k in type(m).__mro__[: type(m).__mro__.index(nn.Module)]}
    digest = hashlib.sha256()
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        for name, value in sorted(vars(cls).items()):
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if code is not None:
                digest.update(f"{cls.__module__}.{cls.__qualname__}.{name}:{_code_text(code)}\n".encode())
    return digest.hexdigest()[:24]


def _code_text(code: types.CodeType) -> str:
    # Nested functions' code objects are read the same way (their repr holds an address); a frozenset's repr follows
    # the per-process string hash, so its items are sorted.
    consts = [
        _code_text(c) if isinstance(c, types.CodeType) else repr(sorted(map(repr, c)) if type(c) is frozenset else c)
        for c in code.co_consts
    ]
    return f"{code.co_code.hex()}|{code.co_names}|{code.co_varnames}|{code.co_freevars}|{consts}"


def int8_onnx_file(cache_dir: str | os.PathLike[str], key: dict[str, str]) -> Path:
    """The file in ``cache_dir`` that keeps the int8 ONNX model for ``key`` (one per machine, model and options: new
    weights replace the old ones)."""
    named = json.dumps({k: v for k, v in sorted(key.items()) if k != "weights"}).encode()
    return Path(cache_dir) / f"{hashlib.sha256(named).hexdigest()[:24]}{_ONNX_SUFFIX}"


def read_int8_onnx(file: Path, key: dict[str, str]) -> bytes | None:
    """The int8 ONNX bytes kept at ``file`` for ``key``, or ``None``: no file, or one for other weights (a miss, said
    nowhere). A file that cannot be read, is not one this cache writes, was written for another machine, model or
    options, or whose bytes do not match the size and hash in its header is refused with one ``MeasurementWarning``
    (the caller converts again and replaces it). The bytes are a model for onnxruntime, data: nothing is executed."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem: str | None = f"it cannot be read ({exc})"
    else:
        problem, payload = _int8_onnx_problem(data, key)
        if problem is None:
            return payload
    if problem:
        warnings.warn(
            f"The dynamic int8 ONNX cache {str(file)!r} is refused: {problem}; converting again.",
            MeasurementWarning,
            stacklevel=4,
        )
    return None


def _int8_onnx_problem(data: bytes, key: dict[str, str]) -> tuple[str | None, bytes]:
    """What is wrong with a cache file's ``data`` for ``key`` (``""``: other weights) and, when nothing, its payload."""
    end = data.find(b"\n", len(_ONNX_MAGIC), len(_ONNX_MAGIC) + 65536) if data.startswith(_ONNX_MAGIC) else -1
    try:
        header = json.loads(data[len(_ONNX_MAGIC) : end]) if end > 0 else None
    except ValueError:
        header = None
    found = header.get("key") if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(found, dict):
        return "it is not a file this cache writes (no valid header)", b""
    other = [name for name in key if name != "weights" and found.get(name) != key[name]]
    if other:
        return f"it was written for another {', '.join(other)} ({found.get(other[0])!r})", b""
    if found.get("weights") != key["weights"]:
        return "", b""
    payload = data[end + 1 :]
    if header.get("bytes") != len(payload):
        return f"it holds {len(payload)} bytes, its header says {header.get('bytes')!r} (truncated or altered)", b""
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        return "its bytes do not match the hash in its header (altered)", b""
    return None, payload


def write_int8_onnx(file: Path, key: dict[str, str], payload: bytes) -> None:
    """Keep ``payload`` at ``file`` for ``key`` with its size and hash, atomically; a failure to write warns."""
    header = {"key": key, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    try:
        atomic_write_bytes(file, _ONNX_MAGIC + json.dumps(header).encode() + b"\n" + payload)
    except OSError as exc:
        warnings.warn(f"Could not write the dynamic int8 ONNX cache {str(file)!r}: {exc}.", MeasurementWarning,
                      stacklevel=4)  # fmt: skip
