"""The auto-tuner: measures a user's own model and recommends the fastest safe configuration."""

from lightning_perf.benchmark.sources import ImportSource, ModelSource, ObjectSource, WorkloadSource
from lightning_perf.tuning.results import Recommendation, Trial, TuningResult
from lightning_perf.tuning.tuner import AutoTuner, Candidate, ModelError, TuningError
from lightning_perf.tuning.verdicts import compare, loss_deviation

__all__ = [
    "AutoTuner",
    "Candidate",
    "ImportSource",
    "ModelError",
    "ModelSource",
    "ObjectSource",
    "Recommendation",
    "Trial",
    "TuningError",
    "TuningResult",
    "WorkloadSource",
    "compare",
    "loss_deviation",
]
