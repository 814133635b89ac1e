"""Each optimization as plain functions on modules, tensors and optimizers: no Lightning needed.

Deployment (export, quantized-model saving) moved to :mod:`lightning_perf.deploy`; its old names here resolve lazily
with a ``DeprecationWarning``.
"""

from __future__ import annotations

from lightning_perf._deprecation import moved_names
from lightning_perf.functional.backend_flags import BackendFlags
from lightning_perf.functional.channels_last import apply_channels_last, batch_to_channels_last
from lightning_perf.functional.compile import CompileMonitor, compile_regions
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

_MOVED = {
    "ExportReport": "lightning_perf.deploy.export",
    "export_model": "lightning_perf.deploy.export",
    "export_quantized": "lightning_perf.deploy.quantize.save",
}


__getattr__ = moved_names(__name__, _MOVED)
