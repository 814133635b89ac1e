"""Module surgery: finding, replacing, restoring and forward-patching submodules with state_dict keys unchanged."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lightning_perf.functional.surgery import (
    ForwardPatch,
    adopt_tensors,
    find_forward_patch,
    find_modules,
    find_repeated_blocks,
    import_module_class,
    patch_forward,
    repeated_block_groups,
    replace_modules,
    restore_modules,
    take_over_modes,
    unpatch_forward,
)
from tests._models import BasicBlock, ResNet, Stage, encoder


def names(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in found]


class Doubled(nn.Module):
    """A replacement that holds the replaced Linear (same parameter objects, same names) and doubles its output."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * nn.functional.linear(x, self.weight, self.bias)


def test_find_modules_skips_the_root_and_can_keep_outermost_only() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    assert names(find_modules(model, lambda m, n: True)) == ["0", "0.0", "0.1", "1"]
    assert names(find_modules(model, lambda m, n: True, outermost=True)) == ["0", "1"]
    assert names(find_modules(model, lambda m, n: isinstance(m, nn.Linear))) == ["0.0", "1"]


def test_replace_in_sequential_and_module_list_keeps_state_dict_and_outputs_change() -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    keys = list(model.state_dict())
    x = torch.randn(2, 3)
    before = model.layers[1](x)
    replaced = replace_modules(model, lambda m, n: isinstance(m, nn.Linear), lambda m, n: Doubled(m))
    assert sorted(replaced) == ["layers.0", "layers.1", "seq.0"]
    assert isinstance(model.seq[0], Doubled) and isinstance(model.layers[1], Doubled)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model.layers[1](x), 2 * before)
    assert replaced["layers.1"][1].weight is replaced["layers.1"][0].weight  # the same Parameter objects

    restore_modules(model, replaced)
    assert type(model.seq[0]) is nn.Linear and type(model.layers[1]) is nn.Linear
    torch.testing.assert_close(model.layers[1](x), before)


def test_replace_by_name_and_unknown_names_raise() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    replaced = replace_modules(model, ["1"], lambda m, n: Doubled(m))
    assert list(replaced) == ["1"] and isinstance(model[1], Doubled) and type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="not submodules"):
        replace_modules(model, ["2"], lambda m, n: Doubled(m))


def test_a_shared_module_is_replaced_everywhere_by_one_object() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.a, model.b = shared, shared
    replaced = replace_modules(model, lambda m, n: isinstance(m, nn.Linear), lambda m, n: Doubled(m))
    assert set(replaced) == {"a", "b"}
    assert model.a is model.b and isinstance(model.a, Doubled)


def test_a_replacement_that_changes_keys_is_refused_before_anything_changes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"state_dict keys.*missing \['bias'\]"):
        replace_modules(model, lambda m, n: True, lambda m, n: nn.Linear(2, 2, bias=False))
    assert all(type(m) is nn.Linear and m.bias is not None for m in model)


def test_factory_returning_none_or_the_module_leaves_it() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert replace_modules(model, lambda m, n: True, lambda m, n: None) == {}
    assert replace_modules(model, lambda m, n: True, lambda m, n: m) == {}


def test_restore_adopts_tensors_the_replacement_got_since() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    replaced = replace_modules(model, ["0"], lambda m, n: Doubled(m))
    new_weight = nn.Parameter(torch.ones(2, 2))
    model[0].weight = new_weight  # e.g. load_state_dict(assign=True)
    model.eval()
    restore_modules(model, replaced)
    assert model[0].weight is new_weight and not model[0].training


def test_adopt_tensors_matches_names() -> None:
    target, source = nn.Linear(2, 2), nn.Linear(2, 2)
    adopt_tensors(target, source)
    assert target.weight is source.weight and target.bias is source.bias


# ------------------------------------------------------------------------------------------- find_repeated_blocks


def test_transformer_layers_in_a_module_list() -> None:
    assert names(find_repeated_blocks(encoder(depth=4))) == [f"layers.{i}" for i in range(4)]


def test_resnet_blocks_across_sequential_stages_not_the_stages_or_convs() -> None:
    assert names(find_repeated_blocks(ResNet(blocks_per_stage=2))) == [
        f"stages.{s}.{b}" for s in (0, 1) for b in (0, 1)
    ]
    # One block per stage: the blocks are still siblings through the plain containers.
    one_each = ResNet(blocks_per_stage=1, widths=(4, 8, 8))
    assert names(find_repeated_blocks(one_each)) == ["stages.0.0", "stages.1.0", "stages.2.0"]


def test_blocks_win_over_custom_stage_modules_that_contain_them() -> None:
    model = nn.Sequential(Stage(8, 2), Stage(8, 3))
    assert names(find_repeated_blocks(model)) == ["0.blocks.0", "0.blocks.1", "1.blocks.0", "1.blocks.1", "1.blocks.2"]


