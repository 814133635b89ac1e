"""What the auto-tuner found: every trial, the recommendation, and their table, JSON and LightningCLI YAML forms."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_perf._io import numbered_path
from lightning_perf.profiling.report import format_ratio

__all__ = ["Recommendation", "Trial", "TuningResult", "unused_output"]


@dataclass
class Trial:
    """What one trial measured and what the tuner decided about it."""

    label: str
    stage: str
    config: str
    batch_size: int | None
    loader: dict[str, Any]
    verdict: str  # baseline, kept, rejected, unreliable, skipped, failed, confirm (a re-run that checks a small win)
    reason: str = ""
    step_median_s: float | None = None
    step_p25_s: float | None = None
    step_p75_s: float | None = None
    latency_p95_s: float | None = None  # inference stages: the step is one batch; its 95th and 99th percentiles
    latency_p99_s: float | None = None
    throughput: float | None = None  # samples per second at the median step
    speedup: float | None = None  # per-sample speed vs the baseline (baseline time / this trial's time)
    speedup_ci95: list[float] | None = None  # its 95% interval [low, high]
    speedup_verdict: str | None = None  # faster, slower, no clear difference
    speedup_method: str | None = None  # how the interval was obtained
    gain: float | None = None  # per-sample speed vs the incumbent it was compared with
    gain_ci95: list[float] | None = None
    gain_verdict: str | None = None
    gain_method: str | None = None
    compared_with: str | None = None  # the incumbent's label
    p_faster: float | None = None  # share of (candidate, incumbent) step pairs where the candidate was faster
    data_wait_share: float | None = None
    loss_deviation: float | None = None  # median relative difference of per-step losses vs baseline
    warmup_s: float | None = None
    peak_memory_bytes: int | None = None
    step_memory_bytes: int | None = None
    wall_s: float | None = None
    error: str | None = None
    disturbed: list[str] = field(default_factory=list)  # what disturbed the measurement kept for this trial
    remeasured_because: list[str] = field(default_factory=list)  # what disturbed its first measurement

    @property
    def measured(self) -> bool:
        return self.step_median_s is not None

    def fill(self, result: Any) -> None:
        """Take the figures of a successful run (a worker's ``RunResult``: a training or an inference stage)."""
        from lightning_perf.profiling.stats import median
        from lightning_perf.tuning.verdicts import quartiles

        times = result.step_times_s
        self.step_median_s = median(times)
        self.step_p25_s, self.step_p75_s = quartiles(times)
        self.latency_p95_s, self.latency_p99_s = result.latency_p95_s, result.latency_p99_s
        self.throughput = result.throughput if result.throughput is not None else result.predict_throughput
        self.warmup_s = result.warmup_s
        self.peak_memory_bytes = result.peak_memory_bytes
        self.step_memory_bytes = result.step_memory_bytes
        if result.data_wait_s:
            self.data_wait_share = median(result.data_wait_s) / self.step_median_s

    def set_ratio(self, name: str, estimate: Any) -> None:
        """Store a :class:`~lightning_perf.profiling.intervals.RatioEstimate` as ``name``, ``name_ci95``,
        ``name_verdict`` and ``name_method``."""
        setattr(self, name, estimate.ratio)
        setattr(self, f"{name}_ci95", [estimate.low, estimate.high])
        setattr(self, f"{name}_verdict", estimate.verdict)
        setattr(self, f"{name}_method", estimate.method)

    @property
    def speedup_text(self) -> str:
        """The speed-up vs baseline as the table prints it (and the reason quotes it)."""
        return format_ratio(self.speedup, self.speedup_ci95, self.speedup_verdict)

    @property
    def gain_text(self) -> str:
        """The gain vs the incumbent, as the reasons quote it."""
        return format_ratio(self.gain, self.gain_ci95, self.gain_verdict)


@dataclass
class Recommendation:
    """The configuration the tuner recommends: callbacks, Trainer and data settings, and how it measured."""

    configs: tuple[str, ...] = ()
    callback_specs: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None  # None: keep the model's own
    loader: dict[str, Any] = field(default_factory=dict)
    speedup: float | None = None  # per-sample speed vs baseline, as the tuner measured it; None: nothing to change
    speedup_ci95: list[float] | None = None
    speedup_verdict: str | None = None
    speedup_method: str | None = None
    notes: list[str] = field(default_factory=list)
    reliable: bool = True
    causes: list[str] = field(default_factory=list)  # why the measurement is unreliable
    stage: str = "fit"  # the Trainer stage it was tuned for: fit, or predict / validate / test (inference)

    @property
    def changes_nothing(self) -> bool:
        """Whether the recommendation is the model as given."""
        return not self.configs and self.batch_size is None and not self.loader

    @property
    def headline(self) -> str:
        """The one line that says what was found: the speed-up with its interval and verdict, or why nothing."""
        if not self.reliable:
            return f"Recommended: nothing: unreliable: {'; '.join(self.causes)}"
        if self.changes_nothing or self.speedup is None:
            return "Recommended: no change (no candidate was measurably faster than the model as given)"
        ratio = format_ratio(self.speedup, self.speedup_ci95, self.speedup_verdict)
        return f"Recommended ({ratio} vs the baseline's per-sample speed, 95% interval):"

    def callbacks(self) -> list[Any]:
        """Fresh instances of the recommended callbacks, ready for ``Trainer(callbacks=...)``."""
        from lightning_perf.benchmark.configs import instantiate_callbacks

        return instantiate_callbacks(self.callback_specs)

    @property
    def datamodule_kwargs(self) -> dict[str, Any]:
        """Batch size and DataLoader settings to give the data module (or its DataLoaders)."""
        return ({"batch_size": self.batch_size} if self.batch_size is not None else {}) | dict(self.loader)


@dataclass
class TuningResult:
    """Every trial and the recommendation; writes itself as a table, JSON and a LightningCLI YAML file."""

    source: str
    device: str
    time_budget_s: float
    elapsed_s: float
    trials: list[Trial]
    recommendation: Recommendation
    datamodule_init_args: list[str] = field(default_factory=list)
    model_init_args: list[str] = field(default_factory=list)
    batch_size_holder: str | None = None
    bench_command: str | None = None
    reliability: dict[str, Any] = field(default_factory=lambda: {"reliable": True, "causes": []})
    stage: str = "fit"  # the Trainer stage tuned for (fit: training steps; predict/validate/test: per-batch latency)
    threads: dict[str, Any] | None = None  # benchmark.threads.ThreadChoice: every trial's intra-op threads, and why
    retry_command: str | None = None  # what to run when the machine is quiet (the CLI's own arguments), if undecided

    @property
    def undecided(self) -> list[str]:
        """Why this run could not decide all it set out to (empty: it decided): a disturbed reference, trials disturbed
        every time they ran, trials the budget did not reach or could not confirm."""
        rec = self.recommendation
        why = [] if rec.reliable else [f"the reference was disturbed ({'; '.join(rec.causes)})"]
        disturbed = [t.label for t in self.trials if t.verdict == "unreliable"]
        late = [t.label for t in self.trials if "out of budget" in t.reason or "no budget left" in t.reason]
        if disturbed:
            why.append(f"disturbed every time they ran: {', '.join(disturbed)}")
        if late:
            why.append(f"not measured or not confirmed for lack of budget: {', '.join(late)}")
        return why

    def next_step(self) -> str | None:
        """What to run later when this run left something undecided (``None`` when it decided)."""
        if not self.undecided:
            return None
        command = self.retry_command or "the tuner again (a larger time_budget_s leaves room to re-measure)"
        return f"run this when the machine is quiet: {command}"

    def ranked(self) -> list[Trial]:
        """Measured trials, fastest per sample first, then the ones without a measurement."""
        measured = sorted((t for t in self.trials if t.measured), key=lambda t: -(t.speedup or 0.0))
        return measured + [t for t in self.trials if not t.measured]

    def table_rows(self) -> list[list[str]]:
        from lightning_perf.profiling import format_bytes, format_number

        return [
            [
                t.label,
                t.stage,
                t.verdict,
                _ms(t.step_median_s, t.step_p25_s, t.step_p75_s),
                format_number(t.throughput, ".1f"),
                "reference" if t.verdict == "baseline" else t.speedup_text,
                format_number(t.p_faster, ".2f"),
                format_number(None if t.data_wait_share is None else 100 * t.data_wait_share, ".1f", "%"),
                format_number(t.loss_deviation, ".3f"),
                format_bytes(t.step_memory_bytes),
                format_number(t.wall_s, ".1f"),
            ]
            for t in self.ranked()
        ]

    TABLE_COLUMNS = ("trial", "stage", "verdict", "step ms (IQR)", "samples/s", "vs baseline [95% CI]", "P(faster)",
                     "data wait", "loss dev", "step memory", "trial s")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Every field (trials and recommendation as dicts), the LightningCLI config and what is left undecided."""
        data = {"kind": "lightning-perf-autotune", **asdict(self)}
        data["recommendation"]["datamodule_kwargs"] = self.recommendation.datamodule_kwargs
        return data | {"lightning_cli": self.lightning_cli_config(), "undecided": self.undecided}

    def lightning_cli_config(self) -> dict[str, Any]:
        """The recommendation as a LightningCLI config: ``trainer`` callbacks and precision, ``data``/``model`` args.

        A data setting is written only where the user's class takes it as an ``__init__`` argument (that is what the
        CLI can set); the others are in :attr:`Recommendation.notes`.
        """
        rec = self.recommendation
        trainer: dict[str, Any] = dict(rec.trainer_kwargs)
        if rec.callback_specs:
            trainer["callbacks"] = [{"class_path": path, "init_args": dict(args)} for path, args in rec.callback_specs]
        config: dict[str, Any] = {"trainer": trainer}
        data: dict[str, Any] = {k: v for k, v in rec.loader.items() if k in self.datamodule_init_args}
        model: dict[str, Any] = {}
        if rec.batch_size is not None:
            if self.batch_size_holder == "datamodule" and "batch_size" in self.datamodule_init_args:
                data["batch_size"] = rec.batch_size
            elif self.batch_size_holder in ("model", "hparams") and "batch_size" in self.model_init_args:
                model["batch_size"] = rec.batch_size
        if data:
            config["data"] = data
        if model:
            config["model"] = model
        return config

    def to_yaml(self) -> str:
        import yaml

        rec = self.recommendation
        header = [
            "# lightning-perf autotune recommendation (a LightningCLI config: `--config` this file)",
            f"# model: {self.source}; device: {self.device}; tuned for: {self.stage}",
            f"# {rec.headline.rstrip(':')} ({self.elapsed_s:.0f} s of tuning, "
            f"{sum(t.measured for t in self.trials)} trials)",
        ]
        header += [f"# note: {note}" for note in rec.notes]
        header += self._empty_lines()
        return "\n".join(header) + "\n" + yaml.safe_dump(self.lightning_cli_config(), sort_keys=False)

    def _empty_lines(self) -> list[str]:
        """The header's word on an empty ``trainer: {}``: why it is empty, and what to run when it is undecided."""
        lines = []
        if self.threads:
            lines.append(f"# measured with {self.threads.get('threads')} intra-op thread(s) per trial")
        if self.lightning_cli_config() != {"trainer": {}}:
            return lines
        if self.undecided:
            lines.append("# trainer: {} below: nothing decided, so nothing changes: " + "; ".join(self.undecided))
            lines.append(f"# {self.next_step()}")
        else:
            lines.append("# trainer: {} below: no candidate was measurably faster; keep the Trainer as it is")
        return lines

    def write(
        self,
        yaml_path: str | os.PathLike[str] | None,
        json_path: str | os.PathLike[str] | None,
        *,
        force: bool = False,
    ) -> list[Path]:
        """Write the YAML and/or JSON files atomically; returns the paths written.

        Raises:
            FileExistsError: when a file exists already and ``force`` is not set (:func:`unused_output` picks a free
                name); nothing is written then.
        """
        from lightning_perf._io import atomic_write_text

        targets = [(Path(p), make) for p, make in ((yaml_path, self.to_yaml), (json_path, self._json)) if p is not None]
        existing = [str(p) for p, _ in targets if p.exists()]
        if existing and not force:
            raise FileExistsError(
                f"{', '.join(existing)} exists already: not overwritten. Pass force=True to overwrite, or a free "
                "name (lightning_perf.tuning.results.unused_output numbers the run)."
            )
        return [atomic_write_text(path, make()) for path, make in targets]

    def _json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def print(self, console: Any = None) -> None:
        from rich.console import Console

        from lightning_perf.profiling import print_table

        if console is None:
            console = Console()
            if not console.is_terminal:  # piped or captured: do not squeeze the table into 80 columns
                console = Console(width=160)
        columns: tuple[str, ...] = self.TABLE_COLUMNS
        if self.stage != "fit":  # an inference run's step is one batch: its latency
            columns = tuple("batch ms (IQR)" if c == "step ms (IQR)" else c for c in columns)
        print_table(
            columns,
            self.table_rows(),
            title=f"autotune ({self.stage}): {self.source} on {self.device} ({self.elapsed_s:.0f} s)",
            console=console,
            width=console.width,
        )
        rec = self.recommendation
        lines = [f"  {t.label}: {t.verdict}, {t.reason}" for t in self.ranked() if t.reason]
        if not self.reliability.get("reliable", True):
            lines += [f"warning: unreliable measurement: {cause}" for cause in self.reliability.get("causes", [])]
        lines.append(rec.headline)
        lines += [f"undecided: {why}" for why in self.undecided]
        if not rec.reliable:
            print("\n".join(lines), flush=True)
            return
        lines.append(f"  callbacks: {', '.join(p.rsplit('.', 1)[-1] for p, _ in rec.callback_specs) or 'none'}")
        lines.append(f"  trainer: {rec.trainer_kwargs or 'as is'}")
        lines.append(f"  data: {rec.datamodule_kwargs or 'as is'}")
        lines += [f"  note: {note}" for note in rec.notes]
        if self.bench_command:
            lines.append(f"  check it with: {self.bench_command}")
        print("\n".join(lines), flush=True)


def unused_output(yaml_path: str | os.PathLike[str], force: bool = False) -> Path:
    """``yaml_path``, or numbered (``tuned-2.yaml``...) when it or its JSON twin exists; as is with ``force``."""
    return numbered_path(Path(yaml_path), lambda p: (p, p.with_suffix(".json")), force)


def _ms(med: float | None, lo: float | None, hi: float | None) -> str:
    if med is None:
        return "n/a"
    return f"{med * 1e3:.1f} ({(lo or med) * 1e3:.1f}-{(hi or med) * 1e3:.1f})"
