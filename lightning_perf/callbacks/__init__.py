"""Lightning callbacks, one optimization or observer each; the logic lives in :mod:`lightning_perf.functional`."""

import lightning_perf.strategies  # noqa: F401  registers Trainer(strategy="ddp_powersgd")
from lightning_perf.callbacks.backend_flags import BackendFlagsCallback
from lightning_perf.callbacks.bottleneck import BottleneckCallback
from lightning_perf.callbacks.channels_last import ChannelsLastCallback
from lightning_perf.callbacks.compile import CompileCallback
from lightning_perf.callbacks.flash_attention import FlashAttentionCallback
from lightning_perf.callbacks.float8 import Float8TrainingCallback
from lightning_perf.callbacks.fused_optimizer import FusedOptimizerCallback
from lightning_perf.callbacks.grad_checkpoint import GradCheckpointCallback
from lightning_perf.callbacks.memory_profiler import MemoryProfilerCallback
from lightning_perf.callbacks.qat import QATCallback
from lightning_perf.callbacks.sliding_window import SlidingWindowInferenceCallback
from lightning_perf.callbacks.tensorrt_export import TensorRTExportCallback

__all__: list[str] = [
    "BackendFlagsCallback",
    "BottleneckCallback",
    "ChannelsLastCallback",
    "CompileCallback",
    "FlashAttentionCallback",
    "Float8TrainingCallback",
    "FusedOptimizerCallback",
    "GradCheckpointCallback",
    "MemoryProfilerCallback",
    "QATCallback",
    "SlidingWindowInferenceCallback",
    "TensorRTExportCallback",
]
