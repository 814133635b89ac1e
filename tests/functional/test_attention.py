"""Attention swap: same results as the original modules, same state_dict, a reason for every decision."""

from __future__ import annotations

import copy
import pickle
import sys
import types
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_perf import FallbackWarning
from lightning_perf.functional.attention import detect as detect_mod
from lightning_perf.functional.attention import kernels as kernels_mod
from lightning_perf.functional.attention.parity import DROPOUT_STREAM_NOTE
from lightning_perf.functional.attention.swap import (
    FLASH_ATTN,
    SDPA,
    UNCHANGED,
    AttentionAdapter,
    AttentionNotSwappable,
    FusedMultiheadAttention,
    FusedQKVAttention,
    FusedQKVSpec,
    SwappedAttention,
    attention,
    check_parity,
    choose_kernel,
    register_attention_adapter,
    restore_attention,
    swap_attention,
)
from tests._models import NanoGPTAttention, PerHeadQKVAttention, ScaledDifferentlyAttention, TinyGPT, encoder


def grads(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
    module.zero_grad(set_to_none=True)
    out = module(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    # A fixed random projection: a sum of squares is flat after a LayerNorm and would leave only rounding noise.
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device)
    (out.float() * direction).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_close(actual: Tensor, expected: Tensor, tol: float, what: str) -> None:
    """Largest difference within ``tol`` of the largest magnitude of ``expected`` (bf16 needs a relative bound)."""
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= tol * max(scale, 1e-6), f"{what}: max difference {error:.3g}, max magnitude {scale:.3g}"


def assert_same(original: nn.Module, swapped: nn.Module, *args: Any, tol: float = 1e-5, **kwargs: Any) -> None:
    out_a, grads_a = grads(original, *args, **kwargs)
    out_b, grads_b = grads(swapped, *args, **kwargs)
    assert_close(out_b, out_a, tol, "output")
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert_close(grads_b[name], grads_a[name], tol, f"gradient of {name}")


def swapped_copy(module: nn.Module) -> nn.Module:
    """``module`` and a deep copy of it with attention swapped (the copy is returned)."""
    clone = copy.deepcopy(module)
    result = swap_attention(clone)
    assert result.swapped, result.decisions
    return clone


# ------------------------------------------------------------------------------------------ nn.MultiheadAttention


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_calls_match(batch_first: bool) -> None:
    torch.manual_seed(0)
    mha = nn.Sequential()
    mha.add_module("attn", nn.MultiheadAttention(16, 4, batch_first=batch_first))
    swapped = swapped_copy(mha)
    assert isinstance(swapped.attn, FusedMultiheadAttention) and isinstance(swapped.attn, nn.MultiheadAttention)
    original, fused = mha.attn, swapped.attn
    batch, seq = 3, 6
    x = torch.randn(batch, seq, 16) if batch_first else torch.randn(seq, batch, 16)
    memory = torch.randn(batch, 9, 16) if batch_first else torch.randn(9, batch, 16)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    padding = torch.zeros(batch, 9, dtype=torch.bool)
    padding[1, -4:] = True
    per_head = torch.randn(batch * 4, seq, 9)
    cases: list[tuple[tuple[Tensor, ...], dict[str, Any]]] = [
        ((x, x, x), {}),
        ((x, x, x), {"attn_mask": causal, "is_causal": True}),
        ((x, x, x), {"attn_mask": causal.float().masked_fill(causal, float("-inf"))}),
        ((x, memory, memory), {"key_padding_mask": padding}),
        ((x, memory, memory), {"key_padding_mask": padding.float() * -1e4, "attn_mask": per_head}),
        ((x, memory, memory), {"key_padding_mask": padding, "attn_mask": torch.zeros(seq, 9, dtype=torch.bool)}),
    ]
    for args, kwargs in cases:
        assert_same(original, fused, *args, need_weights=False, **kwargs)


def test_need_weights_and_unbatched_calls_take_the_original_path() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    fused = FusedMultiheadAttention.from_module(mha)
    x = torch.randn(2, 5, 8)
    out, weights = fused(x, x, x)  # need_weights defaults to True
    ref_out, ref_weights = mha(x, x, x)
    assert weights is not None
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out)
    assert fused(x, x, x, need_weights=False)[1] is None
    torch.testing.assert_close(fused(x[0], x[0], x[0])[0], mha(x[0], x[0], x[0])[0])


