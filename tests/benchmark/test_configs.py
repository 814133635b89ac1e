from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_perf.benchmark import configs
from lightning_perf.benchmark.configs import BenchConfig, available_configs, get_config, stack_configs


class _A(Callback):
    pass


class _B(Callback):
    pass


def _needs_cuda(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "needs a CUDA device"


A = BenchConfig("a", "adds A", callbacks=lambda: [_A()], trainer_kwargs={"benchmark": True})
B = BenchConfig("b", "adds B", callbacks=lambda: [_B()])


def test_baseline_first_and_bf16_registered() -> None:
    names = available_configs()
    assert names[0] == "baseline"
    assert "bf16-mixed" in names
    assert get_config("bf16-mixed").trainer_kwargs["precision"] == "bf16-mixed"


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown benchmark configuration 'nope'.*Valid names: baseline"):
        get_config("nope")
    with pytest.raises(ValueError, match="'nope' in 'baseline\\+nope'"):
        get_config("baseline+nope")


def test_stack_keeps_callback_order_and_merges_kwargs() -> None:
    stacked = stack_configs([A, get_config("bf16-mixed")])
    assert stacked.name == "a+bf16-mixed"
    assert stacked.parts == ("a", "bf16-mixed")
    assert [type(cb) for cb in stacked.callbacks()] == [_A]
    assert dict(stacked.trainer_kwargs) == {"benchmark": True, "precision": "bf16-mixed"}
    assert [type(cb) for cb in stack_configs([B, A]).callbacks()] == [_B, _A]


def test_conflicting_stack_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"both set Trainer\(benchmark=...\)"):
        stack_configs([A, BenchConfig("no_bench", "unsets benchmark", trainer_kwargs={"benchmark": False})])


def test_applicability_of_a_stack_names_the_part() -> None:
    stacked = stack_configs([A, BenchConfig("gpu_only", "needs cuda", applies_to=_needs_cuda)])
    assert stacked.why_not(torch.device("cuda")) is None
    assert stacked.why_not(torch.device("cpu")) == "gpu_only: needs a CUDA device"


@pytest.mark.parametrize("bad", ["", "a+b", "with space", "x,y"])
def test_invalid_config_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a valid name"):
        BenchConfig(bad, "desc")


def test_callback_specs_build_the_callbacks_and_stack() -> None:
    from lightning_perf.callbacks import BackendFlagsCallback, ChannelsLastCallback

    stacked = get_config("channels_last+backend_flags+bf16-mixed")
    assert stacked.callback_specs == (
        ("lightning_perf.callbacks.ChannelsLastCallback", {}),
        ("lightning_perf.callbacks.BackendFlagsCallback", {"preset": "fastest"}),
    )
    assert [type(cb) for cb in stacked.callbacks()] == [ChannelsLastCallback, BackendFlagsCallback]
    assert get_config("baseline").callback_specs == ()


def test_a_stack_with_a_factory_only_part_has_no_specs() -> None:
    assert stack_configs([A, get_config("channels_last")]).callback_specs is None
    with pytest.raises(ValueError, match="give `callbacks` or `callback_specs`, not both"):
        BenchConfig("both", "x", callbacks=lambda: [_A()], callback_specs=(("x.Y", {}),))


def test_the_a_a_control_is_baseline_by_another_name_listed_but_never_a_default(capsys: pytest.CaptureFixture) -> None:
    from lightning_perf.benchmark.session import list_configs
    from lightning_perf.benchmark.structure import ModelStructure

    control = get_config(configs.AA_CONTROL)
    assert control.callbacks() == [] and dict(control.trainer_kwargs) == {} and control.strategy is None
    assert control.stages == get_config("baseline").stages and control.why_not(torch.device("cpu")) is None
    for structure in (None, ModelStructure(model="M", convolutions=("c",), conv_flop_share=0.9)):
        chosen, left_out = configs.default_configs(torch.device("cpu"), structure=structure)
        assert configs.AA_CONTROL not in chosen and configs.AA_CONTROL not in dict(left_out)
    assert list_configs() == 0 and configs.AA_CONTROL in capsys.readouterr().out
