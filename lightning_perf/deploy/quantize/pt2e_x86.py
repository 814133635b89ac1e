"""The ``x86`` back-end after training: PT2E calibration and ``convert_pt2e`` into an int8 q/dq graph.

The converted graph is fast only once lowered by inductor with weight freezing (``torch.compile`` under
``torch._inductor.config.patch(freezing=True)``); run as is, it is slower than the float model. torchao is imported
only inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_perf._device import module_device
from lightning_perf.functional.inputs import split_inputs
from lightning_perf.functional.quantization.qat import allow_train_eval, counts_batches, fast_pattern_matching

__all__ = ["calibrate", "convert_x86"]


@torch.no_grad()
def calibrate(prepared: nn.Module, batches: Iterable[Any], input_key: str | None = None) -> int:
    """Run ``batches`` through a PTQ-prepared model in eval mode so its observers see real data; returns the
    number of samples seen. The model inputs of each batch are found with
    :func:`~lightning_perf.functional.inputs.split_inputs`.
    """
    device = module_device(prepared)
    prepared.eval()
    seen = 0
    for batch in batches:
        inputs = split_inputs(batch, input_key)
        prepared(*(t.to(device) for t in inputs))
        seen += int(inputs[0].shape[0])
    return seen


def convert_x86(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``convert_pt2e`` of ``model`` (a copy the caller owns, on the CPU, in eval mode), in place of it."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    # Inference does not count batches; the counter's `add_` would stay in the int8 graph otherwise.
    for node in [n for n in model.graph.nodes if counts_batches(n) and not n.users]:
        model.graph.erase_node(node)
    with fast_pattern_matching():
        return allow_train_eval(convert_pt2e(model))
