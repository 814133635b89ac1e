"""The one validated description of a bench, from the command line (or a script) to every worker process.

Entry points: :class:`BenchSpec` (checks everything once), :class:`RunSpec` (one worker's run), :class:`RunSettings`
(what both share), and the checks :func:`check_workload`, :func:`check_preset`, :func:`resolve_device`. Design notes:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from lightning_perf._validation import is_int, is_number
from lightning_perf.optimizations import BASELINE, COMPILE_REGIONAL, STAGES

__all__ = [
    "DEVICE_CHOICES",
    "BenchSpec",
    "RunSettings",
    "RunSpec",
    "SpecError",
    "check_config_names",
    "check_preset",
    "check_setting",
    "check_workload",
    "did_you_mean",
    "parse_setting",
    "resolve_device",
]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_MODULE_CLASS = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*$")
PRECISIONS: tuple[str, ...] = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
"""The ``Trainer(precision=...)`` values a bench accepts by name."""
_AT_LEAST = dict(steps=1, warmup_steps=1, repeats=1, batch_size=1, threads=1, predict_batches=0, num_workers=0)
_CHOICES = {"stage": STAGES, "precision": PRECISIONS, "wait_policy": (None, "PASSIVE", "ACTIVE")}
_EXPECTED = {
    **{name: f"an integer >= {minimum}" for name, minimum in _AT_LEAST.items()},
    **{name: "one of " + ", ".join(map(str, choices)) for name, choices in _CHOICES.items()},
    "repeats": "auto or an integer >= 1",
    "target": "a percentage such as 5% (or a fraction such as 0.05), above 0 and below 100%",
    "time_budget_s": "a number of seconds > 0, e.g. 150",
    "timeout_s": "a number of seconds > 0",
    "model": "MODULE:CLASS, e.g. my_pkg.models:Net",
}


class SpecError(ValueError):
    """A setting of a bench that cannot run: names the setting, the value as given and what is expected.

    The command line turns it into ``argument --<setting>: '<value>' is not valid. Expected <expected>.`` (exit 2).
    """

    def __init__(self, setting: str, value: Any, expected: str, owner: str = "BenchSpec") -> None:
        self.setting, self.value, self.expected = setting, value, expected
        super().__init__(f"`{owner}({setting}={value!r})` is not valid. Expected {expected}.")

    @property
    def option(self) -> str:
        """The command-line option of the setting (``--warmup-steps`` for ``warmup_steps``)."""
        return "--" + self.setting.replace("_", "-")


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``"did you mean 'channels_last'?"`` for the nearest of ``choices``, or ``""`` when none is near."""
    near = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"did you mean {near[0]!r}?" if near else ""


def check_setting(name: str, value: Any, as_given: Any = None) -> Any:
    """``value`` when it is valid for the bench setting ``name``, else :class:`SpecError` (echoing ``as_given``, the
    text it was parsed from, when given). The one check of each number and name a bench takes."""
    if name in _AT_LEAST:
        valid = is_int(value, _AT_LEAST[name])
    elif name in _CHOICES:
        valid = value in _CHOICES[name]
    else:  # seconds, or the target: a fraction
        valid = is_number(value) and value > 0
        valid = valid and (name != "target" or value < 1)
    if not valid:
        raise SpecError(name, value if as_given is None else as_given, _EXPECTED[name])
    return value


def parse_setting(name: str, text: str) -> Any:
    """The bench setting ``name`` from ``text`` as typed on the command line or in a task file, checked
    (:func:`check_setting`; configuration and workload names as the spec checks them); :class:`SpecError` echoes
    ``text``. ``repeats`` takes ``auto`` (None), ``target`` a percentage, ``model_args`` a JSON object."""
    stripped = text.strip()
    if name == "configs":
        return check_config_names(text)
    if name == "workload":
        return check_workload(stripped)
    if name in ("model", "datamodule"):
        spec = stripped if ":" in stripped or "." not in stripped else ":".join(stripped.rsplit(".", 1))
        if not _MODULE_CLASS.match(spec):
            raise SpecError(name, text, _EXPECTED["model"])
        return spec
    if name in ("model_args", "datamodule_args"):
        try:
            found = json.loads(text)
        except json.JSONDecodeError as exc:
            expected = f'a JSON object such as {{"name": 1}} ({exc.msg} at column {exc.colno})'
            raise SpecError(name, text, expected) from None
        if not isinstance(found, dict):
            raise SpecError(name, text, f'a JSON object such as {{"name": 1}}, not a JSON {type(found).__name__}')
        return found
    if name == "repeats" and stripped == "auto":
        return None
    try:
        if name in _AT_LEAST:
            value: Any = int(stripped)
        elif name == "target":
            value = float(stripped[:-1]) / 100.0 if stripped.endswith("%") else float(stripped)
        else:
            value = float(stripped) if name.endswith("_s") else stripped
    except ValueError:
        raise SpecError(name, text, _EXPECTED[name]) from None
    return check_setting(name, value, text)


