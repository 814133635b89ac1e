"""CompileCallback: what runs compiled, in which stage, what is reported, and how failures fall back.

Mechanism tests use a counting backend (dynamo's graph capture, guards and counters without inductor); the ``slow``
test runs the real inductor backend on a tiny model, the ``gpu`` test CUDA graphs.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import DummyLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_perf import FallbackWarning, NoEffectWarning
from lightning_perf.callbacks.compile import CompileCallback
from lightning_perf.demos import make_workload
from tests._compiling import CountingBackend, Tower, failing_backend
from tests._models import trainer


@pytest.fixture(autouse=True)
def _fresh_compiler_caches():
    """Torch caches compiled code per code object for the whole process; each test starts from empty caches."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_modules(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if m._compiled_call_impl is not None]


class TinyModule(pl.LightningModule):
    """A LightningModule whose steps call ``self(x)``; records what ran compiled in predict."""

    def __init__(self, depth: int = 3, bug_at_step: int | None = None) -> None:
        super().__init__()
        self.net = Tower(depth)
        self.bug_at_step = bug_at_step
        self.compiled_in_predict: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bug_at_step is not None and self.trainer.global_step >= self.bug_at_step:
            raise ValueError("a real bug in the model")
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.compiled_in_predict.append(compiled_modules(self))
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return _loader()

    def val_dataloader(self) -> DataLoader:
        return _loader()

    def predict_dataloader(self) -> DataLoader:
        return _loader()


