"""The auto-tuner: its decisions (on scripted measurements), its outputs, and real trials on a user's own model."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import lightning_perf.tuning.remeasure as remeasure
from lightning_perf.benchmark.sources import (
    ImportSource,
    ObjectSource,
    apply_data_settings,
    batch_size_holder,
    rebuild_loader,
)
from lightning_perf.demos import make_workload
from lightning_perf.tuning.tuner import AutoTuner, Candidate, ModelError, TuningError
from lightning_perf.tuning.verdicts import compare, loss_deviation
from tests.tuning._scripted import quiet_machine, script_trials, scripted_result
from tests.tuning._user_models import PlainDataModule, SmallConvNet


def _tune(*optimizations: str, **kwargs: Any) -> AutoTuner:
    """A tuner of the small conv net that tries ``optimizations`` only (no precision, data or batch-size stage)."""
    options = {"precisions": [], "tune_data_loading": False, "tune_batch_size": False, "progress": False, **kwargs}
    return AutoTuner(SmallConvNet(), PlainDataModule(), optimizations=list(optimizations), **options)


# --------------------------------------------------------------------------- statistics


def test_compare_separates_a_real_gain_from_noise() -> None:
    incumbent = [0.100, 0.104, 0.098, 0.101, 0.099, 0.103, 0.097, 0.102]
    faster = [t * 0.8 for t in incumbent]
    gain, p = compare(faster, incumbent)
    assert gain == pytest.approx(1.25) and p == 1.0
    # The same distribution shifted by less than its own spread: a median gain, but no confidence.
    noisy = [t * 0.98 for t in reversed(incumbent)]
    gain, p = compare(noisy, incumbent)
    assert gain > 1.0 and p < 0.75
    gain, p = compare(incumbent, incumbent)
    assert gain == 1.0 and p == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least one step time"):
        compare([], incumbent)


def test_loss_deviation() -> None:
    assert loss_deviation([1.0, 0.9, 0.8], [1.0, 0.9, 0.8]) == 0.0
    assert loss_deviation([1.1, 0.99, 0.88], [1.0, 0.9, 0.8]) == pytest.approx(0.1)
    assert loss_deviation([1.0, math.nan], [1.0, 0.9]) == math.inf
    assert loss_deviation([], [1.0]) == math.inf


# ------------------------------------------------------ construction errors (the others: test_autotuner_inputs.py)


def test_objects_that_cannot_be_copied_are_refused_with_the_reason() -> None:
    model = SmallConvNet()
    model.hook = lambda: None  # a lambda does not pickle
    with pytest.raises(ValueError, match=r"pickling them failed.*lightning-perf autotune --model"):
        AutoTuner(model, PlainDataModule())


# --------------------------------------------------------------------------- the search, on scripted measurements


def test_keeps_only_measurable_safe_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _, data = make_workload("convnet", "tiny")
    own = data.batch_size
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, own, wall=10),
            # Faster, but its losses drift 20% from the baseline's on the same batches: not safe.
            "+bf16-mixed": scripted_result(0.070, own, losses=[2.4 - 0.06 * i for i in range(13)]),
            "+channels_last": scripted_result(0.080, own, wall=50),
            # 1.3% faster at the median, well inside its own spread: noise, not a win.
            "+fused_optimizer": scripted_result(0.079, own, spread=0.2),
            "batch_size=" + str(own * 2): scripted_result(0.140, own * 2),
        },
    )
    options = {"precisions": ["bf16-mixed"], "optimizations": ["channels_last", "fused_optimizer", "compile"]}
    # confirm_below=1.0: single-pair wins (confirmation has its own test)
    tuner = AutoTuner(workload="convnet", preset="tiny", time_budget_s=200, max_batch_size=own * 2, confirm_below=1.0,
                      progress=False, **options)  # fmt: skip
    monkeypatch.setattr("lightning_perf._device.supports_bf16", lambda device=None: True)
    result = tuner.run()
    verdicts = {t.label: (t.verdict, t.reason) for t in result.trials}

    assert ran == [
        "baseline",
        "baseline (repeat)",
        "+bf16-mixed",
        "+channels_last",
        "+fused_optimizer",
        f"batch_size={own * 2}",
    ]
    assert verdicts["baseline"][0] == "baseline"
    assert verdicts["+bf16-mixed"][0] == "rejected" and "losses differ" in verdicts["+bf16-mixed"][1]
    assert verdicts["+channels_last"][0] == "kept"
    assert verdicts["+fused_optimizer"][0] == "rejected" and "not measurably faster" in verdicts["+fused_optimizer"][1]
    # compile is estimated at 4x the last trial (50 s): 200 s does not fit the 126 s left.
    assert verdicts["+compile"][0] == "skipped" and "out of budget" in verdicts["+compile"][1]
    assert verdicts["num_workers"][0] == "skipped" and "data wait is 0.0%" in verdicts["num_workers"][1]
    assert verdicts[f"batch_size={own * 2}"][0] == "kept"

    rec = result.recommendation
    assert rec.configs == ("channels_last",)
    assert rec.batch_size == own * 2 and rec.datamodule_kwargs == {"batch_size": own * 2}
    assert rec.speedup == pytest.approx((2 * own / 0.140) / (own / 0.100), rel=0.02)
    assert any("learning rate" in note for note in rec.notes)
    from lightning_perf.callbacks import ChannelsLastCallback

    assert [type(cb) for cb in rec.callbacks()] == [ChannelsLastCallback]
    assert result.bench_command is not None and "--configs baseline,channels_last" in result.bench_command
    # Ranked fastest first (the unsafe bf16 run too, with its verdict); every trial, measured or not, is in the table.
    assert [t.label for t in result.ranked()][:2] == ["+bf16-mixed", f"batch_size={own * 2}"]
    assert len(result.table_rows()) == len(result.trials) == 8


def test_recommendation_loads_in_lightning_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_perf.callbacks import ChannelsLastCallback
    from lightning_perf.demos import WORKLOADS

    _, data = make_workload("convnet", "tiny")
    own = data.batch_size
    script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, own),
            "+channels_last": scripted_result(0.080, own),
            f"batch_size={own * 2}": scripted_result(0.140, own * 2),
        },
    )
    # confirm_below=1.0: single-pair wins (confirmation has its own test)
    options = {"tune_data_loading": False, "max_batch_size": own * 2, "confirm_below": 1.0, "progress": False}
    result = AutoTuner(
        workload="convnet", preset="tiny", precisions=[], optimizations=["channels_last"], **options
    ).run()
    paths = result.write(tmp_path / "tuned.yaml", tmp_path / "tuned.json")
    assert [p.name for p in paths] == ["tuned.yaml", "tuned.json"]
    text = (tmp_path / "tuned.yaml").read_text()
    assert text.startswith("# lightning-perf autotune recommendation")
    config = yaml.safe_load(text)
    assert config["trainer"]["callbacks"] == [
        {"class_path": "lightning_perf.callbacks.ChannelsLastCallback", "init_args": {}}
    ]
    assert config["data"] == {"batch_size": own * 2}
    report = json.loads((tmp_path / "tuned.json").read_text())
    assert report["kind"] == "lightning-perf-autotune" and len(report["trials"]) == 4
    assert report["recommendation"]["datamodule_kwargs"] == {"batch_size": own * 2}

    workload = WORKLOADS["convnet"]
    args = ["--config", str(tmp_path / "tuned.yaml"), "--model.preset=tiny", "--data.preset=tiny"]
    args.append("--trainer.logger=false")
    cli = LightningCLI(workload.module_cls, workload.datamodule_cls, run=False, args=args, save_config_callback=None)
    assert any(isinstance(cb, ChannelsLastCallback) for cb in cli.trainer.callbacks)
    assert cli.datamodule.batch_size == own * 2


def test_precision_alternatives_compete(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two mixed precisions both beat fp32: the faster one is kept, the other rejected as beaten."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("lightning_perf._device.supports_bf16", lambda device=None: True)
    script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "+bf16-mixed": scripted_result(0.060, 8),
            "+16-mixed": scripted_result(0.050, 8),
        },
    )
    tuner = _tune(precisions=None, device="cuda")
    result = tuner.run()
    verdicts = {t.label: t.verdict for t in result.trials}
    expected = {"baseline": "baseline", "baseline (repeat)": "baseline", "+bf16-mixed": "rejected", "+16-mixed": "kept"}
    assert verdicts == expected
    assert result.recommendation.trainer_kwargs == {"precision": "16-mixed"}


def test_data_loading_tried_when_the_step_waits_for_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8, data_wait=0.4),
            "num_workers=1": scripted_result(0.070, 8, data_wait=0.1),
            "num_workers=2": scripted_result(0.069, 8, data_wait=0.05),  # within noise of 1 worker: not kept
        },
    )
    result = _tune(tune_data_loading=True, confirm_below=1.0).run()
    assert ran == ["baseline", "baseline (repeat)", "num_workers=1", "num_workers=2"]
    assert result.trials[0].data_wait_share == pytest.approx(0.4, rel=0.05)
    assert result.recommendation.loader == {"num_workers": 1, "persistent_workers": True}
    # PlainDataModule does not take num_workers in __init__: not in the YAML, said in a note instead.
    assert "data" not in result.lightning_cli_config()
    assert any("does not take num_workers, persistent_workers" in n for n in result.recommendation.notes)


def test_a_failing_model_stops_the_tuner_with_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    error = "ValueError: the user's own bug in training_step"
    ran = script_trials(monkeypatch, {"baseline": scripted_result(0.1, 8, ok=False, error=error)})
    with pytest.raises(ModelError, match="This is the model's own error") as info:
        AutoTuner(SmallConvNet(), PlainDataModule(), progress=False).run()
    assert error in str(info.value) and "Traceback" in str(info.value)
    assert ran == ["baseline"]


def test_budget_too_small_for_two_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    script_trials(monkeypatch, {"baseline": scripted_result(0.1, 8, wall=50)})
    with pytest.raises(TuningError, match=r"time_budget_s=60 is too small.*takes 50 s.*time_budget_s >= 100"):
        AutoTuner(SmallConvNet(), PlainDataModule(), time_budget_s=60, progress=False).run()
    script_trials(monkeypatch, {"baseline": None})  # the baseline did not even finish within the budget
    with pytest.raises(TuningError, match=r"time_budget_s=5 is too small: the baseline trial"):
        AutoTuner(SmallConvNet(), PlainDataModule(), time_budget_s=5, progress=False).run()


# --------------------------------------------------------------------------- data settings on a user's data module


def test_batch_size_holder_follows_lightning_conventions() -> None:
    assert batch_size_holder(SmallConvNet(), PlainDataModule(batch_size=5)) == ("datamodule", 5)

    class NoBatch(PlainDataModule):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    class WithHparams(SmallConvNet):
        def __init__(self, batch_size: int = 12) -> None:
            super().__init__()
            self.save_hyperparameters()

    assert batch_size_holder(WithHparams(), NoBatch()) == ("hparams", 12)
    assert batch_size_holder(SmallConvNet(), NoBatch()) is None


def test_loader_settings_reach_a_data_module_without_attributes() -> None:
    model, data = SmallConvNet(), PlainDataModule(batch_size=4)
    apply_data_settings(model, data, 16, {"num_workers": 2, "persistent_workers": True})
    loader = data.train_dataloader()
    assert data.batch_size == 16 and loader.batch_size == 16
    assert loader.num_workers == 2 and loader.persistent_workers and loader.drop_last
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    # Back to zero workers: persistence must go too, or DataLoader refuses the combination.
    assert rebuild_loader(loader, num_workers=0).persistent_workers is False
    with pytest.raises(TypeError, match="returned a list"):
        rebuild_loader([1, 2])  # type: ignore[arg-type]


def test_import_source_names_the_bad_path() -> None:
    with pytest.raises(ValueError, match=r"model='tests.tuning._user_models:Nope'.*has no attribute 'Nope'"):
        ImportSource("tests.tuning._user_models:Nope", "tests.tuning._user_models:PlainDataModule").load()
    with pytest.raises(ValueError, match=r"datamodule='no_such_pkg.mod:X': cannot import module"):
        ImportSource("tests.tuning._user_models:SmallConvNet", "no_such_pkg.mod:X").load()
    with pytest.raises(ValueError, match="is not an import path"):
        ImportSource("SmallConvNet", "x:Y").load()


# --------------------------------------------------------------------------- real trials


@pytest.fixture
def real_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real trials on a machine taken as quiet (the watcher's verdict on this machine's load is tested on its own)."""
    quiet_machine(monkeypatch)
    # Two real 3-step baselines of a tiny model can land 1.5x apart on a busy machine, which ends the search by design
    # (tests/tuning/test_honest_tuner.py tests that rule); here the path through every trial is what is checked.
    monkeypatch.setattr(remeasure, "baseline_spread_cause", lambda first_s, second_s: None)


