"""The batch path of the deploy layer: a batch goes through the datamodule's and the module's own hooks, as in fit."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_perf.deploy.inputs import model_inputs, submodule_inputs, through_batch_hooks


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * 2)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("module.before")
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self.calls.append(f"module.transfer:{device}")
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("module.after")
        return (batch[0] + 1, batch[1])


class _Data(pl.LightningDataModule):
    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("data.before")
        return (batch[0] * 10, batch[1])


def test_each_hook_is_the_datamodules_when_it_overrides_it_else_the_modules() -> None:
    module = _Module()
    data = _Data(module.calls)
    x, y = torch.ones(2, 3), torch.zeros(2)
    out = through_batch_hooks(module, (x, y), datamodule=data)
    assert module.calls == ["data.before", "module.transfer:cpu", "module.after"]
    torch.testing.assert_close(out[0], x * 10 + 1)
    module.calls.clear()
    out = through_batch_hooks(module, (x, y))  # no datamodule: the module's own three hooks
    assert module.calls == ["module.before", "module.transfer:cpu", "module.after"]
    torch.testing.assert_close(out[0], x + 1)


def test_a_datamodule_without_overrides_defers_to_the_module_and_plain_modules_skip_hooks() -> None:
    module = _Module()
    plain_data = pl.LightningDataModule()
    batches = list(model_inputs(module, [(torch.ones(1, 3), torch.zeros(1))] * 2, datamodule=plain_data))
    assert len(batches) == 2 and module.calls.count("module.after") == 2
    x = torch.ones(2, 3)
    assert through_batch_hooks(nn.Linear(3, 2), x) is x


def test_submodule_inputs_are_what_the_submodule_receives() -> None:
    module = _Module()
    (captured,) = submodule_inputs(module, module.net, torch.ones(2, 3), "a test batch")
    torch.testing.assert_close(captured, torch.full((2, 3), 2.0))  # the forward doubled it before calling net