def test_dropout_is_applied_in_training_only() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
    fused = FusedMultiheadAttention.from_module(mha)
    x = torch.randn(2, 5, 8)
    fused.eval()
    mha.eval()
    torch.testing.assert_close(fused(x, x, x, need_weights=False)[0], mha(x, x, x, need_weights=False)[0])
    fused.train()
    a, b = fused(x, x, x, need_weights=False)[0], fused(x, x, x, need_weights=False)[0]
    assert not torch.allclose(a, b)


def test_transformer_encoder_and_decoder_layers() -> None:
    torch.manual_seed(0)
    enc = encoder(depth=2, dim=16)
    swapped = swapped_copy(enc)
    assert all(isinstance(layer.self_attn, FusedMultiheadAttention) for layer in swapped.layers)
    x = torch.randn(2, 7, 16)
    mask = nn.Transformer.generate_square_subsequent_mask(7)
    assert_same(enc, swapped, x, mask=mask, is_causal=True)
    assert_same(enc, swapped, x, src_key_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    enc.eval()
    swapped.eval()
    with torch.no_grad():  # the layer's own fused inference path still applies
        torch.testing.assert_close(swapped(x), enc(x), atol=1e-5, rtol=1e-4)

    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)
    swapped_decoder = swapped_copy(decoder)
    assert len(swap_attention(copy.deepcopy(decoder)).swapped) == 4  # self_attn and multihead_attn in each layer
    assert_same(decoder, swapped_decoder, x, torch.randn(2, 5, 16), tgt_mask=mask, tgt_is_causal=True)


def test_multihead_attention_it_cannot_swap_stays_with_a_reason() -> None:
    class MyMHA(nn.MultiheadAttention):
        pass

    kv, bias_kv = nn.MultiheadAttention(8, 2, kdim=4, vdim=4), nn.MultiheadAttention(8, 2, add_bias_kv=True)
    model = nn.ModuleDict({"kv": kv, "bias_kv": bias_kv, "subclass": MyMHA(8, 2)})
    result = swap_attention(model)
    assert result.swapped == []
    assert result.decisions["kv"].kernel == UNCHANGED and "kdim/vdim" in result.decisions["kv"].reason
    assert "add_bias_kv" in result.decisions["bias_kv"].reason
    assert "subclass" not in result.decisions  # not an adapter's kind at all
    assert type(model["kv"]) is nn.MultiheadAttention


# ------------------------------------------------------------------------------------- hand-written attention


def test_the_demo_style_lm_attention_is_found_by_structure_and_matches() -> None:
    torch.manual_seed(0)
    model = TinyGPT(depth=2, dropout=0.1)
    swapped = swapped_copy(model)
    attn = swapped.blocks[0].attn
    assert isinstance(attn, FusedQKVAttention)
    assert attn.spec == FusedQKVSpec("c_attn", "c_proj", 2, True, "qkv", "attn_dropout", "resid_dropout")
    idx = torch.randint(0, 11, (2, 12))
    model.eval()  # dropout draws differ between kernels; compare without it
    swapped.eval()
    assert_same(model, swapped, idx)
    swapped.train()
    assert swapped.blocks[0].attn.training


def test_per_head_layout_without_a_head_attribute_is_found_by_behaviour() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PerHeadQKVAttention(16, 4))
    swapped = swapped_copy(model)
    assert swapped[0].spec == FusedQKVSpec("to_qkv", "to_out", 4, False, "head")
    assert_same(model, swapped, torch.randn(2, 5, 16))


