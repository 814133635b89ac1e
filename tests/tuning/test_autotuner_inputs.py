"""Every bad AutoTuner argument is refused at construction, naming the argument, the value and what is expected."""

from __future__ import annotations

import math

import pytest

from lightning_perf.tuning.tuner import AutoTuner
from tests.tuning._user_models import PlainDataModule, SmallConvNet

BAD = [
    ({"workload": "mnist"}, "workload='mnist'", "Expected one of"),
    ({"workload": "convnet", "preset": "huge"}, "AutoTuner(preset='huge')", "Expected one of tiny, default"),
    ({"device": "tpu"}, "device='tpu'", "Expected auto, cpu, cuda or cuda:N"),
    ({"device": 0}, "device=0", "Expected auto, cpu"),
    ({"time_budget_s": 0}, "time_budget_s=0", "Expected a finite number > 0"),
    ({"time_budget_s": math.inf}, "time_budget_s=inf", "Expected a finite number"),
    ({"time_budget_s": "60"}, "time_budget_s='60'", "Expected a finite number"),
    ({"steps": 2}, "steps=2", "Expected an integer >= 3"),
    ({"steps": 5.0}, "steps=5.0", "Expected an integer >= 3"),
    ({"warmup_steps": 0}, "warmup_steps=0", "Expected an integer >= 1"),
    ({"min_gain": -0.1}, "min_gain=-0.1", "Expected a finite number >= 0"),
    ({"min_gain": math.nan}, "min_gain=nan", "Expected a finite number"),
    ({"confidence": 0.4}, "confidence=0.4", ">= 0.5 and <= 1"),
    ({"loss_rtol": 0}, "loss_rtol=0", "> 0"),
    ({"confirm_below": 0.9}, "confirm_below=0.9", ">= 1"),
    ({"max_batch_size": 0}, "max_batch_size=0", "Expected an integer >= 1"),
    ({"max_num_workers": -1}, "max_num_workers=-1", "Expected an integer >= 0"),
    ({"isolation": "thread"}, "isolation='thread'", "Expected one of"),
    ({"precisions": ["fp8"]}, "precisions=['fp8']", "Expected names from"),
    ({"precisions": "bf16-mixed"}, "precisions='bf16-mixed'", "Expected a list"),
    ({"optimizations": ["warp"]}, "optimizations=['warp']", "Valid names"),
    ({"optimizations": ["bf16-mixed"]}, "optimizations=['bf16-mixed']", "Expected it in `precisions`"),
    ({"optimizations": "compile"}, "optimizations='compile'", "Expected a list"),
    ({"tune_batch_size": "false"}, "tune_batch_size='false'", "Expected True or False"),
    ({"noise_check": 1}, "noise_check=1", "Expected True or False"),
    ({"progress": None}, "progress=None", "Expected True or False"),
    ({"seed": 1.5}, "seed=1.5", "Expected an integer"),
]


@pytest.mark.parametrize(("kwargs", "names", "expected"), BAD, ids=[b[1] for b in BAD])
def test_bad_argument_is_named(kwargs: dict, names: str, expected: str) -> None:
    if "workload" not in kwargs:
        kwargs = {"workload": "convnet", "preset": "tiny", **kwargs}
    type_error = expected in ("Expected a list", "Expected True or False", "Expected an integer")
    with pytest.raises(TypeError if type_error else ValueError) as info:
        AutoTuner(**kwargs)
    message = str(info.value)
    assert names in message and expected in message, message


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({}, ValueError, "exactly one of"),
        ({"model": SmallConvNet()}, TypeError, "datamodule=None)` is not valid. Expected a LightningDataModule"),
        ({"model": object(), "datamodule": PlainDataModule()}, TypeError, "Expected a LightningModule"),
        ({"source": "tests:X"}, TypeError, "source='tests:X')` is not valid"),
        ({"workload": "convnet", "model": SmallConvNet(), "datamodule": PlainDataModule()}, ValueError, "exactly one"),
    ],
)
def test_what_to_tune_is_checked(kwargs: dict, error: type[Exception], names: str) -> None:
    with pytest.raises(error) as info:
        AutoTuner(**kwargs)
    assert names in str(info.value)
