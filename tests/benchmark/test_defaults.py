"""The no-argument bench: configurations chosen by the device's capabilities, and what it leaves out says why."""

from __future__ import annotations

import pytest
import torch

from lightning_perf import optimizations
from lightning_perf.benchmark.configs import default_configs, device_capabilities
from lightning_perf.optimizations import Optimization, SlowdownCause

_CPU = {"cpu": True, "cuda": False, "bf16": True, "fp16": False, "fp8": False}
AVX2_CPU = {**_CPU, "fast_bf16": False, "fast_fp32_matmul": False}
BF16_CPU = {**_CPU, "fast_bf16": True, "fast_fp32_matmul": True}
H100 = {
    "cpu": False,
    "cuda": True,
    "bf16": True,
    "fast_bf16": True,
    "fp16": True,
    "fast_fp32_matmul": True,
    "fp8": True,
}
A100 = {**H100, "fp8": False}


def test_an_avx2_only_cpu_gets_no_bf16_and_says_why() -> None:
    chosen, left_out = default_configs(torch.device("cpu"), AVX2_CPU)
    assert chosen[0] == "baseline" and "bf16-mixed" not in chosen and "backend_flags" not in chosen
    assert {"channels_last", "fused_optimizer"} <= set(chosen)
    reasons = dict(left_out)
    assert "no bf16 instructions" in reasons["bf16-mixed"] and "emulated" in reasons["bf16-mixed"]
    assert reasons["compile"].startswith("left out on CPU because a cold compile takes ~30 s per process")
    assert "without the model's structure" in reasons["compile"]
    assert reasons["compile"].endswith("`--configs ...,compile` to include it")
    assert set(chosen) | set(reasons) == {"baseline", *optimizations.names()}


def test_a_cpu_with_bf16_gets_bf16_mixed_and_not_the_backend_flag_it_contains() -> None:
    """On a CPU backend_flags only computes float32 matmuls in bf16: bf16-mixed does that and more, and the flag slows
    the CPU attention kernels the attention swap runs (measured: lm with both, 1.4x slower than the swap alone)."""
    avx512 = {**AVX2_CPU, "bf16": True, "fast_bf16": True, "fast_fp32_matmul": True}
    chosen, left_out = default_configs(torch.device("cpu"), avx512)
    assert "bf16-mixed" in chosen and "backend_flags" not in chosen
    assert "part of what bf16-mixed does" in dict(left_out)["backend_flags"]
    assert "backend_flags" in default_configs(torch.device("cuda"), H100)[0]


def test_every_configuration_left_out_says_why_in_its_own_words() -> None:
    _, left_out = default_configs(torch.device("cpu"), AVX2_CPU)
    for name, why in left_out:
        own = optimizations.get(name).left_out_because
        if why.startswith("left out on CPU"):
            assert own and own in why and f"--configs ...,{name}`" in why, name


def test_fp8_and_compile_regional_are_registered_with_their_gates() -> None:
    fp8 = optimizations.get("fp8")
    assert fp8.trainer_kwargs["precision"] == "bf16-mixed" and fp8.callback_name == "Float8TrainingCallback"
    assert [path for path, _ in fp8.with_callbacks] == ["lightning_perf.callbacks.CompileCallback"]
    assert "bf16 peak" in fp8.mfu_note
    regional = optimizations.get("compile_regional")
    assert dict(regional.callback_kwargs) == {"regions": "auto"} and regional.replaces == "compile"
    # With an H100's capabilities fp8 is in the default set (here it then fails the real device's requirement);
    # with an A100's it is left out by the default set's own rule.
    h100 = dict(default_configs(torch.device("cpu"), H100)[1])
    assert h100["fp8"] == "needs float8 tensor cores (a CUDA device of compute capability 8.9 or later: Ada, Hopper)"
    assert dict(default_configs(torch.device("cpu"), A100)[1])["fp8"].startswith("left out on CPU because float8")
    reasons = dict(default_configs(torch.device("cpu"), AVX2_CPU)[1])
    assert "compute capability 8.9" in reasons["fp8"]


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
        ({"bench_default_on": ("tpu",)}, ValueError, r"bench_default_on=\('tpu',\)\)` is not valid"),
        ({"bench_default_on": "cpu"}, ValueError, r"bench_default_on='cpu'\)` is not valid"),
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
