"""Each callback under FSDP2 on 2 gloo CPU processes: ``python tests/callbacks/_fsdp2_mechanisms.py NAMES OUT ROOT``.

A user model that shards itself (``fully_shard`` per block, then on its root, in ``configure_model``) is trained for
4 steps under Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``, once plain and once
per scenario, all in one launch (Lightning's launcher re-runs this script for rank 1; later trainers reuse the process
group). Rank 0 writes, per scenario, the step losses, a checksum of its first gradients, whether the transform was seen
at work and whether it was undone, or the error that ended the fit. NAMES: comma-separated keys of :data:`SCENARIOS`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make `tests` and `lightning_perf` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.fsdp2_lm import Transformer, shard
from lightning_perf import callbacks as cb
from lightning_perf.functional.attention.swap import SDPACalls, SwappedAttention
from lightning_perf.functional.sharding import is_sharded_parameter

STEPS = 4
VOCAB, SEQ, WIDTH, HEADS, DEPTH = 64, 16, 32, 4, 3


# ------------------------------------------------------------------------------------------------------------ models


def TinyLM() -> nn.Module:
    """The example's transformer (examples/fsdp2_lm.py, so the example's model is tested), tiny."""
    return Transformer(VOCAB, WIDTH, HEADS, DEPTH)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class TinySegNet(nn.Module):
    """A fully convolutional per-pixel classifier (so sliding-window inference applies to it)."""

    def __init__(self, channels: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(DEPTH))
        self.head = nn.Conv2d(channels, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ShardedModule(pl.LightningModule):
    """Shards itself the FSDP2 way: ``fully_shard`` on each block, then on the root, in ``configure_model``."""

    def __init__(self, kind: str = "lm", fail_at_step: int | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.fail_at_step = fail_at_step
        self.model = TinyLM() if kind == "lm" else TinySegNet()
        self.roi_size = 8
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        assert self.device_mesh is not None  # set by ModelParallelStrategy before configure_model
        shard(self.model, self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError("planned failure")
        x, y = batch
        loss = F.cross_entropy(self(x), y.flatten() if self.kind == "lm" else y)  # the LM's logits: one row a token
        self.losses.append(float(loss.detach()))
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def make_data(kind: str, size: int = 2) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    n = 2 * STEPS * size
    if kind == "lm":
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=generator)
        dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    else:
        images = torch.randn(n, 3, 8, 8, generator=generator)
        dataset = TensorDataset(images, (images[:, 0] > 0).long() + (images[:, 0] > 1).long())
    return DataLoader(dataset, batch_size=size)


# ----------------------------------------------------------------------------------------------------------- probing


class Probe(pl.Callback):
    """Records the first step's gradients (local shards) and what the scenario's check wants to see during training."""

    def __init__(self, during: Callable[[pl.LightningModule], dict[str, Any]] | None = None) -> None:
        self.during = during
        self.facts: dict[str, Any] = {}
        self.grad_checksum: float | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.grad_checksum is None:
            total = 0.0
            for p in pl_module.parameters():
                if p.grad is not None:
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    total += float(grad.double().abs().sum())
            self.grad_checksum = total

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == 1:
            self.facts.update(_optimizer_flags(trainer))
            if self.during is not None:
                self.facts.update(self.during(pl_module))


def _sharded_blocks(pl_module: pl.LightningModule) -> list[nn.Module]:
    return list(pl_module.model.blocks)


def _forward_calls(pl_module: pl.LightningModule) -> dict[str, Any]:
    """Runs one forward+backward of a block and counts how often its first layer runs (2: recomputed in backward)."""
    block = _sharded_blocks(pl_module)[0]
    calls = []
    handle = block.norm1.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(2, SEQ, WIDTH, requires_grad=True)
    block(x).sum().backward()
    handle.remove()
    for p in pl_module.parameters():
        p.grad = None
    return {"block_forward_calls_per_step": len(calls)}


def _sdpa_counts(pl_module: pl.LightningModule) -> dict[str, Any]:
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with SDPACalls(pl_module) as calls:
        pl_module(tokens).sum().backward()
    for p in pl_module.parameters():
        p.grad = None
    swapped = [type(b.attn).__name__ for b in _sharded_blocks(pl_module)]
    return {"sdpa_calls": calls.total, "attention_classes": swapped}


def _conv_layout(pl_module: pl.LightningModule) -> dict[str, Any]:
    """Watches the next forward of a sharded block's convolution: is its output channels-last?"""
    outputs: list[bool] = []
    conv = _sharded_blocks(pl_module)[0].conv1

    def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        outputs.append(output.is_contiguous(memory_format=torch.channels_last) and not output.is_contiguous())
        handle.remove()

    handle = conv.register_forward_hook(record)
    return {"conv_output_channels_last": outputs}  # filled in by the step that follows


def _optimizer_flags(trainer: pl.Trainer) -> dict[str, Any]:
    group = trainer.optimizers[0].param_groups[0]
    return {"fused": group.get("fused"), "foreach": group.get("foreach")}