class NoForwardModule(TinyModule):
    """Its steps call ``self.net(x)``: compiling the LightningModule's own forward would do nothing."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 2, (32,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _trainer(root: Path, *callbacks: pl.Callback, **overrides: Any) -> pl.Trainer:
    defaults = {"max_steps": 6, "limit_val_batches": 0, "limit_predict_batches": 2}
    return trainer(root, callbacks=list(callbacks), **{**defaults, **overrides})


# ---------------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # (test_bad_inputs.py names every argument's bad values; these rows check the kind and the explanation)
        ({"mode": "turbo"}, ValueError, r"CompileCallback\(mode='turbo'\).*max-autotune"),
        ({"fullgraph": 1}, TypeError, r"CompileCallback\(fullgraph=1\).*True or False"),
        ({"backend": "nope"}, ValueError, r"CompileCallback\(backend='nope'\).*registered"),
        ({"mode": "max-autotune", "options": {"max_autotune": True}}, ValueError, r"a mode or options, not both"),
        (
            {"options": {"epilogue_fusin": False}},
            ValueError,
            r"'epilogue_fusin'.*Nearest valid ones: 'epilogue_fusion'",
        ),
        ({"regions": []}, ValueError, r"CompileCallback\(regions=\[\]\)"),
        ({"regions": "all"}, ValueError, r"CompileCallback\(regions='all'\)` is not valid: 'all' is not a class name"),
        ({"regions": [3]}, TypeError, r"CompileCallback\(regions=\[3\]\)`: item 3 is not an nn.Module class or class"),
        ({"regions": ["torch.nn.NotALayer"]}, ValueError, r"Cannot import the module class 'torch.nn.NotALayer'"),
        ({"stages": ["fit", "train"]}, ValueError, r"'train' is not one of them.*'fit', 'validate', 'test', 'predict'"),
        ({"stages": []}, ValueError, r"stages=\[\]\)` is not valid. Expected a non-empty list"),
        ({"warmup_steps": 0}, ValueError, r"CompileCallback\(warmup_steps=0\).*>= 1"),
        ({"cache": 3}, TypeError, r"CompileCallback\(cache=3\)` is not valid. Expected None or a file or folder"),
        ({"inductor_cache_dir": ""}, TypeError, r"CompileCallback\(inductor_cache_dir=''\)` is not valid.*folder"),
        ({"trust_cache": "yes"}, TypeError, r"CompileCallback\(trust_cache='yes'\)` is not valid. Expected True"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        CompileCallback(**kwargs)


def test_valid_arguments_are_kept() -> None:
    callback = CompileCallback(
        "max-autotune-no-cudagraphs", regions=["torch.nn.Linear", "Block"], stages="predict", dynamic=False
    )
    assert callback.mode == "max-autotune-no-cudagraphs"
    assert callback.regions == (nn.Linear, "Block")
    assert callback.stages == ("predict",)
    assert CompileCallback().stages == ("fit", "validate", "test", "predict")


# ---------------------------------------------------------------------------------------------------------- fitting


def test_fit_runs_the_forward_compiled_and_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend, model, logger = CountingBackend(), TinyModule(), RecordingLogger()
    keys = list(model.state_dict())
    callback = CompileCallback(backend=backend, warmup_steps=2)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, callback, logger=logger).fit(model)
    assert "CompileCallback: compiled the LightningModule's forward with backend='counting'" in caplog.text
    assert "steady state: median" in caplog.text  # printed and logged
    for key in ("compile_time_s", "recompiles", "unique_graphs", "graph_breaks", "warmup_time_s"):
        assert f"compile/{key}" in logger.metrics
    assert logger.metrics["compile/steady_step_time_s"] > 0

    assert backend.graphs, "the compiled forward never ran"
    report = callback.report
    assert report["compiled"] == [""]
    assert report["unique_graphs"] == len(backend.graphs) >= 1
    assert report["compilations"] >= 1 and report["recompiles"] == 0 and report["graph_breaks"] == 0
    assert report["compile_time_s"] > 0
    assert report["warmup_steps"] == 2 and report["steady_steps"] == 4
    assert report["warmup_time_s"] > 0 and report["steady_step_time_s"] > 0
    assert report["fallbacks"] == {}
    assert list(model.state_dict()) == keys  # no `_orig_mod.` prefix
    assert compiled_modules(model) == []  # plain again after fit

    # A second fit compiles nothing new: torch kept the code, the callback only re-installs it.
    _trainer(tmp_path, callback).fit(model)
    assert callback.report["unique_graphs"] == 0 and callback.report["compiled"] == [""]
    graphs = len(backend.graphs)
    _trainer(tmp_path).fit(model)  # a later Trainer without the callback sees a plain model
    assert len(backend.graphs) == graphs


def test_step_that_bypasses_forward_compiles_the_sub_modules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend, model = CountingBackend(), NoForwardModule()
    callback = CompileCallback(backend=backend)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, callback).fit(model)
    assert "NoForwardModule.training_step does not call the module's forward" in caplog.text
    assert callback.report["compiled"] == ["net"]
    assert backend.graphs and callback.report["steady_steps"] == 4


def test_auto_regions_compile_each_block_once(tmp_path: Path) -> None:
    backend, model = CountingBackend(), TinyModule(depth=4)
    callback = CompileCallback(backend=backend, regions="auto")
    _trainer(tmp_path, callback).fit(model)
    report = callback.report
    assert report["compiled"] == [f"net.layers.{i}" for i in range(4)]
    assert report["unique_graphs"] == 1 and report["recompiles"] == 0  # four blocks, one graph


@pytest.mark.parametrize(
    ("regions", "options", "expected"), [("auto", None, {"cpp_wrapper": True}), (None, None, None)]
)
def test_cpu_regions_compile_with_cpp_wrapper_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, regions: Any, options: Any, expected: Any
) -> None:
    from lightning_perf.functional.compile import startup as compile_startup

    monkeypatch.setattr(compile_startup, "_probe_started", True)  # no real ISA probe thread here
    seen: list[Any] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["options"])
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    callback = CompileCallback(regions=regions, options=options)
    _trainer(tmp_path, callback, max_steps=1).fit(TinyModule(depth=2))
    assert seen and all(option == expected for option in seen)
    assert callback._compile_kwargs["options"] == options  # what the user gave is kept for the next entry point


def test_a_workload_block_class_given_by_path(tmp_path: Path) -> None:
    backend = CountingBackend()
    model, data = make_workload("lm", "tiny", seed=0)
    callback = CompileCallback(backend=backend, regions=["lightning_perf.demos.lm.LMBlock"])
    _trainer(tmp_path, callback, max_steps=3).fit(model, datamodule=data)
    assert callback.report["compiled"] and all(".blocks." in name for name in callback.report["compiled"])
    assert backend.graphs


def test_regions_matching_nothing_warn_and_train_eagerly(tmp_path: Path) -> None:
    backend, model = CountingBackend(), TinyModule()
    callback = CompileCallback(backend=backend, regions=[nn.Conv2d])
    with pytest.warns(NoEffectWarning, match=r"found nothing to compile in TinyModule"):
        _trainer(tmp_path, callback).fit(model)
    assert backend.graphs == [] and callback.report["compiled"] == []


# ----------------------------------------------------------------------------------------------------------- stages


def test_only_listed_stages_run_compiled(tmp_path: Path) -> None:
    backend, model = CountingBackend(), TinyModule()
    trainer = _trainer(tmp_path, CompileCallback(backend=backend, stages=["fit"]))
    trainer.fit(model)
    assert backend.graphs
    trainer.predict(model)
    assert model.compiled_in_predict == [[], []]  # predict ran eager

    backend, model = CountingBackend(), TinyModule()
    callback = CompileCallback(backend=backend, stages="predict")
    trainer = _trainer(tmp_path, callback)
    trainer.fit(model)
    assert backend.graphs == [] and callback.report == {}  # fit ran eager
    predictions = trainer.predict(model)
    assert model.compiled_in_predict == [[""], [""]]
    assert backend.graphs and compiled_modules(model) == []
    assert all(torch.isfinite(p).all() for p in predictions)


def test_validation_inside_fit_follows_fit(tmp_path: Path) -> None:
    backend, model = CountingBackend(), TinyModule()
    trainer = _trainer(tmp_path, CompileCallback(backend=backend, stages="validate"), limit_val_batches=2)
    trainer.fit(model)
    assert backend.graphs == []  # fit (with its validation loop) is not listed
    trainer.validate(model, verbose=False)
    assert backend.graphs  # trainer.validate is


class Wrapper(nn.Module):
    """What DDP does with the LightningModule: call it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def test_forward_redirection_compiles_the_forward_not_the_step() -> None:
    """Under DDP and FSDP, Lightning sends `training_step` through the LightningModule's `__call__`."""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    from lightning_perf.functional.compile.regions import compile_regions

    class SineStep(TinyModule):
        def sine_step(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(self(x))

    backend, model = CountingBackend(), SineStep()
    compiled = compile_regions(model, backend=backend)
    redirect, x = _ForwardRedirection(), torch.randn(4, 8)
    for _ in range(2):
        out = redirect(Wrapper(model), model, "sine_step", x)
    torch.testing.assert_close(out, torch.sin(model.net(x)))
    assert len(backend.graphs) == 1 and compiled.calls == 2  # the inner `self(x)`, compiled once
    assert not any(node.target is torch.sin for node in backend.graphs[0].graph.nodes), "the step was compiled"
    compiled.remove()


# --------------------------------------------------------------------------------------------------------- failures


def test_compiler_failure_falls_back_and_training_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyModule()
    callback = CompileCallback(backend=failing_backend)
    with pytest.warns(FallbackWarning, match=r"torch.compile failed for TinyModule.*simulated compiler crash"):
        trainer = _trainer(tmp_path, callback)
        trainer.fit(model)
    assert trainer.global_step == 6 and math.isfinite(float(trainer.callback_metrics["train_loss"]))
    assert "simulated compiler crash" in callback.report["fallbacks"]["TinyModule"]
    assert compiled_modules(model) == []


def test_strict_raises_the_compiler_failure_and_leaves_the_model_plain(tmp_path: Path) -> None:
    model = TinyModule()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="simulated compiler crash"):
        _trainer(tmp_path, CompileCallback(backend=failing_backend, strict=True)).fit(model)
    assert compiled_modules(model) == []