@pytest.mark.usefixtures("real_trials")
def test_real_trials_in_process_leave_the_users_objects_alone() -> None:
    model, data = SmallConvNet(), PlainDataModule(batch_size=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"max_batch_size": 16, "steps": 4, "warmup_steps": 1, "isolation": "in-process", "time_budget_s": 300}
    result = AutoTuner(model, data, precisions=[], optimizations=["channels_last"], progress=False, **options).run()
    labels = [t.label for t in result.trials]
    assert labels[:3] == ["baseline", "baseline (repeat)", "+channels_last"] and "batch_size=16" in labels
    baseline = result.trials[0]
    assert baseline.verdict == "baseline" and baseline.step_median_s and baseline.throughput
    assert baseline.wall_s and baseline.wall_s > 0
    assert all(t.verdict in ("baseline", "kept", "rejected", "skipped", "confirm") for t in result.trials), (
        result.table_rows()
    )
    # The user's objects: same weights, same batch size, never attached to a Trainer.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert data.batch_size == 8 and model._trainer is None
    assert model.net[0].weight.is_contiguous()  # channels-last was tried on a copy


def test_real_failure_in_a_spawned_trial_reports_the_models_traceback() -> None:
    tuner = AutoTuner(SmallConvNet(fail_at_step=1), PlainDataModule(), isolation="process", progress=False)
    with pytest.raises(ModelError) as info:
        tuner.run()
    message = str(info.value)
    assert "ValueError: the user's own bug in training_step" in message
    assert "_user_models.py" in message  # the traceback points into the user's code
    assert len(tuner._trials) == 1