def _undone(pl_module: pl.LightningModule) -> dict[str, Any]:
    modules = list(pl_module.modules())
    return {
        "forward_patches": sum("forward" in m.__dict__ for m in modules),
        "compiled": sum(getattr(m, "_compiled_call_impl", None) is not None for m in modules),
        "swapped_attention": sum(isinstance(m, SwappedAttention) for m in modules),
        "sharded_params": sum(is_sharded_parameter(p) for p in pl_module.parameters()),
    }


# --------------------------------------------------------------------------------------------------------- scenarios

# name -> (model kind, callbacks factory, check during training, stage)
SCENARIOS: dict[str, tuple[str, Callable[[], list[pl.Callback]], Any]] = {
    "plain": ("lm", lambda: [], _forward_calls),
    "grad_checkpoint": ("lm", lambda: [cb.GradCheckpointCallback()], _forward_calls),
    "grad_checkpoint_budget": ("lm", lambda: [cb.GradCheckpointCallback(memory_budget=0.5)], _forward_calls),
    "plain_conv": ("conv", lambda: [], _conv_layout),
    "channels_last_window": (  # both change nothing a training step computes; one fit serves both
        "conv",
        lambda: [
            cb.ChannelsLastCallback(),
            cb.SlidingWindowInferenceCallback(roi_size=8, sw_batch_size=2, overlap=0.25, mode="constant"),
        ],
        _conv_layout,
    ),
    "stack": (
        "lm",
        lambda: [
            cb.FlashAttentionCallback(),
            cb.GradCheckpointCallback(),
            cb.CompileCallback(backend="aot_eager"),
            cb.FusedOptimizerCallback(),
        ],
        _sdpa_counts,
    ),
    "stack_failing": (
        "lm",
        lambda: [cb.FlashAttentionCallback(), cb.GradCheckpointCallback(), cb.FusedOptimizerCallback()],
        None,
    ),
}


def run(name: str, root: Path) -> dict[str, Any]:
    kind, make_callbacks, during = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    module = ShardedModule(kind, fail_at_step=2 if name == "stack_failing" else None)
    probe = Probe(during)
    callbacks = make_callbacks()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        callbacks=[*callbacks, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    result: dict[str, Any] = {}
    began = time.perf_counter()
    try:
        trainer.fit(module, make_data(kind))
    except Exception as error:  # reported, not raised: the other scenarios still run
        result["error"] = f"{type(error).__name__}: {error}"
        if name != "stack_failing":
            result["traceback"] = traceback.format_exc()[-3000:]
    result["seconds"] = round(time.perf_counter() - began, 1)
    result.update(losses=module.losses, grad_checksum=probe.grad_checksum, during=probe.facts)
    result["after"] = _undone(module)
    if trainer.optimizers:
        result["optimizer_after"] = _optimizer_flags(trainer)
    for callback in callbacks:
        for attribute in ("wrapped", "swapped", "report"):
            value = getattr(callback, attribute, None)
            if isinstance(value, list):
                result.setdefault(attribute, value)
            elif attribute == "report" and isinstance(value, dict) and "compiled" in value:
                result["compiled"] = value["compiled"]
                result["compile_report"] = {k: value[k] for k in ("compilations", "unique_graphs", "graph_breaks")}
        if isinstance(callback, cb.GradCheckpointCallback) and callback.plan is not None:
            result["plan"] = callback.plan.describe()
        if isinstance(callback, cb.MemoryProfilerCallback):
            result["memory_report"] = callback.report is not None
        if isinstance(callback, cb.FlashAttentionCallback):
            result["decisions"] = {k: [d.kernel, d.reason] for k, d in callback.decisions.items()}
    if name == "channels_last_window" and "error" not in result:
        result.update(_predict_with_window(module, callbacks, root))
    return result


def _predict_with_window(module: ShardedModule, callbacks: list[pl.Callback], root: Path) -> dict[str, Any]:
    from monai.inferers import sliding_window_inference

    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    predictions = trainer.predict(module, DataLoader(TensorDataset(images), batch_size=2))
    assert predictions is not None
    got = torch.cat([p for p in predictions if isinstance(p, torch.Tensor)])
    with torch.no_grad():
        mine = images[0::2] if dist.get_rank() == 0 else images[1::2]  # DistributedSampler's share of this rank
        expected = torch.cat(
            [
                sliding_window_inference(mine[i : i + 1], 8, 2, module, overlap=0.25, mode="constant")
                for i in range(len(mine))
            ]
        )
    return {"predict_shape": list(got.shape), "predict_matches_monai": bool(torch.allclose(got, expected, atol=1e-5))}


def main() -> None:
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    names, out, root = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    results = {}
    for name in names.split(","):
        results[name] = run(name, root)
        if dist.is_initialized() and dist.get_rank() == 0:  # after each scenario: a hang later keeps what ran
            out.write_text(json.dumps(results, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
