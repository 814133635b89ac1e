"""Small models we did not design for lightning_perf: built from torch's own layers or written the usual ways."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F


def encoder(depth: int = 3, dim: int = 16, heads: int = 2, dropout: float = 0.0) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """torchvision-style: a stem, stages as plain ``nn.Sequential`` of blocks, a head."""

    def __init__(self, blocks_per_stage: int = 2, widths: tuple[int, ...] = (4, 8)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]))
        stages, cin = [], widths[0]
        for i, width in enumerate(widths):
            blocks = [
                BasicBlock(cin if j == 0 else width, width, 2 if i and j == 0 else 1) for j in range(blocks_per_stage)
            ]
            stages.append(nn.Sequential(*blocks))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stages(F.relu(self.stem(x))).mean((2, 3)))


class Stage(nn.Module):
    """A custom stage class holding its blocks (timm-style), so stages are themselves repeated siblings."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class NanoGPTAttention(nn.Module):
    """nanoGPT's ``CausalSelfAttention`` written out eagerly, with its dropouts and its causal ``bias`` buffer."""

    bias: Tensor

    def __init__(self, n_embd: int = 16, n_head: int = 2, block_size: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class PerHeadQKVAttention(nn.Module):
    """Bidirectional attention whose fused projection is laid out per head (GPT-NeoX style), no head-count attribute."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self._h = heads

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.to_qkv(x).view(B, T, self._h, 3, C // self._h).permute(3, 0, 2, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(C // self._h)).softmax(-1)
        return self.to_out((att @ v).transpose(1, 2).reshape(B, T, C))


class ScaledDifferentlyAttention(PerHeadQKVAttention):
    """Looks like fused-QKV attention but scales scores by ``1 / head_dim`` (muP): no standard variant matches."""

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.to_qkv(x).view(B, T, self._h, 3, C // self._h).permute(3, 0, 2, 1, 4)
        att = (q @ k.transpose(-2, -1) / (C // self._h)).softmax(-1)
        return self.to_out((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, attention: nn.Module, dim: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = attention
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 16, vocab: int = 11, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(NanoGPTAttention(dim, 2, 32, dropout), dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SequenceModule(pl.LightningModule):
    """A LightningModule around any ``(B, T, dim) -> (B, T, dim)`` network, regressing a fixed random target.

    Deterministic data (no shuffling), so two runs with the same seed train identically.
    """

    def __init__(self, net: nn.Module | None = None, dim: int = 16, seq: int = 8, samples: int = 32) -> None:
        super().__init__()
        self.net = net if net is not None else encoder(dim=dim)
        g = torch.Generator().manual_seed(0)
        self.data = torch.utils.data.TensorDataset(torch.randn(samples, seq, dim, generator=g))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=8)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=8)


def trainer(root: object, **kwargs: object) -> pl.Trainer:
    options: dict = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 3,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 1,
        "default_root_dir": root,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


# ------------------------------------------------------- models with dropout and batch norm (tests/test_trust.py)


class ConvBNDropout(nn.Module):
    """A small conv net with BatchNorm (running statistics) and both spatial and plain dropout."""

    def __init__(self, classes: int = 4, p: float = 0.2, width: int = 32) -> None:
        super().__init__()
        first = [nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(p)]
        second = [nn.Conv2d(8, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        self.features = nn.Sequential(*first, *second)
        self.dropout = nn.Dropout(p)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dropout(self.features(x).mean((2, 3))))


class FusedQKVTransformer(nn.Module):
    """Blocks of hand-written fused-QKV attention (nanoGPT's, with ``nn.Dropout`` on the attention weights)."""

    def __init__(self, depth: int = 2, dim: int = 16, seq: int = 8, dropout: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(NanoGPTAttention(dim, 2, seq, dropout), dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class EncoderWithDropout(nn.Module):
    """``nn.MultiheadAttention(dropout > 0)`` inside ``nn.TransformerEncoderLayer``, then a head."""

    def __init__(self, dim: int = 16, dropout: float = 0.2) -> None:
        super().__init__()
        self.encoder = encoder(depth=2, dim=dim, heads=2, dropout=dropout)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))


class BranchesOnTraining(nn.Module):
    """A forward that takes another path in training (noise and dropout, as stochastic regularizers do)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inner(x)
        if self.training:  # noqa: SIM108 - the branch on self.training is what this model is for
            h = F.dropout(h, 0.2, training=True) + 0.1 * torch.randn_like(h)
        else:
            h = 0.5 * h
        return self.head(self.norm(x + h))


# ---------------------------------------- models that shard themselves (FSDP2 in configure_model, tests/_multiproc.py)


def shard_blocks(root: nn.Module, blocks: nn.ModuleList, mesh: Any) -> None:
    """What a user of ``ModelParallelStrategy`` writes: ``fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)


class _SelfShardingModule(pl.LightningModule):
    """Deterministic data (no shuffling), SGD with momentum, and FSDP2 per block in ``configure_model``.

    Under ``ModelParallelStrategy`` the blocks are sharded over the mesh's ``data_parallel`` dimension; under any
    other strategy (no device mesh) ``configure_model`` leaves the model as it is, so the same class trains plainly.
    """

    net: nn.Module
    data: torch.utils.data.TensorDataset

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        mesh = self.device_mesh
        if mesh is None or isinstance(self.net, FSDPModule):
            return
        shard_blocks(self.net, self.net.blocks, mesh["data_parallel"])  # type: ignore[arg-type]

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _loss(self, batch: list[Tensor]) -> Tensor:
        x, y = batch
        out = self(x)
        classes = out.shape[1] if out.dim() != 3 else out.shape[-1]
        out = out.movedim(1, -1) if out.dim() != 3 else out
        return F.cross_entropy(out.reshape(-1, classes), y.reshape(-1))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def _loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


class ShardedLM(_SelfShardingModule):
    """A small decoder-only LM (nanoGPT blocks: eager causal attention + MLP) that shards itself block by block."""

    def __init__(self, vocab: int = 32, dim: int = 32, depth: int = 2, seq: int = 16, samples: int = 32) -> None:
        super().__init__()
        self.net = TinyGPT(depth=depth, dim=dim, vocab=vocab)  # a 32-token causal mask: seq <= 32
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, vocab, (samples, seq + 1), generator=g)
        self.data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.example_input_array = tokens[:4, :-1]