@pytest.mark.usefixtures("real_trials")
def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_perf.cli import main

    output = tmp_path / "tuned.yaml"
    args = "--model tests.tuning._user_models:SmallConvNet --datamodule tests.tuning._user_models:PlainDataModule"
    options = (
        "--optimizations channels_last --no-batch-size --no-data-loading --steps 3 --warmup-steps 1 --time-budget 300"
    )
    code = main(["autotune", *args.split(), "--datamodule-args", '{"batch_size": 8}', "--precisions", "",
                 *options.split(), "--output", str(output)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Recommended" in out and f"wrote {output}" in out
    report = json.loads(output.with_suffix(".json").read_text())
    labels = [t["label"] for t in report["trials"]]
    assert labels[:3] == ["baseline", "baseline (repeat)", "+channels_last"]
    assert set(labels[3:]) <= {"baseline (again)", "+channels_last (again)"}  # a small win is measured again
    assert report["trials"][0]["step_median_s"] > 0
    assert yaml.safe_load(output.read_text())["trainer"] is not None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "tests.tuning._user_models:SmallConvNet"],
            "argument --model: 'tests.tuning._user_models:SmallConvNet' is not valid. Expected --datamodule",
        ),
        (["--model", "nope.mod:X", "--datamodule", "nope.mod:Y"], "cannot import module 'nope.mod'"),
        (
            ["--workload", "convnet", "--time-budget", "-1"],
            "argument --time-budget: '-1' is not valid. Expected a number of seconds > 0",
        ),
        (
            ["--workload", "convnet", "--model-args", "[1]"],
            "argument --model-args: '[1]' is not valid. Expected a JSON object",
        ),
    ],
)
def test_cli_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_perf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["autotune", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_source_pickles_without_the_objects_being_touched() -> None:
    model, data = SmallConvNet(), PlainDataModule()
    source = ObjectSource.from_objects(model, data)
    copy_model, copy_data = pickle.loads(pickle.dumps(source)).load()
    assert copy_model is not model and copy_data is not data
    assert torch.equal(copy_model.net[0].weight, model.net[0].weight)


def test_cuda_graphs_replace_plain_compile_instead_of_stacking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "+compile": scripted_result(0.070, 8),
            "compile_reduce_overhead instead of compile": scripted_result(0.050, 8),
        },
    )
    result = _tune("compile", "compile_reduce_overhead", device="cuda", confirm_below=1.0).run()
    assert ran == ["baseline", "baseline (repeat)", "+compile", "compile_reduce_overhead instead of compile"]
    rec = result.recommendation
    assert rec.configs == ("compile_reduce_overhead",)
    assert rec.callback_specs == [("lightning_perf.callbacks.CompileCallback", {"mode": "reduce-overhead"})]
    # On a CPU the CUDA-graphs variant is skipped and says why.
    monkeypatch.undo()
    script_trials(monkeypatch, {"baseline": scripted_result(0.100, 8), "+compile": scripted_result(0.070, 8)})
    result = _tune("compile", "compile_reduce_overhead").run()
    skipped = result.trials[-1]
    assert skipped.verdict == "skipped" and skipped.reason == "needs a CUDA device"


