"""The QAT/PTQ functional core on tiny models: recipes and configs, prepare, train/eval, schedules, convert, save."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import torchao  # noqa: F401  (the `test` extra installs it: a missing install fails here, not skips)
from torch import nn

from lightning_perf import _imports
from lightning_perf.deploy.quantize.convert import calibrate, convert, float_copy, restore_float
from lightning_perf.deploy.validate import compare_models
from lightning_perf.functional.quantization import qat
from lightning_perf.functional.quantization.config import base_config_spec, resolve_base_config

BATCH_NORM = torch.ops.aten.batch_norm.default


class TinyConvNet(nn.Module):
    """Conv-BN-ReLU, a residual conv-BN with the same ReLU module applied twice (as ResNet blocks do), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)) + x)
        return self.head(self.drop(x.mean(dim=(2, 3))))


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _images(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 4) -> None:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _bn_flags(gm: torch.fx.GraphModule) -> list[bool]:
    return [node.args[5] for node in gm.graph.nodes if node.target is BATCH_NORM]


@pytest.fixture(scope="module")
def prepared_conv() -> tuple[nn.Module, nn.Module]:
    """A float TinyConvNet and its x86 QAT-prepared module after a few training steps (shared by read-only tests)."""
    torch.manual_seed(0)
    float_model = TinyConvNet()
    x, y = _images()
    prepared = qat.prepare(float_model, qat.make_recipe("x86", "qat", example_inputs=x[:1]))
    _train(prepared, x, y)
    return float_model, prepared


# ---------------------------------------------------------------------------------------------- recipes, configs


def test_recipe_round_trips_and_records_per_sample_shapes() -> None:
    recipe = qat.make_recipe(
        "x86", "qat", example_inputs=(torch.zeros(5, 3, 8, 8), torch.zeros(5, 7, dtype=torch.long))
    )
    assert recipe.input_shapes == ((3, 8, 8), (7,))
    assert recipe.input_dtypes == ("float32", "int64")
    assert qat.QuantizationRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    assert [tuple(t.shape) for t in recipe.example_inputs(2)] == [(2, 3, 8, 8), (2, 7)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backend": "arm"}, r"backend='arm'.*'x86', 'torchao'"),
        ({"mode": "fp8"}, r"mode='fp8'.*'qat', 'ptq'"),
        ({"base_config": "IntxWeightOnlyConfig"}, r"x86 backend .* takes no base config"),
        ({"example_inputs": None}, r"needs example_inputs or input_shapes"),
    ],
)
def test_make_recipe_rejects_bad_options(kwargs: dict[str, Any], match: str) -> None:
    options = {"example_inputs": torch.zeros(1, 4), **kwargs}
    with pytest.raises(ValueError, match=match):
        qat.make_recipe(**options)


def test_recipe_from_garbage_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="Not a quantization recipe"):
        qat.QuantizationRecipe.from_dict({"backend": "x86"})
    with pytest.raises(ValueError, match="newer"):
        qat.QuantizationRecipe.from_dict({"version": 99, "backend": "x86"})


