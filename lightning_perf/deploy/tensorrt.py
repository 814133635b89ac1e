"""TensorRT export through torch-tensorrt's dynamo path, saved as an ExportedProgram (``<name>.trt.pt2``).

tensorrt and torch-tensorrt are imported only inside the functions that need them (CUDA only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._imports import require
from lightning_perf.deploy.backend import BackendUnavailable, ExportBackend, ExportOptions, Runner, dynamic_shapes
from lightning_perf.deploy.inputs import Inputs, InputSpec, cast_inputs
from lightning_perf.deploy.onnx import traceable_causal_masks
from lightning_perf.deploy.validate import flat_outputs

__all__ = ["TensorRTBackend", "TensorRTRunner"]


class TensorRTRunner(Runner):
    def __init__(self, path: Path, device: torch.device, dtype: torch.dtype, output_names: list[str]) -> None:
        torch_tensorrt = require("torch_tensorrt", "export(backends=['tensorrt'])")
        self.module = torch_tensorrt.load(str(path)).module()
        self.device, self.dtype = device, dtype
        self.runtime = f"torch-tensorrt {getattr(torch_tensorrt, '__version__', '?')}"
        self.output_names = output_names

    def run(self, inputs: tuple[Tensor, ...]) -> Any:
        return self.module(*cast_inputs(inputs, self.dtype, self.device))

    def __call__(self, inputs: tuple[Tensor, ...]) -> list[Tensor]:
        outputs, names = flat_outputs(self.run(inputs))
        self.output_names = names
        return outputs


class TensorRTBackend(ExportBackend):
    name = "tensorrt"
    suffix = ".trt.pt2"  # torch.export.save wants the .pt2 extension

    def check(self, options: ExportOptions) -> None:
        try:
            require("tensorrt", "export(backends=['tensorrt'])")
            require("torch_tensorrt", "export(backends=['tensorrt'])")
        except ModuleNotFoundError as exc:
            raise BackendUnavailable(str(exc)) from exc
        if options.device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable(f"TensorRT needs a CUDA device; the export device is {options.device}.")

    def _inputs(self, specs: list[InputSpec], dtype: torch.dtype) -> list[Any]:
        import torch_tensorrt

        return [
            torch_tensorrt.Input(
                min_shape=spec.min_shape,
                opt_shape=spec.opt_shape,
                max_shape=spec.max_shape,
                dtype=dtype if spec.dtype.is_floating_point else spec.dtype,
            )
            for spec in specs
        ]

    def build(self, model: nn.Module, example: Inputs, specs: list[InputSpec], options: ExportOptions) -> Any:
        import torch_tensorrt

        # Traced here with one Dim shared by every input's batch dimension: torch-tensorrt's own tracer makes one per
        # input, which torch.export rejects as soon as the model combines two inputs along the batch.
        shapes = dynamic_shapes(specs, model)
        with traceable_causal_masks():
            program = torch.export.export(model, example, dynamic_shapes=shapes)
        # torch-tensorrt >= 2.13 takes the precision from the dtypes (TensorRT 11 is strongly typed, and
        # `enabled_precisions` is gone from the dynamo path): the model copy and the inputs are cast already.
        compiled = torch_tensorrt.compile(
            program,
            ir="dynamo",
            arg_inputs=self._inputs(specs, options.dtype),
            device=options.device,
            # fp32 means fp32: without this TensorRT uses TF32 on Ampere and newer, 1e-3 away from the model.
            disable_tf32=options.precision == "fp32",
            min_block_size=1,
        )
        return compiled, example, shapes  # what saving needs: the module, the traced example, its dynamic shapes

    def save(self, built: Any, path: Path, specs: list[InputSpec], options: ExportOptions) -> list[Path]:
        import torch_tensorrt

        module, example, shapes = built
        torch_tensorrt.save(
            module, str(path), output_format="exported_program", arg_inputs=list(example), dynamic_shapes=shapes
        )
        return [path]

    def load(self, path: Path, options: ExportOptions) -> Runner:
        return TensorRTRunner(path, options.device, options.dtype, options.output_names)
