"""The one list of optimizations: what each adds to a Trainer, where the tuner tries it, and which symptom it answers.

Plain data (standard library and `_validation` only): the bench configurations, the tuner's search list and the
advice derive from it. Entry points: :class:`Optimization`, :class:`AdviceRule`, :func:`register`. Design notes and an
example: docs/architecture.md, Module notes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from lightning_perf._validation import check_bool, check_choice, check_instance, is_number

__all__ = [
    "ADVICE_FACTS",
    "BASELINE",
    "BENCH_CAPABILITIES",
    "DEVICE_CAPABILITIES",
    "INFERENCE_STAGES",
    "MODEL_FEATURES",
    "REQUIREMENTS",
    "RUN_FACTS",
    "STAGES",
    "SYMPTOMS",
    "TUNER_STAGES",
    "AdviceRule",
    "Condition",
    "Optimization",
    "SlowdownCause",
    "advice_for",
    "find",
    "get",
    "holds",
    "names",
    "optimizations",
    "register",
    "tuner_alternatives",
    "tuner_search_list",
    "unregister",
]

BASELINE = "baseline"
"""The bench's reference configuration (plain Lightning, fp32): every ratio is taken against it. Not an optimization,
so no entry may take the name."""

COMPILE, COMPILE_REGIONAL = "compile", "compile_regional"
"""The whole-model and the per-block compile entries: the bench's default set picks one by the model's structure."""
BF16_MIXED, FLASH_ATTENTION = "bf16-mixed", "flash_attention"
"""Entries the bench's default set on a CPU also measures together (``benchmark.configs.MEASURED_TOGETHER_ON_CPU``)."""

SYMPTOMS: tuple[str, ...] = ("compute_bound", "device_idle", "optimizer_step")
"""Advice rules of :mod:`lightning_perf.profiling.advice` that recommend optimizations from this list."""

STAGES: tuple[str, ...] = ("fit", "predict", "validate", "test")
"""The Trainer stages an optimization can apply to (``lightning-perf bench --stage``): a training-only one (a fused
optimizer, activation checkpointing) says ``stages=("fit",)``, an inference-only one (pure bf16 weights, dynamic int8)
``stages=INFERENCE_STAGES``."""

INFERENCE_STAGES: tuple[str, ...] = ("predict", "validate", "test")
"""The stages that run the model without training it."""

TUNER_STAGES: tuple[str, ...] = ("precision", "optimization")
"""The auto-tuner stages that try optimizations from this list (the data and batch-size stages are the tuner's own)."""

DEVICE_CAPABILITIES: Mapping[str, str] = MappingProxyType(
    {
        "cpu": "a CPU",
        "cuda": "a CUDA device",
        "bf16": "bfloat16 support",
        "fast_bf16": "bf16 hardware (avx512_bf16/AMX, Ampere+ GPU)",
        "fp16": "fp16 arithmetic (a CUDA device, or a CPU with avx512_fp16/amx_fp16)",
        "fast_fp32_matmul": "a faster float32 matmul mode (TF32 on a GPU, oneDNN bf16 on a CPU with bf16 instructions)",
        "fp8": "float8 tensor cores (a CUDA device of compute capability 8.9 or later: Ada, Hopper)",
    }
)
"""What a device may offer, each with the words the tools print: an entry's ``requires`` (all needed to run) and
``bench_default_on`` (any one puts it in the no-argument bench) name these. Probed by
:func:`lightning_perf.benchmark.configs.device_capabilities`."""

REQUIREMENTS: tuple[str, ...] = tuple(DEVICE_CAPABILITIES)
"""The names an entry's ``requires`` takes (the device capabilities)."""

BENCH_CAPABILITIES: tuple[str, ...] = tuple(DEVICE_CAPABILITIES)
"""The names an entry's ``bench_default_on`` takes (the device capabilities)."""

MODEL_FEATURES: Mapping[str, str] = MappingProxyType(
    {
        "attention": "attention module the swap knows (nn.MultiheadAttention or a registered adapter)",
        "convolutions": "2D or 3D convolution layer",
    }
)
"""What a model may hold that an optimization acts on (an entry's ``model_needs``), each with the words the tools
print. Found by :func:`lightning_perf.benchmark.structure.probe_structure`; the advice reads ``convolutions``."""