def test_an_unknown_variant_is_left_unchanged_with_the_reason() -> None:
    model = nn.Sequential(ScaledDifferentlyAttention(16, 4))
    result = swap_attention(model)
    assert result.decisions["0"].kernel == UNCHANGED
    assert "matches no standard fused-QKV attention" in result.decisions["0"].reason
    assert type(model[0]) is ScaledDifferentlyAttention


def test_extra_forward_arguments_go_to_the_original() -> None:
    class WithScale(PerHeadQKVAttention):
        def forward(self, x: Tensor, gain: float = 1.0) -> Tensor:
            return super().forward(x) * gain

    torch.manual_seed(0)
    model = nn.Sequential(WithScale(16, 4))
    swapped = swapped_copy(model)
    x = torch.randn(2, 5, 16)
    with pytest.warns(FallbackWarning, match="`gain` = 2.0 has no meaning learned from the original"):
        torch.testing.assert_close(swapped[0](x, gain=2.0), model[0](x, gain=2.0))
    assert swapped[0].fallbacks == {"gain": 1}
    torch.testing.assert_close(swapped[0](x, gain=1.0), model[0](x))  # the default value: the fused kernel


class NanoGPTAdapter(AttentionAdapter):
    """What a user writes for their own attention class: the layout, spelled out."""

    def matches(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, NanoGPTAttention)

    def swap(self, module: nn.Module, kernel: str) -> nn.Module:
        spec = FusedQKVSpec("c_attn", "c_proj", module.n_head, causal=True, attn_dropout="attn_dropout")
        return FusedQKVAttention.from_module(module, spec, kernel)


def test_a_user_adapter_comes_first_and_a_wrong_one_is_caught_by_the_parity_check() -> None:
    torch.manual_seed(0)
    model = TinyGPT(depth=1)
    result = swap_attention(model, adapters=[NanoGPTAdapter()])
    assert model.blocks[0].attn.spec.out_dropout is None  # the adapter's spec, not the detected one
    assert result.decisions["blocks.0.attn"].kernel == SDPA

    class NotCausal(NanoGPTAdapter):
        def swap(self, module: nn.Module, kernel: str) -> nn.Module:
            return FusedQKVAttention.from_module(module, FusedQKVSpec("c_attn", "c_proj", 2, causal=False), kernel)

    model = TinyGPT(depth=1)
    with pytest.warns(FallbackWarning, match=r"blocks.0.attn.*does not compute what the original does"):
        result = swap_attention(model, adapters=[NotCausal()])
    assert result.decisions["blocks.0.attn"].kernel == UNCHANGED
    assert "parity check failed" in result.decisions["blocks.0.attn"].reason
    assert type(model.blocks[0].attn) is NanoGPTAttention
    with pytest.raises(RuntimeError, match="does not compute"):
        swap_attention(model, adapters=[NotCausal()], strict=True)


def test_a_swapped_module_that_raises_keeps_the_original() -> None:
    class Broken(FusedQKVAttention):
        def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no kernel for this")

    class BrokenAdapter(NanoGPTAdapter):
        def swap(self, module: nn.Module, kernel: str) -> nn.Module:
            return Broken.from_module(module, FusedQKVSpec("c_attn", "c_proj", 2, causal=True), kernel)

    model = TinyGPT(depth=1)
    with pytest.warns(FallbackWarning, match="RuntimeError: no kernel for this"):
        result = swap_attention(model, adapters=[BrokenAdapter()])
    assert result.swapped == [] and type(model.blocks[0].attn) is NanoGPTAttention
    with pytest.raises(RuntimeError, match="no kernel for this"):
        swap_attention(model, adapters=[BrokenAdapter()], strict=True)