def test_decoder_layers_win_over_the_two_attention_modules_inside_each() -> None:
    layer = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)
    decoder = nn.TransformerDecoder(layer, 3)
    assert names(find_repeated_blocks(decoder)) == ["layers.0", "layers.1", "layers.2"]


def test_encoder_decoder_picks_the_group_holding_most_parameters() -> None:
    model = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True)
    assert names(find_repeated_blocks(model)) == ["decoder.layers.0", "decoder.layers.1"]


def test_no_repeated_blocks() -> None:
    assert find_repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []
    assert find_repeated_blocks(nn.Sequential(BasicBlock(3, 4), nn.Linear(4, 2))) == []
    assert find_repeated_blocks(nn.Sequential(BasicBlock(3, 4), BasicBlock(4, 4)), min_repeats=3) == []


def test_min_repeats_must_be_at_least_two() -> None:
    with pytest.raises(ValueError, match="min_repeats=1"):
        find_repeated_blocks(encoder(), min_repeats=1)
    with pytest.raises(ValueError, match="min_repeats=True"):
        repeated_block_groups(encoder(), min_repeats=True)


def test_repeated_block_groups_pools_same_class_siblings_across_parents() -> None:
    model = nn.Sequential(Stage(8, 2), Stage(8, 3))
    groups = repeated_block_groups(model)
    assert set(groups) == {Stage, nn.TransformerEncoderLayer}
    assert groups[Stage] == [model[0], model[1]]
    assert groups[nn.TransformerEncoderLayer] == [*model[0].blocks, *model[1].blocks]
    assert repeated_block_groups(model, min_repeats=3) == {nn.TransformerEncoderLayer: list(model[1].blocks)}


# ------------------------------------------------------------------------------------------------ forward patches


class AddOne(ForwardPatch):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_original(*args, **kwargs) + 1


class TimesTen(ForwardPatch):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_original(*args, **kwargs) * 10


def test_patches_stack_once_per_kind_and_come_off_in_any_order() -> None:
    module = nn.Linear(1, 1)
    nn.init.constant_(module.weight, 1.0)
    nn.init.constant_(module.bias, 0.0)
    x = torch.ones(1, 1)
    keys = list(module.state_dict())
    assert patch_forward(module, AddOne) is not None
    assert patch_forward(module, AddOne) is None  # idempotent
    assert patch_forward(module, TimesTen) is not None
    assert module(x).item() == 20.0  # (1 + 1) * 10
    assert list(module.state_dict()) == keys and type(module) is nn.Linear
    assert unpatch_forward(module, AddOne)
    assert module(x).item() == 10.0
    assert find_forward_patch(module, AddOne) is None and find_forward_patch(module, TimesTen) is not None
    assert unpatch_forward(module, TimesTen) and not unpatch_forward(module, TimesTen)
    assert "forward" not in module.__dict__ and module(x).item() == 1.0


def test_a_patched_module_pickles_and_deep_copies() -> None:
    model = nn.Sequential(nn.Linear(1, 1))
    patch_forward(model[0], AddOne)
    x = torch.ones(1, 1)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        patch = find_forward_patch(clone[0], AddOne)
        assert patch is not None and patch.module is clone[0]
        torch.testing.assert_close(clone(x), model(x))


def test_import_module_class() -> None:
    assert import_module_class("torch.nn.TransformerEncoderLayer") is nn.TransformerEncoderLayer
    with pytest.raises(ValueError, match="Cannot import"):
        import_module_class("torch.nn.NoSuchLayer")
    with pytest.raises(ValueError, match=r"not a subclass of torch\.nn\.Module"):
        import_module_class("torch.nn.functional.relu")
    with pytest.raises(ValueError, match="not a class path"):
        import_module_class("Linear")


# ------------------------------------------------------------------------------------------------ training flags


def test_a_replacement_takes_over_the_training_flags_and_follows_train_and_eval() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)), nn.Linear(2, 2))
    model[0][1].eval()  # a submodule the user froze in eval mode inside a training model

    def built_in_eval_mode(module: nn.Module, name: str) -> nn.Module:
        new = copy.copy(module)  # shares the children, but its own flag was set to eval while it was built
        new.__dict__["_modules"] = dict(module._modules)
        new.training = False
        return new

    replaced = replace_modules(model, ["0"], built_in_eval_mode)
    new = model[0]
    assert new is not replaced["0"][0]
    assert new.training and new[0].training and not new[1].training
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_take_over_modes_matches_names_and_keeps_the_rest() -> None:
    source = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    target = nn.Sequential(nn.Linear(2, 2), nn.Dropout(), nn.ReLU())
    source.eval()
    target[2].train()
    take_over_modes(target, source)
    assert not target.training and not target[0].training and not target[1].training
    assert target[2].training