def test_the_noise_between_two_baseline_runs_raises_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two baseline processes 20% apart: a 1.2x candidate is within that noise, a 1.5x one is not."""
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "baseline (repeat)": scripted_result(0.120, 8),
            "+channels_last": scripted_result(0.092, 8),  # 1.2x the pooled baseline's median: within the noise
            "baseline (again)": scripted_result(0.100, 8),
            "+channels_last (again)": scripted_result(0.101, 8),  # ... and measured again, no faster
            "+fused_optimizer": scripted_result(0.070, 8),
        },
    )
    result = _tune("channels_last", "fused_optimizer").run()
    assert ran[:2] == ["baseline", "baseline (repeat)"]
    verdicts = {t.label: (t.verdict, t.reason) for t in result.trials}
    assert (
        "differ by 20.0%" in verdicts["baseline (repeat)"][1] and "1.31x to count" in verdicts["baseline (repeat)"][1]
    )
    assert verdicts["+channels_last"][0] == "rejected"
    assert "not confirmed: 1.19x per sample" in verdicts["+channels_last"][1]
    assert "then 0.99x" in verdicts["+channels_last"][1]
    assert verdicts["baseline (again)"][0] == verdicts["+channels_last (again)"][0] == "confirm"
    assert ran[2:5] == ["+channels_last", "baseline (again)", "+channels_last (again)"]
    assert verdicts["+fused_optimizer"][0] == "kept"
    # Ratios are against both baseline runs pooled, not against the luckier one.
    fused = next(t for t in result.trials if t.label == "+fused_optimizer")
    assert 1.4 < fused.speedup < 1.72
    # Without the check the bar is min_gain alone.
    monkeypatch.undo()
    ran = script_trials(
        monkeypatch, {"baseline": scripted_result(0.100, 8), "+channels_last": scripted_result(0.092, 8)}
    )
    result = _tune("channels_last", noise_check=False, confirm_below=1.0).run()
    assert ran == ["baseline", "+channels_last"] and result.trials[-1].verdict == "kept"


def test_a_trial_past_the_budget_is_stopped_not_left_running(tmp_path: Path) -> None:
    import multiprocessing
    import time

    tuner = AutoTuner(SmallConvNet(), PlainDataModule(), progress=False)
    tuner._tmp, tuner._source_path = tmp_path, tmp_path / "source.pkl"
    tuner._source_path.write_bytes(pickle.dumps(tuner.source))
    from dataclasses import replace

    spec = replace(tuner._spec(Candidate("baseline", "baseline")), steps=100_000)  # far more than a second
    start = time.monotonic()
    assert tuner._measure_in_subprocess(spec, timeout=1.0) is None
    assert time.monotonic() - start < 15
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("lightning-perf-autotune")]


def test_a_small_win_measured_again_and_confirmed_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "baseline (repeat)": scripted_result(0.104, 8),  # 4% apart: the noise bar is 1.06x
            "+compile": scripted_result(0.085, 8),  # 1.2x: clear of the bar, below confirm_below (1.5x)
            "baseline (again)": scripted_result(0.110, 8),
            "+compile (again)": scripted_result(0.090, 8),  # wins again: 1.22x
        },
    )
    result = _tune("compile").run()
    assert ran == ["baseline", "baseline (repeat)", "+compile", "baseline (again)", "+compile (again)"]
    kept = next(t for t in result.trials if t.label == "+compile")
    assert kept.verdict == "kept" and "confirmed by a second pair of runs" in kept.reason
    assert kept.gain_verdict == "faster" and kept.gain_ci95[0] > 1.0
    assert result.recommendation.configs == ("compile",)


def test_a_confirmed_win_inside_the_noise_bar_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported case: a noise bar of 1.31x stated, then a 1.2x candidate 'confirmed' by a second pair: rejected."""
    script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "baseline (repeat)": scripted_result(0.120, 8),  # 20% apart: the bar is 1.31x
            "+compile": scripted_result(0.092, 8),  # 1.2x: plausible, below the bar
            "baseline (again)": scripted_result(0.110, 8),
            "+compile (again)": scripted_result(0.090, 8),  # wins again, by 1.22x: still inside the bar
        },
    )
    result = _tune("compile").run()
    trial = next(t for t in result.trials if t.label == "+compile")
    assert trial.verdict == "rejected" and "not confirmed" in trial.reason and "needs >= 1.31x" in trial.reason
    assert result.recommendation.configs == () and result.recommendation.speedup is None
    assert "no change" in result.recommendation.headline


