"""Quantization-aware training (QAT) of a plain ``nn.Module`` with torchao: the training-time half.

Entry points: :func:`prepare` (``"x86"``: PT2E; ``"torchao"``: ``QATConfig``), :class:`QuantizationRecipe`,
:class:`PreparedGraphModule`, the schedules :func:`set_observers`, :func:`set_fake_quant`,
:func:`freeze_batchnorm_stats`, and :func:`quantization_state_keys`. The back-ends and the prepared graph's modes:
docs/architecture.md, Module notes.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_perf._device import module_device
from lightning_perf._imports import require
from lightning_perf._io import failure_reason
from lightning_perf._validation import check_choice
from lightning_perf.functional.inputs import as_input_tuple
from lightning_perf.functional.quantization.config import base_config_spec, resolve_base_config
from lightning_perf.functional.quantization.device import cache_off, cpu_copy, take_tensors_of
from lightning_perf.profiling.machine import installed_version

__all__ = [
    "BACKENDS",
    "INFO_KEY",
    "MODES",
    "NothingToQuantizeError",
    "PreparedGraphModule",
    "QuantizationError",
    "QuantizationRecipe",
    "allow_train_eval",
    "batchnorm_modules",
    "capture_module",
    "counts_batches",
    "export_dynamic_batch",
    "fast_pattern_matching",
    "freeze_batchnorm_stats",
    "is_prepared",
    "make_recipe",
    "prepare",
    "quantization_state_keys",
    "quiet_deepcopy",
    "recipe_of",
    "set_fake_quant",
    "set_observers",
    "set_quantization_info",
    "torchao_fake_quantizers",
    "with_batch",
    "with_state_versions",
]

BACKENDS: tuple[str, ...] = ("x86", "torchao")
MODES: tuple[str, ...] = ("qat", "ptq")

_RECIPE_VERSION = 1
INFO_KEY = "lightning_perf_quantization"  # where a prepared module keeps its recipe and float state keys


class QuantizationError(RuntimeError):
    """Capturing, preparing, converting or saving a model for quantization failed (the cause is chained)."""


class NothingToQuantizeError(QuantizationError):
    """The backend found no layer it quantizes in the model (e.g. ``x86`` in a network of 3D convolutions)."""


# ----------------------------------------------------------------------------------------------------- recipe


@dataclass(frozen=True)
class QuantizationRecipe:
    """What a quantization did, as plain data: enough to prepare a fresh copy of the model identically.

    Attributes:
        backend: ``"x86"`` (PT2E) or ``"torchao"`` (``quantize_`` + ``QATConfig``).
        mode: ``"qat"`` or ``"ptq"``.
        base_config: the torchao base config's spec (``torchao`` backend), else ``None``.
        input_shapes: per-sample shape of each positional model input (without the batch dimension).
        input_dtypes: dtype name of each input.
    """

    backend: str
    mode: str
    base_config: Mapping[str, Any] | None
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]

    def example_inputs(self, batch_size: int = 2) -> tuple[Tensor, ...]:
        """Zero tensors of the recorded shapes and dtypes (values do not matter for capture)."""
        return tuple(
            torch.zeros((batch_size, *shape), dtype=getattr(torch, dtype))
            for shape, dtype in zip(self.input_shapes, self.input_dtypes)
        )

    def to_dict(self) -> dict[str, Any]:
        return {"version": _RECIPE_VERSION, **asdict(self)}  # copies: the base config's spec too

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationRecipe:
        """Rebuild from :meth:`to_dict` output (as stored in a checkpoint).

        Raises:
            ValueError: if the data is not a recipe this version understands.
        """
        try:
            version = int(data.get("version", 0))
            if version > _RECIPE_VERSION:
                raise ValueError(f"recipe version {version} is newer than this lightning_perf's ({_RECIPE_VERSION})")
            shapes, dtypes = data["input_shapes"], data["input_dtypes"]
            return make_recipe(
                data["backend"], data["mode"], data.get("base_config"), input_shapes=shapes, input_dtypes=dtypes
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"Not a quantization recipe: {dict(data)!r} ({type(exc).__name__}: {exc}).") from None


def make_recipe(
    backend: str = "x86",
    mode: str = "qat",
    base_config: Any = None,
    example_inputs: Any = None,
    *,
    input_shapes: Sequence[Sequence[int]] | None = None,
    input_dtypes: Sequence[str] | None = None,
    owner: str = "make_recipe",
) -> QuantizationRecipe:
    """Check the options and record them with the inputs' per-sample shapes and dtypes.

    Args:
        backend: ``"x86"`` or ``"torchao"``.
        mode: ``"qat"`` or ``"ptq"``.
        base_config: for ``torchao``, see :func:`resolve_base_config` (``None``: its default); must be ``None`` for
            ``x86``.
        example_inputs: a tensor or tuple of tensors with a batch dimension; or give ``input_shapes`` (and
            ``input_dtypes``, default float32).

    Raises:
        ValueError: for an unknown backend or mode, a base config given to ``x86`` or invalid for ``torchao``, or
            missing/invalid inputs.
    """
    check_choice(owner, "backend", backend, BACKENDS)
    check_choice(owner, "mode", mode, MODES)
    spec: dict[str, Any] | None = None
    if backend == "torchao":
        spec = base_config_spec(resolve_base_config(base_config, owner))
    elif base_config is not None:
        raise ValueError(
            f"`{owner}(backend='x86', base_config={base_config!r})`: the x86 backend uses torchao's "
            "X86InductorQuantizer (int8 activations and per-channel int8 weights) and takes no base config. Use "
            "backend='torchao' to choose a torchao config."
        )
    if example_inputs is not None:
        inputs = as_input_tuple(example_inputs, f"`{owner}(example_inputs)`")
        shapes = tuple(tuple(int(s) for s in t.shape[1:]) for t in inputs)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in inputs)
    elif input_shapes is not None:
        shapes = tuple(tuple(int(s) for s in shape) for shape in input_shapes)
        dtypes = tuple(input_dtypes) if input_dtypes is not None else ("float32",) * len(shapes)
    else:
        raise ValueError(f"`{owner}()` needs example_inputs or input_shapes.")
    if not shapes or len(dtypes) != len(shapes) or any(any(s < 1 for s in shape) for shape in shapes):
        raise ValueError(f"`{owner}`: input shapes {shapes!r} / dtypes {dtypes!r} are not valid.")
    for dtype in dtypes:
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"`{owner}`: {dtype!r} is not a torch dtype name.")
    return QuantizationRecipe(backend, mode, spec, shapes, tuple(str(d) for d in dtypes))


# ------------------------------------------------------------------------------------ prepared-module bookkeeping


def _info(module: nn.Module) -> dict[str, Any] | None:
    # Graph modules rebuild themselves on deepcopy from their graph and `meta`; other modules copy their __dict__.
    holder = module.meta if isinstance(module, torch.fx.GraphModule) else module.__dict__
    return holder.get(INFO_KEY)


def set_quantization_info(module: nn.Module, **info: Any) -> None:
    holder = module.meta if isinstance(module, torch.fx.GraphModule) else module.__dict__
    holder.setdefault(INFO_KEY, {}).update(info)


def recipe_of(module: nn.Module) -> QuantizationRecipe | None:
    """The recipe a module was prepared (or converted) with by this module, or ``None``."""
    info = _info(module)
    return None if info is None else info["recipe"]


def is_prepared(module: nn.Module) -> bool:
    """Whether ``module`` was prepared for QAT/PTQ by :func:`prepare` and not converted."""
    info = _info(module)
    return info is not None and not info.get("converted", False)


def quantization_state_keys(module: nn.Module) -> list[str]:
    """The ``state_dict`` keys of a prepared module that its float module did not have (observer, fake-quantize
    state); empty for a module that is not prepared."""
    info = _info(module)
    if info is None:
        return []
    float_keys = set(info["float_keys"])
    return [k for k in module.state_dict() if k not in float_keys]


def with_state_versions(module: nn.Module, state: Mapping[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """``state`` (keys relative to ``module``, under ``prefix`` when given) with the ``_metadata`` of ``module``'s
    own ``state_dict``: each submodule's state version, which ``load_state_dict`` passes to its
    ``_load_from_state_dict``.

    Without it an observer takes the state for its oldest format and resets its ``eps`` buffer to float32's machine
    epsilon (the x86 recipe sets 2**-12), so observer state saved apart from the model must be loaded through this.
    """
    metadata = getattr(module.state_dict(), "_metadata", {})
    out: Any = collections.OrderedDict(state)
    out._metadata = getattr(state, "_metadata", collections.OrderedDict()).copy()
    for name, entry in metadata.items():
        out._metadata.setdefault(f"{prefix}.{name}".strip(".") if prefix else name, entry)
    return out


# -------------------------------------------------------------------------------- exported train / eval switching

_aten = torch.ops.aten
# Index of the `training`/`train` flag in the schema of each op whose behaviour depends on it.
_BATCH_NORM_FLAG = {_aten.batch_norm.default: 5}
_DROPOUT_FLAG = {
    getattr(_aten, f"{kind}{inplace}").default: 2
    for kind in ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
    for inplace in ("", "_")
}
# Batch norm in other IR forms; the flag rewrite does not know these and leaves it to torchao's pattern rewrite.
_OTHER_BATCH_NORMS = {
    _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit_no_training.default,
    _aten._native_batch_norm_legit_functional.default,
    _aten.native_batch_norm.default,
    _aten.cudnn_batch_norm.default,
}


def _set_exported_mode(gm: torch.fx.GraphModule, training: bool, freeze_bn: bool) -> None:
    """Switch batch norm and dropout nodes of an exported graph between training and inference behaviour.

    torchao's ``move_exported_model_to_train/_eval`` do this by matching patterns, which exports six small
    programs per switch (seconds; Lightning switches around every validation) and would undo frozen batch-norm
    statistics. Here each op's ``training`` flag is set directly: batch norm trains only when ``training`` and not
    ``freeze_bn`` (frozen statistics: normalize with the running estimates, the PT2E recipe for freezing BN in QAT).
    """
    if any(node.target in _OTHER_BATCH_NORMS for node in gm.graph.nodes):
        pt2e = require("torchao", "PreparedGraphModule.train").quantization.pt2e
        (pt2e.move_exported_model_to_train if training else pt2e.move_exported_model_to_eval)(gm)
        return
    changed = False
    bn_training = training and not freeze_bn
    wanted: bool | int
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _BATCH_NORM_FLAG:
            index, wanted = _BATCH_NORM_FLAG[node.target], bn_training
        elif node.target in _DROPOUT_FLAG:
            index, wanted = _DROPOUT_FLAG[node.target], training
        elif counts_batches(node):
            index, wanted = 1, int(bn_training)  # `num_batches_tracked += 1` is a node of its own: add 0 instead
        else:
            continue
        if len(node.args) > index and (node.args[index] != wanted or type(node.args[index]) is not type(wanted)):
            node.args = (*node.args[:index], wanted, *node.args[index + 1 :])
            changed = True
    gm.__dict__["_exported_training"] = training  # torchao's own record of the mode
    if changed:
        gm.recompile()


def counts_batches(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a batch norm's ``num_batches_tracked.add_(1)`` (or ``add_(0)`` once switched)."""
    if node.target is not _aten.add_.Tensor or len(node.args) < 2 or node.args[1] not in (0, 1):
        return False
    target = node.args[0]
    return (
        isinstance(target, torch.fx.Node)
        and target.op == "get_attr"
        and str(target.target).endswith("num_batches_tracked")
    )


