"""A tiny LightningModule that shards itself with FSDP2 in ``configure_model``, on a 1-process gloo group: the cheap
way to check what a callback does with a sharded model (the 2-process fits are the generic FSDP2 test's)."""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@pytest.fixture
def one_process_group() -> Iterator[None]:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


class ShardsItself(pl.LightningModule):
    """``fully_shard`` on its first layer, then on the whole net, in ``configure_model`` (as torchtitan orders it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.example_input_array = torch.randn(2, 4)

    def configure_model(self) -> None:
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]
