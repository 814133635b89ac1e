"""The tuner's recommendation: the settings of the best configuration it measured, with notes on what they change."""

from __future__ import annotations

from typing import Any

from lightning_perf.tuning.results import Recommendation, Trial

__all__ = ["bench_command", "long_warmup", "recommend"]


def long_warmup(configs: Any) -> list[str]:
    """The names among ``configs`` whose entries say their warm-up is long (compilation)."""
    from lightning_perf.optimizations import find

    return [name for name in configs if (o := find(name)) is not None and o.long_warmup]


def recommend(
    candidate: Any,
    best: Trial,
    holder: tuple[str, int] | None,
    dm_params: list[str],
    causes: list[str] | None = None,
    stage: str = "fit",
) -> Recommendation:
    """The recommendation for ``candidate`` (a :class:`~lightning_perf.tuning.tuner.Candidate`) measured as ``best``.

    With ``causes`` (the reference measurement was disturbed) nothing is recommended: the result says why. ``stage``
    is the Trainer stage tuned for (an inference stage adds how to run it and what was not checked).
    """
    from lightning_perf.benchmark.configs import get_config
    from lightning_perf.tuning.inference import inference_notes

    if causes:
        return Recommendation(reliable=False, causes=list(causes), stage=stage)
    config = get_config(candidate.config_name)
    specs = [(path, dict(args)) for path, args in (config.callback_specs or ())]
    notes = []
    if candidate.batch_size is not None and holder is not None:
        notes.append(
            f"batch size {holder[1]} -> {candidate.batch_size} changes the optimization: scale the learning "
            f"rate with it (e.g. linearly) and check convergence"
        )
    loader = dict(candidate.loader)
    missing = [k for k in loader if k not in dm_params]
    if missing:
        notes.append(
            f"the data module's __init__ does not take {', '.join(missing)}: set "
            f"{', '.join(f'{k}={loader[k]!r}' for k in missing)} in its DataLoaders"
        )
    if long_warmup(candidate.configs):
        names = ", ".join(long_warmup(candidate.configs))
        notes.append(f"{names} costs {best.warmup_s or 0:.0f} s of warm-up per run; it pays off on long runs")
    notes += inference_notes(stage, candidate.configs)
    unchanged = best.verdict == "baseline"
    return Recommendation(
        configs=candidate.configs,
        callback_specs=specs,
        trainer_kwargs=dict(config.trainer_kwargs),
        batch_size=candidate.batch_size,
        loader=loader,
        speedup=None if unchanged else best.speedup,
        speedup_ci95=None if unchanged else best.speedup_ci95,
        speedup_verdict=None if unchanged else best.speedup_verdict,
        speedup_method=None if unchanged else best.speedup_method,
        notes=notes,
        stage=stage,
    )


def bench_command(source: Any, device: str, candidate: Any, stage: str = "fit") -> str | None:
    """The ``lightning-perf bench`` command that measures the recommendation again, for the stage tuned (a reference
    workload, or classes named by import path; None for objects the command line cannot name)."""
    import json
    import shlex

    from lightning_perf.benchmark.sources import ImportSource, WorkloadSource

    if isinstance(source, WorkloadSource):
        parts = ["lightning-perf bench", f"--workload {source.workload}", f"--preset {source.preset}"]
    elif isinstance(source, ImportSource):
        parts = ["lightning-perf bench", f"--model {source.model}", f"--datamodule {source.datamodule}"]
        for option, args in (("--model-args", source.model_args), ("--datamodule-args", source.datamodule_args)):
            if args:
                parts.append(f"{option} {shlex.quote(json.dumps(args))}")
    else:
        return None
    parts += [
        f"--configs baseline,{candidate.config_name}" if candidate.configs else "--configs baseline",
        f"--device {device}",
    ]
    if stage != "fit":
        parts.append(f"--stage {stage}")
    if candidate.batch_size is not None:
        parts.append(f"--batch-size {candidate.batch_size}")
    workers = dict(candidate.loader).get("num_workers")
    if workers:
        parts.append(f"--num-workers {workers}")
    return " ".join(parts)