def test_base_config_from_yaml_spec() -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, MappingType, PerAxis, PerGroup

    options = {"weight_dtype": "int4", "weight_granularity": {"PerGroup": 16}, "weight_mapping_type": "symmetric"}
    spec = {"Int8DynamicActivationIntxWeightConfig": options}
    config = resolve_base_config(spec)
    assert isinstance(config, Int8DynamicActivationIntxWeightConfig)
    assert config.weight_dtype is torch.int4
    assert config.weight_granularity == PerGroup(16)
    assert config.weight_mapping_type is MappingType.SYMMETRIC
    # The normalized spec names only what differs from the defaults, in plain YAML-able values.
    normalized = base_config_spec(config)
    assert normalized == {
        "Int8DynamicActivationIntxWeightConfig": {
            "weight_dtype": "int4",
            "weight_granularity": {"PerGroup": {"group_size": 16}},
        }
    }
    assert base_config_spec(resolve_base_config(normalized)) == normalized
    assert base_config_spec(resolve_base_config(None)) == {"Int8DynamicActivationIntxWeightConfig": {}}
    by_name = resolve_base_config({"IntxWeightOnlyConfig": {"granularity": {"PerAxis": {"axis": 0}}}})
    assert by_name.granularity == PerAxis(0)
    assert resolve_base_config(config) is config


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("NoSuchConfig", r"'NoSuchConfig' is not a torchao.quantization config"),
        ({"Int8DynamicActivationIntxWeightConfig": {"colour": 1}}, r"has no field 'colour'"),
        ({"Int8DynamicActivationIntxWeightConfig": {"weight_dtype": "int42"}}, r"not a torch dtype"),
        ({"Int8DynamicActivationIntxWeightConfig": {"weight_mapping_type": "sideways"}}, r"not a MappingType"),
        ({"A": {}, "B": {}}, r"one class"),
        # QATConfig cannot derive fake quantization from this one (measured: torchao 0.18 rejects it).
        ("Int8DynamicActivationInt8WeightConfig", r"cannot train Int8DynamicActivationInt8WeightConfig with QAT"),
    ],
)
def test_bad_base_configs_are_rejected_with_the_reason(spec: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_base_config(spec)


def test_torchao_missing_names_the_qat_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_imports, "is_available", lambda module: False)
    recipe = qat.make_recipe("x86", "qat", example_inputs=torch.zeros(1, 32))
    with pytest.raises(ModuleNotFoundError, match=r"lightning-perf\[qat\]"):
        qat.prepare(TinyMLP(), recipe)


# --------------------------------------------------------------------------------------------- x86: prepare


