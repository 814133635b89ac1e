"""Recomputing norm and activation outputs as a budget option: the planner's choice on scripted profiles (no timing),
and the patch itself (gradients, memory, in-place safety)."""

from __future__ import annotations

import copy
from itertools import product

import pytest
import torch
from torch import nn

from lightning_perf.demos.vit import ViTBlock
from lightning_perf.functional.checkpoint.apply import remove_activation_checkpointing
from lightning_perf.functional.checkpoint.budget import (
    ActivationProfile,
    BlockChoice,
    BlockProfile,
    CheckpointPlan,
    apply_plan,
    plan_checkpointing,
    profile_activations,
)
from lightning_perf.functional.checkpoint.cheap import RecomputeCheapForward, cheap_modules
from lightning_perf.functional.checkpoint.plan import _block_options
from lightning_perf.functional.surgery import patch_forward
from lightning_perf.profiling.memory import MemoryProbe


def vit_like(name: str) -> BlockProfile:
    """A ViT block as profiled on CPU (bytes in KiB-ish units, seconds scripted): the GELU output (400, saved by the
    second linear) and a norm output (100) are cheap to make again; the parts and the whole block recompute matmuls."""
    parts = {f"{name}.attn": (500, 100, 0.012), f"{name}.mlp": (900, 100, 0.012)}
    cheap = {f"{name}.mlp.1": (f"{name}.mlp", 400, 0.001), f"{name}.norm2": (f"{name}.mlp", 100, 0.0003)}
    kept, recompute = {"matmul+conv+attention": 1100}, {"matmul+conv+attention": 0.013}
    counts = {"attention": 1, "matmul": 4, "other": 39}
    return BlockProfile(name, 1600, 100, 0.024, kept, recompute, counts, parts, cheap)


def profile_of(blocks: int, outside: int = 30) -> ActivationProfile:
    many = tuple(vit_like(f"blocks.{i}") for i in range(blocks))
    return ActivationProfile(outside + sum(b.saved_bytes for b in many), outside, many)


def test_plan_prefers_the_least_recompute_per_byte_saved() -> None:
    # 0.75 is within reach of the cheap recomputes alone (500 of 1600 per block): no matmul is recomputed.
    plan = plan_checkpointing(profile_of(8), 0.75)
    assert {c.mode for c in plan.choices} <= {"cheap", "none"}
    assert plan.expected_recompute_s <= 8 * 0.0013 + 1e-12
    # Selective checkpointing frees as much per block (500) at 13 ms instead of 1.3 ms: never chosen over it.
    for budget in (0.25, 0.5):
        assert all(c.mode != "selective" for c in plan_checkpointing(profile_of(8), budget).choices)
    # 0.5 needs more than the cheap bytes: the rest from parts (with the cheap recomputes outside them) or full.
    half = plan_checkpointing(profile_of(8), 0.5)
    assert sum(1 for c in half.choices if c.recomputed) >= 4
    described = half.describe()
    assert "norm/activation outputs recomputed" in described and f"{half.expected_ratio:.2f}x" in described


def test_cheap_recomputes_inside_a_checkpointed_part_are_not_counted_twice() -> None:
    options = _block_options(vit_like("b"))
    by_key = {(o[2], o[3], o[4]): o for o in options}
    cheap = ("b.mlp.1", "b.norm2")
    assert by_key[("cheap", (), cheap)][1] == 1600 - 500
    # Checkpointing the MLP already drops the GELU and norm outputs first saved inside it: no cheap option on top.
    assert ("parts", ("b.mlp",), cheap) not in by_key and ("parts", ("b.attn", "b.mlp"), cheap) not in by_key
    attn_cheap = by_key[("parts", ("b.attn",), cheap)]
    assert attn_cheap[1] == 1600 - 400 - 500 and attn_cheap[0] == pytest.approx(0.012 + 0.0013)


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.75])
def test_plan_never_overshoots_the_band_and_is_optimal(budget: float) -> None:
    plan = plan_checkpointing(profile_of(12), budget)
    assert budget - 0.05 <= plan.expected_ratio <= budget
    profile = profile_of(3)
    plan = plan_checkpointing(profile, budget)
    options = [_block_options(b) for b in profile.blocks]
    feasible = [
        sum(o[0] for o in combo)
        for combo in product(*options)
        if profile.outside_bytes + sum(o[1] for o in combo) <= budget * profile.total_saved_bytes
    ]
    assert plan.expected_recompute_s == pytest.approx(min(feasible))
    assert plan.expected_ratio <= budget


def blocks_model(depth: int = 2, dim: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(ViTBlock(dim, 2) for _ in range(depth)))


