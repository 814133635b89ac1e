"""FlashAttentionCallback on the attention of real model zoos: swaps that really run the fused kernel in training.

Shapes: timm's ViT ``Attention`` (built here: timm does not install with the CPU torch; its blocks call it with
``attn_mask=None, is_causal=False`` keywords), MONAI's real ``SABlock`` / ``TransformerBlock`` (called with
``attn_mask=None``), Hugging Face GPT-2 with eager and SDPA attention, and ``nn.MultiheadAttention``. For each, the
fused-kernel calls are counted per module over two training steps (:class:`SDPACalls`), and the losses and gradients
are compared with the un-swapped model's.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_perf import FallbackWarning
from lightning_perf.callbacks import FlashAttentionCallback
from lightning_perf.functional.attention.swap import (
    ALREADY_FUSED,
    SDPA,
    SWAPPED,
    SWITCHED_CONFIG,
    UNCHANGED,
    FusedQKVAttention,
    SDPACalls,
    swap_attention,
)
from tests._models import SequenceModule, trainer


class TimmAttention(nn.Module):
    """timm's ``timm.layers.Attention`` (ViT), as in timm 1.0: fused q/k/v, ``fused_attn`` flag, optional masks."""

    def __init__(self, dim: int, num_heads: int = 2, fused_attn: bool = False, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = fused_attn
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            dropout_p = self.attn_drop.p if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if is_causal:
                attn = attn.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
            if attn_mask is not None:
                attn = attn + attn_mask  # timm's maybe_add_mask: additive
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(self.norm(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, fused_attn: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, fused_attn=fused_attn)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=False)  # how timm's ViT Block calls it
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, fused_attn: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TimmBlock(dim, fused_attn) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask)
        return self.head(x.mean(1))


class _Rearrange(nn.Module):
    """The three einops patterns MONAI's SABlock uses (einops is not installed here), as reshape and permute."""

    def __init__(self, pattern: str, **sizes: int) -> None:
        super().__init__()
        self.pattern, self.sizes = pattern, sizes

    def forward(self, x: Tensor) -> Tensor:
        if self.pattern == "b h (qkv l d) -> qkv b l h d":
            b, h, _ = x.shape
            return x.view(b, h, 3, self.sizes["l"], -1).permute(2, 0, 3, 1, 4)
        if self.pattern == "b h (l d) -> b l h d":
            b, h, _ = x.shape
            return x.view(b, h, self.sizes["l"], -1).transpose(1, 2)
        assert self.pattern == "b l h d -> b h (l d)", self.pattern
        b, heads, h, d = x.shape
        return x.transpose(1, 2).reshape(b, h, heads * d)


@pytest.fixture
def monai_blocks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """MONAI's real ``monai.networks.blocks`` (SABlock, TransformerBlock) with einops' Rearrange stood in for."""
    selfattention = pytest.importorskip("monai.networks.blocks.selfattention")
    monkeypatch.setattr(selfattention, "Rearrange", _Rearrange)
    from monai.networks import blocks

    return blocks


class MonaiViT(nn.Module):
    def __init__(self, blocks: Any, dim: int = 16, depth: int = 2, flash: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            blocks.TransformerBlock(dim, 2 * dim, num_heads=2, qkv_bias=True, use_flash_attention=flash)
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)  # calls its SABlock with attn_mask=None as a keyword
        return self.head(x.mean(1))


class MHAModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return self.head(out.mean(1))


def gpt2(implementation: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0
    )
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def vision_batch(step: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, 16, generator=g), torch.randint(0, 3, (4,), generator=g)


def vision_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_batch(step: int) -> tuple[Tensor, ...]:
    return (torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(step)),)