def test_adapter_raising_not_swappable_and_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuses(NanoGPTAdapter):
        def swap(self, module: nn.Module, kernel: str) -> nn.Module:
            raise AttentionNotSwappable("not today")

    monkeypatch.setattr(detect_mod, "_ADAPTERS", [])
    register_attention_adapter(Refuses())
    result = swap_attention(TinyGPT(depth=1))
    assert result.decisions["blocks.0.attn"] == (UNCHANGED, "NanoGPTAttention: not today")
    with pytest.raises(TypeError, match="expects an AttentionAdapter"):
        register_attention_adapter(NanoGPTAdapter)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- state_dict, restore, misc


def test_state_dict_loads_both_ways_and_restore_brings_back_the_trained_originals() -> None:
    torch.manual_seed(0)
    plain = nn.ModuleDict({"gpt": TinyGPT(depth=2), "enc": encoder(depth=2)})
    model = copy.deepcopy(plain)
    swap_attention(model)
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(plain.state_dict())
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        model.gpt.blocks[0].attn.c_attn.weight.add_(1.0)  # "training" the swapped module
    model.double()  # casts the swapped modules' own tensors (the causal `bias` buffer)
    restored = ["gpt.blocks.0.attn", "gpt.blocks.1.attn", "enc.layers.0.self_attn", "enc.layers.1.self_attn"]
    assert restore_attention(model) == restored
    original = model.gpt.blocks[0].attn
    assert type(original) is NanoGPTAttention and original.bias.dtype == torch.float64
    torch.testing.assert_close(original.c_attn.weight, plain.gpt.blocks[0].attn.c_attn.weight.double() + 1.0)
    assert restore_attention(model) == []


def test_swapping_twice_changes_nothing_and_pickles() -> None:
    model = TinyGPT(depth=1)
    swap_attention(model)
    swapped = model.blocks[0].attn
    result = swap_attention(model)
    assert result.decisions["blocks.0.attn"] == (SDPA, "swapped already") and model.blocks[0].attn is swapped
    clone = pickle.loads(pickle.dumps(model))
    idx = torch.randint(0, 11, (1, 4))
    model.eval()
    clone.eval()
    torch.testing.assert_close(clone(idx), model(idx))


def test_a_model_already_in_bfloat16() -> None:
    torch.manual_seed(0)
    plain = nn.ModuleDict({"gpt": TinyGPT(depth=1), "enc": encoder(depth=1)}).bfloat16()
    model = copy.deepcopy(plain)
    assert len(swap_attention(model).swapped) == 2
    assert_same(plain.gpt, model.gpt, torch.randint(0, 11, (2, 8)), tol=5e-2)


def test_filter_fn_restricts_the_swap() -> None:
    model = encoder(depth=2)
    result = swap_attention(model, filter_fn=lambda m, n: n.startswith("layers.1"))
    assert result.swapped == ["layers.1.self_attn"]


def test_parity_check_leaves_no_grad_no_rng_draw_and_the_modes() -> None:
    torch.manual_seed(0)
    model = TinyGPT(depth=1, dropout=0.2)
    model.eval()
    before = torch.get_rng_state()
    swap_attention(model)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in model.parameters())
    assert not any(m.training for m in model.modules())
    assert model.blocks[0].attn.attn_dropout.p == 0.2


@pytest.mark.slow
def test_torch_compile_of_swapped_attention() -> None:
    torch.manual_seed(0)
    plain = TinyGPT(depth=2)
    model = copy.deepcopy(plain)
    swap_attention(model)
    model.compile(backend="aot_eager")
    assert_same(plain, model, torch.randint(0, 11, (2, 8)))


# --------------------------------------------------------------------------------------------- kernel choice