ADVICE_FACTS: Mapping[str, str] = MappingProxyType(
    {
        "cuda": "the step ran on a CUDA device",
        "full_precision": "the step ran in fp32 or fp64 (no mixed or low precision)",
        "fast_bf16": "the device has bf16 hardware",
        "tf32_off": "the device has TF32 tensor cores and float32 matmuls do not use them",
        "optimizers_fused": "every optimizer steps with fused or foreach kernels",
    }
)
"""What the advice knows about a measured step; an :class:`AdviceRule` applies when each fact it names has the value
it gives (``when={"full_precision": True, "fast_bf16": True}``). Read from
:class:`lightning_perf.profiling.advice.StepBreakdown`."""

RUN_FACTS: Mapping[str, str] = MappingProxyType(
    {
        "bf16_emulated": "the run was on a CPU without bf16 instructions",
        "warmup_not_amortized": "its warm-up exceeded baseline's by more than the steady state saved over the run",
    }
)
"""What the bench knows about a configuration's run, for :class:`SlowdownCause` (``when={"bf16_emulated": True}``).
Evaluated by :mod:`lightning_perf.benchmark.runner`."""

Condition = Mapping[str, bool]
"""Facts and the value each must have (all of them); empty: always."""


def _condition(owner: str, when: object, facts: Mapping[str, str]) -> Condition:
    """``when`` as a read-only ``{fact: value}``: ``"always"`` is ``{}``, a fact's name is ``{name: True}``."""
    if when == "always":
        return MappingProxyType({})
    if isinstance(when, str) and when in facts:
        return MappingProxyType({when: True})
    if isinstance(when, Mapping) and all(k in facts and isinstance(v, bool) for k, v in when.items()):
        return MappingProxyType(dict(when))
    raise ValueError(
        f"`{owner}(when={when!r})` is not valid. Expected 'always', a fact or a dict of facts to True/False; the "
        f"facts: {', '.join(facts)}."
    )


def _check_text(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"`{owner}({name}={value!r})` is not valid. Expected a non-empty string.")


def holds(condition: Condition | str, facts: Mapping[str, bool | None]) -> bool:
    """Whether every fact of ``condition`` has its value in ``facts`` (an unknown fact, ``None``, does not hold); a
    string is ``"always"`` or one fact that must be true, as :class:`AdviceRule` and :class:`SlowdownCause` take it."""
    if isinstance(condition, str):
        return condition == "always" or facts.get(condition) is True
    return all(facts.get(fact) is value for fact, value in condition.items())


@dataclass(frozen=True)
class AdviceRule:
    """When the advice recommends an optimization.

    Args:
        symptom: the advice rule it answers, one of :data:`SYMPTOMS`.
        action: what to do, one short imperative phrase (shown to the user).
        when: the facts of the measured step under which it helps (names from :data:`ADVICE_FACTS`): a dict of fact
            to the value it must have, one fact's name (it must hold), or ``"always"``.
    """

    symptom: str
    action: str
    when: Condition | str = "always"

    def __post_init__(self) -> None:
        if self.symptom not in SYMPTOMS:
            raise ValueError(f"`AdviceRule(symptom={self.symptom!r})` is not valid. Expected one of: {SYMPTOMS}.")
        _check_text("AdviceRule", "action", self.action)
        object.__setattr__(self, "when", _condition("AdviceRule", self.when, ADVICE_FACTS))


@dataclass(frozen=True)
class SlowdownCause:
    """A likely reason why an optimization came out slower than baseline, shown next to the bench's figure.

    Args:
        when: the facts of the run under which the reason holds (names from :data:`RUN_FACTS`): a dict of fact to
            the value it must have, one fact's name (it must hold), or ``"always"``.
        text: the reason, one short phrase (shown to the user).
    """

    when: Condition | str
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "when", _condition("SlowdownCause", self.when, RUN_FACTS))
        _check_text("SlowdownCause", "text", self.text)