def _one_of(setting: str, value: str, known: list[str], owner: str) -> str:
    if value not in known:
        hint = did_you_mean(value, known)
        raise SpecError(setting, value, f"one of {', '.join(known)}" + (f" ({hint})" if hint else ""), owner)
    return value


def check_workload(workload: str, owner: str = "BenchSpec") -> str:
    """``workload`` when it names a reference workload, else :class:`SpecError` with the nearest name."""
    from lightning_perf.demos import workload_names

    return _one_of("workload", workload, workload_names(), owner)


def check_preset(preset: str | None, device_type: str, owner: str = "BenchSpec") -> str:
    """The workload size: ``preset`` when it is one of the demos' presets; ``None`` picks ``gpu`` on a CUDA device
    when the demos offer it, else ``default``."""
    from lightning_perf.demos import PRESETS

    if preset is None:
        return "gpu" if device_type == "cuda" and "gpu" in PRESETS else "default"
    return _one_of("preset", preset, list(PRESETS), owner)


def resolve_device(text: str, owner: str = "BenchSpec", what: str = "the bench") -> tuple[str, str]:
    """``(device, why)``: ``auto`` becomes ``cuda`` when a CUDA device is visible, else ``cpu``; an explicit CUDA
    device must exist. ``why`` is one line for the output (``"auto: CUDA is visible (NVIDIA H100 80GB HBM3)"``)."""
    if not isinstance(text, str) or not _DEVICE.match(text.strip()):
        hint = f" ({what} does not run on mps)" if text == "mps" else ""
        raise SpecError("device", text, DEVICE_CHOICES + hint, owner)
    import torch

    text = text.strip()
    visible = torch.cuda.is_available()
    if text == "auto":
        return (
            ("cuda", f"auto: CUDA is visible ({_gpu_name(0)})")
            if visible
            else ("cpu", "auto: no CUDA device is visible")
        )
    if text.startswith("cuda"):
        if not visible:
            raise SpecError("device", text, "cpu or auto: no CUDA device is visible", owner)
        if ":" in text and int(text.partition(":")[2]) >= torch.cuda.device_count():
            raise SpecError("device", text, f"cuda:0 to cuda:{torch.cuda.device_count() - 1}", owner)
        return text, f"asked for ({_gpu_name(int(text.partition(':')[2] or 0))})"
    return text, "asked for"


def _gpu_name(index: int) -> str:
    import torch

    try:
        return str(torch.cuda.get_device_name(index))
    except Exception as exc:  # a driver that answers is_available() but not the name: say so, choose anyway
        return f"name unknown: {type(exc).__name__}"


MEMORY_STEPS = 2
"""Steps a run on a CPU measures memory over, right after its warm-up, in a process started with
:data:`~lightning_perf.profiling.memory.TRUTHFUL_CPU_MEMORY_ENV` (peak RSS is then the peak of memory in use). That
setting makes every large allocation slow, so it is switched off after them
(:func:`~lightning_perf.profiling.memory.truthful_cpu_peak`) and :data:`SETTLE_STEPS` more steps let the heap grow to
the working set before any step is timed: the timed steps allocate as a user's training does."""