@pytest.mark.parametrize(
    ("device", "capability", "dtype", "head_dim", "kernel", "reason"),
    [
        ("cpu", None, torch.bfloat16, 64, SDPA, "needs a CUDA GPU"),
        ("cuda", (7, 5), torch.float16, 64, SDPA, "capability 8.0+, this GPU has 7.5"),
        ("cuda", (8, 0), torch.float32, 64, SDPA, "needs fp16/bf16"),
        ("cuda", (9, 0), None, 64, SDPA, "needs fp16/bf16"),
        ("cuda", (8, 6), torch.bfloat16, 320, SDPA, "up to 256, not 320"),
        ("cuda", (9, 0), torch.bfloat16, 128, FLASH_ATTN, "flash-attn 2"),
        ("cpu", None, torch.bfloat16, 64, SDPA, "flash-attn is not installed"),  # (not installed: the one row)
    ],
)
def test_kernel_choice(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype | None,
    head_dim: int,
    kernel: str,
    reason: str,
) -> None:
    monkeypatch.setattr(kernels_mod, "is_available", lambda module: "installed" not in reason)
    monkeypatch.setattr(kernels_mod, "cuda_capability", lambda dev=None: capability)
    monkeypatch.setattr(
        kernels_mod, "is_sm_at_least", lambda major, minor=0, dev=None: (capability or (0, 0)) >= (8, 0)
    )
    monkeypatch.setattr(kernels_mod, "_sdpa_backend", lambda *args: None)
    monkeypatch.setattr(kernels_mod, "cpu_sdpa_ms", lambda *args: (5.0, 5.0))  # bf16 as fast as float32 here
    decision = choose_kernel(head_dim, device, dtype)
    assert decision.kernel == kernel and reason in decision.reason


def test_on_a_cpu_whose_half_precision_sdpa_is_slower_attention_computes_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timed: list[tuple[int, torch.dtype, int]] = []
    monkeypatch.setattr(kernels_mod, "cpu_sdpa_ms", lambda *args: timed.append(args) or (10.0, 5.0))
    decision = choose_kernel(32, "cpu", torch.bfloat16)
    assert decision.kernel == kernels_mod.SDPA_FP32 and timed == [(32, torch.bfloat16, torch.get_num_threads())]
    assert "5.0 ms in float32 vs 10.0 ms in bfloat16 (head_dim 32)" in decision.reason
    assert choose_kernel(32, "cpu", torch.float32).kernel == SDPA and len(timed) == 1  # fp32 runs: nothing to time
    monkeypatch.setattr(kernels_mod, "cpu_sdpa_ms", lambda *args: (10.0, 9.0))  # not clearly faster: kept
    assert choose_kernel(32, "cpu", torch.bfloat16).kernel == SDPA


def test_the_float32_kernel_computes_in_float32_and_gives_the_autocast_dtype_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[torch.dtype] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(kernels_mod.F, "scaled_dot_product_attention", recording)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels_mod.attention(q, k, v, kernel=kernels_mod.SDPA_FP32, is_causal=True)
        reference = kernels_mod.attention(q, k, v, kernel=SDPA, is_causal=True)
    assert seen == [torch.float32, torch.float32] and out.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.float(), atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()
    half = [t.detach().bfloat16() for t in (q, k, v)]  # half-precision inputs without autocast: output stays bf16
    assert kernels_mod.attention(*half, kernel=kernels_mod.SDPA_FP32).dtype == torch.bfloat16


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """flash-attn's ``flash_attn_func`` contract, implemented with SDPA, allowed on CPU: exercises our flash path."""
    calls: list[dict[str, Any]] = []

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):  # type: ignore[no-untyped-def]
        calls.append({"shape": tuple(q.shape), "causal": causal, "dropout_p": dropout_p, "dtype": q.dtype})
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(kernels_mod, "is_available", lambda module: True)
    monkeypatch.setattr(kernels_mod, "is_sm_at_least", lambda *a, **k: True)
    monkeypatch.setattr(kernels_mod, "_flash_attn_func", lambda: flash_attn_func)
    real_applies = kernels_mod._flash_attn_applies
    # The real per-call test with the CUDA requirement lifted.
    monkeypatch.setattr(kernels_mod, "_flash_attn_applies", lambda q, k, m, c: real_applies(_Cuda(q), _Cuda(k), m, c))
    return calls


