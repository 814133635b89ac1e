"""Shared by the compile tests: backends that count or fail cheaply, and a small model of repeated blocks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CountingBackend:
    """A torch.compile backend that records each graph (and the keyword arguments) it is given and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.kwargs: list[dict[str, Any]] = []
        self.__name__ = "counting"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        self.graphs.append(gm)
        self.kwargs.append(kwargs)
        return gm.forward


def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """A compiler crash, simulated without inductor."""
    raise RuntimeError("simulated compiler crash")


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Tower(nn.Module):
    """Embedding, an ``nn.ModuleList`` of identical blocks, a head: the shape of a transformer."""

    def __init__(self, depth: int = 4, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
