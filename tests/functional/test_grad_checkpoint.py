"""Activation checkpointing: same gradients, same names and keys, BatchNorm statistics updated once, less saved."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_perf.functional.checkpoint import apply as gc
from lightning_perf.functional.checkpoint.apply import (
    apply_activation_checkpointing,
    checkpointed_modules,
    remove_activation_checkpointing,
    select_blocks,
    take_portion,
)
from tests._models import ResNet, TinyGPT, encoder


def grads_after_step(model: nn.Module, x: Tensor, seed: int = 0) -> dict[str, Tensor]:
    torch.manual_seed(seed)  # same dropout masks for both models
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training(plain: nn.Module, wrapped: nn.Module, x: Tensor, atol: float = 0.0) -> None:
    expected, actual = grads_after_step(plain, x), grads_after_step(wrapped, x)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=name)
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)  # BatchNorm statistics, counters


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: encoder(depth=3, dropout=0.1), (4, 8, 16)),  # with dropout: the RNG state is replayed
        (lambda: ResNet(blocks_per_stage=2), (4, 3, 8, 8)),  # with BatchNorm
    ],
    ids=["transformer-dropout", "resnet-batchnorm"],
)
def test_gradients_and_buffers_equal_the_plain_model(make: Callable[[], nn.Module], shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    plain = make()
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped) == [n for n, _ in select_blocks(plain)]
    x = torch.randn(shape)
    for _ in range(2):
        assert_same_training(plain, wrapped, x)


def test_plain_torch_checkpoint_would_update_batchnorm_twice() -> None:
    """Why CheckpointedForward restores running statistics: torch's recompute runs BatchNorm's update again."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    checkpoint(bn, torch.randn(8, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert bn.num_batches_tracked.item() == 2

    patched = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain = copy.deepcopy(patched)
    apply_activation_checkpointing(patched, filter_fn=lambda m, n: n == "")  # the root is never a target
    assert checkpointed_modules(patched) == []
    outer = nn.Sequential(patched)
    apply_activation_checkpointing(outer, filter_fn=lambda m, n: n == "0")
    x = torch.randn(8, 4)
    assert_same_training(plain, patched, x)
    assert patched[1].num_batches_tracked.item() == 1


def test_batchnorm_replaced_after_patching_is_still_updated_once() -> None:
    """Lightning's ``sync_batchnorm=True`` swaps BatchNorm modules after the callback's setup."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    apply_activation_checkpointing(model, filter_fn=lambda m, n: n == "0")
    model[0][1] = nn.BatchNorm1d(4)
    model(torch.randn(8, 4)).sum().backward()
    assert model[0][1].num_batches_tracked.item() == 1


def test_bf16_autocast_on_cpu_matches() -> None:
    torch.manual_seed(0)
    plain = encoder(depth=2)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    x = torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_same_training(plain, wrapped, x)


def saved_activation_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes of the tensors autograd saves for backward outside checkpointed regions, parameters excluded."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return sum(seen.values())


def test_checkpointing_cuts_saved_activations_and_fraction_trades_some_back() -> None:
    torch.manual_seed(0)
    plain = encoder(depth=8, dim=32)
    x = torch.randn(4, 64, 32, requires_grad=True)
    full, half = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_activation_checkpointing(full)
    apply_activation_checkpointing(half, fraction=0.5)
    baseline, everything, some = (saved_activation_bytes(m, x) for m in (plain, full, half))
    assert everything < 0.1 * baseline
    assert everything < some < 0.6 * baseline


def test_no_grad_runs_the_plain_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = encoder(depth=2)
    apply_activation_checkpointing(model)
    calls: list[int] = []
    monkeypatch.setattr(gc, "checkpoint", lambda fn, *a, **k: calls.append(1) or fn(*a))
    with torch.no_grad():
        model(torch.randn(1, 4, 16))
    assert calls == []
    model(torch.randn(1, 4, 16))
    assert len(calls) == 2


def test_names_keys_and_checkpoints_are_those_of_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = TinyGPT(depth=3)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in wrapped.named_modules()] == [n for n, _ in plain.named_modules()]
    assert all(type(a) is type(b) for a, b in zip(wrapped.modules(), plain.modules()))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    fresh = TinyGPT(depth=3)
    apply_activation_checkpointing(fresh)
    fresh.load_state_dict(plain.state_dict())  # plain -> checkpointed
    plain.load_state_dict(wrapped.state_dict())  # checkpointed -> plain


def test_apply_twice_wraps_once_and_remove_undoes() -> None:
    model = encoder(depth=3)
    assert apply_activation_checkpointing(model) == ["layers.0", "layers.1", "layers.2"]
    assert apply_activation_checkpointing(model) == []
    assert checkpointed_modules(model) == ["layers.0", "layers.1", "layers.2"]
    assert remove_activation_checkpointing(model) == ["layers.0", "layers.1", "layers.2"]
    assert checkpointed_modules(model) == [] and all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.slow
def test_torch_compile_of_checkpointed_blocks() -> None:
    torch.manual_seed(0)
    plain = ResNet(blocks_per_stage=2)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    wrapped.compile(backend="aot_eager")  # in place, as lightning_perf compiles
    x = torch.randn(4, 3, 8, 8)
    expected, actual = grads_after_step(plain, x), grads_after_step(wrapped, x)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    assert wrapped.stages[0][0].bn1.num_batches_tracked.item() == 1  # compiled recompute does not repeat it


def test_select_blocks_by_class_path_and_bare_name_and_filter() -> None:
    model = TinyGPT(depth=2)
    by_path = select_blocks(model, "tests._models.Block")
    assert [n for n, _ in by_path] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in select_blocks(model, ["NanoGPTAttention"])] == ["blocks.0.attn", "blocks.1.attn"]
    assert [n for n, _ in select_blocks(model, nn.LayerNorm)] == [f"blocks.{i}.ln{j}" for i in (0, 1) for j in (1, 2)]
    outer = select_blocks(model, filter_fn=lambda m, n: n.startswith("blocks"))
    assert [n for n, _ in outer] == ["blocks"]  # outermost only: the ModuleList holds everything else


def test_unknown_bare_class_name_is_an_error_with_suggestions() -> None:
    with pytest.raises(ValueError, match=r"no module of TinyGPT has: 'Blok' \(did you mean 'Block'\?\)"):
        select_blocks(TinyGPT(), "Blok")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every_n": 0}, ValueError, "every_n=0"),
        ({"every_n": 1.5}, ValueError, "every_n=1.5"),
        ({"every_n": True}, ValueError, "every_n=True"),
        ({"fraction": 0}, ValueError, r"fraction=0.*> 0 and <= 1"),
        ({"fraction": 1.5}, ValueError, "fraction=1.5"),
        ({"fraction": float("nan")}, ValueError, "fraction=nan"),
        ({"fraction": "half"}, ValueError, "fraction='half'"),
        ({"every_n": 2, "fraction": 0.5}, ValueError, "not both"),
    ],
)
def test_invalid_portions(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        apply_activation_checkpointing(encoder(), **kwargs)


def test_portions() -> None:
    blocks = list(range(10))
    assert take_portion(blocks) == blocks
    assert take_portion(blocks, every_n=3) == [0, 3, 6, 9]
    assert take_portion(blocks, fraction=0.5) == [0, 1, 2, 3, 4]
    assert take_portion(blocks, fraction=0.01) == [0]
    assert take_portion(blocks, fraction=1.0) == blocks
    assert take_portion(blocks, fraction=0.3) == [0, 1, 2]