def test_a_bug_in_the_model_propagates_unchanged(tmp_path: Path) -> None:
    model = TinyModule(bug_at_step=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with pytest.raises(ValueError, match=r"^a real bug in the model$"):
            _trainer(tmp_path, CompileCallback(backend="eager")).fit(model)
    assert compiled_modules(model) == []


def test_reduce_overhead_without_cuda_warns_and_still_compiles(tmp_path: Path) -> None:
    backend, model = CountingBackend(), TinyModule()
    with pytest.warns(NoEffectWarning, match=r"reduce-overhead.*CUDA graphs.*on cpu"):
        _trainer(tmp_path, CompileCallback("reduce-overhead", backend=backend)).fit(model)
    assert backend.graphs and backend.kwargs[0] == {"mode": "reduce-overhead"}


# ----------------------------------------------------------------------------------------- checkpoints, loggers


def test_a_plain_checkpoint_resumes_with_the_callback(tmp_path: Path) -> None:
    plain = TinyModule()
    first = _trainer(tmp_path, max_steps=2)
    first.fit(plain)
    ckpt = tmp_path / "plain.ckpt"
    first.save_checkpoint(ckpt)

    backend, model = CountingBackend(), TinyModule()
    trainer = _trainer(tmp_path, CompileCallback(backend=backend), max_steps=4)
    trainer.fit(model, ckpt_path=ckpt)
    assert trainer.global_step == 4 and backend.graphs
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    state = torch.load(tmp_path / "compiled.ckpt", weights_only=True)["state_dict"]
    assert list(state) == list(plain.state_dict())


class RecordingLogger(DummyLogger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)


@pytest.mark.parametrize("compile_first", [True, False], ids=["compile-first", "channels-last-first"])
def test_stacks_with_channels_last_in_either_order(tmp_path: Path, compile_first: bool) -> None:
    from lightning_perf.callbacks import ChannelsLastCallback

    class LayoutDuringTraining(pl.Callback):
        def __init__(self) -> None:
            self.channels_last: list[bool] = []

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            conv = next(m for m in pl_module.modules() if isinstance(m, nn.Conv2d))
            self.channels_last.append(conv.weight.is_contiguous(memory_format=torch.channels_last))

    backend = CountingBackend()
    model, data = make_workload("convnet", "tiny", seed=0)
    callbacks = [CompileCallback(backend=backend, regions="auto"), ChannelsLastCallback()]
    layout = LayoutDuringTraining()
    trainer = _trainer(tmp_path, *(callbacks if compile_first else callbacks[::-1]), layout, max_steps=3)
    trainer.fit(model, datamodule=data)
    assert backend.graphs and callbacks[0].report["compiled"]
    # Channels-last weights while training, the original layout back after the fit (ChannelsLastCallback's teardown).
    assert layout.channels_last == [True, True, True]
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous() and not conv.weight.is_contiguous(memory_format=torch.channels_last)
    # The compiled blocks saw channels-last activations.
    placeholders = [n.meta.get("example_value") for n in backend.graphs[0].graph.nodes if n.op == "placeholder"]
    assert any(
        isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_contiguous(memory_format=torch.channels_last)
        for v in placeholders
    )


# ------------------------------------------------------------------------------------------------------ warm starts


def test_cache_is_saved_after_a_fit_and_loaded_before_the_next_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, loaded = CountingBackend(), []

    def load(data: bytes) -> str:  # records the bytes and how many graphs were compiled when they came
        loaded.append((data, len(backend.graphs)))
        return "info"

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (f"graphs {len(backend.graphs)}".encode(), 0))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    _trainer(tmp_path, CompileCallback(backend=backend, cache=tmp_path)).fit(TinyModule())  # a first run: no warning
    assert (tmp_path / "torch_compile_cache.bin").is_file() and backend.graphs and loaded == []

    failed = pytest.raises(ValueError, match="a real bug")
    with failed:  # a failed fit saves nothing
        _trainer(tmp_path, CompileCallback(backend=backend, cache=tmp_path / "failed.bin")).fit(
            TinyModule(bug_at_step=1)
        )
    assert not (tmp_path / "failed.bin").exists()

    torch._dynamo.reset()
    callback, before = CompileCallback(backend=backend, cache=tmp_path), len(backend.graphs)
    _trainer(tmp_path, callback).fit(TinyModule())
    assert loaded == [(b"graphs 1", before)] and len(backend.graphs) > before  # loaded before the first compile
    assert callback.report["cache_loaded"]
    with pytest.warns(NoEffectWarning, match=r"another setup: modules \(file: '1 x TinyModule .*now: '1 x Tower"):
        _trainer(tmp_path, CompileCallback(backend=backend, cache=tmp_path, regions=["Tower"])).fit(TinyModule())


