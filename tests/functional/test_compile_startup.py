"""A quicker cold start for regional compile on a CPU: ``cpp_wrapper`` for regions, the ISA probe ahead of time."""

from __future__ import annotations

import glob
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._inductor.utils import clear_caches

from lightning_perf.functional.compile import startup as compile_startup
from lightning_perf.functional.compile.regions import compile_options, compile_regions
from lightning_perf.functional.compile.startup import (
    CPU_REGIONAL_OPTIONS,
    cpu_startup,
    on_cpu,
    startup_options,
    warm_cpu_probe,
)
from tests._compiling import Tower


@pytest.fixture(autouse=True)
def _no_real_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe thread is real only in the slow test; elsewhere it is counted."""
    monkeypatch.setattr(compile_startup, "_probe_started", True)


def _kwargs(**given: Any) -> dict[str, Any]:
    return compile_options(**given)


def test_regional_inductor_on_cpu_gets_cpp_wrapper() -> None:
    kwargs = cpu_startup(_kwargs(), regional=True, cpu=True)
    assert kwargs["options"] == CPU_REGIONAL_OPTIONS == {"cpp_wrapper": True}
    assert kwargs["options"] is not CPU_REGIONAL_OPTIONS  # torch.compile pops keys from it
    assert {k: v for k, v in kwargs.items() if k != "options"} == {k: v for k, v in _kwargs().items() if k != "options"}


@pytest.mark.parametrize(
    ("given", "regional", "cpu"),
    [
        ({}, False, True),  # a whole model: one file holding every block compiles slower
        ({}, True, False),  # CUDA and other devices: leave inductor's defaults
        ({"options": {"max_autotune": False}}, True, True),  # the user's options win
        ({"options": {"cpp_wrapper": False}}, True, True),  # the way to opt out
        ({"mode": "max-autotune-no-cudagraphs"}, True, True),  # a mode sets its own options
        ({"backend": "eager"}, True, True),
        ({"backend": "aot_eager"}, True, True),
    ],
)
def test_anything_else_is_left_as_given(given: dict[str, Any], regional: bool, cpu: bool) -> None:
    assert cpu_startup(_kwargs(**given), regional=regional, cpu=cpu) == _kwargs(**given)


def test_regional_means_the_model_itself_is_not_compiled() -> None:
    model = Tower(depth=2)
    blocks = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    assert startup_options(model, blocks, _kwargs())["options"] == {"cpp_wrapper": True}
    assert startup_options(model, [("", model)], _kwargs())["options"] is None
    assert startup_options(model, [], _kwargs())["options"] is None
    assert on_cpu([model]) and not on_cpu([])
    assert not on_cpu([Tower(depth=1).to("meta")])


def test_compile_regions_passes_the_startup_options_to_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = Tower(depth=3)
    compile_regions(model, "auto").remove()
    assert [kwargs["options"] for kwargs in seen] == [{"cpp_wrapper": True}] * 3
    seen.clear()
    compile_regions(model).remove()
    assert seen[0]["options"] is None
    seen.clear()
    compile_regions(model, "auto", options={"cpp_wrapper": False}).remove()
    assert [kwargs["options"] for kwargs in seen] == [{"cpp_wrapper": False}] * 3


def test_the_probe_starts_once_per_process_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    called = threading.Event()
    threads: list[str] = []

    def fake_pick() -> None:
        threads.append(threading.current_thread().name)
        called.set()

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", fake_pick)
    monkeypatch.setattr(compile_startup, "_probe_started", False)
    assert warm_cpu_probe() is True
    assert called.wait(10)
    assert warm_cpu_probe() is False
    assert threads == ["inductor-cpu-isa-probe"]


def test_a_failing_probe_is_left_to_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler")

    compile_startup._probe(broken)  # swallowed: inductor runs the probe again and reports it


def test_the_isas_are_checked_side_by_side_then_torch_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_startup, "usable_cpu_count", lambda: 2)
    both_running = threading.Barrier(2, timeout=10)  # broken (and the checks unrecorded) if they ran one after another
    checked: list[str] = []
    picked: list[list[str]] = []

    class FakeISA:
        def __init__(self, name: str) -> None:
            self.name = name

        def __bool__(self) -> bool:
            both_running.wait()
            checked.append(self.name)
            return True

    compile_startup._probe(lambda: picked.append(sorted(checked)), [FakeISA("avx512"), FakeISA("avx2")])
    assert picked == [["avx2", "avx512"]]  # the pick comes after both checks


def test_one_core_leaves_the_checks_to_torchs_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_startup, "usable_cpu_count", lambda: 1)

    class Untouchable:
        def __bool__(self) -> bool:
            raise AssertionError("checked outside torch's pick")

    picked: list[bool] = []
    compile_startup._probe(lambda: picked.append(True), [Untouchable(), Untouchable()])
    assert picked == [True]


def test_the_candidates_are_the_isas_whose_flags_the_cpu_reports() -> None:
    class Module:
        supported_vec_isa_list = ["avx512 avx512_vnni amx_tile", "avx512 avx512_vnni", "avx512", "avx2", "asimd"]

        @staticmethod
        def x86_isa_checker() -> list[str]:
            return ["avx2", "avx512"]

    assert compile_startup._isa_candidates(Module) == ["avx512", "avx2"]


# ------------------------------------------------------------------------------------------------ real compilers


@pytest.mark.slow
def test_regional_cpu_compile_builds_one_library_per_graph_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Inductor cold, for real: the blocks' forward and backward are one C++ build each, and nothing changes."""
    monkeypatch.setattr(compile_startup, "_probe_started", False)
    torch.manual_seed(0)
    model, x = Tower(depth=3, width=16), torch.randn(4, 16)
    model(x).sum().backward()
    expected = model(x), [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    folder = str(tmp_path / "inductor")  # cold: a new on-disk cache, torch's in-memory caches cleared
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", folder)
    torch._dynamo.reset()
    clear_caches()
    compiled = compile_regions(model, "auto", strict=True)
    out = model(x)
    out.sum().backward()
    libraries = glob.glob(os.path.join(folder, "**", "*.so"), recursive=True)
    compiled.remove()
    torch._dynamo.reset()
    clear_caches()
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close([p.grad for p in model.parameters()], expected[1])
    # forward and backward of the block (and the ISA probe's library): not one library per fused kernel
    assert 2 <= len(libraries) <= 3, libraries
