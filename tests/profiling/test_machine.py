"""The machine and run descriptions: flags parsed from cpuinfo text, graceful without git or /proc."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_perf.profiling import machine
from lightning_perf.profiling.machine import (
    CPU_FLAGS,
    cpu_flags,
    describe_machine,
    finish_run,
    git_state,
    has_cpu_bf16_instructions,
    run_metadata,
)

AVX2_ONLY = "processor : 0\nmodel name : AMD EPYC 7B13\nflags : fpu sse sse2 avx avx2 fma\n"
SAPPHIRE = (
    "model name : Intel Xeon\nflags : avx2 avx512f avx512_vnni avx_vnni avx512_bf16 avx512_fp16 "
    "amx_tile amx_bf16 amx_int8 amx_fp16\n"
)


def test_flags_of_an_avx2_only_cpu() -> None:
    flags = cpu_flags(AVX2_ONLY)
    assert flags is not None and set(flags) == set(CPU_FLAGS)
    assert flags["avx2"] and not flags["avx512f"] and not flags["avx512_bf16"] and not flags["amx_bf16"]
    assert has_cpu_bf16_instructions(flags) is False


def test_flags_of_a_cpu_with_bf16_and_amx() -> None:
    flags = cpu_flags(SAPPHIRE)
    assert flags is not None and all(flags.values())
    assert has_cpu_bf16_instructions(flags) is True
    assert has_cpu_bf16_instructions({"avx512_bf16": False, "amx_bf16": True}) is True


def test_unknown_flags_are_none() -> None:
    assert cpu_flags("processor : 0\n") is None
    assert has_cpu_bf16_instructions(None) is None


def test_no_cpuinfo_is_graceful(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "_read_cpuinfo", lambda path="/proc/cpuinfo": None)
    described = describe_machine()
    assert described["cpu_flags"] is None and described["cpu_bf16_instructions"] is None
    assert described["cpu_count"] >= 1


def test_describe_machine_is_json_and_names_versions() -> None:
    described = describe_machine()
    json.dumps(described)
    assert described["torch_threads"] >= 1 and described["torch"] and described["lightning_perf"]
    assert "gpu" in described and "gpu_driver" in described


def test_git_state_of_a_repository(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    state = git_state(tmp_path)
    assert len(state["git_commit"]) == 40 and state["git_dirty"] is False
    (tmp_path / "a.txt").write_text("2")
    assert git_state(tmp_path)["git_dirty"] is True


def test_no_repository_and_no_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}

    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(machine.subprocess, "run", missing)
    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}


def test_run_metadata_has_command_and_times(tmp_path: Path) -> None:
    run = run_metadata(["lightning-perf", "bench", "--output", "a b.json"], cwd=tmp_path)
    assert run["command"] == "lightning-perf bench --output 'a b.json'"
    assert run["start_time"] and run["end_time"] is None
    assert finish_run(run)["end_time"] >= run["start_time"]
    assert set(run) >= {"git_commit", "git_dirty", "argv", "cwd"}


def test_no_lightning_import() -> None:
    code = "import lightning_perf.profiling.machine as m, sys; m.describe_machine(); print('lightning' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