def test_no_budget_to_confirm_a_small_win_rejects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8, wall=30),
            "baseline (repeat)": scripted_result(0.120, 8, wall=30),
            "+compile": scripted_result(0.092, 8, wall=20),
        },
    )
    # 100 s: 60 for the two baselines, 20 for compile; confirming needs another baseline run (30 s) and more.
    monkeypatch.setattr(AutoTuner, "_estimate", lambda self, candidate, against: 10.0)
    result = _tune("compile", time_budget_s=100).run()
    compile_trial = next(t for t in result.trials if t.label == "+compile")
    assert compile_trial.verdict == "rejected" and "no budget left to measure it again" in compile_trial.reason


def test_a_win_below_confirm_below_needs_a_second_pair_of_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clear of the noise bar but below 1.5x: a lucky first process (a fluke) is caught by the second pair."""
    ran = script_trials(
        monkeypatch,
        {
            "baseline": scripted_result(0.100, 8),
            "+fused_optimizer": scripted_result(0.075, 8),  # 1.33x in its first process...
            "+fused_optimizer (again)": scripted_result(0.099, 8),  # ... and nothing when measured again
            "+compile": scripted_result(0.060, 8),  # 1.67x: no second pair needed
        },
    )
    result = _tune("fused_optimizer", "compile").run()
    assert ran == [
        "baseline",
        "baseline (repeat)",
        "+fused_optimizer",
        "baseline (again)",
        "+fused_optimizer (again)",
        "+compile",
    ]
    fused = next(t for t in result.trials if t.label == "+fused_optimizer")
    assert fused.verdict == "rejected" and "then 1.01x" in fused.reason
    assert result.recommendation.configs == ("compile",)
    with pytest.raises(ValueError, match=r"confirm_below=0.9\)` is not valid"):
        AutoTuner(SmallConvNet(), PlainDataModule(), confirm_below=0.9)