SETTLE_STEPS = 1
"""Untimed steps after the memory steps (and the switch to full-speed allocation), before the timed ones."""


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What every run of a bench (and every trial of the tuner) measures with; only plain values, so it travels as
    JSON.

    Args:
        workload: a reference workload's name, or the label of the user's model when ``source`` is given.
        preset: the reference workload's size.
        steps: steady-state steps (batches, for an inference stage) per run.
        warmup_steps: excluded warm-up steps.
        batch_size: samples per batch; ``None``: the workload's (the model's) own.
        precision: ``Trainer(precision=...)`` of every configuration that does not set its own.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        seed: the model's initialization and the data's order.
        predict_batches: timed inference batches after a fit (0: none).
        num_workers: DataLoader workers.
        source: the user's model (``ModelSource.to_dict()``); ``None``: the reference workload.
        stage: ``fit``, or an inference stage measured per batch (``predict``, ``validate``, ``test``).
        threads: every worker's intra-op threads; ``None``: decided at the run's start (benchmark.threads).
        wait_policy: every worker's ``OMP_WAIT_POLICY`` (decided with the threads); ``None``: the environment's.
    """

    workload: str = "convnet"
    preset: str = "default"
    steps: int = 20
    warmup_steps: int = 5
    batch_size: int | None = None
    precision: str = "32-true"
    device: str = "cpu"
    seed: int = 0
    predict_batches: int = 10
    num_workers: int = 0
    source: dict[str, Any] | None = None
    stage: str = "fit"
    threads: int | None = None
    wait_policy: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunSpec(RunSettings):
    """What one worker process runs: the bench's settings, one configuration (``a+b`` for a stack) and its repeat."""

    config: str
    repeat: int = 0
    count_flops: bool = False  # count one training step's FLOPs after the measurement (the bench: repeat 0)
    pin_memory: bool = False
    persistent_workers: bool = False
    loader_overrides: dict[str, Any] = field(default_factory=dict)  # the auto-tuner's DataLoader settings
    decided: dict[str, Any] = field(default_factory=dict)  # callback class -> state_dict: its first run's decision


@dataclass(frozen=True, kw_only=True)
class BenchSpec(RunSettings):
    """One ``lightning-perf bench``: which configurations, on what, how often; validated and resolved on construction.

    Args (beyond :class:`RunSettings`, whose ``device`` also takes ``auto`` and whose ``preset`` takes ``None``, the
    device's default size):
        configs: the configurations: ``None`` (the default set for this model's structure and this device, see
            :func:`~lightning_perf.benchmark.configs.default_configs`), ``"all"``, a comma-separated string or a
            sequence of names, each a registered name or a ``+``-joined stack. Resolved to a tuple, ``baseline``
            first, without duplicates and without the ones that do not apply to ``stage`` (those go to ``left_out``).
        repeats: runs per configuration, interleaved; ``None`` (``--repeats auto``): until every speed-up's 95%
            interval lies within ``+-target`` or ``time_budget_s`` is spent.
        target: the relative half-width at which a speed-up counts as settled (0.05: +-5%).
        time_budget_s: seconds of measuring that ``--repeats auto`` may spend (single configurations and stack).
        timeout_s: the limit of one run.
        batch_sizes: a sweep: one bench per size (``batch_size`` must then be ``None``).
        precision_from: where ``precision`` came from when not the default (``"--config"``).
        ignored_trainer_settings: the ``--config`` file's trainer keys the bench decides itself.
        left_out: ``(configuration, why)`` for each one not run; filled on construction.
        device_reason: why this device (``"auto: no CUDA device is visible"``); filled on construction.
        structure: the model's structure that chose the default set
            (:meth:`~lightning_perf.benchmark.structure.ModelStructure.to_dict`); with ``configs`` None and no
            structure given, probed on construction by building the model once in this process
            (:func:`~lightning_perf.benchmark.structure.structure_of_source`).

    Raises:
        SpecError: (a ``ValueError``) naming the setting, the value as given and what is expected.
    """

    device: str = "auto"
    preset: str | None = None  # type: ignore[assignment]  # resolved to a preset's name on construction
    configs: str | Sequence[str] | None = None
    repeats: int | None = None
    target: float = 0.05  # settle.DEFAULT_TARGET (not imported: this module stays free of NumPy and torch)
    time_budget_s: float = 150.0  # settle.DEFAULT_TIME_BUDGET_S
    timeout_s: float = 900.0
    batch_sizes: tuple[int, ...] = ()
    precision_from: str | None = None
    ignored_trainer_settings: Mapping[str, Any] = field(default_factory=dict)
    left_out: tuple[tuple[str, str], ...] = ()
    device_reason: str = ""
    structure: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in (*_AT_LEAST, "stage", "wait_policy", "target", "time_budget_s", "timeout_s"):
            if name not in ("repeats", "threads", "batch_size") or getattr(self, name) is not None:
                check_setting(name, getattr(self, name))
        sizes = tuple(self.batch_sizes)
        if not all(is_int(n, 1) for n in sizes) or len(set(sizes)) < len(sizes):
            raise SpecError("batch_sizes", self.batch_sizes, "distinct integers >= 1, e.g. (1, 8, 32)")
        if sizes and self.batch_size is not None:
            raise SpecError("batch_sizes", sizes, "no batch_sizes together with batch_size")
        device, why = resolve_device(self.device)
        if self.source is None:
            check_workload(self.workload)
        preset = check_preset(self.preset, device.split(":")[0])
        structure = self.structure
        if self.configs is None and structure is None:
            structure = _probe(self, preset)
        configs, left_out = _resolve_configs(self.configs, device, self.stage, self.left_out, structure)
        if self.configs is None:
            configs, left_out = _compile_within_budget(
                configs, left_out, device, self.repeats, self.time_budget_s, structure
            )
        set_ = object.__setattr__
        set_(self, "structure", None if structure is None else dict(structure))
        set_(self, "device", device)
        set_(self, "device_reason", self.device_reason if self.device == device and self.device_reason else why)
        set_(self, "preset", preset)
        set_(self, "configs", configs)
        set_(self, "left_out", left_out)
        set_(self, "batch_sizes", sizes)
        set_(self, "ignored_trainer_settings", dict(self.ignored_trainer_settings))

    @property
    def names(self) -> tuple[str, ...]:
        """The resolved configuration names, ``baseline`` first."""
        return tuple(self.configs or ())

    def run_spec(self, config: str, repeat: int, decided: Mapping[str, Any] | None = None) -> RunSpec:
        """What the worker process of ``config``'s repeat ``repeat`` runs (FLOPs are counted on repeat 0 of a fit);
        ``decided``: what the configuration's first run decided by timing (``RunResult.decided``), replayed."""
        shared = {f.name: getattr(self, f.name) for f in fields(RunSettings)}
        first_fit = repeat == 0 and self.stage == "fit"
        return RunSpec(**shared, config=config, repeat=repeat, count_flops=first_fit, decided=dict(decided or {}))

    def per_batch_size(self) -> list[BenchSpec]:
        """The benches of a sweep, one per batch size (this spec alone when it is not a sweep)."""
        if not self.batch_sizes:
            return [self]
        return [replace(self, batch_size=size, batch_sizes=()) for size in self.batch_sizes]

    def to_dict(self) -> dict[str, Any]:
        """The ``options`` of the results file."""
        data = asdict(self)
        data["configs"] = list(self.names)
        data["left_out"] = [list(item) for item in self.left_out]
        data["batch_sizes"] = list(self.batch_sizes)
        return data