@dataclass(frozen=True)
class Optimization:
    """One optimization: what it adds to a plain Trainer and where the tools use it.

    Args:
        name: the bench configuration name (a word: no ``+``, ``,`` or space).
        description: one line for ``lightning-perf bench --list``.
        callback: the callback's import path (``package.module.Class``), or ``None`` for Trainer arguments only.
        callback_kwargs: the callback's keyword arguments.
        trainer_kwargs: extra ``Trainer`` arguments (e.g. ``{"precision": "bf16-mixed"}``).
        changes_numerics: whether the losses may differ from fp32 eager training (the tuner then checks them).
        tuner_stage: the auto-tuner stage that tries it (one of :data:`TUNER_STAGES`), or ``None``: not searched.
        tuner_order: position within the stage (lower first).
        replaces: the name of an optimization this one is tried in place of, not on top of.
        requires: what the device must offer, all of it (names from :data:`DEVICE_CAPABILITIES`).
        advice: when the advice recommends it.
        bench_default_on: the capabilities (names from :data:`DEVICE_CAPABILITIES`) under which the no-argument
            ``lightning-perf bench`` includes it (any one suffices); empty: only when asked for.
        slowdown_causes: likely reasons why it comes out slower than baseline, checked in order.
        stages: the Trainer stages (names from :data:`STAGES`) it applies to; the bench leaves it out of a run of
            another stage and says why. Default: every stage.
        packages: optional dependencies it imports (module names, e.g. ``("torchao",)``); the bench skips it with
            the install hint where one is missing.
        model_needs: what the model must hold for it to change anything (names from :data:`MODEL_FEATURES`): the
            tuner skips its trial on a model without, the advice does not recommend it.
        fast_fp32_matmul: it lets float32 matmuls run in the device's faster mode (TF32, oneDNN bf16): the MFU of a
            run with it is taken against that mode's peak (its utilization dtype).
        with_callbacks: further callbacks it always runs with, as ``(class path, keyword arguments)`` pairs after
            ``callback`` (``fp8`` is float8 *and* compile: float8 without compile is slow).
        left_out_because: why the no-argument bench leaves it out where ``bench_default_on`` does not hold, in words
            a user can act on (the bench adds how to include it).
        mfu_note: what its MFU is taken against when that is not its own dtype (shown with the peak).
        long_warmup: its warm-up is long (compilation): the tuner budgets its trial accordingly and the
            recommendation says the warm-up pays off on long runs only.

    A predict-only optimization is one entry, e.g.
    ``Optimization("dynamic_int8", "...", callback="lightning_perf.callbacks.QATCallback",
    callback_kwargs={"mode": "dynamic"}, stages=INFERENCE_STAGES)``.
    """

    name: str
    description: str
    callback: str | None = None
    callback_kwargs: Mapping[str, Any] = field(default_factory=dict)
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    changes_numerics: bool = False
    tuner_stage: str | None = None
    tuner_order: float = 0
    replaces: str | None = None
    requires: tuple[str, ...] = ()
    advice: tuple[AdviceRule, ...] = ()
    bench_default_on: tuple[str, ...] = ()
    slowdown_causes: tuple[SlowdownCause, ...] = ()
    stages: tuple[str, ...] = STAGES
    packages: tuple[str, ...] = ()
    model_needs: tuple[str, ...] = ()
    fast_fp32_matmul: bool = False
    long_warmup: bool = False
    with_callbacks: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    left_out_because: str = ""
    mfu_note: str = ""

    def __post_init__(self) -> None:
        owner = f"Optimization(name={self.name!r})"
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "+, "):
            raise ValueError(f"`{owner}` is not a valid name. Expected a non-empty word without '+', ',' or spaces.")
        if self.name == BASELINE:
            raise ValueError(f"`{owner}` is not a valid name. Expected another: {BASELINE!r} is the bench's reference.")
        owner = f"Optimization[{self.name!r}]"  # the messages read "`Optimization['x'](arg=value)` is not valid"
        _check_text(owner, "description", self.description)
        if self.callback is not None and (not isinstance(self.callback, str) or "." not in self.callback.strip(".")):
            raise ValueError(
                f"`{owner}(callback={self.callback!r})` is not valid. Expected an import path 'package.module.Class'."
            )
        for arg in ("callback_kwargs", "trainer_kwargs"):
            value = check_instance(owner, arg, getattr(self, arg), Mapping, "a dict")
            object.__setattr__(self, arg, MappingProxyType(dict(value)))
        if self.callback_kwargs and self.callback is None:
            raise ValueError(f"`{owner}(callback_kwargs={dict(self.callback_kwargs)!r})` given without a callback.")
        for arg in ("changes_numerics", "fast_fp32_matmul", "long_warmup"):
            check_bool(owner, arg, getattr(self, arg))
        for arg in ("left_out_because", "mfu_note"):
            check_instance(owner, arg, getattr(self, arg), str, "a string")
        if self.tuner_stage is not None:
            check_choice(owner, "tuner_stage", self.tuner_stage, TUNER_STAGES)
        if not is_number(self.tuner_order):
            raise ValueError(f"`{owner}(tuner_order={self.tuner_order!r})` is not valid. Expected a finite number.")
        for arg, allowed in (("requires", REQUIREMENTS), ("bench_default_on", BENCH_CAPABILITIES), ("stages", STAGES),
                             ("model_needs", MODEL_FEATURES), ("packages", None)):  # fmt: skip
            value = getattr(self, arg)
            if (
                isinstance(value, str)
                or any(not isinstance(v, str) or (allowed and v not in allowed) for v in value)
                or (arg == "stages" and not value)
            ):
                expected = f"names from {tuple(allowed)}" if allowed else "importable module names, e.g. ('torchao',)"
                empty = "non-empty " if arg == "stages" else ""
                raise ValueError(f"`{owner}({arg}={value!r})` is not valid. Expected a {empty}tuple of {expected}.")
            object.__setattr__(self, arg, tuple(value))
        for arg, cls in (("advice", AdviceRule), ("slowdown_causes", SlowdownCause)):
            value = getattr(self, arg)
            if isinstance(value, cls) or any(not isinstance(v, cls) for v in value):
                raise TypeError(f"`{owner}({arg}={value!r})` is not valid. Expected a tuple of {cls.__name__}.")
            object.__setattr__(self, arg, tuple(value))
        extra = self.with_callbacks
        if isinstance(extra, (str, Mapping)) or any(
            not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) or "." not in item[0]
            or not isinstance(item[1], Mapping) for item in extra
        ):  # fmt: skip
            raise ValueError(
                f"`{owner}(with_callbacks={extra!r})` is not valid. Expected a tuple of ('package.module.Class', dict)."
            )
        object.__setattr__(self, "with_callbacks", tuple((p, MappingProxyType(dict(k))) for p, k in extra))

    @property
    def callback_name(self) -> str | None:
        """The callback's class name (what the advice prints and checks against the active callbacks)."""
        return None if self.callback is None else self.callback.rsplit(".", 1)[-1]