class _Cuda:
    """A tensor stand-in that claims to be on CUDA, for the per-call flash-attn test."""

    def __init__(self, t: Tensor) -> None:
        self.t, self.is_cuda, self.dtype, self.shape = t, True, t.dtype, t.shape


def test_the_flash_attn_path_layout_causal_and_fallbacks(
    fake_flash_attn: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels_mod, "_sdpa_backend", lambda *args: None)
    assert choose_kernel(8, "cuda", torch.bfloat16).kernel == FLASH_ATTN
    torch.manual_seed(0)
    model = TinyGPT(depth=1)
    plain = copy.deepcopy(model)
    model.blocks[0].attn = FusedQKVAttention.from_module(
        model.blocks[0].attn, FusedQKVSpec("c_attn", "c_proj", 2, True, attn_dropout="attn_dropout"), FLASH_ATTN
    )
    idx = torch.randint(0, 11, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same(plain, model, idx, tol=5e-2)
    expected = {"shape": (2, 6, 2, 8), "causal": True, "dropout_p": 0.0, "dtype": torch.bfloat16}
    assert fake_flash_attn and fake_flash_attn[0] == expected
    fake_flash_attn.clear()
    model(idx)  # fp32 outside autocast: SDPA
    assert fake_flash_attn == []
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    attention(q, q, q, kernel=FLASH_ATTN, attn_mask=torch.ones(4, 4, dtype=torch.bool))  # a mask: SDPA
    attention(q, q[:, :3], q[:, :3], kernel=FLASH_ATTN, is_causal=True)  # non-square causal: SDPA
    assert fake_flash_attn == []


def test_check_parity_reports_what_differs() -> None:
    class OffByOne(FusedMultiheadAttention):
        def forward(self, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
            return super().forward(*args, **kwargs)[0] + 1, None

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    calls = [((x, x, x), {"need_weights": False})]
    assert check_parity(mha, FusedMultiheadAttention.from_module(mha), calls) is None
    problem = check_parity(mha, OffByOne.from_module(mha), calls)
    assert problem is not None and "call 1 of 1: the output differs" in problem
    # A "swap" that does not use the original's parameters is caught by the gradients.
    problem = check_parity(mha, FusedMultiheadAttention.from_module(copy.deepcopy(mha)), calls)
    assert problem is not None and "gradient of in_proj_weight is missing" in problem


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_flash_attn_on_cuda(dtype: torch.dtype) -> None:
    pytest.importorskip("flash_attn", reason="flash-attn is an optional CUDA-only extra (`lightning-perf[flash]`)")
    if not torch.cuda.get_device_capability() >= (8, 0):
        pytest.skip("flash-attn needs compute capability 8.0+")
    torch.manual_seed(0)
    plain = nn.ModuleDict({"gpt": TinyGPT(depth=2), "enc": encoder(depth=2)}).cuda()
    model = copy.deepcopy(plain)
    result = swap_attention(model, compute_dtype=dtype)
    assert {d.kernel for d in result.decisions.values()} == {FLASH_ATTN}, result.decisions
    idx, x = torch.randint(0, 11, (2, 16), device="cuda"), torch.randn(2, 16, 16, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        assert_same(plain.gpt, model.gpt, idx, tol=5e-2)
        assert_same(plain.enc, model.enc, x, tol=5e-2)


@pytest.mark.gpu
def test_sdpa_on_cuda_in_fp32() -> None:
    torch.manual_seed(0)
    plain = TinyGPT(depth=2).cuda()
    model = copy.deepcopy(plain)
    result = swap_attention(model)
    assert {d.kernel for d in result.decisions.values()} == {SDPA}
    assert_same(plain, model, torch.randint(0, 11, (2, 16), device="cuda"), tol=1e-4)


# ------------------------------------------------------------------------------------------- training mode (dropout)


def _swapped(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


@pytest.mark.parametrize("build", [lambda: TinyGPT(depth=2, dropout=0.3), lambda: encoder(depth=2, dropout=0.3)])
def test_swapped_modules_train_with_dropout_like_the_original(build: Any) -> None:
    torch.manual_seed(0)
    model = build()
    plain = copy.deepcopy(model)
    result = swap_attention(model)
    swapped = _swapped(model)
    assert len(swapped) == 2 and result.swapped
    # The swap takes over the training flag (the fused-QKV detection builds its module in eval mode).
    assert all(m.training for m in swapped)
    x = torch.randint(0, 11, (2, 8)) if isinstance(model, TinyGPT) else torch.randn(8, 2, 16)
    a, b = model(x), model(x)
    assert not torch.allclose(a, b), "two training-mode forwards are equal: dropout never ran"
    # On the CPU the fused kernel draws the eager code's dropout masks: same RNG state, same output.
    torch.manual_seed(1)
    expected = plain(x)
    torch.manual_seed(1)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-4)
    assert all("random stream" not in reason for _, reason in result.decisions.values())
    model.eval()
    plain.eval()
    assert not any(m.training for m in swapped)
    torch.testing.assert_close(model(x), model(x))
    torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-4)
    model.train()
    assert all(m.training for m in swapped)


class NoDropoutInTraining(FusedQKVAttention):
    """A wrong swap: it forgets the attention dropout."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            p, self._modules[self.spec.attn_dropout].p = self._modules[self.spec.attn_dropout].p, 0.0  # type: ignore[union-attr]
        try:
            return super().forward(x, *args, **kwargs)
        finally:
            self._modules[self.spec.attn_dropout].p = p  # type: ignore[union-attr]


class OtherRandomStream(FusedQKVAttention):
    """Dropout at the right rate from another random stream (as CUDA's fused kernels draw it)."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            torch.rand(1)  # moves the stream on
        return super().forward(x, *args, **kwargs)


def _nano_spec() -> FusedQKVSpec:
    return FusedQKVSpec("c_attn", "c_proj", 2, True, attn_dropout="attn_dropout", out_dropout="resid_dropout")


def test_parity_in_training_mode_catches_a_swap_without_dropout_and_notes_another_random_stream() -> None:
    torch.manual_seed(0)
    module = NanoGPTAttention(16, 2, 32, dropout=0.3)
    module.resid_dropout.p = 0.0  # only the attention dropout varies the output
    calls = [((torch.randn(2, 8, 16),), {})]
    problem = check_parity(module, NoDropoutInTraining.from_module(module, _nano_spec()), calls)
    assert problem is not None and "the original applies dropout, the swapped module does not" in problem
    module.resid_dropout.p = 0.3
    before = torch.get_rng_state()
    notes: list[str] = []
    assert check_parity(module, OtherRandomStream.from_module(module, _nano_spec()), calls, notes=notes) is None
    assert notes == [DROPOUT_STREAM_NOTE]
    assert torch.equal(torch.get_rng_state(), before)
    notes.clear()
    assert check_parity(module, FusedQKVAttention.from_module(module, _nano_spec()), calls, notes=notes) is None
    assert notes == []


class ScalesInTraining(NanoGPTAttention):
    """Computes something else in training mode than in eval mode (the eval-mode detection cannot see it)."""

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return 0.9 * out if self.training else out


def test_a_module_that_branches_on_training_is_checked_in_training_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScalesInTraining(16, 2, 32, dropout=0.0))
    with pytest.warns(FallbackWarning, match="in training mode"):
        result = swap_attention(model)
    assert result.swapped == [] and type(model[0]) is ScalesInTraining
    assert "parity check failed" in result.decisions["0"].reason


def test_the_cpu_timing_runs_as_training_would_whatever_the_callers_context() -> None:
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):  # e.g. a swap before predict
        half, single = kernels_mod.cpu_sdpa_ms.__wrapped__(8, torch.bfloat16, torch.get_num_threads())
    assert half > 0 and single > 0