def check_config_names(configs: str | Sequence[str], owner: str = "BenchSpec") -> tuple[str, ...]:
    """The configurations named in ``configs`` (a comma-separated string or a sequence), each a registered name or a
    ``+``-joined stack, in order and without duplicates; a :class:`SpecError` echoing ``configs`` as given for an
    empty or unknown name (with the nearest registered one) or a stack whose parts conflict."""
    from lightning_perf.benchmark import configs as registry

    items = configs.split(",") if isinstance(configs, str) else list(configs)
    expected = "comma-separated configuration names, each a registered name or a '+'-joined stack (--list shows them)"
    if not items or any(not isinstance(item, str) for item in items) or all(not item.strip() for item in items):
        raise SpecError("configs", configs, expected, owner)
    items = [item.strip() for item in items]
    if any(not item for item in items):
        raise SpecError("configs", configs, expected + ", with no empty name between commas", owner)
    known = registry.available_configs()
    resolved: list[str] = []
    for item in items:
        for part in (p.strip() for p in item.split("+")):
            if part not in known:
                hint = did_you_mean(part, known) or f"--list shows all {len(known)}"
                raise SpecError("configs", configs, f"registered names (unknown configuration {part!r}: {hint})", owner)
        try:
            name = registry.get_config(item).name
        except ValueError as exc:  # a stack whose parts conflict (two precisions, two strategies)
            raise SpecError("configs", configs, f"a stack that can be built: {str(exc).rstrip('.')}", owner) from None
        if name not in resolved:
            resolved.append(name)
    return tuple(resolved)


def _probe(spec: BenchSpec, preset: str) -> dict[str, Any] | None:
    """The structure of the model ``spec`` benches, built once here (``None`` when it cannot be built here)."""
    from lightning_perf.benchmark.structure import structure_of_source

    found = structure_of_source(
        spec.source, workload=spec.workload, preset=preset, seed=spec.seed, batch_size=spec.batch_size
    )
    return None if found is None else found.to_dict()