_REGISTRY: dict[str, Optimization] = {}  # the built-ins first: filled from _BUILTIN_OPTIMIZATIONS at the end


def register(optimization: Optimization, *, replace: bool = False) -> Optimization:
    """Add ``optimization`` to the list; a second registration of a name is an error unless ``replace``."""
    if not isinstance(optimization, Optimization):
        raise TypeError(f"`register({optimization!r})` is not valid. Expected an Optimization.")
    if optimization.name in _REGISTRY and not replace:
        raise ValueError(f"An optimization named {optimization.name!r} is already registered.")
    _REGISTRY[optimization.name] = optimization
    return optimization


def unregister(name: str) -> None:
    """Remove the optimization called ``name`` (a no-op when there is none)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Optimization:
    """The optimization called ``name``.

    Raises:
        KeyError: for an unknown name.
    """
    return _REGISTRY[name]


def find(name: str) -> Optimization | None:
    """The optimization called ``name``, or ``None`` (``baseline``, a stack, a bench-only configuration)."""
    return _REGISTRY.get(name)


def optimizations() -> list[Optimization]:
    """Every registered optimization, in registration order."""
    return list(_REGISTRY.values())


def names() -> list[str]:
    """The registered names, in registration order."""
    return [o.name for o in optimizations()]


def tuner_search_list(stage: str = "optimization") -> tuple[str, ...]:
    """The names the auto-tuner tries in ``stage``, in order."""
    found = [(o.tuner_order, i, o.name) for i, o in enumerate(optimizations()) if o.tuner_stage == stage]
    return tuple(name for _, _, name in sorted(found))


def tuner_alternatives() -> dict[str, str]:
    """Name -> the name it is tried in place of (two compiles do not stack)."""
    return {o.name: o.replaces for o in optimizations() if o.replaces is not None}


def advice_for(symptom: str) -> list[tuple[Optimization, AdviceRule]]:
    """The optimizations that answer ``symptom``, in registration order, each with its rule."""
    return [(o, rule) for o in optimizations() for rule in o.advice if rule.symptom == symptom]


def _callback(name: str) -> str:
    return f"lightning_perf.callbacks.{name}"


def _precision(precision: str, description: str, **kwargs: Any) -> Optimization:
    """One of Lightning's own precisions: a Trainer argument only, which changes the numerics."""
    trainer_kwargs = {"precision": precision}
    return Optimization(precision, description, trainer_kwargs=trainer_kwargs, changes_numerics=True, **kwargs)


