"""Backend flags as a snapshot: capture, apply, exact restore, and which settings matter on which device."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.functional import backend_flags as bf
from lightning_perf.functional.backend_flags import BackendFlags, apply, backend_flags, capture, restore

# Every setting away from torch's default.
NON_DEFAULT = BackendFlags(
    cudnn_benchmark=True, cudnn_tf32=False, float32_matmul_precision="medium", sdpa_backends=frozenset({"math"})
)


def test_apply_sets_and_restore_puts_back_exactly() -> None:
    before = capture()
    assert before.fp32_precision is not None  # torch 2.13 has the per-backend table: it is part of the snapshot
    previous = apply(NON_DEFAULT)
    assert previous == before
    during = capture()
    assert during.cudnn_benchmark is True and during.cudnn_tf32 is False
    assert during.float32_matmul_precision == "medium" and during.matmul_tf32 is True
    assert during.sdpa_backends == {"math"}
    assert torch.backends.cuda.flash_sdp_enabled() is False and torch.backends.cuda.math_sdp_enabled() is True
    # "medium" is what lets oneDNN use bf16 arithmetic for float32 matmuls on a CPU.
    assert torch._C._get_fp32_precision_getter("mkldnn", "matmul") == "bf16"
    restore(previous)
    assert capture() == before


def test_none_leaves_a_setting_alone() -> None:
    with backend_flags(BackendFlags(cudnn_benchmark=True)) as previous:
        after = capture()
        assert after.cudnn_benchmark is True
        assert after.float32_matmul_precision == previous.float32_matmul_precision
        assert after.sdpa_backends == previous.sdpa_backends
    assert capture() == previous


def test_context_restores_after_an_exception() -> None:
    before = capture()
    with pytest.raises(RuntimeError, match="boom"), backend_flags(NON_DEFAULT):
        raise RuntimeError("boom")
    assert capture() == before


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_keeps_torchs_two_apis_in_agreement(tf32: bool) -> None:
    """Setting only the legacy matmul switch after "medium" leaves torch's tables contradicting each other, and torch
    then raises on every read of the precision; apply goes through the precision setter instead."""
    before = capture()
    try:
        torch.set_float32_matmul_precision("medium")
        with backend_flags(BackendFlags(matmul_tf32=tf32, cudnn_tf32=tf32)):
            during = capture()
            assert None not in (during.matmul_tf32, during.cudnn_tf32, during.float32_matmul_precision)
            assert during.matmul_tf32 is tf32 and during.cudnn_tf32 is tf32
            assert torch.get_float32_matmul_precision() == ("medium" if tf32 else "highest")
    finally:
        restore(before)
    assert capture() == before


def test_restore_is_exact_from_states_set_through_the_new_api() -> None:
    before = capture()
    try:
        torch.backends.cudnn.conv.fp32_precision = "ieee"  # type: ignore[attr-defined]
        torch.backends.mkldnn.conv.fp32_precision = "bf16"  # type: ignore[attr-defined]
        start = capture()
        previous = apply(BackendFlags(cudnn_tf32=True, matmul_tf32=True, float32_matmul_precision="high"))
        assert previous == start
        restore(previous)
        assert capture() == start
    finally:
        restore(before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"float32_matmul_precision": "low"}, r"float32_matmul_precision='low'.*Expected one of None, 'highest'"),
        ({"sdpa_backends": ["flash", "fast"]}, r"sdpa_backends=\['flash', 'fast'\].*'fast'.*Expected a non-empty list"),
        ({"sdpa_backends": []}, r"sdpa_backends=\[\]"),
        ({"matmul_tf32": True, "float32_matmul_precision": "highest"}, "contradict each other"),
        ({"matmul_tf32": False, "float32_matmul_precision": "medium"}, "contradict each other"),
    ],
)
def test_invalid_flags(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BackendFlags(**kwargs)  # type: ignore[arg-type]


def test_a_string_of_backends_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"sdpa_backends='flash'.*Expected a non-empty list"):
        BackendFlags(sdpa_backends="flash")  # type: ignore[arg-type]


CPU = torch.device("cpu")


def test_what_has_no_effect_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: True)
    reasons = bf.no_effect_reasons(
        BackendFlags(cudnn_benchmark=True, matmul_tf32=True, cudnn_tf32=True, sdpa_backends=frozenset({"efficient"})),
        CPU,
    )
    assert set(reasons) == {"cudnn_benchmark", "tf32", "sdpa_backends"}
    assert "no TF32 units" in reasons["tf32"] and "only concerns CUDA" in reasons["cudnn_benchmark"]
    assert "flash, math" in reasons["sdpa_backends"]
    # CPUs run flash and math SDPA kernels, and "medium" reaches oneDNN's bf16 matmuls on CPUs that have them.
    assert not bf.no_effect_reasons(BackendFlags(sdpa_backends=frozenset({"flash", "efficient"})), CPU)
    assert not bf.no_effect_reasons(BackendFlags(float32_matmul_precision="medium"), CPU)
    assert not bf.no_effect_reasons(BackendFlags(float32_matmul_precision="highest"), CPU)
    assert (
        "TF32" in bf.no_effect_reasons(BackendFlags(float32_matmul_precision="high"), CPU)["float32_matmul_precision"]
    )
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: False)
    reasons = bf.no_effect_reasons(BackendFlags(float32_matmul_precision="medium"), CPU)
    assert "no bf16 matmul support" in reasons["float32_matmul_precision"]


def test_fastest_flags_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: True)
    assert bf.fastest_flags(CPU) == BackendFlags(float32_matmul_precision="medium")
    monkeypatch.setattr(bf, "has_fast_cpu_bf16", lambda: False)
    assert bf.fastest_flags(CPU).requested() == {}
    monkeypatch.setattr(bf, "supports_tf32", lambda device: True)
    assert bf.fastest_flags(torch.device("cuda")) == BackendFlags(
        cudnn_benchmark=True, matmul_tf32=True, cudnn_tf32=True
    )
    monkeypatch.setattr(bf, "supports_tf32", lambda device: False)
    assert bf.fastest_flags(torch.device("cuda")) == BackendFlags(cudnn_benchmark=True)


def test_sdpa_backends_select_the_cpu_kernel() -> None:
    """On CPU the `flash` switch is real: with it off, SDPA falls back to the math kernel (same result)."""
    q = torch.randn(1, 2, 16, 8)

    def kernels() -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return {e.key for e in prof.key_averages() if "attention" in e.key}

    assert any("flash" in k for k in kernels())
    with backend_flags(BackendFlags(sdpa_backends=frozenset({"math"}))):
        assert not any("flash" in k for k in kernels())