class PreparedGraphModule(torch.fx.GraphModule):
    """An exported, PT2E-prepared model whose graph follows its ``training`` flag like an eager module.

    The graph's batch-norm and dropout nodes take their training or inference behaviour (batch norm stays in
    inference behaviour while its statistics are frozen, see :func:`freeze_batchnorm_stats`), and the fake-quantize
    observers pause in eval mode (evaluation never moves the quantization ranges; in train mode they follow
    :func:`set_observers`). The switch happens in ``train()`` / ``eval()`` and, should the flag have been set
    directly (Lightning restores the mode of every submodule after validation by assigning ``module.training``), at
    the next call. Python branches on ``self.training`` inside the original model were fixed when it was captured.
    Not created directly: :func:`prepare` returns it.
    """

    def train(self, mode: bool = True) -> PreparedGraphModule:
        super().train(mode)  # refuses a non-bool mode itself
        _sync_mode(self)
        return self

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_lightning_perf_mode") != _wanted_mode(self):
            _sync_mode(self)
        return super()._call_impl(*args, **kwargs)


def _wanted_mode(gm: torch.fx.GraphModule) -> tuple[bool, bool, bool]:
    info = _info(gm) or {}
    return gm.training, bool(info.get("bn_frozen", False)), bool(info.get("observers", True))


