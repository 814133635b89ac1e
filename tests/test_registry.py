"""An optimization registered in the one list reaches the bench, the tuner's search list and the advice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lightning.pytorch.callbacks import Callback

import lightning_perf.optimizations as optimizations
from lightning_perf.optimizations import AdviceRule, Optimization


class DummySpeedupCallback(Callback):
    """Does nothing: stands for an optimization added by a contributor."""


@pytest.fixture
def dummy() -> Iterator[Optimization]:
    entry = Optimization(
        "dummy_speedup",
        "DummySpeedupCallback: a registry test's stand-in",
        callback=f"{__name__}.DummySpeedupCallback",
        tuner_stage="optimization",
        tuner_order=15,
        advice=(AdviceRule("compute_bound", "try the dummy speed-up"),),
    )
    optimizations.register(entry)
    yield entry
    optimizations.unregister(entry.name)
    assert "dummy_speedup" not in optimizations.names()


def test_found_in_bench_list(dummy: Optimization, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_perf.benchmark.configs import get_config
    from lightning_perf.cli import main

    assert main(["bench", "--list"]) == 0
    assert "dummy_speedup" in capsys.readouterr().out
    config = get_config("channels_last+dummy_speedup")
    assert [type(cb) for cb in config.callbacks()][-1] is DummySpeedupCallback


def test_found_in_the_tuner_search_list(dummy: Optimization) -> None:
    from lightning_perf.tuning.tuner import AutoTuner

    tuner = AutoTuner(workload="convnet", preset="tiny", progress=False)
    assert tuner.optimizations.index("dummy_speedup") == tuner.optimizations.index("channels_last") + 1


def test_found_in_the_advice(dummy: Optimization) -> None:
    from lightning_perf.profiling.advice import StepBreakdown, recommend

    shares = {"data": 0.02, "transfer": 0.02, "forward": 0.4, "backward": 0.45, "optimizer": 0.05, "other": 0.06}
    breakdown = StepBreakdown(shares=shares, medians={p: 0.01 for p in shares}, step_median_s=0.1, steps=20)
    compute = next(rec for rec in recommend(breakdown) if rec.rule == "compute_bound")
    assert "DummySpeedupCallback" in compute.callbacks and "try the dummy speed-up" in compute.actions
    in_use = StepBreakdown(**{**breakdown.__dict__, "active_callbacks": frozenset({"DummySpeedupCallback"})})
    assert all("DummySpeedupCallback" not in rec.callbacks for rec in recommend(in_use))


def test_removed_entry_leaves_the_bench() -> None:
    from lightning_perf.benchmark.configs import available_configs

    entry = optimizations.register(Optimization("dummy_gone", "gone soon", callback=f"{__name__}.DummySpeedupCallback"))
    assert "dummy_gone" in available_configs()
    optimizations.unregister(entry.name)
    assert "dummy_gone" not in available_configs()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "a+b"}, "is not a valid name"),
        ({"name": ""}, "is not a valid name"),
        ({"description": ""}, "description=''"),
        ({"callback": "NoDots"}, "callback='NoDots'"),
        ({"callback_kwargs": {"x": 1}}, "without a callback"),
        ({"trainer_kwargs": [("precision", "bf16")]}, "trainer_kwargs="),
        ({"changes_numerics": "yes"}, "changes_numerics='yes'"),
        ({"tuner_stage": "data"}, "tuner_stage='data'"),
        ({"tuner_order": float("nan")}, "tuner_order=nan"),
        ({"requires": ("tpu",)}, "requires=('tpu',)"),
        ({"advice": AdviceRule("compute_bound", "x")}, "advice="),
        ({"stages": ("train",)}, "stages=('train',)"),
        ({"stages": ()}, "stages=()"),
        ({"stages": "predict"}, "stages='predict'"),
        ({"model_needs": ("gpus",)}, "model_needs=('gpus',)"),
        ({"packages": "torchao"}, "packages='torchao'"),
        ({"fast_fp32_matmul": 1}, "fast_fp32_matmul=1"),
        ({"long_warmup": "yes"}, "long_warmup='yes'"),
        ({"name": "baseline"}, "'baseline' is the bench's reference"),
    ],
)
def test_bad_entries_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        Optimization(**{"name": "x", "description": "d", **kwargs})
    assert message in str(info.value)


def test_duplicate_and_bad_advice_rules() -> None:
    with pytest.raises(ValueError, match="already registered"):
        optimizations.register(Optimization("compile", "again"))
    with pytest.raises(ValueError, match="symptom='slow'"):
        AdviceRule("slow", "x")
    with pytest.raises(ValueError, match="when='sometimes'"):
        AdviceRule("compute_bound", "x", "sometimes")


def test_a_predict_only_optimization_is_one_entry() -> None:
    from lightning_perf.benchmark.configs import get_config, split_by_stage

    callback, stages = f"{__name__}.DummySpeedupCallback", optimizations.INFERENCE_STAGES
    entry = optimizations.register(
        Optimization("dummy_int8", "a predict-only stand-in", callback=callback, stages=stages)
    )
    try:
        assert get_config("dummy_int8").stages == ("predict", "validate", "test")
        assert split_by_stage(["baseline", "dummy_int8"], "predict") == (["baseline", "dummy_int8"], [])
        assert split_by_stage(["dummy_int8"], "fit")[1] == [
            ("dummy_int8", "applies to predict/validate/test only, not to fit")
        ]
        assert "dummy_int8" not in optimizations.tuner_search_list("optimization")
    finally:
        optimizations.unregister(entry.name)


def test_an_entry_carries_its_own_requirements_needs_conditions_and_dtype() -> None:
    """Everything the tools ask of an optimization comes from its entry: no list elsewhere names it."""
    import torch

    from lightning_perf.benchmark.configs import get_config
    from lightning_perf.benchmark.structure import ModelStructure
    from lightning_perf.benchmark.utilization import matmul_setting
    from lightning_perf.profiling.advice import StepBreakdown, recommend
    from lightning_perf.tuning.inference import trial_skip_reason
    from lightning_perf.tuning.recommend import long_warmup

    entry = optimizations.register(
        Optimization(
            "dummy_fusion",
            "a stand-in that needs CUDA, a package and convolutions",
            callback=f"{__name__}.DummySpeedupCallback",
            requires=("cuda",),
            packages=("no_such_package_for_the_registry_test",),
            model_needs=("convolutions",),
            fast_fp32_matmul=True,
            long_warmup=True,
            advice=(AdviceRule("compute_bound", "fuse the dummy layers", {"full_precision": True, "cuda": True}),),
            slowdown_causes=(optimizations.SlowdownCause({"warmup_not_amortized": True}, "dummy warm-up"),),
        )
    )
    try:
        assert get_config("dummy_fusion").why_not(torch.device("cpu")) == "needs a CUDA device"
        assert matmul_setting("channels_last+dummy_fusion", "32-true") == ("32-true", True)
        assert matmul_setting("channels_last", "32-true") == ("32-true", False)
        assert long_warmup(["baseline", "channels_last", "dummy_fusion"]) == ["dummy_fusion"]
        reason = trial_skip_reason("dummy_fusion", ModelStructure(), "cpu")
        assert reason == "the model has no 2D or 3D convolution layer: dummy_fusion changes nothing"
        assert trial_skip_reason("dummy_fusion", ModelStructure(convolutions=("conv",)), "cpu") == "needs a CUDA device"

        shares = {"data": 0.02, "transfer": 0.02, "forward": 0.4, "backward": 0.45, "optimizer": 0.05, "other": 0.06}
        medians = {p: 0.01 for p in shares}

        def actions(**facts: object) -> tuple[str, ...]:
            step = StepBreakdown(shares=shares, medians=medians, step_median_s=0.1, steps=20, **facts)  # type: ignore[arg-type]
            return next(rec for rec in recommend(step) if rec.rule == "compute_bound").actions

        assert "fuse the dummy layers" in actions(device_type="cuda", has_convolutions=True)
        assert "fuse the dummy layers" not in actions(device_type="cuda", has_convolutions=False)  # model need
        assert "fuse the dummy layers" not in actions(device_type="cpu", has_convolutions=True)  # condition
        assert "fuse the dummy layers" not in actions(device_type="cuda", has_convolutions=True, precision="bf16-mixed")
    finally:
        optimizations.unregister(entry.name)


def test_conditions_name_known_facts() -> None:
    with pytest.raises(ValueError, match=r"AdviceRule\(when=\{'sunny': True\}\)` is not valid.*full_precision"):
        AdviceRule("compute_bound", "x", {"sunny": True})
    with pytest.raises(ValueError, match=r"SlowdownCause\(when=\{'bf16_emulated': 1\}\)` is not valid"):
        optimizations.SlowdownCause({"bf16_emulated": 1}, "x")  # type: ignore[dict-item]
    assert AdviceRule("compute_bound", "x", "cuda").when == {"cuda": True}
    assert AdviceRule("compute_bound", "x").when == {}


def test_every_fact_and_feature_the_list_names_is_evaluated() -> None:
    """The vocabularies of the list and the places that evaluate them agree: a new name is evaluated or refused."""
    import dataclasses

    import torch

    from lightning_perf.benchmark import configs
    from lightning_perf.benchmark.structure import ModelStructure
    from lightning_perf.profiling.advice import StepBreakdown

    assert set(optimizations.MODEL_FEATURES) <= {f.name for f in dataclasses.fields(ModelStructure)}
    step = StepBreakdown(shares={}, medians={}, step_median_s=0.1, steps=1)
    assert set(optimizations.ADVICE_FACTS) | set(optimizations.MODEL_FEATURES) == set(step.facts())
    assert set(configs.device_capabilities(torch.device("cpu"))) == set(optimizations.DEVICE_CAPABILITIES)
    with pytest.raises(KeyError, match="'tpu' is not a device capability"):
        configs.device_offers(torch.device("cpu"), "tpu")
