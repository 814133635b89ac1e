"""The captured call: what `forward` received, kept once with its structure, and replayed positionally."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf.functional.inputs import CallRecorder, CapturedCall, as_input_tuple, call_of, export_shapes


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, extra: dict[str, Any], *, mask: torch.Tensor | None = None, scale: float = 1.0):
        out = self.linear(x * scale + extra["bias"]) + extra["table"].sum()
        return out if mask is None else out * mask.unsqueeze(-1)


def _call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    extra = {"bias": torch.randn(4, 3), "table": torch.randn(5), "off": None}
    return (torch.randn(4, 3, requires_grad=True), extra), {"mask": torch.ones(4), "scale": 2.0}


def test_the_recorder_keeps_the_first_call_detached_on_the_cpu_and_removes_its_hook() -> None:
    net = _Net()
    recorder = CallRecorder(net)
    args, kwargs = _call()
    net(*args, **kwargs)
    net(torch.zeros(4, 3), args[1], mask=None)  # a second call changes nothing
    call = recorder.call
    assert call is not None and not net._forward_pre_hooks
    assert not call.args[0].requires_grad and call.args[0].device.type == "cpu"
    torch.testing.assert_close(call.args[0], args[0].detach())
    assert call.args[1]["off"] is None and call.kwargs["scale"] == 2.0 and call.kwargs["mask"] is not None
    # The batched tensors are the inputs; the table (5 rows, not 4) stays a constant of the call.
    assert [tuple(t.shape) for t in call.tensors] == [(4, 3), (4, 3), (4,)]
    assert call.names(net) == ["x", "extra_bias", "mask"]
    assert not call.positional


def test_the_adapter_calls_the_model_as_the_call_did_and_the_reverse_takes_it_back() -> None:
    net = _Net().eval()
    args, kwargs = _call()
    call = call_of(net, lambda: net(*args, **kwargs), "a test")
    assert call is not None
    adapter = call.adapter(net)
    with torch.no_grad():
        expected = net(*args, **kwargs)
        torch.testing.assert_close(adapter(*call.tensors), expected)
        other = [t * 3 for t in call.tensors]  # other inputs of the same structure go where the captured ones were
        rebuilt_args, rebuilt_kwargs = call.bind(tuple(other))
        torch.testing.assert_close(adapter(*other), net(*rebuilt_args, **rebuilt_kwargs))
        assert call.inputs_of(rebuilt_args, rebuilt_kwargs) == tuple(other)
    assert export_shapes(adapter, [{0: 1}, {0: 1}, {0: 1}]) == (({0: 1}, {0: 1}, {0: 1}),)  # *inputs: one argument
    with pytest.raises(ValueError, match="keyword or non-tensor arguments \\(mask, scale\\)"):
        as_input_tuple(call)


def test_a_positional_call_needs_no_adapter_and_call_of_stops_before_forward_runs() -> None:
    net = nn.Linear(3, 2)
    ran: list[bool] = []
    net.register_forward_hook(lambda *_: ran.append(True))
    x = torch.randn(2, 3)
    call = call_of(net, lambda: net(x), "a test")
    assert call is not None and call.positional and call.adapter(net) is net and call.names(net) == ["input"]
    assert not ran and len(net._forward_pre_hooks) == 0  # stopped before forward, hook gone
    assert call_of(net, lambda: None, "no call") is None
    assert CapturedCall((x,), {}).positional and as_input_tuple(CapturedCall((x,), {}))[0] is x
