"""What a model is made of, as far as the bench's default set cares: the facts :func:`default_configs` decides on.

Entry points: :func:`probe_structure`, :func:`structure_of_source`, :func:`training_step_flops`,
:class:`ModelStructure`. Design notes: docs/architecture.md, Module notes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_perf.profiling.flops import FlopCount

__all__ = [
    "CONV_SHARE_MIN",
    "ModelStructure",
    "probe_structure",
    "structure_of",
    "structure_of_source",
    "training_step_flops",
]

CONV_SHARE_MIN = 0.05
"""The share of one training step's FLOPs that convolutions must carry for channels-last to be worth measuring."""

_CONV_OPS = ("convolution",)  # aten.convolution, aten.convolution_backward, aten._convolution
_LINEAR_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul")


@dataclass(frozen=True)
class ModelStructure:
    """The facts of one model that choose the bench's default set.

    Attributes:
        model: the model's class name (for the reasons the bench prints).
        convolutions: names of its 2D and 3D convolution layers.
        conv_flop_share: the convolutions' share of one training step's FLOPs (``None``: not counted).
        linear_flop_share: the matrix products' share (Linear layers, attention's matmuls).
        attention: the attention modules the attention swap knows.
        fused_attention: those of them that already call ``scaled_dot_product_attention``.
        repeated_blocks: the repeated blocks regional compilation compiles once (``select_regions(model, "auto")``).
        block_class: their class name.
        block_shapes: how many different parameter shapes the repeated blocks come in (0: none, or not known); one
            shape compiles once and is reused by every block, each further shape is compiled apart.
        unknown: why some fact could not be found (the FLOP count or the model's build failed), else ``""``.
    """

    model: str = "the model"
    convolutions: tuple[str, ...] = ()
    conv_flop_share: float | None = None
    linear_flop_share: float | None = None
    attention: tuple[str, ...] = ()
    fused_attention: tuple[str, ...] = ()
    repeated_blocks: tuple[str, ...] = ()
    block_class: str | None = None
    block_shapes: int = 0
    unknown: str = ""

    def __post_init__(self) -> None:
        for name in ("convolutions", "attention", "fused_attention", "repeated_blocks"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("conv_flop_share", "linear_flop_share"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not 0.0 <= float(value) <= 1.0):
                raise ValueError(f"`ModelStructure({name}={value!r})` is not valid. Expected a fraction in [0, 1].")

    @property
    def unfused_attention(self) -> tuple[str, ...]:
        """The attention modules the swap would put on a fused kernel."""
        return tuple(name for name in self.attention if name not in self.fused_attention)

    @property
    def conv_heavy(self) -> bool:
        """Whether convolutions carry a real share of the work (from the layers alone when FLOPs are unknown)."""
        if self.conv_flop_share is None:
            return bool(self.convolutions)
        return self.conv_flop_share >= CONV_SHARE_MIN

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values."""
        data = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelStructure:
        """The structure :meth:`to_dict` wrote (unknown keys are refused, naming them)."""
        known = {f.name for f in fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(
                f"`ModelStructure.from_dict({dict(data)!r})`: unknown keys {extra}. Expected {sorted(known)}."
            )
        return cls(**dict(data))


def probe_structure(
    model: nn.Module, flops_by_operator: Mapping[str, int] | None = None, *, unknown: str = ""
) -> ModelStructure:
    """The structure of ``model`` (its parameters are only read; attention modules are called on small random inputs
    to see whether they already use SDPA), with the FLOP shares taken from ``flops_by_operator`` when given."""
    from lightning_perf.functional.attention.swap import SwappedAttention, attention_adapters
    from lightning_perf.functional.channels_last import find_conv_layers
    from lightning_perf.functional.compile.regions import select_regions

    found = find_conv_layers(model)
    blocks = select_regions(model, "auto")
    attention: list[str] = []
    fused: list[str] = []
    adapters = attention_adapters()
    for name, module in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer in attention):
            continue
        if isinstance(module, SwappedAttention):
            attention.append(name)
            fused.append(name)
            continue
        adapter = next((a for a in adapters if a.matches(module, name)), None)
        if adapter is not None:
            attention.append(name)
            if _already_fused(adapter, module):
                fused.append(name)
    conv_share = linear_share = None
    total = sum(flops_by_operator.values()) if flops_by_operator else 0
    if flops_by_operator and total > 0:
        conv_share = sum(n for op, n in flops_by_operator.items() if any(k in op for k in _CONV_OPS)) / total
        linear_share = sum(n for op, n in flops_by_operator.items() if _is_matmul(op)) / total
    return ModelStructure(
        model=type(model).__name__,
        convolutions=tuple(found.get(2, []) + found.get(3, [])),
        conv_flop_share=conv_share,
        linear_flop_share=linear_share,
        attention=tuple(attention),
        fused_attention=tuple(fused),
        repeated_blocks=tuple(name for name, _ in blocks),
        block_class=type(blocks[0][1]).__name__ if blocks else None,
        block_shapes=len({tuple((n, tuple(p.shape)) for n, p in block.named_parameters()) for _, block in blocks}),
        unknown=unknown,
    )


def _is_matmul(op: str) -> bool:
    return any(op == name or op.startswith(name + ".") for name in _LINEAR_OPS)


def _already_fused(adapter: Any, module: nn.Module) -> bool:
    """The adapter's own verdict; a module its sample call cannot run counts as not fused (the swap then says why)."""
    import torch

    try:
        return bool(adapter.already_fused(module, adapter.sample_inputs(module, torch.Generator().manual_seed(0))))
    except Exception:
        return False


_CACHE: dict[str, ModelStructure | None] = {}


def structure_of_source(
    source: Mapping[str, Any] | None,
    *,
    workload: str = "convnet",
    preset: str = "default",
    seed: int = 0,
    batch_size: int | None = None,
) -> ModelStructure | None:
    """The structure of the model a bench runs: the user's (``source``, a ``ModelSource.to_dict()``) or the reference
    ``workload``, built once in this process and remembered for the same arguments. ``None`` when the model cannot be
    built here (the bench's workers then say why); FLOPs that cannot be counted leave ``unknown`` saying why."""
    import json

    key = json.dumps([source, workload, preset, seed, batch_size], sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE[key] = _probe_source(source, workload, preset, seed, batch_size)
    return _CACHE[key]


def _probe_source(
    source: Mapping[str, Any] | None, workload: str, preset: str, seed: int, batch_size: int | None
) -> ModelStructure | None:
    import torch

    from lightning_perf.benchmark.sources import WorkloadSource, source_from_dict

    built = source_from_dict(dict(source)) if source is not None else WorkloadSource(workload, preset, seed)
    settings = SimpleNamespace(batch_size=batch_size, loader_overrides={})
    with torch.random.fork_rng():  # the parent's random state stays as it was
        torch.manual_seed(seed)
        try:
            model, datamodule = built.build(settings)  # type: ignore[arg-type]  # the two fields build() reads
        except Exception:  # the workers will say it in full; the default set then follows the device alone
            return None
        return structure_of(model, datamodule)


def structure_of(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> ModelStructure:
    """The structure of a built model, its FLOP shares counted on one training batch of ``datamodule`` on the meta
    device (the model and data module are not changed)."""
    flops, why = _flops_by_operator(model, datamodule)
    return probe_structure(model, flops, unknown=why)


def _flops_by_operator(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> tuple[dict[str, int], str]:
    """One training step's FLOPs per operator, counted on the meta device (shapes only: no arithmetic, so a large
    model costs no more than a small one); ``({}, why)`` where the step cannot run there (an operator whose output
    shape depends on the data, a ``.item()``). A real step is not run instead: on a CPU it can take longer than a
    configuration's run, and the layers alone still decide."""
    import copy

    import torch

    try:
        count = training_step_flops(copy.deepcopy(model), datamodule, torch.device("meta"))
    except Exception as exc:
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        return {}, f"its FLOPs could not be counted on the meta device ({why})"
    if count.total <= 0:
        return {}, "its training step counted 0 FLOPs"
    return dict(count.by_operator), ""


def training_step_flops(
    model: pl.LightningModule, datamodule: pl.LightningDataModule, device: torch.device
) -> FlopCount:
    """FLOPs of one training step of ``model`` outside a Trainer: ``training_step`` and ``loss.backward()`` on the
    first training batch, moved to ``device`` by the model's batch-transfer hooks (``meta``: shapes only).

    The optimizer's update is not counted (MFU convention, see :func:`~lightning_perf.profiling.flops.count_flops`).
    The model's parameters get gradients (and move to ``device``): pass a copy. ``self.log`` warns outside a Trainer;
    those warnings are silenced here, and here only.

    Raises:
        RuntimeError: for manual optimization (its ``training_step`` needs the Trainer's optimizers), or when
            ``training_step`` returns no loss with a gradient; whatever the model's own code raises passes through.
    """
    import torch

    from lightning_perf.profiling.flops import count_flops

    if not model.automatic_optimization:
        raise RuntimeError(
            "manual optimization: training_step runs its own backward and optimizer steps, which need a Trainer"
        )
    datamodule.setup("fit")
    batches = iter(datamodule.train_dataloader())
    batch = next(batches)
    del batches  # ends DataLoader workers, if any
    model.to(device)
    model.train()
    batch = model.on_after_batch_transfer(
        model.transfer_batch_to_device(model.on_before_batch_transfer(batch, 0), device, 0), 0
    )

    def step() -> None:
        output = model.training_step(batch, 0)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise RuntimeError(f"training_step returned no loss with a gradient (got {type(output).__name__})")
        loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return count_flops(step)