def lm_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def train_two_steps(model: nn.Module, loss_fn: Any, batch_fn: Any) -> tuple[list[float], dict[str, Tensor], SDPACalls]:
    """Two SGD steps; the losses, the gradients of the last step, and the SDPA calls per module."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    losses = []
    with SDPACalls(model) as calls:
        for step in range(2):
            optimizer.zero_grad()
            loss = loss_fn(model, batch_fn(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, calls


def assert_trains_like(swapped: tuple, plain: tuple) -> None:
    (losses, grads, _), (plain_losses, plain_grads, _) = swapped, plain
    assert losses == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def swap_and_train(model: nn.Module, names: list[str], lm: bool = False) -> Any:
    """Swaps ``model``'s attention (``names`` swapped), trains it and an un-swapped copy two steps: same losses and
    gradients, the kernel run once per forward in each swapped module and never in the plain copy."""
    loss_fn, batch_fn = (lm_loss, lm_batch) if lm else (vision_loss, vision_batch)
    plain = copy.deepcopy(model)
    result = swap_attention(model)
    assert result.swapped == names, result.decisions
    swapped_run, plain_run = train_two_steps(model, loss_fn, batch_fn), train_two_steps(plain, loss_fn, batch_fn)
    assert {n: swapped_run[2].counts[n] for n in names} == {n: 2 for n in names} and plain_run[2].total == 0
    assert_trains_like(swapped_run, plain_run)
    return result


def test_timm_attention_called_with_default_keywords_runs_the_kernel() -> None:
    torch.manual_seed(0)
    model = TinyViT()
    names = ["blocks.0.attn", "blocks.1.attn"]
    result = swap_and_train(model, names)
    assert all(result.decisions[n].action == SWAPPED for n in names)
    assert all(isinstance(model.blocks[i].attn, FusedQKVAttention) for i in range(2))
    assert model.blocks[0].attn.fallbacks == {}


def test_timm_attention_masks_and_causal_go_to_the_kernel() -> None:
    torch.manual_seed(0)
    attn = TimmAttention(16)
    result = swap_attention(nn.Sequential(attn))
    swapped = result.replaced["0"][1]
    assert isinstance(swapped, FusedQKVAttention)
    assert swapped.arguments.causal == {"is_causal"}
    assert swapped.arguments.masks["attn_mask"][("float", "full")] == "additive"
    x = torch.randn(2, 6, 16)
    additive = torch.randn(2, 1, 6, 6)
    for kwargs in ({"attn_mask": additive}, {"is_causal": True}, {"attn_mask": None, "is_causal": False}):
        with SDPACalls() as calls:
            out = swapped(x, **kwargs)
        assert calls.total == 1, kwargs
        torch.testing.assert_close(out, attn(x, **kwargs), rtol=1e-4, atol=1e-5)


def test_an_argument_the_kernel_cannot_serve_falls_back_for_that_call_only() -> None:
    class ScaledMaskAttention(TimmAttention):
        """Accepts a ``temperature`` the kernel knows nothing of."""

        def forward(self, x: Tensor, attn_mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:  # type: ignore[override]
            return super().forward(x * temperature, attn_mask=attn_mask)

    torch.manual_seed(0)
    attn = ScaledMaskAttention(16)
    model = nn.Sequential(attn)
    swap_attention(model)
    swapped = model[0]
    assert isinstance(swapped, FusedQKVAttention)
    x = torch.randn(2, 6, 16)
    with pytest.warns(FallbackWarning, match="`temperature` = 2.0 has no meaning learned"), SDPACalls() as calls:
        out = swapped(x, temperature=2.0)
    assert calls.total == 0 and swapped.fallbacks == {"temperature": 1}
    torch.testing.assert_close(out, attn(x, temperature=2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: the second fallback is silent
        swapped(x, temperature=2.0)
    with SDPACalls() as calls:
        swapped(x, temperature=1.0)  # the default: the kernel
    assert calls.total == 1 and swapped.fallbacks == {"temperature": 2}


@pytest.mark.parametrize("zoo", ["timm", "monai", "gpt2"])
def test_attention_that_already_runs_the_kernel_is_left_alone(zoo: str, request: Any) -> None:
    """timm with ``fused_attn``, MONAI's SABlock with ``use_flash_attention``, GPT-2 configured for SDPA."""
    if zoo == "gpt2":
        model, prefix = gpt2("sdpa"), "transformer.h"
    else:
        blocks = request.getfixturevalue("monai_blocks") if zoo == "monai" else None
        model, prefix = TinyViT(fused_attn=True) if blocks is None else MonaiViT(blocks, flash=True), "blocks"
    kinds = [type(m) for m in model.modules()]
    result = swap_attention(model)
    assert result.swapped == [] and result.replaced == {} and result.switched == {}
    assert {n: (d.kernel, d.action) for n, d in result.decisions.items()} == {
        f"{prefix}.{i}.attn": (UNCHANGED, ALREADY_FUSED) for i in range(2)
    }
    assert [type(m) for m in model.modules()] == kinds


def test_monai_transformer_blocks_run_the_kernel(monai_blocks: Any) -> None:
    torch.manual_seed(0)
    model = MonaiViT(monai_blocks)
    swap_and_train(model, ["blocks.0.attn", "blocks.1.attn"])
    swapped = model.blocks[0].attn
    assert isinstance(swapped, FusedQKVAttention) and isinstance(swapped.original, monai_blocks.SABlock)
    # MONAI's attn_mask is a key padding mask (batch, keys): 0 / False is blocked.
    assert swapped.arguments.masks["attn_mask"] == {("bool", "padding"): "keep", ("float", "padding"): "keep"}
    x, padding = torch.randn(2, 6, 16), torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with SDPACalls() as calls:
        out = swapped(x, attn_mask=padding)
    assert calls.total == 1
    torch.testing.assert_close(out, swapped.original(x, attn_mask=padding), rtol=1e-4, atol=1e-5)