def test_cache_is_saved_with_checkpoints_once_per_new_compilation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saves: list[int] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: saves.append(len(saves)) or (b"artifacts", 0))
    callback = CompileCallback(backend=CountingBackend(), cache=tmp_path / "cache.bin")
    every_step = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    _trainer(tmp_path, callback, every_step, enable_checkpointing=True).fit(TinyModule())
    assert len(list((tmp_path / "ckpt").iterdir())) == 6  # six checkpoints...
    assert saves == [0] and (tmp_path / "cache.bin").is_file()  # ...one write: nothing was compiled after the first


class CacheDirSeen(TinyModule):
    """Records torch's on-disk compile cache folder as each training step sees it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return super().training_step(batch, batch_idx)


def test_inductor_cache_dir_is_used_while_fitting_and_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "default"))
    folder, model = tmp_path / "run" / "inductor", CacheDirSeen()
    _trainer(tmp_path, CompileCallback(backend=CountingBackend(), inductor_cache_dir=folder)).fit(model)
    assert model.seen == os.path.abspath(folder) and folder.stat().st_mode & 0o777 == 0o700  # made private
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "default")
    with pytest.raises(ValueError, match="a real bug"):  # restored when the fit fails too
        _trainer(tmp_path, CompileCallback(backend=CountingBackend(), inductor_cache_dir=folder)).fit(
            CacheDirSeen(bug_at_step=1)
        )
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "default")
    folder.chmod(0o777)  # others could plant native code in it: not used
    model = CacheDirSeen()
    with pytest.warns(NoEffectWarning, match=r"not used: it is writable by group or others \(mode 0o777\)"):
        _trainer(tmp_path, CompileCallback(backend=CountingBackend(), inductor_cache_dir=folder)).fit(model)
    assert model.seen == str(tmp_path / "default")


# ------------------------------------------------------------------------------------------------ real compilers


@pytest.mark.slow
def test_inductor_compiles_a_workload(tmp_path: Path) -> None:
    """The real default backend, cold: the only test here that pays inductor's compile time."""
    model, data = make_workload("convnet", "tiny", seed=0)
    callback = CompileCallback()
    trainer = _trainer(tmp_path, callback, max_steps=3, limit_predict_batches=1)
    trainer.fit(model, datamodule=data)
    report = callback.report
    assert report["fallbacks"] == {} and report["unique_graphs"] >= 1 and report["compile_time_s"] > 0
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    compiled = trainer.predict(model, datamodule=data)
    eager = _trainer(tmp_path, limit_predict_batches=1).predict(model, datamodule=data)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_reduce_overhead_records_cuda_graphs_for_training_and_inference(tmp_path: Path) -> None:
    model = TinyModule()
    callback = CompileCallback("reduce-overhead")
    trainer = _trainer(tmp_path, callback, accelerator="cuda", max_steps=8)
    trainer.fit(model)
    assert callback.report["fallbacks"] == {}
    assert callback.report["cudagraph_recordings"] >= 1, "no CUDA graph was recorded in training"

    from torch._dynamo.callback import CallbackTrigger, callback_handler

    recorded: list[str] = []

    def count(args: Any) -> None:
        if args.callback_trigger is CallbackTrigger.CUDAGRAPH_RECORDING:
            recorded.append(args.compile_id)

    callback_handler.register_end_callback(count)
    try:
        predictions = trainer.predict(model)
    finally:
        callback_handler.remove_end_callback(count)
    assert recorded, "no CUDA graph was recorded in predict"
    assert all(torch.isfinite(p).all() for p in predictions)
