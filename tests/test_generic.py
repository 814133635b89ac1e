"""Generic tests over every registered callback and strategy (``tests/callback_settings.py``)."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lightning_perf.callbacks import TensorRTExportCallback
from lightning_perf.demos import WORKLOADS, make_workload
from tests import _device, _multiproc
from tests.callback_settings import (
    SETTINGS,
    Setting,
    device_marks,
    fsdp2_duplicate_of,
    get_setting,
    loss_mismatch,
    params,
    public_classes,
)
from tests.deploy._sets import visible_files


def _trainer(setting: Setting, root: Path, extra: Any = None, **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": _device.accelerator(),  # pytest --device cuda (tests/_device.py)
        "devices": 1,
        "max_steps": 3,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
    }
    kwargs.update(setting.trainer_kwargs)
    kwargs.update(overrides)
    instance = setting.build() if extra is None else extra
    if setting.is_strategy:
        kwargs["strategy"] = instance
    else:
        kwargs["callbacks"] = [instance]
    return pl.Trainer(**kwargs)


def _workload(setting: Setting, seed: int = 0) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """The setting's workload; ``seed`` picks the model's initial weights and the data (a checkpoint restores both).

    The global seed stays 0: DDP-based strategies seed their sampler from it, even on one device. On CUDA data
    loader workers are seeded too (``workers=True``), part of the resume test's deterministic settings.
    """
    pl.seed_everything(0, verbose=False, workers=_device.on_cuda())
    return make_workload(setting.workload, setting.preset, seed=seed)


def test_every_public_class_has_a_setting() -> None:
    registered = {s.cls for s in SETTINGS if not s.test_only}
    missing = [cls.__name__ for cls in public_classes() if cls not in registered]
    assert not missing, f"public classes without an entry in tests/callback_settings.py: {missing}"


@pytest.mark.parametrize("setting", params())
def test_fit_evaluate_checkpoint_pickle_and_fit_again(setting: Setting, tmp_path: Path) -> None:
    """One instance pickles before and after a short fit; fit, validate, test and predict give finite figures; the
    checkpoint has the plain model's keys and loads without the callback; the same instance drives a second fit."""
    instance = setting.build()
    assert type(pickle.loads(pickle.dumps(instance))) is setting.cls
    model, data = _workload(setting)
    trainer = _trainer(setting, tmp_path, extra=instance)
    trainer.fit(model, datamodule=data)
    assert trainer.state.finished and trainer.global_step == 3
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    ckpt = tmp_path / "with.ckpt"
    trainer.save_checkpoint(ckpt)
    (val,) = trainer.validate(model, datamodule=data, verbose=False)
    (test,) = trainer.test(model, datamodule=data, verbose=False)
    predictions: list[Any] = list(trainer.predict(model, datamodule=data) or [])
    assert math.isfinite(val["val_loss"]) and math.isfinite(test["test_loss"])
    assert predictions and all(torch.isfinite(p).all() for p in predictions)

    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert set(state) == set(_workload(setting)[0].state_dict())
    loaded = WORKLOADS[setting.workload].module_cls.load_from_checkpoint(ckpt, map_location="cpu")
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[key], atol=0, rtol=0, msg=key)

    if not setting.is_strategy:  # a strategy holds its trainer's process state after fit; the DDP test covers it
        clone = pickle.loads(pickle.dumps(instance))
        assert type(clone) is setting.cls and clone.state_dict().keys() == instance.state_dict().keys()
    # A strategy belongs to one Trainer (Lightning sets its accelerator): the second fit gets its own.
    again = _trainer(setting, tmp_path, extra=setting.build() if setting.is_strategy else instance)
    again.fit(model, datamodule=data)
    assert again.global_step == 3 and math.isfinite(float(again.callback_metrics["train_loss"]))


@pytest.mark.parametrize("setting", params())
def test_resume_equals_uninterrupted(setting: Setting, tmp_path: Path) -> None:
    """Two epochs in one go equal one epoch, a checkpoint, and a resumed second epoch with fresh objects.

    On CUDA the three fits run with deterministic kernels (``tests/_device.py:deterministic``: deterministic
    algorithms, cuDNN deterministic without autotuning, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, seeded workers), restored
    after: without them cuDNN's kernels make two identical runs differ, whatever the callback.
    """
    with _device.deterministic() as how:
        _resume_equals_uninterrupted(setting, tmp_path, how)


