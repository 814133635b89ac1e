"""FSDP2 helpers and the FSDP2 paths of the transforms, on a 1-process gloo group (fast; the 2-process fits of every
callback are in tests/callbacks/test_fsdp2.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_perf.functional.attention.swap import SDPACalls, restore_attention, swap_attention
from lightning_perf.functional.channels_last import apply_channels_last
from lightning_perf.functional.checkpoint.apply import apply_activation_checkpointing
from lightning_perf.functional.compile.regions import CompileMonitor, compile_regions, inside_wrappers
from lightning_perf.functional.fused_optimizer import choose_implementation, switch_implementation
from lightning_perf.functional.sharding import (
    is_fsdp_module,
    is_sharded,
    is_sharded_parameter,
    plain_parameters,
    rebind_parameters,
)


class Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2) for u in self.qkv(x).split(c, dim=2))
        weights = ((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.attn = Attention(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).flatten(2).transpose(1, 2)  # (batch, pixels, 16)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def _sharded(mesh: object) -> tuple[Net, Net]:
    torch.manual_seed(0)
    plain = Net()
    sharded = Net()
    sharded.load_state_dict(plain.state_dict())
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return plain, sharded


def test_detection(mesh: object) -> None:
    plain, sharded = _sharded(mesh)
    assert not is_sharded(plain) and is_sharded(sharded)
    assert is_fsdp_module(sharded) and not is_fsdp_module(plain)
    assert all(is_sharded_parameter(p) for p in sharded.parameters())


def test_plain_parameters_are_stand_ins_and_come_back(mesh: object) -> None:
    _, sharded = _sharded(mesh)
    attn = sharded.blocks[0].attn
    before = dict(attn.named_parameters())
    with plain_parameters(attn) as stand_ins:
        assert len(stand_ins) == 4
        assert not any(is_sharded_parameter(p) for p in attn.parameters())
        assert attn.qkv.weight.shape == before["qkv.weight"].shape
        attn(torch.randn(2, 5, 16))  # a plain call works on the stand-ins
        holder = nn.Module()
        holder.register_parameter("w", attn.qkv.weight)
        assert rebind_parameters(holder, stand_ins) == 1 and holder.w is before["qkv.weight"]
    assert all(p is before[n] for n, p in attn.named_parameters())
    with plain_parameters(attn) as again:  # the same stand-in values on every call (and rank): same decisions
        first = attn.qkv.weight.detach().clone()
    with plain_parameters(attn):
        assert torch.equal(attn.qkv.weight, first)
    assert len(again) == 4


def test_channels_last_leaves_sharded_weights_alone(mesh: object) -> None:
    _, sharded = _sharded(mesh)
    report = apply_channels_last(sharded)
    assert report.dims == frozenset({2}) and report.sharded == ["conv"] and report.changed == 0
    assert is_sharded_parameter(sharded.conv.weight)
    assert "FSDP2-sharded" in report.summary()


def test_attention_swap_on_sharded_blocks_matches(mesh: object) -> None:
    plain, sharded = _sharded(mesh)
    result = swap_attention(sharded)
    assert result.swapped == ["blocks.0.attn", "blocks.1.attn"]
    assert all("sharded by FSDP2" in d.reason for d in result.decisions.values())
    assert all(is_sharded_parameter(p) for p in sharded.parameters())  # the real shards are back in the swap
    x = torch.randn(2, 3, 4, 4)
    with SDPACalls(sharded) as calls:
        out = sharded(x)
    assert calls.total == 2
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)
    assert restore_attention(sharded) == ["blocks.0.attn", "blocks.1.attn"]


def test_attention_module_sharded_itself_is_kept_with_the_reason(mesh: object) -> None:
    torch.manual_seed(0)
    model = Net()
    fully_shard(model.blocks[0].attn, mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = swap_attention(model)
    assert result.decisions["blocks.0.attn"].action == "kept"
    assert (
        "fully_shard was applied to the attention module itself or to a layer"
        in result.decisions["blocks.0.attn"].reason
    )
    assert result.swapped == ["blocks.1.attn"]


def test_compile_goes_inside_the_wrappers(mesh: object) -> None:
    plain, sharded = _sharded(mesh)
    assert [n for n, _ in inside_wrappers(sharded, [("", sharded)])] == ["blocks.0", "blocks.1"]
    assert inside_wrappers(plain, [("", plain)]) == [("", plain)]
    apply_activation_checkpointing(sharded, [Block])  # torchtitan's order: checkpointing, then compile around it
    compiled = compile_regions(sharded, backend="eager")
    assert compiled.names == ["blocks.0", "blocks.1"]
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in sharded.blocks)  # not around the hooks
    x = torch.randn(2, 3, 4, 4)
    monitor = CompileMonitor()
    monitor.start()
    sharded(x).sum().backward()
    stats = monitor.stop()
    assert stats.compilations == 1 and stats.graph_breaks == 0  # the two blocks share one graph, hooks outside it
    plain(x).sum().backward()
    assert compiled.calls == 2
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6)
    compiled.remove()
    assert compiled.active == [] and all("forward" in b.__dict__ for b in sharded.blocks)  # checkpointing stays


def test_multihead_attention_holding_shards_itself_is_kept_with_the_reason(mesh: object) -> None:
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), nn.Linear(16, 16))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    result = swap_attention(model)
    decision = result.decisions["0.self_attn"]
    assert decision.action == "kept" and "in_proj_weight" in decision.reason and "FSDP2" in decision.reason


def test_a_sharded_hugging_face_model_switches_config_without_calling_it(mesh: object) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    result = swap_attention(model)
    assert calls == []  # a call outside a step would run FSDP2's all-gathers on one rank alone
    assert model.config._attn_implementation == "sdpa"
    (decision,) = result.decisions.values()
    assert decision.action == "switched config" and "sharded by FSDP2" in decision.reason
    result.undo(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), "fused"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "foreach"),  # no DTensor rule for aten._fused_sgd_
    ],
    ids=["AdamW", "SGD"],
)
def test_fused_optimizer_over_dtensors_takes_what_dtensor_can_run(mesh: object, make: object, expected: str) -> None:
    plain, sharded = _sharded(mesh)
    optimizers = [make(plain.parameters()), make(sharded.parameters())]  # type: ignore[operator]
    assert choose_implementation(optimizers[0]).implementation == "fused"
    if expected == "foreach":
        refused = choose_implementation(optimizers[1], "fused")
        assert refused.implementation is None and "no DTensor rule for the fused SGD kernel" in str(refused.reason)
    assert switch_implementation(optimizers[1]).implementation == expected
    switch_implementation(optimizers[0])  # the plain model's steps fused too: the same arithmetic for AdamW
    x = torch.randn(2, 3, 4, 4)
    for model, optimizer in zip((plain, sharded), optimizers):
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for name, param in plain.named_parameters():
        torch.testing.assert_close(dict(sharded.named_parameters())[name].full_tensor(), param, rtol=1e-5, atol=1e-6)
