"""Lightning callbacks, one optimization or observer each; the logic lives in :mod:`lightning_perf.functional`."""

__all__: list[str] = []
