"""The no-argument bench: configurations chosen by the device's capabilities, and what it leaves out says why."""

from __future__ import annotations

import pytest
import torch

from lightning_perf import optimizations
from lightning_perf.benchmark.configs import default_configs, device_capabilities
from lightning_perf.optimizations import Optimization, SlowdownCause

AVX2_CPU = {"cpu": True, "cuda": False, "bf16": True, "fast_bf16": False, "fp16": False, "fast_fp32_matmul": False}
BF16_CPU = {"cpu": True, "cuda": False, "bf16": True, "fast_bf16": True, "fp16": False, "fast_fp32_matmul": True}


def test_an_avx2_only_cpu_gets_no_bf16_and_says_why() -> None:
    chosen, left_out = default_configs(torch.device("cpu"), AVX2_CPU)
    assert chosen[0] == "baseline" and "bf16-mixed" not in chosen and "backend_flags" not in chosen
    assert {"channels_last", "fused_optimizer"} <= set(chosen)
    reasons = dict(left_out)
    assert "no bf16 instructions" in reasons["bf16-mixed"] and "emulated" in reasons["bf16-mixed"]
    assert "CUDA" in reasons["compile"] and "--configs" in reasons["compile"]
    assert set(chosen) | set(reasons) == {"baseline", *optimizations.names()}


def test_a_cpu_with_bf16_instructions_gets_bf16() -> None:
    chosen, _ = default_configs(torch.device("cpu"), BF16_CPU)
    assert "bf16-mixed" in chosen


def test_capabilities_of_this_machine_follow_its_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_perf.profiling import machine

    monkeypatch.setattr(machine, "_read_cpuinfo", lambda path="/proc/cpuinfo": "flags : avx2 fma\n")
    assert device_capabilities(torch.device("cpu")) == AVX2_CPU
    monkeypatch.setattr(machine, "_read_cpuinfo", lambda path="/proc/cpuinfo": "flags : avx2 avx512f amx_bf16\n")
    assert device_capabilities(torch.device("cpu")) == BF16_CPU


def test_every_builtin_slowdown_cause_is_well_formed() -> None:
    bf16 = optimizations.get("bf16-mixed")
    assert bf16.bench_default_on == ("fast_bf16",)
    assert [c.when for c in bf16.slowdown_causes] == [{"bf16_emulated": True}]
    assert optimizations.get("compile").slowdown_causes[0].when == {"warmup_not_amortized": True}
    assert "layout conversion" in optimizations.get("channels_last").slowdown_causes[0].text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bench_default_on": ("tpu",)}, ValueError, r"bench_default_on=\('tpu',\) is not valid"),
        ({"bench_default_on": "cpu"}, ValueError, r"bench_default_on='cpu' is not valid"),
        ({"slowdown_causes": SlowdownCause("always", "x")}, TypeError, "Expected a tuple of SlowdownCause"),
        ({"slowdown_causes": ("slow",)}, TypeError, "Expected a tuple of SlowdownCause"),
    ],
)
def test_bad_new_fields_are_refused(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Optimization("x", "desc", **kwargs)


@pytest.mark.parametrize(
    ("when", "text", "match"),
    [("sometimes", "x", r"when='sometimes'"), ("always", " ", r"text=' '"), ("always", None, "text=None")],
)
def test_bad_slowdown_cause_is_refused(when: str, text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SlowdownCause(when, text)