CPU_COMPILE_MIN_BUDGET_S = 400.0
"""The ``--time-budget`` from which the default set on a CPU includes a compile variant whose cold compile grows with
the model: whole-model ``compile``, or ``compile_regional`` over blocks of several shapes (each shape is compiled
apart: the default convnet's 6 blocks in 6 shapes took a cold first step of 97 s on a 2-core AVX2 CPU, while the
whole default budget is 150 s); measured inside a shorter budget it leaves every other configuration too few repeats
for a recommendation. ``compile_regional`` over blocks of one shape is kept at any budget: one block is compiled once
per process and reused by the others (the default ``lm``, 6 blocks: a cold first step of 16-17 s on a 2-core AVX-512
CPU) and the bench's per-configuration compile cache starts its later repeats warm."""


def _compile_within_budget(
    configs: tuple[str, ...],
    left_out: tuple[tuple[str, str], ...],
    device: str,
    repeats: int | None,
    budget: float,
    structure: Mapping[str, Any] | None = None,
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The default set less the compile variants whose cold compile grows with the model (see
    :data:`CPU_COMPILE_MIN_BUDGET_S`) on a CPU when ``--repeats auto`` has under that many seconds, left out with what
    in the model (``structure``) decided it and how to include them."""
    from lightning_perf.benchmark.configs import COMPILE_VARIANTS

    if not device.startswith("cpu") or repeats is not None or budget >= CPU_COMPILE_MIN_BUDGET_S:
        return configs, left_out
    facts = structure or {}
    once = (COMPILE_REGIONAL,) if facts.get("block_shapes") == 1 else ()  # one block's shape: compiled once
    dropped = [name for name in configs if name in COMPILE_VARIANTS and name not in once]
    if not dropped:
        return configs, left_out
    model, blocks = facts.get("model") or "the model", len(facts.get("repeated_blocks") or ())
    if not blocks:
        what = f"{model} has no repeated blocks to compile once, and a whole-model cold compile"
    else:  # regional compile over blocks of several shapes (the default set has no whole-model compile then)
        shapes = f"{facts['block_shapes']} shapes" if facts.get("block_shapes") else "shapes not known"
        kind = facts.get("block_class") or "repeated"
        what = f"{model}'s {blocks} {kind} blocks come in {shapes}, each compiled apart: a cold compile"
    why = (
        f"left out on CPU within a {budget:.0f} s budget: {what} there takes minutes, which would leave the other "
        f"configurations too few repeats for an answer; `--time-budget {CPU_COMPILE_MIN_BUDGET_S:.0f}` or "
        "`--configs ...,{name}` includes it"
    )
    kept = tuple(name for name in configs if name not in dropped)
    return kept, (*left_out, *((name, why.replace("{name}", name)) for name in dropped))


def _resolve_configs(
    configs: str | Sequence[str] | None,
    device: str,
    stage: str,
    left_out: Sequence[tuple[str, str]],
    structure: Mapping[str, Any] | None = None,
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The names to run (``baseline`` first) and the ones left out with why; every name is looked up here, once."""
    import torch

    from lightning_perf.benchmark import configs as registry
    from lightning_perf.benchmark.structure import ModelStructure

    if configs is None:
        facts = None
        if structure is not None:
            try:
                facts = ModelStructure.from_dict(structure)
            except (TypeError, ValueError) as exc:
                raise SpecError("structure", structure, f"ModelStructure.to_dict() fields ({exc})") from None
        names, out = registry.default_configs(torch.device(device), stage=stage, structure=facts)
        return tuple(names), tuple(out)
    if (configs.strip() if isinstance(configs, str) else list(configs)) in ("all", ["all"]):
        names, out = registry.split_by_stage(registry.available_configs(), stage)
        return tuple(names), tuple((name, why) for name, why in out if name != BASELINE)
    resolved = list(check_config_names(configs))
    if BASELINE not in resolved:  # every ratio is taken against a baseline measured in the same session
        resolved.insert(0, BASELINE)
    kept, out = registry.split_by_stage(resolved, stage)
    # A re-built spec passes its left-out list back in: keep the entries that are not run now.
    earlier = tuple((name, why) for name, why in left_out if name not in kept and name not in dict(out))
    return tuple(kept), (*earlier, *out)
