"""Lightning strategies (gradient compression for DDP)."""

from lightning_perf.strategies.powersgd import PowerSGDDDPStrategy

__all__: list[str] = [
    "PowerSGDDDPStrategy",
]
