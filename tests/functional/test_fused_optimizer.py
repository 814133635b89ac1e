"""Switching optimizers to fused/foreach in place: flags, numerics, state, schedulers, and what is left alone."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf.functional.fused_optimizer import (
    choose_implementation,
    fused_kernel_error,
    match_state_layout,
    set_implementation,
    switch_implementation,
    validate_mode,
)


def _net() -> nn.Module:
    torch.manual_seed(0)  # no BatchNorm: Adam would turn rounding noise in near-zero gradients into full steps
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(X).square().mean().backward()
    optimizer.step()


OPTIMIZERS: list[tuple[Callable[..., torch.optim.Optimizer], dict[str, Any], str]] = [
    (torch.optim.AdamW, {}, "fused"),
    (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01}, "fused"),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, "fused"),
    (torch.optim.Adagrad, {}, "fused"),
    (torch.optim.RMSprop, {"momentum": 0.5}, "foreach"),
    (torch.optim.NAdam, {}, "foreach"),
]


@pytest.mark.parametrize(("cls", "kwargs", "expected"), OPTIMIZERS, ids=[c[0].__name__ for c in OPTIMIZERS])
def test_switch_mid_training_keeps_state_and_matches_the_default(cls, kwargs, expected: str) -> None:
    reference, switched = _net(), _net()
    ref_opt = cls(reference.parameters(), lr=1e-2, **kwargs)
    opt = cls(switched.parameters(), lr=1e-2, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for _ in range(2):
        _step(reference, ref_opt), ref_scheduler.step()
        _step(switched, opt), scheduler.step()
    first = next(iter(switched.parameters()))
    state_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[first].items()}

    choice = switch_implementation(opt)

    assert choice.implementation == expected and choice.reason is None
    assert all(g[expected] is True for g in opt.param_groups) and opt.defaults[expected] is True
    assert scheduler.optimizer is opt  # the same object: nothing to rebind
    for key, value in state_before.items():  # exp_avg, momentum_buffer, sum...: values carried over
        torch.testing.assert_close(opt.state[first][key].cpu().to(value.dtype), value, rtol=0, atol=0, msg=key)
    for _ in range(3):
        _step(reference, ref_opt), ref_scheduler.step()
        _step(switched, opt), scheduler.step()
    assert scheduler.get_last_lr() == ref_scheduler.get_last_lr()
    for p, q in zip(reference.parameters(), switched.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_fused_moves_step_counters_to_the_parameter_device_in_float32() -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt)
    set_implementation(opt, "fused")
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32 and float(step) == 1.0


def test_state_tensors_take_their_parameter_layout() -> None:
    """torch's fused CPU kernels compute wrong updates when a state tensor is laid out differently from its
    parameter (a channels-last weight resumed from a contiguous checkpoint); the switch realigns them."""

    def two_steps(fused: bool, channels_last: bool) -> torch.Tensor:
        torch.manual_seed(0)
        p, g = torch.randn(8, 4, 3, 3), torch.randn(8, 4, 3, 3)
        if channels_last:
            p, g = p.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
        p.requires_grad_()
        opt = torch.optim.AdamW([p], lr=0.1)
        p.grad = g.clone(memory_format=torch.preserve_format)
        opt.step()
        for key in ("exp_avg", "exp_avg_sq"):  # as loaded from a checkpoint written without channels-last
            opt.state[p][key] = opt.state[p][key].contiguous()
        if fused:
            set_implementation(opt, "fused")
        p.grad = g.clone(memory_format=torch.preserve_format)
        opt.step()
        return p.detach().contiguous()

    torch.testing.assert_close(two_steps(fused=True, channels_last=True), two_steps(fused=False, channels_last=False))
    weight = torch.zeros(2, 3, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    opt.state[weight]["momentum_buffer"] = torch.ones(2, 3, 3, 3)
    assert match_state_layout(opt) == 1
    assert opt.state[weight]["momentum_buffer"].stride() == weight.stride()
    assert match_state_layout(opt) == 0


@pytest.mark.parametrize(
    ("make", "mode", "reason"),
    [
        (lambda ps: torch.optim.LBFGS(ps), "auto", "LBFGS has neither a fused nor a foreach implementation"),
        (lambda ps: torch.optim.Adam(ps, fused=True), "auto", "already fused"),
        (lambda ps: torch.optim.Adam(ps, foreach=False), "auto", r"asked for the for-loop implementation \(foreach"),
        (lambda ps: torch.optim.SGD(ps, fused=False), "fused", r"for-loop implementation \(fused=False\)"),
        (lambda ps: torch.optim.Adam(ps, differentiable=True), "auto", "differentiable=True"),
        (lambda ps: torch.optim.RMSprop(ps), "fused", "RMSprop has no fused implementation in torch"),
        (lambda ps: torch.optim.Adam(ps, foreach=True), "foreach", "already uses foreach"),
    ],
)
def test_left_alone_with_a_reason(make, mode: str, reason: str) -> None:
    opt = make(_net().parameters())
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    choice = switch_implementation(opt, mode)  # type: ignore[arg-type]
    assert choice.implementation is None
    assert choice.reason is not None and re.search(reason, choice.reason), choice.reason
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def test_parameters_fused_kernels_reject_fall_back_to_foreach() -> None:
    complex_param = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    choice = choose_implementation(torch.optim.SGD([complex_param], lr=0.1), "auto")
    assert choice.implementation == "foreach"
    choice = choose_implementation(torch.optim.SGD([complex_param], lr=0.1), "fused")
    assert choice.implementation is None and "complex64 parameters (fused needs floating point)" in str(choice.reason)

    embedding = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    assert choose_implementation(opt, "auto", sparse_params=[embedding.weight]).implementation == "foreach"
    choice = choose_implementation(opt, "fused", sparse_params=[embedding.weight])
    assert "sparse gradients" in str(choice.reason)


def test_fused_kernels_exist_on_this_cpu() -> None:
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert fused_kernel_error(cls, torch.device("cpu"), dtype) is None, (cls, dtype)

    class MyAdam(torch.optim.AdamW):  # a user's subclass is probed through its torch base class
        pass

    assert fused_kernel_error(MyAdam, torch.device("cpu"), torch.float32) is None
    assert "no fused implementation" in str(fused_kernel_error(torch.optim.RMSprop, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("bad", ["fast", None, 1])
def test_mode_validation(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"mode={bad!r}.*Expected one of 'fused', 'foreach', 'auto'"):
        validate_mode(bad)