def test_gpt2_eager_is_switched_to_sdpa_and_back() -> None:
    model = gpt2("eager")
    names = ["transformer.h.0.attn", "transformer.h.1.attn"]
    result = swap_and_train(model, names, lm=True)
    assert all(result.decisions[n] == (SDPA, result.decisions[n].reason) for n in names)
    assert all(result.decisions[n].action == SWITCHED_CONFIG for n in names)
    assert model.config._attn_implementation == "sdpa"
    result.undo(model)
    assert model.config._attn_implementation == "eager" and result.switched == {}


def test_multihead_attention_runs_the_kernel() -> None:
    torch.manual_seed(0)
    swap_and_train(MHAModel(), ["attn"])


class ZooModule(SequenceModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.calls = SDPACalls()

    def train_dataloader(self) -> Any:
        data = [vision_batch(i) for i in range(2)]
        return torch.utils.data.DataLoader(data, batch_size=None)

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        with SDPACalls(self.net) as calls:
            loss = vision_loss(self.net, batch)
        self.calls.counts.update(calls.counts)
        return loss


@pytest.mark.parametrize("zoo", ["timm", "monai"])
def test_callback_reports_per_module_and_the_kernel_runs_in_fit(zoo: str, tmp_path: Path, request: Any) -> None:
    torch.manual_seed(0)
    net = TinyViT() if zoo == "timm" else MonaiViT(request.getfixturevalue("monai_blocks"))
    module = ZooModule(net)
    callback = FlashAttentionCallback()
    trainer(tmp_path, callbacks=[callback], max_steps=2, limit_val_batches=0).fit(module)
    names = ["net.blocks.0.attn", "net.blocks.1.attn"]
    assert callback.swapped == names and [callback.decisions[n].action for n in names] == [SWAPPED, SWAPPED]
    assert {n.removeprefix("net."): 2 for n in names} == {
        n: module.calls.counts[n] for n in ("blocks.0.attn", "blocks.1.attn")
    }
    assert type(net.blocks[0].attn) is not FusedQKVAttention  # the originals are back after fit


def test_callback_switches_gpt2_back_on_teardown(tmp_path: Path) -> None:
    class LMModule(SequenceModule):
        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader([lm_batch(i) for i in range(2)], batch_size=None)

        def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
            return lm_loss(self.net, batch)

    model = gpt2("eager")
    callback = FlashAttentionCallback()
    trainer(tmp_path, callbacks=[callback], max_steps=2, limit_val_batches=0).fit(LMModule(model))
    assert callback.swapped == ["net.transformer.h.0.attn", "net.transformer.h.1.attn"]
    assert model.config._attn_implementation == "eager"


def test_callback_reports_fallbacks_and_switches_gpt2_back_on_exception(tmp_path: Path, caplog: Any) -> None:
    class Fails(FlashAttentionCallback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            assert pl_module.net.config._attn_implementation == "sdpa"
            raise RuntimeError("stop")

    model = gpt2("eager")
    module = SequenceModule(model)
    module.train_dataloader = lambda: torch.utils.data.DataLoader([lm_batch(0)], batch_size=None)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stop"):
        trainer(tmp_path, callbacks=[Fails()], limit_val_batches=0).fit(module)
    assert model.config._attn_implementation == "eager"


def test_callback_logs_each_decision_and_the_calls_that_fell_back(tmp_path: Path, caplog: Any) -> None:
    class TemperatureAttention(TimmAttention):
        def forward(self, x: Tensor, attn_mask: Tensor | None = None, temperature: float = 1.0) -> Tensor:  # type: ignore[override]
            return super().forward(x / temperature, attn_mask=attn_mask)

    class TwoCalls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = TemperatureAttention(16)
            self.head = nn.Linear(16, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head((self.attn(x, temperature=2.0) + self.attn(x, temperature=1.0)).mean(1))

    torch.manual_seed(0)
    callback = FlashAttentionCallback()
    module = ZooModule(TwoCalls())
    with caplog.at_level(logging.INFO), pytest.warns(FallbackWarning, match="`temperature` = 2.0 has no meaning"):
        trainer(tmp_path, callbacks=[callback], max_steps=2, limit_val_batches=0).fit(module)
    assert "1 of 1 attention modules swapped (1 swapped)" in caplog.text
    assert "net.attn: swapped, sdpa (" in caplog.text
    assert callback.fallbacks == {"net.attn": {"temperature": 2}}
    assert module.calls.counts["attn"] == 2  # the temperature=1.0 (default) calls ran the kernel
