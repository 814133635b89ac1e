"""Each optimization as plain functions on modules, tensors and optimizers: no Lightning needed."""

from __future__ import annotations

from lightning_perf.functional.backend_flags import BackendFlags
from lightning_perf.functional.channels_last import apply_channels_last, batch_to_channels_last
from lightning_perf.functional.compile.regions import CompileMonitor, compile_regions
from lightning_perf.functional.fused_optimizer import switch_implementation
from lightning_perf.functional.powersgd import gather_state_dict, register_powersgd_hook

__all__ = [
    "BackendFlags",
    "CompileMonitor",
    "apply_channels_last",
    "batch_to_channels_last",
    "compile_regions",
    "gather_state_dict",
    "register_powersgd_hook",
    "switch_implementation",
]
