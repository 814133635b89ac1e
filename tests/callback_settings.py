"""The registry of every public callback and strategy, with the model, data and arguments to test it on.

Generic tests (``tests/test_generic.py``) run over every entry: short fit, fit twice, fit -> validate -> test ->
predict, resume equal to an uninterrupted run, checkpoint keys, LightningCLI construction, pickling, 2-process DDP.
A public ``Callback`` or ``Strategy`` in :mod:`lightning_perf.callbacks` / :mod:`lightning_perf.strategies` without
an entry here fails ``test_every_public_class_has_a_setting``.

To add an optimization: append one ``Setting`` to ``SETTINGS``.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import Strategy

from lightning_perf.callbacks import (
    BackendFlagsCallback,
    BottleneckCallback,
    ChannelsLastCallback,
    CompileCallback,
    FlashAttentionCallback,
    Float8TrainingCallback,
    FusedOptimizerCallback,
    GradCheckpointCallback,
    MemoryProfilerCallback,
    QATCallback,
    SlidingWindowInferenceCallback,
    TensorRTExportCallback,
)
from lightning_perf.strategies import PowerSGDDDPStrategy
from tests import _device
from tests._trivial import CountingCallback

NUMERICS = ("exact", "close", "lossy")
_FLOAT = "float arithmetic in another order"
# "close": three SGD steps carry the rounding differences of the first forward on, a little amplified.
CLOSE = {"rtol": 1e-4, "atol": 1e-5}
# "lossy": a loss stays within this factor of the plain run's loss at the same step.
LOSSY_BAND = 1.5
# What the 2-process FSDP2 test (ModelParallelStrategy, tests/test_generic.py) expects of an entry.
FSDP2 = ("works", "refuses", "partial", "xfail: ", "skip: ")
# The self-sharding model (tests/_models.py SHARDED_MODELS) that stands in for each workload under FSDP2.
SHARDED_MODEL = {"convnet": "conv2d", "unet3d": "conv3d", "lm": "lm", "vit": "lm"}


@dataclass(frozen=True)
class Setting:
    """How to test one public class.

    Args:
        cls: the callback or strategy class.
        kwargs: constructor arguments (plain YAML-able values: the LightningCLI test builds it from YAML too).
        workload: reference workload from :mod:`lightning_perf.demos` to train.
        preset: its size preset.
        trainer_kwargs: extra Trainer arguments this class needs (e.g. a precision).
        resume_atol: tolerance of "resume equals uninterrupted" (0 means bit-identical).
        ddp: whether the 2-process DDP test applies.
        marks: pytest marks for every generic test of this entry (e.g. ``pytest.mark.slow``).
        test_only: entries that exist only to exercise the generic tests.
        numerics: how training with it compares with training without it, from the same seed
            (``tests/test_trust.py``): ``"exact"`` (bit-identical losses, gradients and weights: observers),
            ``"close"`` (within float tolerance: numerically equivalent transforms) or ``"lossy"`` (compared in its
            own terms: finite losses within a band, identical ``state_dict`` keys and gradient names).
        numerics_reason: why, for anything but ``"exact"``.
        fsdp2: the 2-process FSDP2 test (``ModelParallelStrategy``, a model that shards itself per block):
            ``"works"`` (the fit ends with the plain FSDP2 run's losses, in the terms of ``numerics``, and no
            lightning_perf warning), ``"refuses"`` (it says at setup, in an error or a warning, that it cannot apply
            under ``ModelParallelStrategy``), ``"partial"`` (it trains with the plain run's losses and one warning
            naming ``ModelParallelStrategy`` says what it leaves as it is), ``"xfail: <reason>"`` (meant to work,
            known to fail: a strict xfail the fix flips) or ``"skip: <reason>"`` (does not apply, e.g. a strategy of
            its own).
        cuda_skip: why the entry's generic and trust tests cannot hold on CUDA (``pytest --device cuda``); empty
            when they can.
    """

    cls: type
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    workload: str = "convnet"
    preset: str = "tiny"
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    resume_atol: float = 1e-6
    ddp: bool = True
    marks: tuple[Any, ...] = ()
    test_only: bool = False
    name: str | None = None
    numerics: str = "exact"
    numerics_reason: str = ""
    fsdp2: str = "works"
    cuda_skip: str = ""

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"Setting(numerics={self.numerics!r}) is not valid. Expected one of {NUMERICS}.")
        if self.numerics != "exact" and not self.numerics_reason:
            raise ValueError(f"Setting({self.id}) with numerics={self.numerics!r} must say why (numerics_reason).")
        if self.fsdp2 not in FSDP2[:3] and not (
            self.fsdp2.startswith(FSDP2[3:]) and self.fsdp2.split(":", 1)[1].strip()
        ):
            raise ValueError(
                f"Setting({self.id}, fsdp2={self.fsdp2!r}) is not valid. Expected 'works', 'refuses', 'partial', "
                "'xfail: <reason>' or 'skip: <reason>'."
            )
        if self.workload not in SHARDED_MODEL:
            raise ValueError(f"Setting({self.id}, workload={self.workload!r}): no sharded stand-in in SHARDED_MODEL.")

    @property
    def fsdp2_mode(self) -> str:
        """``"works"``, ``"refuses"``, ``"xfail"`` or ``"skip"``."""
        return self.fsdp2.split(":", 1)[0]

    @property
    def fsdp2_reason(self) -> str:
        return self.fsdp2.split(":", 1)[1].strip() if ":" in self.fsdp2 else ""

    @property
    def sharded_model(self) -> str:
        """The name of the self-sharding model this entry trains on under FSDP2 (tests/_models.py)."""
        return SHARDED_MODEL[self.workload]

    @property
    def id(self) -> str:
        return self.name or self.cls.__name__

    @property
    def is_strategy(self) -> bool:
        return issubclass(self.cls, Strategy)

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def build(self) -> Any:
        return self.cls(**copy.deepcopy(dict(self.kwargs)))


SETTINGS: list[Setting] = [
    Setting(CountingCallback, {"start": 0}, test_only=True),
    # Variants on another workload skip the 2-process DDP test (about 12 s each) when a sibling entry of the same
    # callback covers the same DDP path.
    Setting(CountingCallback, {"start": 0}, workload="lm", test_only=True, name="CountingCallback-lm", ddp=False),
    Setting(ChannelsLastCallback, numerics="close", numerics_reason=f"convolutions in NHWC: {_FLOAT}", fsdp2="partial"),
    Setting(
        ChannelsLastCallback,
        workload="unet3d",
        name="ChannelsLastCallback-unet3d",
        ddp=False,
        numerics="close",
        numerics_reason=f"convolutions in NDHWC: {_FLOAT}",
        fsdp2="partial",
    ),
    # Changes global state on every device without a no-effect warning (CPUs have flash and math kernels too).
    Setting(
        BackendFlagsCallback,
        {"sdpa_backends": ["flash", "math"]},
        workload="vit",
        numerics="close",
        numerics_reason=f"another SDPA kernel: {_FLOAT}",
    ),
    Setting(FusedOptimizerCallback, numerics="close", numerics_reason=f"one fused optimizer kernel: {_FLOAT}"),
    # Exports at every fit end (about 2 s of ONNX export each): two validation batch sizes, no timing.
    Setting(
        TensorRTExportCallback,
        {"backends": ["onnx"], "batch_range": [1, 2, 2], "latency_iterations": 0, "device": "cpu"},
        marks=(pytest.mark.slow,),
        fsdp2="refuses",  # warns at setup naming the strategy; export the consolidated checkpoint after training
    ),
    Setting(
        GradCheckpointCallback,
        workload="vit",
        numerics="close",
        numerics_reason="recomputed activations (dropout replayed from the saved RNG state)",
    ),
    Setting(
        GradCheckpointCallback,
        {"modules": "lightning_perf.demos.lm.LMBlock", "every_n": 2},
        workload="lm",
        name="GradCheckpointCallback-lm",
        ddp=False,
        fsdp2="skip: its arguments name the lm workload's block class; GradCheckpointCallback covers sharded blocks",
        numerics="close",
        numerics_reason="recomputed activations (dropout replayed from the saved RNG state)",
    ),
    # A memory budget: the second (warm) step is profiled, then blocks are checkpointed fully or selectively.
    Setting(
        GradCheckpointCallback,
        {"memory_budget": 0.5},
        workload="lm",
        name="GradCheckpointCallback-budget",
        numerics="close",
        numerics_reason="recomputed activations (dropout replayed from the saved RNG state)",
        fsdp2="refuses",  # the budget planner: it warns naming the strategy and checkpoints every block fully
    ),
    # SDPA draws its attention-dropout mask from the RNG in its own way: same distribution, other masks.
    Setting(
        FlashAttentionCallback,
        workload="vit",
        numerics="lossy",
        numerics_reason="attention dropout masks drawn by SDPA, not nn.Dropout",
    ),
    Setting(
        FlashAttentionCallback,
        workload="lm",
        name="FlashAttentionCallback-lm",
        numerics="lossy",
        numerics_reason="attention dropout masks drawn by SDPA, not nn.Dropout",
    ),
    # Every eligible layer, unmeasured: on a GPU of compute capability 8.9+ the tiny lm trains in float8 (uncompiled,
    # so it also warns that float8 is slow without compile); elsewhere it warns NoEffectWarning and changes nothing.
    Setting(
        Float8TrainingCallback,
        {"filter": "all"},
        workload="lm",
        trainer_kwargs={"precision": "bf16-mixed"},
        ddp=False,
        marks=(pytest.mark.filterwarnings("ignore:Float8TrainingCallback:lightning_perf.LightningPerfWarning"),),
        numerics="lossy",
        numerics_reason="float8 matrix products on GPUs of compute capability 8.9+ (unchanged elsewhere)",
        fsdp2="refuses",
    ),
    # A cheap backend: aot_eager still captures forward and backward graphs with dynamo and AOT autograd (guards,
    # caches, counters, state_dict keys), without inductor's 10-30 s cold compile per process. Inductor is covered by
    # one slow test in tests/callbacks/test_compile.py and by the `compile` bench configuration.
    Setting(CompileCallback, {"backend": "aot_eager"}, numerics="close", numerics_reason=f"traced graphs: {_FLOAT}"),
    # Compresses from the third step on (the generic fits run 3-4 steps), on one process and, in the DDP test, two.
    Setting(
        PowerSGDDDPStrategy,
        {"start_powerSGD_iter": 2},
        numerics="lossy",
        numerics_reason="rank-2 gradient compression from the third step on",
        fsdp2="skip: a DDP strategy: it takes the place of ModelParallelStrategy, it does not stack on it",
    ),
    # Dynamic int8 for predict/test/validate only (training untouched: exact); the eager back-end, no timing.
    Setting(
        QATCallback,
        {"mode": "dynamic", "backend": "eager", "benchmark": False, "validation_batches": 1},
        workload="lm",
        name="QATCallback-dynamic",
        cuda_skip="dynamic int8 kernels run on the CPU only: on a CUDA model it predicts in float and warns, by design",
        fsdp2="refuses",  # quantizing needs the whole model in one process: warns at setup naming the strategy
    ),
    # Predict, test and validate in 8^3 windows (fit untouched: training is exact): the tiny unet3d's 32^3 predict
    # volumes and 16^3 validation/test patches go through MONAI's window; the trust tests' 8x8 images are one window.
    Setting(SlidingWindowInferenceCallback, {"roi_size": 8, "sw_batch_size": 4}, workload="unet3d"),
    # Observers: one steady step after warm-up, with the host-sync check (a TorchFunctionMode) on the warm-up step,
    # so every generic test, resume and DDP included, also checks that observing leaves training unchanged.
    Setting(BottleneckCallback, {"warmup_steps": 1, "sync_check_steps": 1}),
    Setting(
        BottleneckCallback,
        {"warmup_steps": 1, "sync_check_steps": 1, "log_every_n_steps": 1, "progress_bar": True},
        workload="lm",
        name="BottleneckCallback-lm",
    ),
    Setting(MemoryProfilerCallback, {"every_n_steps": 1, "warmup_steps": 1}),
    # Converts, validates (one batch) and saves the int8 model at every fit end; no compiled timing (tens of seconds).
    # Its checkpoints keep the plain model's keys: the quantization state travels in the callback's own entry.
    Setting(
        QATCallback,
        {"benchmark": False, "validation_batches": 1},
        numerics="lossy",
        numerics_reason="fake-quantized int8 weights and activations",
        fsdp2="refuses",  # torch.export cannot capture DTensor parameters: warns at setup naming the strategy
    ),
    Setting(
        QATCallback,
        {"backend": "torchao", "benchmark": False, "validation_batches": 1},
        workload="lm",
        name="QATCallback-torchao",
        numerics="lossy",
        numerics_reason="fake-quantized int8 weights and activations",
        fsdp2="refuses",  # fake-quantized layers take plain tensors, not DTensors: warns at setup
    ),
]


def get_setting(setting_id: str) -> Setting:
    for setting in SETTINGS:
        if setting.id == setting_id:
            return setting
    raise KeyError(setting_id)


def public_classes() -> list[type]:
    """Every public Callback/Strategy subclass exported by lightning_perf."""
    found = []
    for package in ("lightning_perf.callbacks", "lightning_perf.strategies"):
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, (Callback, Strategy)):
                found.append(obj)
    return found


def device_marks(setting: Setting) -> tuple[Any, ...]:
    """The entry's marks, plus a skip with its reason when the session's device is one it cannot hold on."""
    if _device.on_cuda() and setting.cuda_skip:
        return (*setting.marks, pytest.mark.skip(reason=f"{setting.id} on CUDA: {setting.cuda_skip}"))
    return tuple(setting.marks)


def params(settings: list[Setting] | None = None) -> list[Any]:
    """``pytest.param`` per setting, with its marks (and its CUDA skip, under ``--device cuda``) and id."""
    return [pytest.param(s, marks=device_marks(s), id=s.id) for s in (SETTINGS if settings is None else settings)]


def loss_mismatch(setting: Setting, loss: float, reference: float) -> str | None:
    """Why ``loss`` is not the plain run's ``reference`` in the terms of the entry's ``numerics`` (None: it is)."""
    if not math.isfinite(loss):
        return f"loss {loss} is not finite"
    if setting.numerics == "exact":
        ok = loss == reference
    elif setting.numerics == "close":
        ok = abs(loss - reference) <= CLOSE["atol"] + CLOSE["rtol"] * abs(reference)
    else:
        ok = reference / LOSSY_BAND <= loss <= reference * LOSSY_BAND
    why = f" ({setting.numerics_reason})" if setting.numerics_reason else ""
    return None if ok else f"loss {loss!r}, plain run {reference!r}: not {setting.numerics}{why}"


def fsdp2_duplicate_of(setting: Setting) -> Setting | None:
    """An earlier entry that trains the same class, with the same arguments, on the same sharded model, if any."""

    def key(s: Setting) -> tuple[Any, ...]:
        return (s.cls, repr(sorted(s.kwargs.items())), s.sharded_model, repr(sorted(s.trainer_kwargs.items())))

    for earlier in SETTINGS:
        if earlier is setting:
            return None
        if key(earlier) == key(setting):
            return earlier
    return None