def _compile(name: str, description: str, **kwargs: Any) -> Optimization:
    """A CompileCallback variant: it changes the numerics and warms up long."""
    callback = _callback("CompileCallback")
    return Optimization(name, description, callback=callback, changes_numerics=True, long_warmup=True, **kwargs)


_NO_BF16 = "this CPU has no bf16 instructions (avx512_bf16, AMX)"
_BF16_EMULATED = (SlowdownCause("bf16_emulated", f"{_NO_BF16}: bf16 is emulated"),)
_COMPILE_SLOWDOWN = (
    SlowdownCause("warmup_not_amortized", "compile warm-up not amortized over this run's steps"),
    SlowdownCause("always", "inductor's kernels gain little on this model and device"),
)
_COLD_COMPILE = (
    "a cold compile takes ~30 s per process on a CPU, and without the model's structure (it could not be built "
    "here) the bench cannot tell whether repeated blocks or convolutions would win it back"
)
"""Why compile is left out of a CPU's default set when the model's structure is unknown (with it, the structure
decides: :func:`lightning_perf.benchmark.configs.structural_verdict`)."""
_FLASH = "it acts on attention modules only, and gains most on a GPU in fp16/bf16: include it for a transformer"
_QAT = "fake quantization adds work to every step: it measures the cost of QAT, not a speed-up"
_TIME_FOR_MEMORY = "it trades step time for activation memory: slower by design, worth it when memory limits the batch"

