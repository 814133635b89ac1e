"""The auto-tuner (:class:`~lightning_perf.tuning.tuner.AutoTuner`): measures a user's own model and recommends the
fastest safe configuration."""