class _ConvBlock(nn.Module):
    def __init__(self, width: int, dims: int) -> None:
        super().__init__()
        conv, norm = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)
        self.conv1, self.bn1 = conv(width, width, 3, padding=1, bias=False), norm(width)
        self.conv2, self.bn2 = conv(width, width, 3, padding=1, bias=False), norm(width)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class _DenseConvNet(nn.Module):
    def __init__(self, dims: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        self.stem = conv(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(_ConvBlock(width, dims) for _ in range(depth))
        self.head = conv(width, classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ShardedConvNet(_SelfShardingModule):
    """A dense-prediction residual conv net (2D or 3D, BatchNorm) that shards itself block by block.

    Per-pixel (per-voxel) classes, so inference transforms that need a spatial output (sliding windows) apply too.
    """

    def __init__(self, dims: int = 2, width: int = 8, depth: int = 2, size: int = 16, samples: int = 32) -> None:
        super().__init__()
        if dims not in (2, 3):
            raise ValueError(f"`ShardedConvNet(dims={dims!r})` is not valid. Expected 2 or 3.")
        classes = 4
        self.net = _DenseConvNet(dims, width, depth, classes)
        g = torch.Generator().manual_seed(2)
        size = size if dims == 2 else size // 2
        shape = (size,) * dims
        x = torch.randn(samples, 3, *shape, generator=g)
        self.data = torch.utils.data.TensorDataset(x, torch.randint(0, classes, (samples, *shape), generator=g))
        self.example_input_array = x[:4]


def run_result(config: str, repeat: int, steps: list[float], memory: int = 100, **fields: Any) -> Any:
    """A benchmark run of batch 4 that ran: its step times, their median, the samples per second at it, 1 s of
    warm-up, ``memory`` bytes a step and twice that at peak; ``fields`` add to or replace these."""
    from lightning_perf.benchmark.worker import RunResult

    median = float(statistics.median(steps))
    return RunResult(**{"spec": {"config": config, "repeat": repeat}, "batch_size": 4, "step_median_s": median,
                        "step_times_s": steps, "throughput": 4 / median, "warmup_s": 1.0, "step_memory_bytes": memory,
                        "peak_memory_bytes": 2 * memory, **fields})  # fmt: skip


class ScriptedClock:
    """Time that moves only when the test moves it: ``now`` (nanoseconds, or seconds where a test sets it so)."""

    def __init__(self, now: float = 0) -> None:
        self.now = now

    def __call__(self) -> Any:
        return self.now

    def advance(self, ms: float) -> None:
        """Moves ``now`` on by ``ms`` milliseconds, in nanoseconds."""
        self.now += int(ms * 1_000_000)


SHARDED_MODELS: dict[str, Callable[[], pl.LightningModule]] = {
    "lm": ShardedLM,
    "conv2d": lambda: ShardedConvNet(dims=2),
    "conv3d": lambda: ShardedConvNet(dims=3),
}
