"""Lightning strategies (gradient compression for DDP)."""

__all__: list[str] = []