def test_recorder_finds_the_gelu_and_norm_outputs() -> None:
    model = blocks_model()
    x = torch.randn(4, 17, 32)
    blocks = [(n, m) for n, m in model.named_children()]
    profile, loss = profile_activations(model, blocks, lambda: model(x).pow(2).mean())
    loss.backward()
    cheap = profile.blocks[0].cheap
    assert set(cheap) >= {"0.mlp.1", "0.norm2"}
    gelu_part, gelu_bytes, _ = cheap["0.mlp.1"]
    assert gelu_part == "0.mlp" and gelu_bytes == 4 * 17 * 128 * 4  # the (B, T, 4 dim) float GELU output


def test_recomputing_cheap_outputs_keeps_gradients_and_frees_memory() -> None:
    plain = blocks_model(depth=3, dim=64)
    x = torch.randn(8, 65, 64)
    blocks = [(n, m) for n, m in plain.named_children()]
    profile, loss = profile_activations(plain, blocks, lambda: plain(x).pow(2).mean())
    loss.backward()
    choices = tuple(BlockChoice(b.name, "cheap", (), 0, 0.0, (), tuple(b.cheap)) for b in profile.blocks)
    plan = CheckpointPlan(0.5, choices, 1, 1, 0.0, 1.0)
    wrapped = copy.deepcopy(plain)
    assert apply_plan(wrapped, plan) == ["0", "1", "2"] == plan.regions
    probe = MemoryProbe("cpu")
    grown = {}
    for key, model in (("plain", plain), ("wrapped", wrapped)):
        model.zero_grad(set_to_none=True)
        before = probe.allocated()
        loss = model(x).pow(2).mean()
        grown[key] = probe.allocated() - before
        loss.backward()
    probe.close()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    freed = sum(v[1] for b in profile.blocks for v in b.cheap.values())
    assert grown["plain"] - grown["wrapped"] == pytest.approx(freed, rel=0.1)
    assert remove_activation_checkpointing(wrapped) == ["0", "1", "2"]


def test_cheap_recomputes_around_a_checkpointed_part_keep_gradients() -> None:
    plain = blocks_model(depth=2)
    x = torch.randn(4, 17, 32)
    choices = tuple(
        BlockChoice(f"{i}", "parts", (), 0, 0.0, (f"{i}.attn",), (f"{i}.norm2", f"{i}.mlp.1")) for i in range(2)
    )
    wrapped = copy.deepcopy(plain)
    plan = CheckpointPlan(0.5, choices, 1, 1, 0.0, 1.0)
    assert apply_plan(wrapped, plan) == ["0", "0.attn", "1", "1.attn"] == plan.regions
    for model in (plain, wrapped):
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_an_input_modified_in_place_is_refused_in_backward() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.GELU()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            y = self.fc(self.act(h))
            h.add_(1)  # the GELU's input changes after the forward (its own saved input is the same tensor)
            return y

    block = Block()
    patch_forward(block, lambda m: RecomputeCheapForward(m, [m.act]))
    out = block(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="modified"):
        out.sum().backward()


def test_cheap_modules_skip_in_place_and_random_modules() -> None:
    block = nn.Sequential(nn.LayerNorm(4), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.SiLU(), nn.BatchNorm1d(4))
    assert [n for n, _ in cheap_modules("b", block)] == ["b.0", "b.3"]


def test_recompute_time_stops_where_torch_checkpoint_stops() -> None:
    """A checkpointed MLP runs its first linear and the GELU again, not its second linear (early stop: that linear's
    input is its last saved tensor, packed before its kernel runs); the profile charges the recompute accordingly."""
    model = blocks_model(depth=2, dim=64)
    x = torch.randn(8, 65, 64)
    blocks = [(n, m) for n, m in model.named_children()]
    from lightning_perf.functional.checkpoint.budget import ActivationRecorder

    recorder = ActivationRecorder(model, blocks)
    recorder.start()
    loss = model(x).pow(2).mean()
    profile = recorder.stop()
    loss.backward()
    ops, parts = recorder._ops["0"], recorder._op_parts["0"]
    mlp_ops = [i for i, p in enumerate(parts) if p == "0.mlp"]
    rerun = [i for i in mlp_ops if i < recorder._last_pack["0.mlp"]]
    assert [ops[i][0] for i in rerun].count("matmul") == 1 and [ops[i][0] for i in mlp_ops].count("matmul") == 2
    block = profile.blocks[0]
    assert block.parts["0.mlp"][2] == pytest.approx(sum(ops[i][1] for i in rerun) / 1e9)
    assert block.full_recompute_s is not None and block.full_recompute_s < block.forward_s