@torch.compiler.disable
def _sync_mode(gm: torch.fx.GraphModule) -> None:
    """Make the graph and the observers match the module's training flag and settings (a no-op when they do)."""
    training, bn_frozen, observers = wanted = _wanted_mode(gm)
    _set_exported_mode(gm, training, freeze_bn=bn_frozen)
    _switch_observers(gm, training and observers)
    gm.__dict__["_lightning_perf_mode"] = wanted


def _as_prepared_graph_module(gm: torch.fx.GraphModule) -> PreparedGraphModule:
    """Make ``gm`` (in place) a :class:`PreparedGraphModule`.

    Every GraphModule has a class of its own named ``GraphModuleImpl`` (``GraphModule.__new__``) that carries its
    generated ``forward``; the new one derives from :class:`PreparedGraphModule` instead, so ``deepcopy`` (which
    re-creates the first class in the MRO not named ``GraphModuleImpl``) keeps it.
    """
    gm.__class__ = type("GraphModuleImpl", (PreparedGraphModule,), {})
    allow_train_eval(gm)
    gm.recompile()
    return gm  # type: ignore[return-value]


def allow_train_eval(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove the instance-level ``train``/``eval`` that torchao installs to refuse them (``nn.Module``'s apply)."""
    gm.__dict__.pop("train", None)
    gm.__dict__.pop("eval", None)
    return gm


# ---------------------------------------------------------------------------------------- torchao speed-ups


_PATTERN_CACHE: dict[Any, torch.fx.GraphModule] = {}


def _tensor_meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    return value


def _pattern_key(pattern: Any, example_inputs: Sequence[Any], is_cuda: bool, kwargs: Mapping[str, Any]) -> Any:
    fn = getattr(pattern, "fn", pattern)  # torchao wraps some patterns in a WrapperModule(fn)
    closure = tuple(cell.cell_contents for cell in (fn.__closure__ or ()))
    if any(isinstance(value, Tensor) for value in closure):
        raise TypeError("a pattern closing over a tensor depends on its values: not cached")
    key = (
        type(pattern),
        fn.__code__,
        closure,
        fn.__defaults__,
        tuple(_tensor_meta(x) for x in example_inputs),
        is_cuda,
        tuple(sorted((k, _tensor_meta(v)) for k, v in kwargs.items())),
    )
    hash(key)
    return key


_CONV_OPS = {name: getattr(_aten, name) for name in ("conv1d", "conv2d", "conv_transpose1d", "conv_transpose2d")}


@contextlib.contextmanager
def fast_pattern_matching() -> Iterator[None]:
    """Make torchao's PT2E prepare and convert steps fast, without changing what they compute.

    Conv-BN fusion (``prepare_qat_pt2e``) and folding (``convert_pt2e``) build their match and replacement patterns
    by ``torch.export``-ing small functions: for every kind of convolution (1d, 2d, transposed 1d/2d) whether the
    model has one or not: 12 exports in prepare and 96 in convert (a convert takes 12 s on a quiet 2-core CPU). Within
    this context (1) each pattern is exported once per process and reused (a pattern is a pure function of its code, its
    closure and the shapes and dtypes of its example inputs; a deep copy is handed out each time) and (2) the
    per-kind passes skip convolution kinds the graph does not contain, which cannot match: the same convert then
    takes about 4 s the first time in a process and 0.3 s after. Should torchao's internals move, the context does
    nothing and the steps run as they are.
    """
    try:
        from torchao.quantization.pt2e import qat_utils, utils
    except ImportError:
        yield
        return
    patches: list[tuple[Any, str, Any]] = []
    original_export = getattr(utils, "_get_aten_graph_module_for_pattern", None)
    if original_export is not None:

        def cached_export(pattern: Any, example_inputs: Any, is_cuda: bool = False, **kwargs: Any) -> Any:
            try:
                key = _pattern_key(pattern, example_inputs, is_cuda, kwargs)
            except (AttributeError, TypeError):
                return original_export(pattern, example_inputs, is_cuda, **kwargs)
            if key not in _PATTERN_CACHE:
                _PATTERN_CACHE[key] = original_export(pattern, example_inputs, is_cuda, **kwargs)
            return quiet_deepcopy(_PATTERN_CACHE[key])

        patches += [(utils, "_get_aten_graph_module_for_pattern", cached_export)]
        if getattr(qat_utils, "_get_aten_graph_module_for_pattern", None) is original_export:
            patches += [(qat_utils, "_get_aten_graph_module_for_pattern", cached_export)]

    def skip_absent_kinds(helper: Any) -> Any:
        def run(m: torch.fx.GraphModule, conv_fn: Any, *args: Any, **kwargs: Any) -> Any:
            ops = {getattr(node.target, "overloadpacket", None) for node in m.graph.nodes if node.op == "call_function"}
            present = {name for name, op in _CONV_OPS.items() if op in ops}
            generic = _aten.convolution in ops
            if present and not generic and getattr(conv_fn, "__name__", None) not in present:
                return m
            return helper(m, conv_fn, *args, **kwargs)

        return run

    for name in ("_fuse_conv_bn_qat_helper", "_fold_conv_bn_qat_helper"):
        helper = getattr(qat_utils, name, None)
        if helper is not None:
            patches.append((qat_utils, name, skip_absent_kinds(helper)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def quiet_deepcopy(obj: Any) -> Any:
    # Copying an exported graph module trips a deprecation warning inside torch's pytree code; it is not actionable.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        return copy.deepcopy(obj)


def _distinguish_repeated_module_calls(gm: torch.fx.GraphModule) -> int:
    """Give every call of a module used more than once its own name in the nodes' ``nn_module_stack``.

    ``torch.export`` records the ``n``-th further call of a module under the key ``<path>@<n>`` but with the module's
    own path, and torchao's partitioner groups nodes by that path: a ReLU module applied twice (torchvision's and
    most ResNet blocks do it) becomes one partition with two outputs, which ``X86InductorQuantizer`` rejects ("Input
    partition has more than one output node"). Naming the call ``<path>@<n>`` keeps the calls apart. Returns the
    number of nodes renamed.
    """
    renamed = 0
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        key, (path, cls) = next(reversed(stack.items()))
        _, sep, call = key.rpartition("@")
        if sep and call.isdigit() and not path.endswith(f"@{call}"):
            stack = dict(stack)
            stack[key] = (f"{path}@{call}", cls)
            node.meta["nn_module_stack"] = stack
            renamed += 1
    return renamed


# ------------------------------------------------------------------------------------------ prepare / convert


def with_batch(inputs: Sequence[Tensor], batch_size: int) -> tuple[Tensor, ...]:
    """The inputs with exactly ``batch_size`` samples (repeating them cyclically when there are fewer)."""
    index = torch.arange(batch_size) % inputs[0].shape[0]
    return tuple(t.detach()[index.to(t.device)] for t in inputs)


def export_dynamic_batch(module: nn.Module, example: Sequence[Tensor]) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict) with a dynamic batch dimension; the example gets two samples, since
    ``torch.export`` specializes a dimension whose example size is 1."""
    from torch.export import Dim

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecation chatter
        return torch.export.export(
            module,
            with_batch(example, 2),
            dynamic_shapes=tuple({0: Dim.DYNAMIC} for _ in example),
            strict=False,
        )


def capture_module(module: nn.Module, example: tuple[Tensor, ...], training: bool) -> torch.fx.GraphModule:
    """``torch.export`` the module in training or inference behaviour, with a dynamic batch dimension."""
    was_training = module.training
    module.train(training)
    try:
        program = export_dynamic_batch(module, example)
    except Exception as exc:
        raise QuantizationError(
            f"torch.export could not capture {type(module).__name__} for quantization: {failure_reason(exc)}. The "
            "model must be exportable (no data-dependent Python control flow, positional tensor inputs); see "
            "https://pytorch.org/docs/stable/export.html."
        ) from exc
    finally:
        module.train(was_training)
    gm = program.module()
    _distinguish_repeated_module_calls(gm)
    return gm


def _unannotated_hint(graph_module: torch.fx.GraphModule) -> str:
    """When the captured graph has convolutions or linear layers the quantizer left alone: the versions to suspect."""
    targets = {"conv": 0, "linear": 0}
    for node in graph_module.graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        for kind in targets:
            targets[kind] += name.startswith(f"aten.{kind}")
    if not any(targets.values()):
        return ""
    torchao_version = installed_version("torchao") or "unknown"
    return (
        f" Its captured graph has {targets['conv']} convolution(s) and {targets['linear']} linear layer(s), none "
        f"annotated: suspect this torch ({torch.__version__}) and torchao ({torchao_version}) pair (torch 2.11 with "
        "torchao 0.18 annotated nothing where torch 2.13 with the same torchao quantizes the same model)."
    )


def _count_quantizers(module: nn.Module) -> int:
    from torchao.quantization.pt2e import FakeQuantizeBase, ObserverBase

    return sum(isinstance(m, (FakeQuantizeBase, ObserverBase)) for m in module.modules())


def torchao_fake_quantizers(module: nn.Module) -> list[nn.Module]:
    from torchao.quantization.qat import FakeQuantizerBase

    return [m for m in module.modules() if isinstance(m, FakeQuantizerBase)]


def prepare(
    module: nn.Module, recipe: QuantizationRecipe, example_inputs: Any = None, *, owner: str = "prepare"
) -> nn.Module:
    """Prepare ``module`` for QAT (fake quantization) or PTQ (observers) as ``recipe`` says; returns the module to
    train or calibrate in its place.

    - ``x86``: a new :class:`PreparedGraphModule`, captured from ``module`` in training (QAT) or inference (PTQ)
      behaviour, in that mode; ``module`` itself is not changed and its parameters are shared.
    - ``torchao``, QAT: ``module`` itself, its ``nn.Linear`` layers swapped for fake-quantized ones in place
      (parameters and ``state_dict`` keys unchanged). PTQ: a float copy in eval mode (dynamic activation
      quantization needs no calibration).

    Args:
        module: the float model; its ``forward`` takes positional tensors.
        recipe: from :func:`make_recipe` (or a checkpoint).
        example_inputs: inputs to capture with (``x86``); default zeros of the recipe's shapes.
        owner: the caller's name in messages (a callback passes its class name).

    Raises:
        QuantizationError: if the module cannot be captured with ``torch.export`` (with its reason) or prepared, or
            nothing in it can be quantized.
        ModuleNotFoundError: if torchao is not installed.
    """
    torchao = require("torchao", f"{owner}(backend={recipe.backend!r})")
    float_keys = list(module.state_dict())
    example = as_input_tuple(example_inputs) if example_inputs is not None else recipe.example_inputs()
    if recipe.backend == "x86":
        return _prepare_x86(module, recipe, example, float_keys)
    return _prepare_torchao(torchao, module, recipe, float_keys, owner)


def _prepare_x86(
    module: nn.Module, recipe: QuantizationRecipe, example: tuple[Tensor, ...], float_keys: list[str]
) -> nn.Module:
    """A new :class:`PreparedGraphModule` captured from ``module`` (PT2E, X86InductorQuantizer), sharing its tensors."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    qat = recipe.mode == "qat"
    # X86InductorQuantizer annotates the graph of a CPU model: capture a CPU copy when the parameters live
    # elsewhere (CUDA, meta), and give the prepared graph the module's own tensors afterwards.
    device = module_device(module)
    source = module if device.type == "cpu" else cpu_copy(module)
    with cache_off(source):
        captured = capture_module(source, tuple(t.cpu() for t in example), training=qat)
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=qat))
    try:
        with fast_pattern_matching():
            prepared = (prepare_qat_pt2e if qat else prepare_pt2e)(captured, quantizer)
    except Exception as exc:
        raise QuantizationError(
            f"torchao's X86InductorQuantizer could not prepare {type(module).__name__}: {failure_reason(exc)}"
        ) from exc
    if _count_quantizers(prepared) == 0:
        raise NothingToQuantizeError(
            f"X86InductorQuantizer found nothing to quantize in {type(module).__name__} (it quantizes "
            f"convolutions, linear layers and the ops around them).{_unannotated_hint(captured)}"
        )
    graph = _as_prepared_graph_module(prepared)
    if source is not module:
        take_tensors_of(graph, module, device)
    set_quantization_info(graph, recipe=recipe, float_keys=float_keys, bn_frozen=False)
    graph.train(qat)
    return graph


def _prepare_torchao(
    torchao: Any, module: nn.Module, recipe: QuantizationRecipe, float_keys: list[str], owner: str
) -> nn.Module:
    """QAT: ``module`` with its ``nn.Linear`` layers fake-quantized in place; PTQ: a float copy in eval mode."""
    base = resolve_base_config(recipe.base_config, owner)
    if recipe.mode == "ptq":
        prepared = quiet_deepcopy(module).eval()
        set_quantization_info(prepared, recipe=recipe, float_keys=float_keys)
        return prepared
    if isinstance(module, (nn.Linear, nn.Embedding)):
        raise QuantizationError(
            f"torchao's QAT swaps the Linear layers inside a model; {type(module).__name__} is one itself. Quantize "
            "the module that contains it."
        )
    try:
        torchao.quantization.quantize_(module, torchao.quantization.qat.QATConfig(base, step="prepare"))
    except Exception as exc:
        why = failure_reason(exc)
        raise QuantizationError(f"torchao could not prepare {type(module).__name__} for QAT: {why}") from exc
    if not torchao_fake_quantizers(module):
        raise NothingToQuantizeError(
            f"torchao found nothing to quantize in {type(module).__name__}: {type(base).__name__} applies to "
            "nn.Linear layers."
        )
    set_quantization_info(module, recipe=recipe, float_keys=float_keys)
    return module


# ---------------------------------------------------------------------------------------------------- schedules


def _fake_quantizers(module: nn.Module) -> list[nn.Module]:
    from torchao.quantization.pt2e import FakeQuantizeBase

    return [m for m in module.modules() if isinstance(m, FakeQuantizeBase)]


def _switch_observers(module: nn.Module, enabled: bool) -> int:
    quantizers = _fake_quantizers(module)
    for m in quantizers:
        m.enable_observer(enabled)  # type: ignore[operator]
    return len(quantizers)


def set_observers(module: nn.Module, enabled: bool) -> int:
    """Enable or disable the observers of a QAT-prepared model (the quantization ranges stop moving once disabled);
    returns how many fake-quantize modules it switched (0 for the dynamic ``torchao`` backend).

    On a :class:`PreparedGraphModule` the setting is remembered: observers run in train mode only.
    """
    if isinstance(module, PreparedGraphModule):
        set_quantization_info(module, observers=enabled)
        _sync_mode(module)
        return len(_fake_quantizers(module))
    return _switch_observers(module, enabled)


def set_fake_quant(module: nn.Module, enabled: bool) -> int:
    """Enable or disable fake quantization (disabled, the model trains in float while observers keep collecting
    ranges); returns how many fake quantizers it switched."""
    quantizers = _fake_quantizers(module)
    for m in quantizers:
        m.enable_fake_quant(enabled)  # type: ignore[operator]
    torchao = is_prepared(module) and recipe_of(module).backend == "torchao"  # type: ignore[union-attr]
    swapped = torchao_fake_quantizers(module) if torchao else []
    for m in swapped:
        m.enabled = enabled  # type: ignore[assignment]
    return len(quantizers) + len(swapped)


def batchnorm_modules(module: nn.Module) -> list[nn.Module]:
    """The batch-norm layers of an eager module (the ones :func:`freeze_batchnorm_stats` puts in eval mode)."""
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def freeze_batchnorm_stats(module: nn.Module, frozen: bool = True) -> int:
    """Freeze (or unfreeze) batch-norm statistics: normalize with the running estimates and stop updating them.

    On a :class:`PreparedGraphModule` the setting lasts through ``train()`` / ``eval()``. On an eager module the
    batch-norm layers are put in eval mode (``frozen``) or back in the module's mode: a later ``module.train()``
    unfreezes them, so call this again after it. Returns the number of batch-norm ops or layers affected.
    """
    if isinstance(module, PreparedGraphModule):
        set_quantization_info(module, bn_frozen=frozen)
        _sync_mode(module)
        return sum(node.target in _BATCH_NORM_FLAG for node in module.graph.nodes)
    layers = batchnorm_modules(module)
    for layer in layers:
        layer.train(module.training and not frozen)
    return len(layers)
