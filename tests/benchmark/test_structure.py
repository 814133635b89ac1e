"""The bench's default set follows the model's structure: convolutions and their FLOP share, attention and whether it is
already fused, repeated blocks; every configuration left out names what in the model decided it."""

from __future__ import annotations

import pytest
import torch

from lightning_perf.benchmark.configs import default_configs
from lightning_perf.benchmark.spec import BenchSpec, SpecError
from lightning_perf.benchmark.structure import ModelStructure, probe_structure, structure_of, structure_of_source
from lightning_perf.tuning.inference import search_plan
from tests.benchmark import _structure_models as models
from tests.benchmark.test_defaults import AVX2_CPU, H100

CPU = torch.device("cpu")
STRUCTURAL = ("channels_last", "flash_attention", "compile", "compile_regional")


def chosen_and_why(structure: ModelStructure, caps: dict = AVX2_CPU) -> tuple[set[str], dict[str, str]]:
    names, left_out = default_configs(CPU, caps, structure=structure)
    return set(names), dict(left_out)


@pytest.mark.parametrize(
    ("workload", "expected_in", "expected_out"),
    [
        ("convnet", {"channels_last", "compile_regional"}, {"flash_attention", "compile"}),
        ("lm", {"flash_attention", "compile_regional"}, {"channels_last", "compile"}),
        ("vit", {"flash_attention", "compile_regional"}, {"channels_last", "compile"}),
        ("unet3d", {"channels_last", "compile_regional"}, {"flash_attention", "compile"}),
    ],
)
def test_the_demos_get_the_configurations_their_structure_calls_for(
    workload: str, expected_in: set[str], expected_out: set[str]
) -> None:
    structure = structure_of_source(None, workload=workload, preset="tiny")
    assert structure is not None
    chosen, why = chosen_and_why(structure)
    assert expected_in <= chosen and not expected_out & chosen, (chosen, why)
    for name in expected_out:  # what in this model decided it, by the model's name
        assert why[name].startswith(f"left out because {structure.model}"), why[name]


@pytest.mark.parametrize("workload", ["lm", "vit"])
def test_a_cpu_with_bf16_measures_bf16_and_the_attention_swap_together_too(workload: str) -> None:
    """Under bf16 the swap computes attention in float32 where that is faster: a thing neither shows alone (vit:
    1.00x and 1.00x alone, 1.52x together), so the pair is a configuration of its own; not without attention."""
    avx512 = {**AVX2_CPU, "bf16": True, "fast_bf16": True, "fast_fp32_matmul": True}
    structure = structure_of_source(None, workload=workload, preset="tiny")
    assert structure is not None
    names = default_configs(CPU, avx512, structure=structure)[0]
    assert {"bf16-mixed", "flash_attention", "bf16-mixed+flash_attention"} <= set(names)
    assert "bf16-mixed+flash_attention" not in default_configs(CPU, AVX2_CPU, structure=structure)[0]  # no bf16
    convnet = structure_of_source(None, workload="convnet", preset="tiny")
    assert convnet is not None and not any("+" in n for n in default_configs(CPU, avx512, structure=convnet)[0])


def test_the_vit_s_patch_embedding_is_too_small_a_share_for_channels_last() -> None:
    structure = structure_of_source(None, workload="vit", preset="tiny")
    assert structure is not None and structure.convolutions == ("net.patch_embed",)
    assert structure.conv_flop_share is not None and structure.conv_flop_share < 0.05
    why = chosen_and_why(structure)[1]["channels_last"]
    assert f"{structure.conv_flop_share:.1%} of a training step's FLOPs, under the 5%" in why


@pytest.mark.parametrize(
    ("model", "kind", "expected_in", "reasons"),
    [
        (models.Encoder, "tokens", {"flash_attention", "compile_regional"},
         {"channels_last": "Encoder has no 2D or 3D convolution",
          "compile": "Encoder has 2 repeated TransformerEncoderLayer blocks: compile_regional"}),
        (models.FusedGPT, "tokens", {"compile_regional"},
         {"flash_attention": "FusedGPT's attention already runs on scaled_dot_product_attention (blocks.0.attn"}),
        (models.PlainConvNet, "image", {"channels_last", "compile"},
         {"compile_regional": "PlainConvNet has no repeated blocks",
          "flash_attention": "PlainConvNet has no attention module the swap knows"}),
        (models.MLP, "vector", set(),
         {"compile": "MLP has neither repeated blocks nor convolutions carrying 5% of the FLOPs",
          "compile_regional": "MLP has neither repeated blocks", "channels_last": "MLP has no 2D or 3D convolution"}),
    ],
)  # fmt: skip
def test_models_that_are_no_demo_get_the_set_their_structure_calls_for(
    model: type, kind: str, expected_in: set[str], reasons: dict[str, str]
) -> None:
    structure = structure_of(model(), models.Data(kind))
    assert structure.unknown == "" and structure.conv_flop_share is not None
    chosen, why = chosen_and_why(structure)
    assert chosen & set(STRUCTURAL) == expected_in
    assert {"baseline", "fused_optimizer"} <= chosen and "bf16-mixed" not in chosen  # the device still decides these
    for name, text in reasons.items():
        assert text in why[name] and why[name].endswith(f"`--configs ...,{name}` to include it"), why[name]


def test_on_a_gpu_a_model_without_blocks_or_convolutions_still_gets_compile() -> None:
    structure = ModelStructure(model="MLP", conv_flop_share=0.0)
    names, left_out = default_configs(torch.device("cuda"), H100, structure=structure)
    assert "compile" in names and "compile_regional" not in names and "channels_last" not in names
    assert "MLP has no repeated blocks" in dict(left_out)["compile_regional"]
    assert "compile" not in default_configs(CPU, AVX2_CPU, structure=structure)[0]  # on a CPU it has little to win


