"""ONNX export (``torch.onnx.export(..., dynamo=True)``, weights in ``<name>.onnx.data``) and its onnxruntime runner.

onnx, onnxscript and onnxruntime are imported only inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._imports import require
from lightning_perf.deploy.backend import BackendUnavailable, ExportBackend, ExportOptions, Runner, dynamic_shapes
from lightning_perf.deploy.inputs import Inputs, InputSpec

__all__ = [
    "OnnxBackend",
    "OnnxRunner",
    "equal_thread_options",
    "onnx_providers",
    "save_program_onnx",
    "traceable_causal_masks",
]


ORT_TYPES = {
    "tensor(float)": torch.float32,
    "tensor(float16)": torch.float16,
    "tensor(double)": torch.float64,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}


_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def onnx_providers(ort: Any, device: torch.device, requested: Sequence[str] | None) -> list[str]:
    """The execution providers asked for, or by default CUDA's (on a CUDA device, when installed) then the CPU's."""
    if requested is not None:
        return list(requested)
    wanted = ["CUDAExecutionProvider"] if device.type == "cuda" else []
    return [p for p in wanted if p in ort.get_available_providers()] + ["CPUExecutionProvider"]


def equal_thread_options(ort: Any, threads: int | None = None) -> Any:
    """``onnxruntime.SessionOptions`` for a session timed against torch: as many intra-op threads as torch uses
    (``threads``, default ``torch.get_num_threads()``), one inter-op thread, and no spin-waiting between calls.

    onnxruntime's defaults (one intra-op thread per core, spinning) against 1-thread torch made an ONNX file look
    0.61x of eager on a 2-core machine where, at equal threads, it was 1.15x faster: the comparison is only fair
    with equal threads, and spinning workers would take the cores from the torch side between calls.
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the session's warnings about fallback nodes are not actionable
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


class OnnxRunner(Runner):
    """A saved ONNX file in an onnxruntime session with :func:`equal_thread_options` (``threads`` intra-op)."""

    def __init__(self, path: Path, device: torch.device, providers: Sequence[str] | None) -> None:
        ort = require("onnxruntime", "export(backends=['onnx'])")
        providers = onnx_providers(ort, device, providers)
        options = equal_thread_options(ort)
        self.threads: int | None = options.intra_op_num_threads
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        self.providers = list(self.session.get_providers())
        self.runtime = f"onnxruntime {ort.__version__} ({', '.join(self.providers)}, {self.threads} intra-op threads)"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_dtypes = [ORT_TYPES.get(i.type) for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.on_cuda = device.type == "cuda" and self.providers[0] in _GPU_PROVIDERS
        self.device = device

    def _prepare(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"The ONNX model takes {len(self.input_names)} inputs, got {len(inputs)}.")
        target = self.device if self.on_cuda else torch.device("cpu")
        return [t.to(device=target, dtype=dtype or t.dtype).contiguous() for t, dtype in zip(inputs, self.input_dtypes)]

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        tensors = self._prepare(inputs)
        if not self.on_cuda:
            return self.session.run(None, {n: t.numpy() for n, t in zip(self.input_names, tensors)})
        # Inputs already on the GPU are bound in place, outputs stay there: no host copy in the timed call.
        binding = self.session.io_binding()
        index = self.device.index or 0
        for name, t in zip(self.input_names, tensors):
            binding.bind_input(name, "cuda", index, _numpy_dtype(t.dtype), tuple(t.shape), t.data_ptr())
        for name in self.output_names:
            binding.bind_output(name, "cuda", index)
        self.session.run_with_iobinding(binding)
        return binding

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        result = self.run(inputs)
        arrays = result.copy_outputs_to_cpu() if self.on_cuda else result
        return [torch.from_numpy(a) for a in arrays]


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.empty((), dtype=dtype).numpy().dtype


class OnnxBackend(ExportBackend):
    name = "onnx"
    suffix = ".onnx"

    def check(self, options: ExportOptions) -> None:
        try:
            for module in ("onnx", "onnxscript", "onnxruntime"):
                require(module, "export(backends=['onnx'])")
        except ModuleNotFoundError as exc:
            raise BackendUnavailable(str(exc)) from exc
        if options.precision == "bf16":
            raise BackendUnavailable(
                "bf16 ONNX is not supported: numpy has no bfloat16, so onnxruntime's Python API cannot feed or return "
                "it. Use fp16, or the tensorrt backend for bf16."
            )
        ort = require("onnxruntime")
        providers = onnx_providers(ort, options.device, options.onnx_providers)
        if options.precision == "fp16" and providers[0] == "CPUExecutionProvider":
            # Refused rather than tried: onnxruntime 1.31's CPU provider lacks fp16 kernels for many operators, and
            # loading an fp16 transformer (the `vit` workload) crashes the whole process, which no fallback catches.
            raise BackendUnavailable(
                "fp16 ONNX needs a GPU execution provider (onnxruntime-gpu on a CUDA device): onnxruntime's CPU "
                "provider lacks half-precision kernels for many operators."
            )

    def build(self, model: nn.Module, example: Inputs, specs: list[InputSpec], options: ExportOptions) -> Any:
        return _onnx_export(
            model,
            example,
            dynamic_shapes=dynamic_shapes(specs, model),
            input_names=[s.name for s in specs],
            output_names=options.output_names,
            opset_version=options.opset,
        )

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: ExportOptions) -> list[Path]:
        return _save_external(built, path)

    def load(self, path: Path, options: ExportOptions) -> Runner:
        return OnnxRunner(path, options.device, options.onnx_providers)


def save_program_onnx(
    program: torch.export.ExportedProgram, path: Path, owner: str = "save_program_onnx"
) -> list[Path]:
    """ONNX export of a captured program at ``path`` (a staging path: weights in ``<name>.data`` beside it); returns
    the files written, the graph last."""
    for module in ("onnx", "onnxscript"):
        require(module, f"{owner}(onnx=True)")
    onnx_program = _onnx_export(program, ())
    if onnx_program is None:
        raise RuntimeError("torch.onnx.export returned no program")
    return _save_external(onnx_program, path)


@contextlib.contextmanager
def traceable_causal_masks() -> Iterator[None]:
    """nn.Transformer's check of whether a mask is causal reads the mask's values, which ``torch.export`` cannot trace
    (a data-dependent guard): inside the block the answer is "not known causal", so the mask is applied as given, the
    same result without the causal fast path."""
    from torch.nn.modules import transformer

    detect = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = lambda mask, is_causal=None, size=None: bool(is_causal)
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


def _onnx_export(model: Any, args: tuple[Any, ...], **kwargs: Any) -> Any:
    with warnings.catch_warnings(), traceable_causal_masks():
        # torch.export's own deprecation chatter (pytree LeafSpec...) says nothing about the user's model.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.onnx.export(model, args, None, dynamo=True, verbose=False, **kwargs)


def _save_external(onnx_program: Any, path: Path) -> list[Path]:
    """Save with the weights in ``<name>.data`` beside the graph, referenced by that name: both move together."""
    onnx_program.save(str(path), external_data=True)
    data = path.with_name(path.name + ".data")
    return [data, path] if data.exists() else [path]
