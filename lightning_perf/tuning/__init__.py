"""The auto-tuner (:class:`~lightning_perf.tuning.tuner.AutoTuner`): measures a user's own model and recommends the
fastest safe configuration."""

__all__: list[str] = []  # nothing re-exported: import from the modules (``tuning.tuner``, ``tuning.results``...)