def test_x86_prepare_keeps_float_keys_and_shares_parameters(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    float_model, prepared = prepared_conv
    assert isinstance(prepared, qat.PreparedGraphModule)
    assert qat.is_prepared(prepared) and qat.recipe_of(prepared).backend == "x86"
    extra = qat.quantization_state_keys(prepared)
    assert extra and all(k.startswith("activation_post_process_") for k in extra)
    assert set(prepared.state_dict()) == set(float_model.state_dict()) | set(extra)
    # The prepared graph trains the float model's own Parameter objects.
    float_params = {id(p) for p in float_model.parameters()}
    assert all(id(p) in float_params for p in prepared.parameters())


def test_x86_prepare_shares_buffers_so_restoring_the_float_module_keeps_what_was_trained(
    prepared_conv: tuple[nn.Module, nn.Module],
) -> None:
    float_model, prepared = prepared_conv
    held = prepared.state_dict(keep_vars=True)
    assert all(held[k] is v for k, v in float_model.state_dict(keep_vars=True).items())
    assert int(float_model.bn1.num_batches_tracked) == 4  # the graph's training steps updated the float buffers
    assert restore_float(prepared, float_model) is float_model


def test_observer_state_loaded_apart_from_the_model_keeps_its_eps(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    _, prepared = prepared_conv
    current = prepared.state_dict()
    state = {k: current[k].clone() for k in qat.quantization_state_keys(prepared)}
    eps_keys = [k for k in state if k.endswith(".eps")]
    assert eps_keys and all(float(state[k]) == 2**-12 for k in eps_keys)  # the x86 recipe's eps
    torch.manual_seed(0)
    fresh = qat.prepare(TinyConvNet(), qat.recipe_of(prepared))
    fresh.load_state_dict(state, strict=False)  # no state versions: observers read it as their oldest format
    assert all(float(fresh.state_dict()[k]) == torch.finfo(torch.float32).eps for k in eps_keys)
    fresh.load_state_dict(qat.with_state_versions(fresh, state), strict=False)
    after = fresh.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)
    nested = qat.with_state_versions(fresh, {f"net.{k}": v for k, v in state.items()}, prefix="net")
    assert set(nested._metadata) == {f"net.{k}".rstrip(".") for k in fresh.state_dict()._metadata}


def test_repeated_module_calls_are_told_apart() -> None:
    # torchao groups nodes by module path; a ReLU applied twice used to make one partition with two outputs.
    gm = torch.export.export(TinyConvNet(), (torch.zeros(2, 3, 8, 8),)).module()
    assert qat._distinguish_repeated_module_calls(gm) >= 1
    assert qat._distinguish_repeated_module_calls(gm) == 0  # idempotent


def test_batch_dimension_stays_dynamic(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    _, prepared = prepared_conv
    model = copy.deepcopy(prepared).eval()
    for batch in (1, 3, 40):
        assert model(torch.randn(batch, 3, 8, 8)).shape == (batch, 4)


def test_train_and_eval_switch_the_graph(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    _, prepared = prepared_conv
    model = copy.deepcopy(prepared)
    assert type(model).__mro__[1] is qat.PreparedGraphModule  # deepcopy keeps the class
    model.eval()
    assert not model.training and not any(_bn_flags(model))
    dropout = [n.args[2] for n in model.graph.nodes if n.target is torch.ops.aten.dropout.default]
    assert dropout == [False]
    x = torch.randn(4, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(model(x), model(x))  # inference: deterministic, running statistics
    for key, value in model.state_dict().items():  # and nothing moves: statistics, ranges, batch counters
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    model.train()
    assert model.training and all(_bn_flags(model))


def test_graph_follows_a_training_flag_set_directly(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    # Lightning restores modes after validation by assigning `module.training`, without calling train().
    _, prepared = prepared_conv
    model = copy.deepcopy(prepared).eval()
    for module in model.modules():
        module.training = True
    model(torch.randn(4, 3, 8, 8))
    assert all(_bn_flags(model))
    assert all(int(v) == 1 for k, v in model.state_dict().items() if k.endswith("observer_enabled"))


def test_frozen_batchnorm_stays_frozen_through_train(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    _, prepared = prepared_conv
    model = copy.deepcopy(prepared).train()
    assert qat.freeze_batchnorm_stats(model) == 2
    model.eval()
    model.train()
    assert model.training and not any(_bn_flags(model))
    running = [b.clone() for name, b in model.named_buffers() if name.endswith("running_mean")]
    model(torch.randn(4, 3, 8, 8))
    after = [b for name, b in model.named_buffers() if name.endswith("running_mean")]
    assert all(torch.equal(a, b) for a, b in zip(running, after))
    qat.freeze_batchnorm_stats(model, False)
    assert all(_bn_flags(model))


def test_observer_and_fake_quant_switches(prepared_conv: tuple[nn.Module, nn.Module]) -> None:
    _, prepared = prepared_conv
    model = copy.deepcopy(prepared)
    n = qat.set_observers(model, False)
    assert n > 0 and all(int(b) == 0 for k, b in model.state_dict().items() if k.endswith("observer_enabled"))
    assert qat.set_fake_quant(model, False) == n
    assert all(int(b) == 0 for k, b in model.state_dict().items() if k.endswith("fake_quant_enabled"))


def test_capture_failure_names_torch_export_and_its_reason() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    with pytest.raises(
        qat.QuantizationError,
        match=r"torch.export could not capture DataDependent for quantization: \w+: .*data-dependent",
    ):
        qat.prepare(DataDependent(), qat.make_recipe("x86", "qat", example_inputs=torch.ones(1, 4)))


def test_nothing_to_quantize_is_an_error() -> None:
    model = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(qat.QuantizationError, match="found nothing to quantize") as caught:
        qat.prepare(model, qat.make_recipe("x86", "qat", example_inputs=torch.ones(1, 4)))
    assert "suspect this torch" not in str(caught.value)  # nothing there to quantize: no version to blame


def test_a_quantizer_that_annotates_nothing_it_should_names_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    # What torch 2.11 + torchao 0.18 did on an H200 machine: convolutions and a linear layer captured, none annotated.
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

    monkeypatch.setattr(X86InductorQuantizer, "annotate", lambda self, model: model)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    with pytest.raises(qat.QuantizationError, match="found nothing to quantize in Sequential") as caught:
        qat.prepare(model, qat.make_recipe("x86", "qat", example_inputs=torch.ones(1, 3, 8, 8)))
    message = str(caught.value)
    assert "1 convolution(s) and 1 linear layer(s), none annotated" in message
    assert f"this torch ({torch.__version__}) and torchao (" in message


def test_torchao_internals_are_restored_after_prepare() -> None:
    from torchao.quantization.pt2e import qat_utils, utils

    before = (utils._get_aten_graph_module_for_pattern, qat_utils._fold_conv_bn_qat_helper)
    with pytest.raises(RuntimeError), qat.fast_pattern_matching():
        assert utils._get_aten_graph_module_for_pattern is not before[0]
        raise RuntimeError
    assert (utils._get_aten_graph_module_for_pattern, qat_utils._fold_conv_bn_qat_helper) == before


# ------------------------------------------------------------------------------------------------- torchao


def test_torchao_prepare_in_place_convert_and_float_copy() -> None:
    from torchao.quantization.qat import FakeQuantizedLinear

    torch.manual_seed(0)
    model = TinyMLP()
    keys = list(model.state_dict())
    recipe = qat.make_recipe("torchao", "qat", example_inputs=torch.zeros(1, 32))
    prepared = qat.prepare(model, recipe)
    assert prepared is model and isinstance(model.fc1, FakeQuantizedLinear)
    assert list(model.state_dict()) == keys and qat.quantization_state_keys(model) == []
    x = torch.randn(8, 32)
    y = torch.randint(0, 4, (8,))
    _train(model, x, y)
    assert qat.set_fake_quant(model, False) >= 2
    assert not model.fc1.weight_fake_quantizer.enabled
    qat.set_fake_quant(model, True)
    quantized = convert(model)
    assert isinstance(model.fc1, FakeQuantizedLinear)  # the trainable model is untouched
    assert type(quantized.fc1.weight).__name__ != "Parameter" or quantized.fc1.weight.dtype != torch.float32
    summary = compare_models(model, quantized, [(x, y)])
    assert summary.passed, summary.problem
    plain = float_copy(model)
    assert type(plain.fc1) is nn.Linear and not qat.is_prepared(plain)
    torch.testing.assert_close(plain.fc1.weight, model.fc1.weight)


def test_torchao_ptq_leaves_the_float_model_alone() -> None:
    model = TinyMLP()
    prepared = qat.prepare(model, qat.make_recipe("torchao", "ptq", example_inputs=torch.zeros(1, 32)))
    assert prepared is not model and type(model.fc1) is nn.Linear
    assert calibrate(prepared, [torch.randn(4, 32)]) == 4
    quantized = convert(prepared)
    assert compare_models(model, quantized, [torch.randn(8, 32)]).passed


def test_torchao_rejects_a_bare_linear() -> None:
    with pytest.raises(qat.QuantizationError, match="is one itself"):
        qat.prepare(nn.Linear(4, 4), qat.make_recipe("torchao", "qat", example_inputs=torch.zeros(1, 4)))


# ------------------------------------------------------------------------------- parameters off the CPU (CUDA)


def test_x86_prepare_captures_a_cpu_copy_and_trains_the_modules_own_tensors_where_they_live() -> None:
    # The meta device stands in for CUDA: X86InductorQuantizer annotates the graph of a CPU copy (zeros would do: only
    # shapes matter), and the prepared graph holds the module's own tensors on their device, observers moved there.
    from lightning_perf.deploy.quantize.qat_quantizer import holds_tensors_of

    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    net = net.to("meta")
    recipe = qat.make_recipe("x86", "qat", None, torch.zeros(2, 3, 8, 8))
    prepared = qat.prepare(net, recipe, torch.zeros(2, 3, 8, 8))
    fake_quantizers = [m for m in prepared.modules() if "FakeQuantize" in type(m).__name__]
    assert len(fake_quantizers) >= 3  # conv and linear weights and their input activations
    assert holds_tensors_of(prepared, net) and qat.is_prepared(prepared)
    assert {t.device.type for t in prepared.state_dict().values()} == {"meta"}
    assert not [n for n in prepared.graph.nodes if getattr(n.kwargs.get("device"), "type", None) == "cpu"]
    assert restore_float(prepared, net) is net