def test_without_a_structure_the_device_alone_decides() -> None:
    names, left_out = default_configs(CPU, AVX2_CPU)
    assert "channels_last" in names and "flash_attention" not in names
    assert dict(left_out)["compile"].startswith("left out on CPU because a cold compile")


def test_flop_shares_unknown_fall_back_to_the_layers() -> None:
    unknown = ModelStructure(model="M", convolutions=("conv",), unknown="its FLOPs could not be counted")
    assert unknown.conv_heavy and "channels_last" in chosen_and_why(unknown)[0]
    assert "channels_last" not in chosen_and_why(ModelStructure(model="M"))[0]


def own_model(name: str) -> dict:
    """``--model tests.benchmark._structure_models:<name> --datamodule ...:Data`` as the bench's source."""
    path = "tests.benchmark._structure_models"
    return {"kind": "import", "model": f"{path}:{name}", "datamodule": f"{path}:Data", "model_args": {},
            "datamodule_args": {}}  # fmt: skip


def test_a_user_transformer_through_model_gets_attention_and_compile_not_channels_last() -> None:
    source = own_model("Encoder")
    spec = BenchSpec(workload="Encoder", source=source, device="cpu", repeats=1)
    assert {"flash_attention", "compile_regional"} <= set(spec.names) and "channels_last" not in spec.names
    left_out = dict(spec.left_out)
    assert "Encoder has no 2D or 3D convolution" in left_out["channels_last"]
    assert spec.structure is not None and spec.structure["block_class"] == "TransformerEncoderLayer"
    again = BenchSpec(**{**spec.to_dict(), "left_out": spec.left_out, "batch_sizes": ()})
    assert again.names == spec.names and again.structure == spec.structure


def test_a_structure_given_decides_and_a_bad_one_is_refused() -> None:
    given = ModelStructure(model="Mine", convolutions=("c",), conv_flop_share=0.5).to_dict()
    spec = BenchSpec(device="cpu", preset="tiny", structure=given, time_budget_s=400)
    assert "channels_last" in spec.names and "compile" in spec.names  # convolutions, no repeated blocks
    short = BenchSpec(device="cpu", preset="tiny", structure=given)  # a cold CPU compile does not fit 150 s
    assert "compile" not in short.names and "within a 150 s budget" in dict(short.left_out)["compile"]
    assert "Mine has no repeated blocks to compile once" in dict(short.left_out)["compile"]
    with pytest.raises(SpecError, match=r"structure=.*ModelStructure.to_dict\(\) fields"):
        BenchSpec(device="cpu", preset="tiny", structure={"convs": 3})
    with pytest.raises(ValueError, match=r"conv_flop_share=1.5.*a fraction"):
        ModelStructure(conv_flop_share=1.5)
    assert ModelStructure.from_dict(given) == ModelStructure(model="Mine", convolutions=("c",), conv_flop_share=0.5)


@pytest.mark.parametrize("shapes", [1, 3, 0])
def test_regional_compile_stays_in_a_short_cpu_budget_only_over_blocks_of_one_shape(shapes: int) -> None:
    blocks = ("b.0", "b.1", "b.2")
    given = ModelStructure(model="Net", repeated_blocks=blocks, block_class="Blk", block_shapes=shapes).to_dict()
    spec = BenchSpec(device="cpu", preset="tiny", structure=given)  # the default 150 s budget
    if shapes == 1:  # one block compiled once, later repeats warm from the configuration's cache
        assert "compile_regional" in spec.names
        return
    assert "compile_regional" not in spec.names
    why = dict(spec.left_out)["compile_regional"]
    assert f"Net's 3 Blk blocks come in {shapes or 'shapes not known'}" in why and "--time-budget 400" in why
    assert "compile_regional" in BenchSpec(device="cpu", preset="tiny", structure=given, time_budget_s=400).names


def test_the_demos_blocks_shapes_decide_regional_compile_on_a_short_cpu_budget() -> None:
    from lightning_perf.demos import make_workload

    lm = probe_structure(make_workload("lm", preset="tiny")[0])
    assert len(lm.repeated_blocks) > 1 and lm.block_shapes == 1  # identical blocks: one compile
    convnet = probe_structure(make_workload("convnet", preset="tiny")[0])
    assert convnet.block_shapes == len(convnet.repeated_blocks) > 1  # a shape per stage: each compiled apart


def test_a_model_that_cannot_be_built_leaves_the_choice_to_the_device() -> None:
    source = own_model("Missing")
    assert structure_of_source(source) is None


def test_the_tuner_s_default_search_follows_the_structure_too() -> None:
    encoder = structure_of(models.Encoder(), models.Data("tokens"))
    plan = search_plan("fit", device="cpu", structure=encoder)
    assert "compile_regional" in plan.searched_optimizations and "compile" not in plan.optimizations
    assert "flash_attention" in plan.searched_optimizations
    assert plan.left_out["channels_last"] == "Encoder has no 2D or 3D convolution"
    mlp = search_plan("fit", device="cpu", structure=structure_of(models.MLP(), models.Data("vector")))
    assert {"compile", "channels_last", "flash_attention"} <= set(mlp.left_out)
    assert "compile" in search_plan("fit", device="cpu").searched_optimizations  # without a structure: as before
    gpu = search_plan("fit", device="cuda", structure=encoder)
    assert (
        "compile" in gpu.searched_optimizations
    )  # on CUDA the whole-model compile stays (reduce-overhead replaces it)