def _resume_equals_uninterrupted(setting: Setting, tmp_path: Path, how: str) -> None:
    limits = {"limit_train_batches": 2, "max_steps": -1}

    model, data = _workload(setting)
    straight = _trainer(setting, tmp_path / "straight", max_epochs=2, **limits)
    straight.fit(model, datamodule=data)

    first_model, first_data = _workload(setting)
    first = _trainer(setting, tmp_path / "first", max_epochs=1, **limits)
    first.fit(first_model, datamodule=first_data)
    ckpt = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(ckpt)

    resumed_model, resumed_data = _workload(setting, seed=1)  # different init: the checkpoint must win
    resumed = _trainer(setting, tmp_path / "resumed", max_epochs=2, **limits)
    resumed.fit(resumed_model, datamodule=resumed_data, ckpt_path=ckpt)

    assert resumed.global_step == straight.global_step == 4
    expected, actual = model.state_dict(), resumed_model.state_dict()
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=setting.resume_atol, rtol=0, msg=f"{key} ({how})")


@pytest.mark.parametrize("setting", params())
def test_built_from_lightning_cli_yaml(setting: Setting, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    entry = {"class_path": setting.class_path, "init_args": dict(setting.kwargs)}
    trainer_cfg: dict[str, Any] = {"accelerator": _device.accelerator(), "devices": 1, "logger": False}
    trainer_cfg.update({k: v for k, v in setting.trainer_kwargs.items() if isinstance(v, (str, int, float, bool))})
    trainer_cfg["strategy" if setting.is_strategy else "callbacks"] = entry if setting.is_strategy else [entry]
    config = {
        "trainer": trainer_cfg,
        "model": {"preset": setting.preset},
        "data": {"preset": setting.preset},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    workload = WORKLOADS[setting.workload]
    cli = LightningCLI(
        workload.module_cls,
        workload.datamodule_cls,
        run=False,
        args=["--config", str(path)],
        save_config_callback=None,
    )
    if setting.is_strategy:
        assert isinstance(cli.trainer.strategy, setting.cls)
    else:
        assert any(isinstance(cb, setting.cls) for cb in cli.trainer.callbacks)  # type: ignore[attr-defined]


# ------------------------------------------------------------------- 2 processes: DDP and FSDP2, in one shared launch

DDP_TEST, FSDP2_TEST = "test_ddp_two_processes", "test_fsdp2_two_processes"
# The whole matrix in one launch; a setting that hangs costs _multiproc.COLLECTIVE_TIMEOUT_S, then the rest is reported.
LAUNCH_TIMEOUT_S = 1500


class SharedLaunch:
    """The results of the one 2-process launch that ran every selected DDP and FSDP2 job (``tests/_multiproc.py``)."""

    def __init__(self, out: Path, log: Path, returncode: int | None, skip_reason: str = "") -> None:
        self.out, self.log, self.returncode, self.skip_reason = out, log, returncode, skip_reason

    def result(self, mode: str, setting: Setting | None, model: str | None = None) -> dict[str, Any]:
        if self.skip_reason:
            pytest.skip(self.skip_reason)
        path = self.out / _multiproc.result_name(mode, setting.id if setting else None, model)
        if not path.exists():
            tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"
            pytest.fail(f"no result for this job from the shared launch (exit status {self.returncode}):\n{tail}")
        return json.loads(path.read_text())

    def root(self, mode: str, setting: Setting) -> Path:
        """The job's ``default_root_dir`` (``tests/_multiproc.py``): what its callback wrote is there."""
        return self.out / "roots" / Path(_multiproc.result_name(mode, setting.id)).stem


def _jobs(items: list[pytest.Item]) -> list[dict[str, Any]]:
    """The jobs of the selected 2-process tests (after -k/-m): DDP first, then each sharded model's plain run."""
    ddp, fsdp2 = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        setting = callspec.params.get("setting") if callspec is not None else None
        if not isinstance(setting, Setting) or item.get_closest_marker("skip") is not None:
            continue
        name = getattr(item, "originalname", "")
        if name == DDP_TEST:
            ddp.append({"mode": "ddp", "setting": setting.id, "model": None})
        elif name == FSDP2_TEST and _fsdp2_runs(setting):
            fsdp2.append({"mode": "fsdp2", "setting": setting.id, "model": setting.sharded_model})
    plain = [{"mode": "fsdp2", "setting": None, "model": m} for m in dict.fromkeys(j["model"] for j in fsdp2)]
    # Known failures last: one that breaks the process group then costs a relaunch for the other xfails only.
    fsdp2.sort(key=lambda job: get_setting(job["setting"]).fsdp2_mode == "xfail")
    return ddp + plain + fsdp2


def _fsdp2_runs(setting: Setting) -> bool:
    return setting.fsdp2_mode != "skip" and fsdp2_duplicate_of(setting) is None and not setting.is_strategy


@pytest.fixture(scope="session")
def shared_launch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SharedLaunch:
    """Starts the 2 processes once for every selected DDP and FSDP2 test (about 8 s of start-up, paid once)."""
    out = tmp_path_factory.mktemp("multiproc")
    log = out / "launch.log"
    if _device.on_cuda() and torch.cuda.device_count() < 2:
        reason = (
            f"2-process tests on CUDA need 2 GPUs; this machine has {torch.cuda.device_count()} "
            "(CPU CI runs them with gloo)"
        )
        return SharedLaunch(out, log, None, reason)
    jobs = _jobs(request.session.items)
    if not jobs:  # every selected 2-process test skips before reading a result
        return SharedLaunch(out, log, None)
    returncode = _multiproc.run(jobs, out, _device.device(), LAUNCH_TIMEOUT_S, log)
    return SharedLaunch(out, log, returncode)


@pytest.mark.parametrize("value", ["maybe", "xfail", "xfail: ", "skip:", "works: fine"])
def test_fsdp2_field_is_validated(value: str) -> None:
    expected = r"fsdp2=.*Expected 'works', 'refuses', 'partial', 'xfail: <reason>' or 'skip: <reason>'"
    with pytest.raises(ValueError, match=expected):
        Setting(SETTINGS[0].cls, fsdp2=value)


def test_fsdp2_matrix_runs_each_class_and_model_once() -> None:
    """Variants that train the same class and arguments on the same sharded model are run once, under the first."""
    runs = [(s.cls, repr(sorted(s.kwargs.items())), s.sharded_model) for s in SETTINGS if _fsdp2_runs(s)]
    assert len(runs) == len(set(runs))
    assert all(s.fsdp2_mode in ("works", "refuses", "partial", "xfail", "skip") for s in SETTINGS)


def _failures(report: dict[str, Any]) -> str:
    failed = [r for r in report["ranks"] if not r["ok"]]
    return "\n".join(f"rank {r.get('rank', '?')}: {r['error']}\n{r.get('traceback') or ''}" for r in failed)


@pytest.mark.distributed
@pytest.mark.parametrize("setting", params([s for s in SETTINGS if s.ddp]))
def test_ddp_two_processes(setting: Setting, shared_launch: SharedLaunch) -> None:
    """A 2-process DDP fit (gloo on CPU) runs the callback on both ranks and ends with identical weights."""
    report = shared_launch.result("ddp", setting)
    assert all(r["ok"] for r in report["ranks"]), _failures(report)
    for rank in report["ranks"]:
        assert rank["world_size"] == 2
        assert rank["global_step"] == 3
        assert len(rank["losses"]) == 3 and all(math.isfinite(x) for x in rank["losses"])
    assert report["ranks_agree"], f"parameters differ between ranks after DDP training: {report['checksums']}"
    if setting.cls is TensorRTExportCallback:  # rank zero alone exports: one artifact set, not one per rank
        files = ["model/model.export.json", "model/model.onnx", "model/model.onnx.data"]
        assert visible_files(shared_launch.root("ddp", setting) / "export") == files


def _fsdp2_params() -> list[Any]:
    out = []
    for s in SETTINGS:
        marks = device_marks(s)
        if s.fsdp2_mode == "xfail":
            marks = (*marks, pytest.mark.xfail(strict=True, reason=f"under FSDP2: {s.fsdp2_reason}"))
        out.append(pytest.param(s, marks=marks, id=s.id))
    return out


STRATEGY_NAME = "ModelParallelStrategy"


@pytest.mark.distributed
@pytest.mark.parametrize("setting", _fsdp2_params())
def test_fsdp2_two_processes(setting: Setting, shared_launch: SharedLaunch) -> None:
    """Under ``ModelParallelStrategy`` (FSDP2 per block in ``configure_model``, 2 processes), the callback trains
    with the plain FSDP2 run's losses (in the terms of its ``numerics``) without a warning, or refuses at setup with
    a message naming the strategy."""
    if setting.is_strategy:
        pytest.skip(f"{setting.id} is a strategy: it takes the place of {STRATEGY_NAME}")
    if setting.fsdp2_mode == "skip":
        pytest.skip(setting.fsdp2_reason)
    duplicate = fsdp2_duplicate_of(setting)
    if duplicate is not None:
        pytest.skip(f"the same class and arguments on the same sharded model as {duplicate.id}")
    plain = shared_launch.result("fsdp2", None, setting.sharded_model)
    assert all(r["ok"] for r in plain["ranks"]), f"the plain FSDP2 run failed:\n{_failures(plain)}"
    report = shared_launch.result("fsdp2", setting)
    ranks = report["ranks"]
    said = [r["error"] for r in ranks if r["error"]] + [
        w["message"] for r in ranks for w in r.get("warnings", ()) if w["lightning_perf"]
    ]
    if setting.fsdp2_mode == "refuses":
        assert any(STRATEGY_NAME in message for message in said), (
            f"{setting.id} is registered as refusing FSDP2 but said nothing naming {STRATEGY_NAME}: {said}"
        )
        if not all(r["ok"] for r in ranks):
            return  # refused with an error at setup
    elif setting.fsdp2_mode == "partial":
        assert all(r["ok"] for r in ranks), _failures(report)
        assert len(said) == 1 and STRATEGY_NAME in said[0], f"{setting.id} must say once what it leaves: {said}"
    else:
        assert all(r["ok"] for r in ranks), _failures(report)
        assert not said, f"{setting.id} warned under FSDP2: {said}"
    for rank, reference in zip(ranks, plain["ranks"]):
        assert rank["strategy"] == STRATEGY_NAME
        assert rank["global_step"] == 3 and len(rank["losses"]) == len(reference["losses"]) == 3
        for step, (loss, expected) in enumerate(zip(rank["losses"], reference["losses"])):
            problem = loss_mismatch(setting, loss, expected)
            assert problem is None, f"{setting.id} under FSDP2, rank {rank['rank']}, step {step}: {problem}"


# ------------------------------------------------------------------------------------------------- the device switch


@pytest.mark.parametrize(
    ("option", "env", "cuda", "expected"),
    [
        (None, None, False, "cpu"),
        (None, "", True, "cpu"),
        ("cpu", "cuda", True, "cpu"),  # the option wins over the variable
        (None, "CUDA", True, "cuda"),
        ("cuda", None, True, "cuda"),
    ],
)
def test_device_switch_resolves(option: str | None, env: str | None, cuda: bool, expected: str) -> None:
    assert _device.resolve(option, env, cuda) == expected


@pytest.mark.parametrize(
    ("option", "env", "match"),
    [
        ("cuda", None, r"--device=cuda .* no CUDA device"),
        (None, "cuda", r"LIGHTNING_PERF_TEST_DEVICE=cuda .* no CUDA device"),
        (None, "tpu", r"LIGHTNING_PERF_TEST_DEVICE='tpu' is not a test device. Expected one of \('cpu', 'cuda'\)"),
    ],
)
def test_device_switch_refuses(option: str | None, env: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _device.resolve(option, env, cuda_available=False)


def test_device_switch_selects_the_accelerator(tmp_path: Path) -> None:
    """The trainers of the generic tests take their accelerator from the switch (CPU here: a CPU-only check)."""
    setting = SETTINGS[0]
    assert _device.device() == ("cuda" if _device.on_cuda() else "cpu")
    expected = "CUDAAccelerator" if _device.on_cuda() else "CPUAccelerator"
    assert type(_trainer(setting, tmp_path).accelerator).__name__ == expected
    saved = _device.device()
    try:
        _device.select("cuda")
        assert _device.accelerator() == "gpu"
        _device.select("cpu")
        assert _device.accelerator() == "cpu"
        with pytest.raises(ValueError, match=r"select\(device='xpu'\)"):
            _device.select("xpu")
    finally:
        _device.select(saved)


class _Config:
    """What ``pytest_configure`` reads of a ``pytest.Config``: the ``--device`` option."""

    def __init__(self, device: str | None) -> None:
        self.device = device

    def getoption(self, name: str, default: Any = None) -> Any:
        return self.device if name == "device" else default


@pytest.mark.parametrize(("option", "env"), [("cuda", None), (None, "cuda")])
def test_device_cuda_without_cuda_is_a_usage_error(
    option: str | None, env: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pytest --device cuda`` (or the variable) on a machine without CUDA stops the session with a usage error."""
    from tests import conftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if env is None:
        monkeypatch.delenv(_device.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(_device.ENV_VAR, env)
    saved = _device.device()
    try:
        with pytest.raises(pytest.UsageError, match="asks for the registry's tests on CUDA, but torch sees no CUDA"):
            conftest.pytest_configure(_Config(option))  # type: ignore[arg-type]
        assert _device.device() == saved  # nothing selected
        monkeypatch.delenv(_device.ENV_VAR, raising=False)
        conftest.pytest_configure(_Config("cpu"))  # type: ignore[arg-type]
        assert _device.device() == "cpu"
    finally:
        _device.select(saved)