_BUILTIN_OPTIMIZATIONS: tuple[Optimization, ...] = (
    _precision(
        BF16_MIXED,
        "Lightning's own bf16 autocast (Trainer(precision='bf16-mixed'))",
        tuner_stage="precision",
        tuner_order=10,
        requires=("bf16",),
        advice=(
            AdviceRule(
                "compute_bound",
                "train in mixed precision: Trainer(precision='bf16-mixed')",
                {"full_precision": True, "fast_bf16": True},
            ),
        ),
        bench_default_on=("fast_bf16",),
        left_out_because=f"{_NO_BF16}: bf16 would be emulated, several times slower",
        slowdown_causes=_BF16_EMULATED,
    ),
    _precision(
        "16-mixed",
        "Lightning's own fp16 autocast with gradient scaling (Trainer(precision='16-mixed'))",
        tuner_stage="precision",
        tuner_order=20,
        requires=("cuda",),
        bench_default_on=("cuda",),
        left_out_because="fp16 autocast is for GPUs; CPUs without avx512_fp16 emulate it",
    ),
    _precision(
        "bf16-true",
        "Lightning's pure bf16 (Trainer(precision='bf16-true')): weights and activations in bf16, inference only",
        requires=("bf16",),
        bench_default_on=("fast_bf16",),
        left_out_because=f"{_NO_BF16}: bf16 would be emulated",
        slowdown_causes=_BF16_EMULATED,
        stages=INFERENCE_STAGES,
    ),
    _precision(
        "16-true",
        "Lightning's pure fp16 (Trainer(precision='16-true')): weights and activations in fp16, inference only",
        requires=("fp16",),
        bench_default_on=("cuda",),
        left_out_because="pure fp16 is for GPUs; CPUs without avx512_fp16 emulate it",
        stages=INFERENCE_STAGES,
    ),
    Optimization(
        "channels_last",
        "ChannelsLastCallback: conv weights and 4D/5D inputs in channels-last memory format",
        callback=_callback("ChannelsLastCallback"),
        tuner_stage="optimization",
        tuner_order=10,
        advice=(AdviceRule("compute_bound", "store convolution inputs and weights channels-last"),),
        model_needs=("convolutions",),
        bench_default_on=("cpu", "cuda"),
        slowdown_causes=(
            SlowdownCause("always", "layout conversion at the model's edges costs more than its few convolutions gain"),
        ),
    ),
    _compile(
        COMPILE,
        "CompileCallback(): torch.compile of the LightningModule's forward, in place (inductor, default mode)",
        tuner_stage="optimization",
        tuner_order=50,
        advice=(
            AdviceRule(
                "device_idle",
                "compile the model: fewer, larger kernels (mode='reduce-overhead' also captures CUDA graphs)",
            ),
            AdviceRule("compute_bound", "compile the model (fused kernels)"),
        ),
        bench_default_on=("cuda",),
        left_out_because=_COLD_COMPILE,
        slowdown_causes=_COMPILE_SLOWDOWN,
    ),
    _compile(
        COMPILE_REGIONAL,
        "CompileCallback(regions='auto'): each repeated block compiled once and reused by its copies (regional "
        "compilation: a shorter cold compile than the whole model's)",
        callback_kwargs={"regions": "auto"},
        tuner_order=55,  # not searched by the tuner (one compile trial is enough there); ordered for a stack
        replaces=COMPILE,
        slowdown_causes=_COMPILE_SLOWDOWN,
        left_out_because=_COLD_COMPILE,
    ),
    _compile(
        "compile_reduce_overhead",
        "CompileCallback(mode='reduce-overhead'): torch.compile with CUDA graphs (replays whole steps' kernels)",
        callback_kwargs={"mode": "reduce-overhead"},
        tuner_stage="optimization",
        tuner_order=60,
        replaces=COMPILE,
        left_out_because="CUDA graphs need a CUDA device; on a GPU it is the compile variant to try after compile",
        requires=("cuda",),
        slowdown_causes=(
            SlowdownCause("warmup_not_amortized", "compile warm-up (and CUDA graph capture) not amortized"),
        ),
    ),
    Optimization(
        "backend_flags",
        "BackendFlagsCallback(preset='fastest'): CUDA: cudnn.benchmark + TF32; CPU: bf16 float32 matmuls (oneDNN)",
        callback=_callback("BackendFlagsCallback"),
        callback_kwargs={"preset": "fastest"},
        changes_numerics=True,
        tuner_stage="optimization",
        tuner_order=30,
        requires=("fast_fp32_matmul",),
        advice=(
            AdviceRule(
                "compute_bound",
                "let float32 matmuls and convolutions use TF32 tensor cores",
                {"full_precision": True, "tf32_off": True},
            ),
        ),
        fast_fp32_matmul=True,
        bench_default_on=("cuda",),
        left_out_because=(
            "its one CPU flag (float32 matmuls computed in bf16 by oneDNN, where the CPU has bf16 instructions) is a "
            "part of what bf16-mixed does, and it slows torch's CPU attention kernels (the default lm on a 2-core "
            "AVX-512 CPU: backend_flags+flash_attention 245 ms a step, flash_attention alone 178 ms)"
        ),
    ),
    Optimization(
        "fused_optimizer",
        "FusedOptimizerCallback: the optimizers step with torch's fused (else foreach) kernels",
        callback=_callback("FusedOptimizerCallback"),
        tuner_stage="optimization",
        tuner_order=20,
        advice=(
            AdviceRule(
                "optimizer_step",
                "step the optimizer with torch's fused or foreach kernels",
                {"optimizers_fused": False},
            ),
        ),
        bench_default_on=("cpu", "cuda"),
        stages=("fit",),
    ),
    Optimization(
        "grad_checkpoint",
        "GradCheckpointCallback(): activation checkpointing of every repeated block (less memory, more compute)",
        callback=_callback("GradCheckpointCallback"),
        advice=(
            AdviceRule(
                "compute_bound",
                "if memory limits the batch size, recompute activations to fit a larger batch",
                "cuda",
            ),
        ),
        slowdown_causes=(SlowdownCause("always", "recomputes activations in the backward pass: time for memory"),),
        stages=("fit",),
        left_out_because=_TIME_FOR_MEMORY,
    ),
    *(
        Optimization(
            f"grad_checkpoint_budget{round(budget * 100)}",
            f"GradCheckpointCallback(memory_budget={budget}): keeps about {budget:.0%} of the activation memory, "
            "checkpointing blocks fully or selectively at the least recompute",
            callback=_callback("GradCheckpointCallback"),
            callback_kwargs={"memory_budget": budget},
            slowdown_causes=(
                SlowdownCause("always", "recomputes part of the activations in the backward pass: time for memory"),
            ),
            stages=("fit",),
            left_out_because=_TIME_FOR_MEMORY,
        )
        for budget in (0.75, 0.5, 0.25)
    ),
    Optimization(
        FLASH_ATTENTION,
        "FlashAttentionCallback(): attention through flash-attn 2 (CUDA, fp16/bf16) or fused SDPA kernels",
        callback=_callback("FlashAttentionCallback"),
        changes_numerics=True,
        tuner_stage="optimization",
        tuner_order=40,
        model_needs=("attention",),
        left_out_because=_FLASH,
    ),
    Optimization(
        "dynamic_int8",
        "QATCallback(mode='dynamic'): predict/test/validate through a dynamic int8 copy (CPU; the fastest correct "
        "back-end, measured)",
        callback=_callback("QATCallback"),
        callback_kwargs={"mode": "dynamic", "export": False},
        changes_numerics=True,
        tuner_stage="optimization",
        tuner_order=45,
        stages=INFERENCE_STAGES,
        left_out_because="it changes inference only: measure it with --stage predict",
        slowdown_causes=(
            SlowdownCause(
                "always",
                "small Linear layers: quantizing activations per batch costs more than int8 matmuls save (or no "
                "back-end beat fp32 and the float model ran)",
            ),
        ),
    ),
    Optimization(
        "sliding_window",
        "SlidingWindowInferenceCallback(roi_size='model', sw_batch_size='auto'): whole volumes predicted in the "
        "model's patch windows (MONAI, Gaussian blending), the window batch size measured",
        callback=_callback("SlidingWindowInferenceCallback"),
        callback_kwargs={"roi_size": "model", "sw_batch_size": "auto"},
        stages=INFERENCE_STAGES,
        left_out_because="it changes whole-volume inference only: measure it with --stage predict on a 3D model",
    ),
    *(
        Optimization(
            f"sliding_window_sw{n}",
            f"SlidingWindowInferenceCallback(roi_size='model', sw_batch_size={n}): whole volumes in patch windows",
            callback=_callback("SlidingWindowInferenceCallback"),
            callback_kwargs={"roi_size": "model", "sw_batch_size": n},
            stages=INFERENCE_STAGES,
            left_out_because="a fixed window batch size, to compare with sliding_window's measured one",
        )
        for n in (1, 2, 4, 8)
    ),
    Optimization(
        "fp8",
        "bf16-mixed + Float8TrainingCallback() + CompileCallback(): Linear layers measured faster in float8 train "
        "in float8 (torchao), compiled",
        callback=_callback("Float8TrainingCallback"),
        trainer_kwargs={"precision": "bf16-mixed"},
        with_callbacks=((_callback("CompileCallback"), {}),),
        changes_numerics=True,
        requires=("fp8",),
        packages=("torchao",),
        bench_default_on=("fp8",),
        stages=("fit",),
        long_warmup=True,
        mfu_note="against the bf16 peak: a float8 MFU is not defined when layers mix dtypes",
        left_out_because="float8 matmuls need a CUDA device of compute capability 8.9 or later",
    ),
    Optimization(
        "qat",
        "QATCallback(export=False): x86 PT2E fake quantization during training (the step overhead of QAT)",
        # Training only: the int8 model's own speed is what QATCallback's end-of-fit report measures.
        callback=_callback("QATCallback"),
        callback_kwargs={"export": False},
        changes_numerics=True,
        packages=("torchao",),
        slowdown_causes=(
            SlowdownCause("always", "fake quantization adds work to every training step (the cost of QAT)"),
        ),
        stages=("fit",),
        left_out_because=_QAT,
    ),
)

_REGISTRY.update((optimization.name, optimization) for optimization in _BUILTIN_OPTIMIZATIONS)
